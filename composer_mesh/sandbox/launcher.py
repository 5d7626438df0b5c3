"""The first process inside a sandbox: sets the resource limits, drops root to the slot's uid, runs the command.
Stdlib only: its source is passed to the sandbox's interpreter with `-c` (composer_mesh itself is not importable
there), as `python -I -S -c SOURCE LIMITS COMMAND...`. The host imports it too, for `walk` and `Budget`. It
imports only modules that cost no time (no json, signal or typing: each pulls in re or enum, milliseconds of every
command's start); LIMITS is `key=value,...` (`encode_limits`).

Why limits are set here and not on bubblewrap: the process limit of a user namespace counts from the limit its
creator had, so bubblewrap itself runs unlimited and only what it starts is limited; and setting them after
bubblewrap built the sandbox keeps the address-space limit off bubblewrap's own setup.

rlimits mode (no `outbox_fd` in the limits): not root, the launcher becomes the command (`become`). As root
(`supervised`) it makes itself the subreaper of what the command starts, forks the command as the slot's uid and
waits for it, then drops to that uid, SIGKILLs every process of it (`kill(-1)`: one atomic call, so nothing forks
past it) and reaps them all: a daemon the command left (setsid() takes it out of the process group, not out of
the launcher's descendants) dies with it, and no zombie is left to the host's init, which may reap only every
second or so while zombies count against the slot's process limit.

bwrap mode (`staged`): the episode's work dir is bound read-only at `stage` and `/work` is a sized tmpfs. The
launcher copies the one into the other, forks the command, waits for it, SIGKILLs every other process of the
sandbox's pid namespace and waits until they are gone (so nothing writes `/work` any more), then, as the slot's
uid, copies `/work` into the outbox and writes `status` there last (saved, or the reason not: more than
`work_files` entries, `work_mb` MB or `MAX_DEPTH` levels). The host swaps the copy in as the work dir only when
that file says saved, so a command killed at its wall time, or over a limit, leaves the work dir as it was before
it. The outbox is a directory fd the host passed (no path in the sandbox leads to it) that the command never
holds; when the trainer is root the launcher stays root while the command runs, so the command cannot signal it
or read its fds. The copies never follow a symlink and keep only directories, regular files and symlinks (as
links). Files the command left as they were copied in (same inode and ctime) are not copied out but listed in
`unchanged`, and the host links them from the old work dir: on disk, writing a file costs a hundred times more
than linking one.
"""

from __future__ import annotations

import os
import resource
import stat
import sys
import time

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every command milliseconds
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any, NoReturn

MB = 1024 * 1024
STATUS = "status"  # the completion marker the launcher writes last in the outbox: "saved" or NOT_SAVED + why
NOT_SAVED = "not saved: "
SAVED = "work"  # the outbox's copy of /work
UNCHANGED = "unchanged"  # the outbox's list of files left out of SAVED as unchanged: NUL-separated names
CLOCK_REALTIME_COARSE = 5  # Linux's clock id (the time module does not name it)
SIGKILL = 9  # not signal.SIGKILL: importing signal imports enum
# Directory levels a saved work dir may have: the host's own tools (shutil.rmtree, copytree, os.walk) recurse once
# a level, and a tree deeper than Python's recursion limit would break them.
MAX_DEPTH = 100


class Refused(Exception):
    """The work dir is over one of its limits: it is not saved (the message says which)."""


