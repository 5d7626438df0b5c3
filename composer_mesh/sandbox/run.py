"""Run one command in a sandbox and report what happened as data and as an observation for the policy.

How a command is contained (docs/sandbox.md):
- `bwrap` mode: `bwrap` with new pid, network, ipc and uts namespaces (a network namespace with only a
  downed loopback: no connection succeeds, not even to 127.0.0.1). It sees read-only only what `view.py` lists
  (/usr, the system libraries, a few /etc files, the trainer's base interpreter at `/run/python`, `ro_paths`),
  fresh `/dev` and `/proc`, and writes only sized tmpfs trees: `/tmp` and `/work`, a copy of the episode's work
  dir that comes back only when the command ended within `work_mb` and `work_files` (`workdir.py`). Killing
  bubblewrap kills its pid namespace: no process outlives a command.
- both modes: `launcher.py` sets RLIMIT_CPU/AS/FSIZE/NPROC/CORE and, when the trainer is root (which the kernel
  exempts from RLIMIT_NPROC), switches to the pool slot's uid before it execs the command; the command runs in
  its own session (process group), which the wall timeout kills with SIGKILL; stdout/stderr are kept up to
  `output_bytes` each.
- `rlimits` mode, trainer root: after each command every process of the slot's uid is killed (a process that
  called setsid() left the process group): by the launcher, its subreaper, then by a scan of /proc; not root:
  only the process group is, and such a process survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from composer_mesh.errors import UserInputError
from composer_mesh.sandbox.config import SandboxConfig
from composer_mesh.sandbox.launcher import encode_limits
from composer_mesh.sandbox.view import INNER_PYTHON, INNER_STAGE, INNER_WORK, bwrap_prefix, path_problem
from composer_mesh.sandbox.workdir import Outbox, over_limit

LAUNCHER = (Path(__file__).with_name("launcher.py")).read_text()
BWRAP_FIX = "install Debian's bubblewrap or set run.environment.sandbox.mode: rlimits (no isolation)"


class SandboxUnavailable(UserInputError):
    """The configured sandbox cannot run on this host (bubblewrap missing or refused, interpreter unreadable)."""


@dataclass
class SandboxResult:
    """What one sandboxed command did. `exit_code` is None when it was killed by a signal (`signal`)."""

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    wall_s: float
    config: SandboxConfig
    work_note: str | None = None  # the work dir was not saved, or (rlimits mode) is over a limit: why

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def summary(self) -> str:
        """One human line: how the command ended ("exit code 0", "killed: wall time 20 s exceeded", ...)."""
        c = self.config
        if self.timed_out:
            return f"killed: wall time {c.wall_s:g} s exceeded"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.valid_signals() else str(self.signal)
            cause = {signal.SIGXCPU: f"cpu time limit ({c.cpu_s} s)", signal.SIGXFSZ: f"file size limit "
                     f"({c.file_mb} MB)"}.get(self.signal)
            return f"killed by {name}" + (f": {cause} exceeded" if cause else "")
        tail = self.stderr.strip().splitlines()[-1:] if self.exit_code else []
        return f"exit code {self.exit_code}" + (f": {tail[0][:200]}" if tail else "")

    def observation(self) -> str:
        """The text a tool returns to the policy: the summary, what became of the work dir when not saved, then
        stdout and stderr (saying when cut)."""
        parts = [self.summary(), *([self.work_note] if self.work_note else [])]
        for name, text, cut in (("stdout", self.stdout, self.stdout_truncated),
                                ("stderr", self.stderr, self.stderr_truncated)):
            if text or cut:
                note = f" (truncated to {self.config.output_bytes} bytes)" if cut else ""
                parts.append(f"--- {name}{note}\n{text}")
        return "\n".join(parts)


def interpreter(config: SandboxConfig) -> tuple[str, str | None]:
    """(the interpreter's path as the command sees it, the host prefix to bind at /run/python or None)."""
    if config.python is not None:
        return config.python, None
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    prefix = Path(os.path.realpath(sys.base_prefix))
    if config.mode == "rlimits" or not exe.is_relative_to(prefix):
        return str(exe), None
    return f"{INNER_PYTHON}/{exe.relative_to(prefix)}", str(prefix)


def sandbox_command(config: SandboxConfig, workdir: Path, argv: list[str], uid: int,
                    outbox: Outbox | None = None) -> list[str]:
    """The full host command line that runs `argv` in `workdir` under `config` (as `uid` when root); bwrap mode
    needs the `outbox` its launcher saves the work dir to (its fd must be passed to the process)."""
    python, prefix = interpreter(config)
    limits = {k: getattr(config, k) for k in ("cpu_s", "memory_mb", "processes", "file_mb")} | {"uid": uid}
    if config.mode == "rlimits":
        return [python, "-I", "-S", "-c", LAUNCHER, encode_limits(limits), *argv]
    if outbox is None:
        raise ValueError("a bwrap sandbox command needs an outbox")
    limits |= {"stage": INNER_STAGE, "work": INNER_WORK, "outbox_fd": outbox.fd, "work_mb": config.work_mb,
               "work_files": config.work_files}
    return [*bwrap_prefix(config, workdir, prefix), python, "-I", "-S", "-c", LAUNCHER, encode_limits(limits), *argv]


def sandbox_env(config: SandboxConfig, workdir: Path) -> dict[str, str]:
    """The whole environment of a sandboxed command: nothing of the trainer's (no keys, no PYTHONPATH)."""
    python = interpreter(config)[0]
    home = INNER_WORK if config.mode == "bwrap" else str(workdir)
    return {"PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
            "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """Read `stream` to its end, keeping the first `limit` bytes (the rest is drained, so the writer never
    blocks on a full pipe)."""
    kept, dropped = bytearray(), False
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        kept += chunk[:room]
        dropped = dropped or len(chunk) > room
    return bytes(kept), dropped


async def _feed(writer: asyncio.StreamWriter | None, data: bytes | None) -> None:
    if writer is None:
        return
    try:
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()
    except (BrokenPipeError, ConnectionResetError):  # the command exited without reading its input
        pass


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_uid(uid: int, timeout_s: float = 3.0) -> bool:
    """SIGKILL every live process of `uid` (real, effective, saved or fs uid) until a scan of /proc finds none,
    then wait until their zombies are reaped too (they count against the slot's RLIMIT_NPROC: its next command
    could not fork); False when some were left after `timeout_s`. Why: in rlimits mode a process that called
    setsid() left the command's process group; as root each slot has its own uid, so its processes are exactly
    what the command started. The launcher, their subreaper, kills and reaps them itself when the command exits;
    this acts at the wall time (the launcher reaps what it kills) and as a backstop. Each is signalled through a
    pidfd opened before its uid is read, so a reused pid is never hit."""
    end = time.monotonic() + timeout_s
    while found := {_kill_if_of(int(pid), uid) for pid in os.listdir("/proc") if pid.isdigit()} - {None}:
        if time.monotonic() > end:
            return False
        if found == {"zombie"}:
            time.sleep(0.005)
    return True


def _kill_if_of(pid: int, uid: int) -> str | None:
    """SIGKILL `pid` when it is a live process of `uid` ("killed"); "zombie" for one of its dead not yet
    reaped; None for any other."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
        if str(uid) not in fields["Uid"].split():
            return None
        if fields["State"].split()[0] == "Z":
            return "zombie"
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return "killed"
    except (OSError, KeyError):
        return None
    finally:
        os.close(fd)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Return once `proc` has exited, even while a process it left holds its pipes open (asyncio's `wait()`
    waits for the pipes too): its pidfd turns readable when it exits."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # exited and reaped already
        return
    except OSError:  # no pidfds (Linux before 5.3)
        await proc.wait()
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def run_sandboxed(config: SandboxConfig, workdir: Path, argv: list[str], *, stdin: str | None = None,
                        uid: int | None = None) -> SandboxResult:
    """Run `argv` in `workdir` under `config`; never raises for anything the command does. bwrap mode: the
    work dir becomes what the command left only when the launcher saved it; rlimits mode: it is measured."""
    uid = config.uid if uid is None else uid
    outbox = Outbox(workdir) if config.mode == "bwrap" else None  # a mkdtemp and an open: no thread needed
    try:
        command = sandbox_command(config, workdir, argv, uid, outbox)
        result = await _execute(config, workdir, command, stdin, uid, () if outbox is None else (outbox.fd,))
        result.work_note = await asyncio.to_thread(_settle, config, workdir, outbox, result.timed_out)
        return result
    finally:  # cancelled or failed: the outbox goes, the work dir stays as it was
        if outbox is not None:
            outbox.close()


def _settle(config: SandboxConfig, workdir: Path, outbox: Outbox | None, timed_out: bool) -> str | None:
    """After a command: adopt (bwrap) or measure (rlimits) its work dir; the observation's note, or None."""
    if outbox is None:
        return over_limit(config, workdir)
    try:
        return outbox.adopt(timed_out)
    finally:
        outbox.close()


async def _execute(config: SandboxConfig, workdir: Path, command: list[str], stdin: str | None, uid: int,
                   fds: tuple[int, ...]) -> SandboxResult:
    """Run the host `command` (passing it `fds`), feed it `stdin`, keep its capped output, kill it at the wall
    time (and, in rlimits mode as root, every process of `uid` after it)."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *command, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, cwd=workdir, env=sandbox_env(config, workdir), start_new_session=True,
        pass_fds=fds)
    readers = [asyncio.ensure_future(_read_capped(s, config.output_bytes)) for s in (proc.stdout, proc.stderr)]
    feeder = asyncio.ensure_future(_feed(proc.stdin, None if stdin is None else stdin.encode()))
    timed_out = False
    try:
        await asyncio.wait_for(_exited(proc), config.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:  # also when the caller is cancelled: nothing of the command survives
        if config.mode == "rlimits" and os.getuid() == 0:  # first: the launcher (root) reaps what this kills
            await asyncio.to_thread(kill_uid, uid)
        _kill_group(proc.pid)
    waiter = asyncio.ensure_future(proc.wait())
    done, pending = await asyncio.wait([waiter, *readers, feeder], timeout=2.0)  # a straggler holding the pipes
    for task in pending:
        task.cancel()
    (out, out_cut), (err, err_cut) = (r.result() if r in done else (b"", True) for r in readers)
    code = -signal.SIGKILL if proc.returncode is None else proc.returncode
    return SandboxResult(*_status(config, code), out.decode(errors="replace"),
                         err.decode(errors="replace"), out_cut, err_cut, timed_out, time.monotonic() - started,
                         config)


def _try_once(config: SandboxConfig, argv: list[str]) -> tuple[str, int | None]:
    """Run `argv` once in a throwaway work dir, synchronously: (the last line of its stderr, its exit code)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-check-") as tmp:
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        if os.getuid() == 0 and config.mode == "rlimits":
            os.chown(workdir, config.uid, config.uid)
        outbox = Outbox(workdir) if config.mode == "bwrap" else None
        try:
            done = subprocess.run(sandbox_command(config, workdir, argv, config.uid, outbox), capture_output=True,
                                  text=True, timeout=60, cwd=workdir, env=sandbox_env(config, workdir),
                                  pass_fds=() if outbox is None else (outbox.fd,))
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e), None
        finally:
            if outbox is not None:
                outbox.close()
    return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1], done.returncode


