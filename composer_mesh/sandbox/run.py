"""Run one command in a sandbox and report what happened as data and as an observation for the policy.

How a command is contained (docs/sandbox.md):
- `bwrap` mode: `bwrap` with new pid, network, ipc and uts namespaces (a network namespace with only a
  downed loopback: no connection succeeds, not even to 127.0.0.1), a read-only bind of the host's `/`, fresh
  `/dev`, `/proc`, `/tmp` and `/run`, `/root` and `/home` hidden, and the episode's work dir bound read-write at
  `/work`. The trainer's base interpreter is bound read-only at `/run/python` (so it runs whatever the host
  permissions of its install). Killing bubblewrap kills its pid namespace: no process outlives a command.
- both modes: `launcher.py` sets RLIMIT_CPU/AS/FSIZE/NPROC/CORE and, when the trainer is root (which the kernel
  exempts from RLIMIT_NPROC), switches to the pool slot's uid before it execs the command; the command runs in
  its own session (process group), which the wall timeout kills with SIGKILL; stdout/stderr are kept up to
  `output_bytes` each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

INNER_WORK = "/work"  # where the episode's work dir appears inside a bwrap sandbox
INNER_PYTHON = "/run/python"  # where the base interpreter's prefix is bound inside a bwrap sandbox
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
        """The text a tool returns to the policy: the summary, then stdout and stderr (saying when cut)."""
        parts = [self.summary()]
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


def bwrap_prefix(workdir: Path, python_prefix: str | None) -> list[str]:
    """The bubblewrap arguments that build the sandbox around `workdir` (everything before the command)."""
    user = [] if os.getuid() == 0 else ["--unshare-user"]  # root keeps its real uid so it can drop to the slot's
    hide = [a for d in ("/root", "/home") if os.path.isdir(d) for a in ("--tmpfs", d)]
    bind_python = ["--ro-bind", python_prefix, INNER_PYTHON] if python_prefix else []
    return ["bwrap", *user, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--ro-bind", "/", "/",
            "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run", *hide, *bind_python,
            "--bind", str(workdir), INNER_WORK, "--chdir", INNER_WORK, "--"]


def sandbox_command(config: SandboxConfig, workdir: Path, argv: list[str], uid: int) -> list[str]:
    """The full host command line that runs `argv` in `workdir` under `config` (as `uid` when root)."""
    python, prefix = interpreter(config)
    limits = {k: getattr(config, k) for k in ("cpu_s", "memory_mb", "processes", "file_mb")} | {"uid": uid}
    launch = [python, "-I", "-S", "-c", LAUNCHER, json.dumps(limits), *argv]
    return bwrap_prefix(workdir, prefix) + launch if config.mode == "bwrap" else launch


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


async def run_sandboxed(config: SandboxConfig, workdir: Path, argv: list[str], *, stdin: str | None = None,
                        uid: int | None = None) -> SandboxResult:
    """Run `argv` in `workdir` under `config`; never raises for anything the command does."""
    command = sandbox_command(config, workdir, argv, config.uid if uid is None else uid)
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *command, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, cwd=workdir, env=sandbox_env(config, workdir), start_new_session=True)
    readers = [asyncio.ensure_future(_read_capped(s, config.output_bytes)) for s in (proc.stdout, proc.stderr)]
    feeder = asyncio.ensure_future(_feed(proc.stdin, None if stdin is None else stdin.encode()))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), config.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:  # also when the caller is cancelled: nothing of the command survives
        _kill_group(proc.pid)
    await proc.wait()
    done, pending = await asyncio.wait([*readers, feeder], timeout=2.0)  # a straggler holding the pipes open
    for task in pending:
        task.cancel()
    (out, out_cut), (err, err_cut) = (r.result() if r in done else (b"", True) for r in readers)
    return SandboxResult(*_status(config, proc.returncode), out.decode(errors="replace"),
                         err.decode(errors="replace"), out_cut, err_cut, timed_out, time.monotonic() - started,
                         config)


def _status(config: SandboxConfig, code: int) -> tuple[int | None, int | None]:
    """(exit code, signal): bubblewrap reports a child killed by signal N as exit code 128 + N."""
    if code < 0:
        return None, -code
    if config.mode == "bwrap" and 128 < code <= 128 + 64:
        return None, code - 128
    return code, None


def check_available(config: SandboxConfig) -> None:
    """Run the configured sandbox once (`python -c pass` in it); raise `SandboxUnavailable` naming the fix."""
    if config.mode == "bwrap" and shutil.which("bwrap") is None:
        raise SandboxUnavailable(f"bubblewrap cannot run here: no 'bwrap' on PATH; {BWRAP_FIX}")
    with tempfile.TemporaryDirectory(prefix="sandbox-check-") as tmp:
        workdir = Path(tmp)
        if os.getuid() == 0:
            os.chown(workdir, config.uid, config.uid)
        python = interpreter(config)[0]
        try:
            done = subprocess.run(sandbox_command(config, workdir, [python, "-c", "pass"], config.uid),
                                  capture_output=True, text=True, timeout=60, cwd=workdir,
                                  env=sandbox_env(config, workdir))
        except (OSError, subprocess.TimeoutExpired) as e:
            reason, code = str(e), None
        else:
            reason, code = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1], done.returncode
    if code == 0:
        return
    if config.mode == "bwrap":
        raise SandboxUnavailable(f"bubblewrap cannot run here: {reason}; {BWRAP_FIX}")
    raise SandboxUnavailable(f"the rlimits sandbox cannot run {python} as uid {config.uid}: {reason}; set "
                             "run.environment.sandbox.python to an interpreter that uid can read (e.g. /usr/bin/python3)")
