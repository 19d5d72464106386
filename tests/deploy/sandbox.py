"""Run a command under the restrictions of deploy/systemd/edgerun.service without systemd as PID 1.

The CI machine has no systemd init, so ``systemd-run`` cannot apply the unit. This rebuilds the parts
of its sandbox that can break a node, from what exists without PID 1:

* bwrap (as root, no user namespace): a read-only root (ProtectSystem=strict), empty /home and /root
  (ProtectHome=yes), a private /tmp (PrivateTmp=yes), a minimal /dev with only null, zero, full,
  random, urandom, tty and ptmx (DevicePolicy=closed), private IPC, PID and UTS namespaces, and
  read-write binds of the state and cache directories only (StateDirectory=, CacheDirectory=);
* then this module's ``__main__`` inside the sandbox: mounts /proc as ProtectProc= (other users'
  processes hidden) and ProcSubset= would, drops to the service account and its groups
  (User=, Group=, SupplementaryGroups=; with no capabilities left, CapabilityBoundingSet=), sets
  no_new_privs (NoNewPrivileges=), the umask (UMask=0077), and loads a seccomp filter built with
  libseccomp from the unit's own SystemCallFilter= lines, as systemd expands them (EPERM for the rest,
  SystemCallErrorNumber=EPERM), and execs the command.

The filter also allows socket() only for the unit's RestrictAddressFamilies=. What this cannot
reproduce: cgroup device ACLs beyond the minimal /dev, and ProtectKernel*/ProtectClock= beyond their
system calls (already outside the filter) and the read-only /proc/sys (read-only here anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO_BASE = 0x00050000
NR_SCMP_ERROR = -1


def syscall_groups() -> dict[str, list[str]]:
    """systemd's own system call groups (``systemd-analyze syscall-filter``), members unexpanded."""
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif not line.strip() or not line.startswith(" "):
            current = None  # the trailing "unlisted" section is not a group
        elif current is not None and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    calls: set[str] = set()
    for name in names:
        if name.startswith("@"):
            calls |= expand(groups[name], groups)
        else:
            calls.add(name)
    return calls


def unit_allowed_syscalls(unit_text: str) -> set[str]:
    """The allow list a unit's SystemCallFilter= lines give, in order (``~`` lines subtract)."""
    groups = syscall_groups()
    allowed: set[str] = set()
    for value in re.findall(r"^SystemCallFilter=(.*)$", unit_text, re.MULTILINE):
        value = value.strip()
        if value.startswith("~"):
            allowed -= expand(value[1:].split(), groups)
        else:
            allowed |= expand(value.split(), groups)
    if not allowed:
        raise ValueError("the unit has no SystemCallFilter= allow list")
    return allowed