def _status(config: SandboxConfig, code: int) -> tuple[int | None, int | None]:
    """(exit code, signal): a launcher that waits for the command (bwrap mode, and rlimits mode as root) reports
    a command killed by signal N as exit code 128 + N, as bubblewrap does."""
    if code < 0:
        return None, -code
    if (config.mode == "bwrap" or os.getuid() == 0) and 128 < code <= 128 + 64:
        return None, code - 128
    return code, None


def check_available(config: SandboxConfig) -> None:
    """Run the configured sandbox once (`python -c pass` in it); raise `SandboxUnavailable` naming the fix."""
    if config.mode == "bwrap" and shutil.which("bwrap") is None:
        raise SandboxUnavailable(f"bubblewrap cannot run here: no 'bwrap' on PATH; {BWRAP_FIX}")
    if config.mode == "bwrap" and (problem := path_problem(config)):
        raise SandboxUnavailable(problem)
    python = interpreter(config)[0]
    reason, code = _try_once(config, [python, "-c", "pass"])
    if code == 0:
        return
    if config.mode == "bwrap":
        raise SandboxUnavailable(f"bubblewrap cannot run here: {reason}; {BWRAP_FIX}")
    raise SandboxUnavailable(f"the rlimits sandbox cannot run {python} as uid {config.uid}: {reason}; set "
                             "run.environment.sandbox.python to an interpreter that uid can read (e.g. /usr/bin/python3)")
