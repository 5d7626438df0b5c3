"""What a bubblewrap sandbox sees of the host, and the sized trees it may write.

Why an allow-list and not the host's `/` minus a few directories: a command can read whatever its uid may read,
which on a trainer's host includes the repository, the installed composer_mesh (whose catalog holds the coding
tasks' hidden tests: reward hacking) and other users' files. So a sandbox sees only what programs need: `/usr` and
the top-level system directories (on a usr-merged host these are symlinks into `/usr`, recreated as symlinks), a
fixed list of `/etc` entries, the interpreter's install at `/run/python`, and the paths the user lists in
`ro_paths`, all read-only. Wherever one of those holds the installed composer_mesh package, an empty directory is
mounted over it. What it may write is memory with a size: `/tmp` (`tmp_mb`), `/run` (1 MB, root's) and `/work`
(`work_mb`: a copy of the episode's work dir, see `launcher.py`); its root and `/dev` (unsized tmpfs that a
non-root trainer's command would own) are remounted read-only.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from composer_mesh.sandbox.config import SandboxConfig

INNER_WORK = "/work"  # the command's work dir: a tmpfs holding a copy of the episode's work dir
INNER_STAGE = "/run/work-before"  # the episode's work dir, read-only: what the launcher copies into /work
INNER_PYTHON = "/run/python"  # where the base interpreter's prefix is bound
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The dynamic loader's cache and config, the alternatives' links, the time zone, user and group names and how
# to look them up: what python, sh and coreutils read of /etc (checked by tests/sandbox).
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "passwd", "group",
       "nsswitch.conf")
PACKAGE = os.path.realpath(Path(__file__).resolve().parents[1])  # composer_mesh, with the hidden tests
MB = 1024 * 1024
RUN_MB = 1  # /run holds only mount points; root owns it
NAMESPACES = ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session")


@functools.cache
def system_view() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(bubblewrap arguments that show /usr, the system directories and the /etc entries; the (host, sandbox)
    directories bound, for masking). Cached: the host's layout does not change under a running trainer."""
    args, binds = ["--ro-bind", "/usr", "/usr"], [("/usr", "/usr")]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            binds.append((d, d))
    args += ["--perms", "0755", "--dir", "/etc"]  # else made 0700 for the binds in it: unreadable to the slot uid
    args += [a for name in ETC if os.path.lexists(f"/etc/{name}") for a in ("--ro-bind", f"/etc/{name}",
                                                                              f"/etc/{name}")]
    return tuple(args), tuple(binds)


def tmpfs(path: str, mb: int, perms: str | None = None) -> list[str]:
    return [*(["--perms", perms] if perms else []), "--size", str(mb * MB), "--tmpfs", path]


def parents(paths: list[str]) -> list[str]:
    """`--dir` with mode 0755 for every directory above `paths` (bubblewrap makes them 0700, which the slot uid
    could not pass through); a directory that exists already is left as it is."""
    above = dict.fromkeys(str(p) for path in paths for p in reversed(Path(path).parents) if str(p) != "/")
    return [a for d in above for a in ("--perms", "0755", "--dir", d)]


def masks(binds: list[tuple[str, str]]) -> list[str]:
    """An empty read-only tmpfs over composer_mesh wherever a bound host directory holds it."""
    out = []
    for host, inner in binds:
        real = os.path.realpath(host)
        if real == PACKAGE or PACKAGE.startswith(real + "/"):
            hidden = inner + PACKAGE[len(real):]
            out += [*tmpfs(hidden, 1), "--remount-ro", hidden]
    return out


def bwrap_prefix(config: SandboxConfig, workdir: Path, python_prefix: str | None) -> list[str]:
    """The bubblewrap arguments that build the sandbox around `workdir` (everything before the command)."""
    user = [] if os.getuid() == 0 else ["--unshare-user"]  # root keeps its real uid so it can drop to the slot's
    system, binds = system_view()
    ours = [(python_prefix, INNER_PYTHON)] if python_prefix else []
    theirs = [(p, p) for p in config.ro_paths]
    return ["bwrap", *user, *NAMESPACES, *system, "--dev", "/dev", "--proc", "/proc",
            *tmpfs("/tmp", config.tmp_mb, "1777"), *tmpfs("/run", RUN_MB),
            *parents(config.ro_paths), *[a for host, inner in ours + theirs for a in ("--ro-bind", host, inner)],
            "--ro-bind", str(workdir), INNER_STAGE, *masks([*binds, *ours, *theirs]),
            *tmpfs(INNER_WORK, config.work_mb), "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", INNER_WORK, "--"]


def path_problem(config: SandboxConfig) -> str | None:
    """The first path the user named that a bwrap sandbox cannot show, as one line naming its field; or None."""
    for path in config.ro_paths:
        if not os.path.exists(path):
            return f"run.environment.sandbox.ro_paths: {path} does not exist on this host"
    if config.python is None:
        return None
    python = os.path.realpath(config.python)
    shown = [os.path.realpath(h) for h, _ in system_view()[1]] + [os.path.realpath(p) for p in config.ro_paths]
    if not any(python.startswith(d.rstrip("/") + "/") for d in shown):
        return (f"run.environment.sandbox.python: {config.python} is not visible in a bwrap sandbox (it shows /usr "
                "and ro_paths): add the directory it is installed in to run.environment.sandbox.ro_paths")
    return None
