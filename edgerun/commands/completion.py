"""``edgerun completion bash|zsh|tcsh``: the shell completion script for every subcommand and option.

Generated from the same argparse tree ``edgerun`` parses with (shtab), so it cannot drift from the commands:

    edgerun completion bash > ~/.local/share/bash-completion/completions/edgerun
    edgerun completion zsh > "${fpath[1]}/_edgerun"
"""

from __future__ import annotations

import argparse
from typing import Any

SHELLS = ("bash", "zsh", "tcsh")
# Options whose value is a path: the shell completes file or directory names for them.
_FILE_METAVARS = {"FILE", "PEM", "KEYFILE", "BUNDLE", "CONFIG"}
_DIR_METAVARS = {"DIR"}


def add_completion_parser(sub: Any) -> None:
    p = sub.add_parser(
        "completion",
        help="print the shell completion script (bash, zsh or tcsh)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=cmd_completion)


def completion_script(shell: str) -> str:
    """The completion script for ``shell``, with path options completing file or directory names."""
    import shtab

    from edgerun.cli import build_parser, subcommand_parsers

    parser = build_parser()
    for command in [parser, *subcommand_parsers(parser)]:
        for action in command._actions:
            metavar = action.metavar if isinstance(action.metavar, str) else ""
            if metavar in _FILE_METAVARS or action.dest in ("config", "bundle"):
                action.complete = shtab.FILE  # type: ignore[attr-defined]  # shtab reads this attribute
            elif metavar in _DIR_METAVARS:
                action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
    return str(shtab.complete(parser, shell=shell))


def cmd_completion(args: argparse.Namespace) -> int:
    print(completion_script(args.shell))
    return 0
