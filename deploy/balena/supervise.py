"""The container's entrypoint: runs the node, passes the engine's stop signals on, and stops for good on exit 2.

systemd's unit says ``RestartPreventExitStatus=2``; a container engine has no such setting. Exit 2 means a person
must fix the config or the model (the node printed one line naming it), so restarting cannot help: this script
then exits 0, and the compose file's ``restart: on-failure`` leaves the container stopped instead of restarting
it every few seconds forever. Any other failure (a crash, a signal, a driver taking the process down) keeps its
non-zero status and is restarted. Usage: ``supervise.py edgerun run -c /etc/edgerun/node.toml``.
"""

from __future__ import annotations

import signal
import subprocess
import sys

# edgerun/errors.py EXIT_NEEDS_OPERATOR: "a person must act" (ConfigError, ModelError).
EXIT_NEEDS_A_PERSON = 2


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: supervise.py COMMAND [ARGS...]", file=sys.stderr)
        return EXIT_NEEDS_A_PERSON
    started: list[subprocess.Popen[bytes]] = []
    stop_before_start: list[int] = []

    def pass_on(signum: int, _frame: object) -> None:  # `docker stop` sends SIGTERM to PID 1: us
        if started:
            started[0].send_signal(signum)
        else:
            stop_before_start.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # before the node starts: no signal is lost
        signal.signal(sig, pass_on)
    node = subprocess.Popen(argv)
    started.append(node)
    for signum in stop_before_start:
        node.send_signal(signum)
    code = node.wait()
    if code == EXIT_NEEDS_A_PERSON:
        print(
            "supervise: the node exited 2 (the line above says what to fix); not restarting. Fix the device "
            "variable or the model, then restart the service.",
            file=sys.stderr,
            flush=True,
        )
        return 0
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128+N, never 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