class Budget:
    """Entries, bytes and depth of a work dir counted against `work_files`, `work_mb` and `MAX_DEPTH`: raises
    `Refused` past one."""

    def __init__(self, entries: int, mb: int) -> None:
        self.entries, self.bytes, self.max_entries, self.mb = 0, 0, entries, mb

    def entry(self, name: str, st: os.stat_result) -> None:
        """Count the entry `name` (a path relative to the work dir; `st` its lstat)."""
        self.entries += 1
        if self.entries > self.max_entries:
            raise Refused(f"more than {self.max_entries} entries (work_files)")
        if stat.S_ISDIR(st.st_mode) and name.count("/") >= MAX_DEPTH:
            raise Refused(f"more than {MAX_DEPTH} directory levels")

    def data(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.mb * MB:
            raise Refused(f"more than {self.mb} MB (work_mb)")

    def room(self) -> int:
        """Bytes to ask for next: a chunk, or one past what is left (so going over is seen)."""
        return min(MB, self.mb * MB - self.bytes + 1)


def walk(root: str, fix: bool = False) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below `root` as (path relative to `root`, its lstat), each directory before what it holds;
    never follows a symlink. `fix`: first give the owner read and search rights on a directory that lacks them
    (copying out as the slot's uid, which owns every entry of `/work`)."""
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(os.path.join(root, rel)) as listing:
            entries = list(listing)
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            name = os.path.join(rel, entry.name)
            if stat.S_ISDIR(st.st_mode):
                if fix and st.st_mode & 0o500 != 0o500:
                    os.chmod(entry.path, stat.S_IMODE(st.st_mode) | 0o500)
                pending.append(name)
            yield name, st


def copy_tree(src: str, dst_fd: int, budget: Budget, owner: int | None = None, fix: bool = False,
              same: dict[str, tuple[int, int]] | None = None) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Copy the tree below `src` into the directory `dst_fd`: directories, regular files, symlinks as links;
    anything else (FIFOs, sockets, devices) is left out. `owner`: the uid (and gid) to give every copy. A regular
    file whose (inode, ctime) is its entry in `same` is unchanged since it was copied in: it is not copied (the
    host links it from the work dir before). Returns the (inode, ctime) of each file written, and the names of
    those left out as unchanged."""
    written, kept, dirs = {}, [], []
    for name, st in walk(src, fix):
        budget.entry(name, st)
        if stat.S_ISREG(st.st_mode) and same and same.get(name) == (st.st_ino, st.st_ctime_ns):
            budget.data(st.st_size)
            kept.append(name)
            continue
        if stat.S_ISREG(st.st_mode):
            written[name] = copy_file(os.path.join(src, name), name, dst_fd, st, budget, fix, owner)
            continue
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o700, dir_fd=dst_fd)
            dirs.append((name, stat.S_IMODE(st.st_mode) & 0o777))
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(os.path.join(src, name)), name, dir_fd=dst_fd)
        else:
            continue
        if owner is not None:
            os.chown(name, owner, owner, dir_fd=dst_fd, follow_symlinks=False)
    for name, mode in reversed(dirs):  # last: a read-only directory was writable while it was filled
        os.chmod(name, mode, dir_fd=dst_fd)
    return written, kept


def copy_file(path: str, name: str, dst_fd: int, st: os.stat_result, budget: Budget, fix: bool,
              owner: int | None) -> tuple[int, int]:
    """Copy the regular file `path` to `name` under `dst_fd`, counting its bytes; the copy's (inode, ctime)."""
    if fix and not st.st_mode & 0o400:
        os.chmod(path, stat.S_IMODE(st.st_mode) | 0o400)
    src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, stat.S_IMODE(st.st_mode) & 0o777,
                      dir_fd=dst_fd)
        try:
            while n := os.sendfile(dst, src, None, budget.room()):
                budget.data(n)
            if owner is not None:
                os.fchown(dst, owner, owner)
            copy = os.fstat(dst)
            return copy.st_ino, copy.st_ctime_ns
        finally:
            os.close(dst)
    finally:
        os.close(src)


def become(limits: dict[str, Any], argv: list[str]) -> NoReturn:
    """Apply the limits, drop root to the slot's uid, exec `argv`: never returns."""
    for name, value in (("RLIMIT_CPU", (limits["cpu_s"], limits["cpu_s"] + 1)),
                        ("RLIMIT_AS", (limits["memory_mb"] * MB,) * 2),
                        ("RLIMIT_FSIZE", (limits["file_mb"] * MB,) * 2),
                        ("RLIMIT_CORE", (0, 0))):
        resource.setrlimit(getattr(resource, name), value)
    if os.getuid() == 0:  # root ignores RLIMIT_NPROC: run as the slot's own uid
        drop(limits["uid"])
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    os.umask(0o022)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"sandbox: cannot run {argv[0]!r}: {e.strerror}\n")
        os._exit(127)