class ScmpArgCmp(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp: a condition on one system call argument."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


SCMP_CMP_EQ = 4


def unit_address_families(unit_text: str) -> list[int]:
    """The socket families a unit's RestrictAddressFamilies= allows (an allow list)."""
    names = re.search(r"^RestrictAddressFamilies=(.*)$", unit_text, re.MULTILINE)
    if names is None or names.group(1).startswith("~"):
        raise ValueError("the unit has no RestrictAddressFamilies= allow list")
    return [int(getattr(socket, name)) for name in names.group(1).split()]


def load_seccomp(allowed: set[str], families: list[int]) -> None:
    """Install an allow-list filter on this process: anything else fails with EPERM; socket() only for
    ``families`` (systemd answers EAFNOSUPPORT for the others, the same refusal to the caller)."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ScmpArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ERRNO_BASE | errno.EPERM)
    if not ctx:
        raise OSError("seccomp_init failed")
    for name in sorted(allowed):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr == NR_SCMP_ERROR:
            continue  # not a system call of this architecture (arm_fadvise64_64 on x86-64)
        if name == "socket":
            conditions = [ScmpArgCmp(0, SCMP_CMP_EQ, family, 0) for family in families]
        else:
            conditions = [None]
        for condition in conditions:
            args = (ScmpArgCmp * 1)(condition) if condition is not None else None
            rc = lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 0 if args is None else 1, args)
            if rc < 0:
                raise OSError(-rc, f"seccomp_rule_add({name})")
    rc = lib.seccomp_load(ctx)  # libseccomp sets no_new_privs first (SCMP_FLTATR_CTL_NNP)
    if rc < 0:
        raise OSError(-rc, "seccomp_load")


def bwrap_command(
    root: Path,
    command: list[str],
    *,
    unit: Path,
    uid: int,
    gid: int,
    groups: list[int],
    env: dict[str, str],
    journal_socket: Path | None = None,
) -> list[str]:
    """The bwrap command line that runs ``command`` from an installed DESTDIR tree as the unit would.

    ``journal_socket``: a socket to bind at /run/systemd/journal/socket, standing in for journald's.
    """
    interpreter_home = Path(sys.base_prefix)
    args = [
        "bwrap",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/home",
        "--tmpfs",
        "/root",
    ]
    for home in ("/root", "/home"):
        if interpreter_home.is_relative_to(home):
            # This CI machine's Python lives under /root (pyenv); on a board it is /usr/bin/python3.
            top = Path(home, interpreter_home.relative_to(home).parts[0])
            args += ["--ro-bind", str(top), str(top)]
    venv = Path(sys.prefix)
    if venv != interpreter_home and any(venv.is_relative_to(hidden) for hidden in ("/tmp", "/root", "/home")):
        # The installed venv's python links to the venv it was built from (a checkout under /tmp in CI).
        # bwrap makes missing parents 0700, which the service account could not pass through.
        hidden = next(Path(h) for h in ("/tmp", "/root", "/home") if venv.is_relative_to(h))
        for parent in reversed(venv.parents):
            if parent.is_relative_to(hidden) and parent != hidden:
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", str(venv), str(venv)]
    parents = ["/opt", "/etc", "/var/lib", "/var/cache"]
    if journal_socket is not None:
        parents.append("/run/systemd" if Path("/run/systemd").is_dir() else "/run")
    grafted = [parent for parent in parents if Path(parent).is_dir()]
    for parent in grafted:
        args += _graft(parent)
    args += [
        "--ro-bind",
        str(root / "opt/edgerun"),
        "/opt/edgerun",
        "--ro-bind",
        str(root / "etc/edgerun"),
        "/etc/edgerun",
        "--bind",
        str(root / "var/lib/edgerun"),
        "/var/lib/edgerun",
        "--bind",
        str(root / "var/cache/edgerun"),
        "/var/cache/edgerun",
        "--ro-bind",
        str(Path(__file__).resolve()),
        "/tmp/.sandbox/edgerun-sandbox.py",
        "--ro-bind",
        str(unit),
        "/tmp/.sandbox/edgerun.service",
    ]
    if journal_socket is not None:
        # bwrap makes missing parents 0700; journald's directory is 0755.
        args += ["--perms", "0755", "--dir", "/run/systemd/journal"]
        args += ["--bind", str(journal_socket), "/run/systemd/journal/socket"]
    args += [
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--chdir",
        "/var/lib/edgerun",
        "--clearenv",
    ]
    for parent in grafted:
        args += ["--remount-ro", parent]
    for key, value in env.items():
        args += ["--setenv", key, value]
    args += [
        sys.executable, "/tmp/.sandbox/edgerun-sandbox.py",
        "--uid", str(uid), "--gid", str(gid), "--groups", ",".join(map(str, groups)),
        "--unit", "/tmp/.sandbox/edgerun.service", "--",
        *command,
    ]  # fmt: skip
    return args


def _graft(parent: str) -> list[str]:
    """A tmpfs over ``parent`` holding the host's entries, so new mount points can be made in a read-only root."""
    args = ["--tmpfs", parent]
    for entry in sorted(os.listdir(parent)):
        path = os.path.join(parent, entry)
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
    return args


def service_env() -> dict[str, str]:
    """The environment systemd gives the unit's process (from its directories and Environment= lines)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/var/lib/edgerun",
        "STATE_DIRECTORY": "/var/lib/edgerun",
        "CACHE_DIRECTORY": "/var/cache/edgerun",
        "CONFIGURATION_DIRECTORY": "/etc/edgerun",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8


def mount_private_proc(unit_text: str) -> None:
    """/proc as the unit's ProtectProc= (hidepid) and ProcSubset= (subset) would mount it."""
    options = []
    protect = re.search(r"^ProtectProc=(\w+)$", unit_text, re.MULTILINE)
    if protect and protect.group(1) != "default":
        options.append(f"hidepid={protect.group(1)}")
    if re.search(r"^ProcSubset=pid$", unit_text, re.MULTILINE):
        options.append("subset=pid")
    libc = ctypes.CDLL(None, use_errno=True)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if libc.mount(b"proc", b"/proc", b"proc", flags, ",".join(options).encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount proc (subset=pid): {os.strerror(err)}")


def main(argv: list[str]) -> None:
    """Inside the sandbox, as root: become the service account, load the filter, exec the command."""
    sep = argv.index("--")
    opts = dict(zip(argv[:sep:2], argv[1:sep:2]))
    command = argv[sep + 1 :]
    unit_text = Path(opts["--unit"]).read_text()
    allowed = unit_allowed_syscalls(unit_text)
    families = unit_address_families(unit_text)
    groups = [int(g) for g in opts["--groups"].split(",") if g]
    mount_private_proc(unit_text)
    os.setgroups(groups)
    os.setresgid(int(opts["--gid"]), int(opts["--gid"]), int(opts["--gid"]))
    os.setresuid(int(opts["--uid"]), int(opts["--uid"]), int(opts["--uid"]))  # every capability goes with root
    os.umask(0o077)
    load_seccomp(allowed, families)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