def drop(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def staged(limits: dict[str, Any], argv: list[str]) -> int:
    """bwrap mode: copy the work dir in, run the command, kill what it left, save `/work` to the outbox.
    Returns the launcher's exit code: the command's, or 128 + the signal that killed it (as bubblewrap says)."""
    out = limits["outbox_fd"]
    os.set_inheritable(out, False)  # closed at the command's exec: only the launcher holds it
    if (os.getpid(), os.getppid()) != (2, 1):  # kill(-1) below must reach nothing but the sandbox
        return fail("the launcher is not pid 2 of a new pid namespace")
    uid = limits["uid"] if os.getuid() == 0 else None
    os.umask(0)
    try:
        if uid is None:
            undumpable()
        work = os.open(limits["work"], os.O_RDONLY | os.O_DIRECTORY)
        copied = copy_tree(limits["stage"], work, Budget(limits["work_files"], limits["work_mb"]), owner=uid)[0]
        if uid is not None:
            os.fchown(work, uid, uid)
    except (OSError, Refused) as e:
        return fail(f"the work dir could not be copied in: {e}")
    # A file the command rewrites gets a ctime no earlier than now (the kernel stamps files with the coarse clock
    # or finer): only a copy stamped before now is known unchanged when its (inode, ctime) still match.
    now = time.clock_gettime_ns(CLOCK_REALTIME_COARSE)
    same = {name: ident for name, ident in copied.items() if ident[1] < now}
    code = run_command(limits, argv)
    if not kill_others():
        return fail("processes of the command would not die: the work dir is not saved")
    if uid is not None:
        os.fchown(out, uid, uid)
        drop(uid)
    save(limits, out, same)
    return code


def supervised(limits: dict[str, Any], argv: list[str]) -> int:
    """rlimits mode as root: run the command as the slot's uid, then kill and reap every process of that uid.
    Returns the command's exit code, or 128 + the signal that killed it."""
    try:
        prctl(36, 1, "PR_SET_CHILD_SUBREAPER")
    except OSError as e:
        return fail(e.strerror or str(e))
    code = run_command(limits, argv)
    drop(limits["uid"])
    if os.getuid() == 0:  # kill(-1) as root would kill the host's every process
        return fail("the launcher is still root: not killing what the command left")
    try:  # noqa: SIM105 (contextlib.suppress: an import that costs every command milliseconds)
        os.kill(-1, SIGKILL)  # every process of the slot's uid but this one
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)  # the command's orphans are this subreaper's children
        except ChildProcessError:
            break
    return code


def run_command(limits: dict[str, Any], argv: list[str]) -> int:
    """Fork the command (`become`) and wait for it: its exit code, or 128 + the signal that killed it (as
    bubblewrap says)."""
    pid = os.fork()
    if pid == 0:
        become(limits, argv)
    status = os.waitpid(pid, 0)[1]
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def prctl(option: int, arg: int, name: str) -> None:
    """prctl(2) through libc (ctypes is imported only by the launchers that call it); raises OSError naming it."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({name}) failed: {os.strerror(errno)}")


def undumpable() -> None:
    """Not root: the command runs as the launcher's own uid, which could open the outbox fd through
    /proc/2/fd unless the launcher is not dumpable (PR_SET_DUMPABLE 0; the command's exec makes it dumpable)."""
    prctl(4, 0, "PR_SET_DUMPABLE, 0")


def kill_others(timeout_s: float = 2.0) -> bool:
    """SIGKILL every other process of the pid namespace (however it left the command's group) and wait until
    none is left (pid 1, bubblewrap, reaps them); False when some would not die within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(-1, SIGKILL)
        except ProcessLookupError:
            return True
        time.sleep(0.0005)
    return False


def save(limits: dict[str, Any], out: int, same: dict[str, tuple[int, int]]) -> None:
    """Copy `/work` into the outbox's `work` (but the files `same` says are unchanged: their names go to
    `unchanged`, for the host to link), then write `status`: saved, or the reason it is not."""
    try:
        root = os.lstat(limits["work"])
        if root.st_mode & 0o500 != 0o500:
            os.chmod(limits["work"], stat.S_IMODE(root.st_mode) | 0o500)
        os.mkdir(SAVED, 0o700, dir_fd=out)
        saved = os.open(SAVED, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=out)
        kept = copy_tree(limits["work"], saved, Budget(limits["work_files"], limits["work_mb"]), fix=True, same=same)[1]
        write_new(out, UNCHANGED, b"\0".join(map(os.fsencode, kept)))
        state = "saved"
    except Refused as e:
        state = f"{NOT_SAVED}{e}"
    except (OSError, RecursionError) as e:
        state = f"{NOT_SAVED}it could not be copied: {getattr(e, 'strerror', None) or e}"[:300]
    write_new(out, STATUS, state.encode(errors="replace"))


def write_new(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def fail(message: str) -> int:
    sys.stderr.write(f"sandbox: {message}\n")
    return 125


def encode_limits(limits: dict[str, int | str]) -> str:
    """The launcher's first argument: `key=value` pairs joined by commas (no value holds either)."""
    return ",".join(f"{key}={value}" for key, value in limits.items())


def decode_limits(text: str) -> dict[str, Any]:
    pairs = (item.split("=", 1) for item in text.split(","))
    return {key: int(value) if value.isdigit() else value for key, value in pairs}


def main(argv: list[str]) -> None:
    """`argv[0]` is the limits (`encode_limits`: cpu_s, memory_mb, processes, file_mb, uid; in bwrap mode also
    stage, work, outbox_fd, work_mb, work_files); `argv[1:]` the command."""
    limits = decode_limits(argv[0])
    if "outbox_fd" in limits:
        os._exit(staged(limits, argv[1:]))
    if os.getuid() == 0:
        os._exit(supervised(limits, argv[1:]))
    become(limits, argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
