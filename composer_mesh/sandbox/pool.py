"""A pool of sandboxed command slots and the per-episode work dirs they run in.

Why the pool bounds commands and not episodes: an episode spends most of its time waiting for the policy's next
turn, holding only a directory; only a running command holds CPU and memory. So `session()` only makes a private
work dir (removed when the episode ends), and each `box.run` waits for one of `concurrency` slots. When the
trainer is root, slot i runs its commands as uid `config.uid + i`, so that concurrent commands never share the
process limit (the kernel counts RLIMIT_NPROC per uid), and in rlimits mode so that every process a command left
can be found by its uid and killed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from composer_mesh.sandbox.config import SandboxConfig
from composer_mesh.sandbox.run import SandboxResult, interpreter, run_sandboxed

RUN_STDIN = "import sys; exec(compile(sys.stdin.read(), '<code>', 'exec'), {'__name__': '__main__'})"


class BoxPathError(ValueError):
    """A path a policy gave that is not inside the episode's work dir (absolute, `..`, a symlink out)."""


class SandboxBox:
    """One episode's private work dir and the sandbox its commands run in. Paths are relative to the work dir
    (`/work` inside a bwrap sandbox); `read`/`write` answer a policy's bad path with an error line. In bwrap mode
    a command's changes reach `workdir` (same path, swapped in) only when it ended within the work dir's limits;
    its result's `work_note` says when not. Run one command of a box at a time: of two at once, the last to end
    would win."""

    def __init__(self, pool: SandboxPool, workdir: Path) -> None:
        self.pool, self.workdir = pool, workdir
        self.python = interpreter(pool.config)[0]  # the interpreter's path as commands see it

    async def run(self, argv: list[str], stdin: str | None = None) -> SandboxResult:
        """Run `argv` in the work dir, in the sandbox, once a pool slot is free."""
        return await self.pool.run(self.workdir, argv, stdin)

    async def run_python(self, code: str) -> SandboxResult:
        """Run Python source `code` as `__main__` (sent on stdin, so of any length; the work dir is on its
        import path, so it can import the episode's modules)."""
        return await self.run([self.python, "-c", RUN_STDIN], stdin=code)

    def path(self, relative: str) -> Path:
        """The host path of `relative`, checked to stay in the work dir; raises `BoxPathError`."""
        if not relative or os.path.isabs(relative) or ".." in Path(relative).parts or "\0" in relative:
            raise BoxPathError(f"path {relative!r} must be relative to the work dir, without '..'")
        root = Path(os.path.realpath(self.workdir))
        target = Path(os.path.realpath(root / relative))
        if target == root or not target.is_relative_to(root):
            raise BoxPathError(f"path {relative!r} leads out of the work dir")
        if target.exists() and not target.is_file() and not target.is_dir():  # a FIFO would block the host
            raise BoxPathError(f"path {relative!r} is not a regular file")
        return target

    def write(self, relative: str, text: str) -> str:
        """Write `text` to `relative` (making its directories); the observation line says what happened."""
        limit = self.pool.config.file_mb * 1024 * 1024
        try:
            target = self.path(relative)
            if len(text.encode()) > limit:
                return f"error: {relative} not written: larger than the {self.pool.config.file_mb} MB file limit"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        except (BoxPathError, OSError) as e:
            return f"error: {relative!r} not written: {e}"
        return f"wrote {len(text)} characters to {relative}"

    def read(self, relative: str) -> str:
        """The text of `relative` (cut at `output_bytes`, saying so), or an error line starting with 'error:'."""
        limit = self.pool.config.output_bytes
        try:
            with open(self.path(relative), "rb") as f:
                data = f.read(limit + 1)
        except (BoxPathError, OSError) as e:
            return f"error: cannot read {relative!r}: {e}"
        text = data[:limit].decode(errors="replace")
        return text + (f"\n[truncated to {limit} bytes]" if len(data) > limit else "")


class SandboxPool:
    """`concurrency` slots for sandboxed commands, and private work dirs for episodes (`session()`)."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._free = list(range(config.concurrency))
        self._slots = asyncio.Semaphore(config.concurrency)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[SandboxBox]:
        """A fresh private work dir for one episode, removed (with everything in it) when the block ends."""
        workdir = Path(tempfile.mkdtemp(prefix="composer-sandbox-"))
        try:
            yield SandboxBox(self, workdir)
        finally:
            await asyncio.to_thread(shutil.rmtree, workdir, True)

    async def run(self, workdir: Path, argv: list[str], stdin: str | None = None) -> SandboxResult:
        """Run `argv` in `workdir` in one of the pool's slots (waiting for a free one)."""
        async with self._slots:
            slot = self._free.pop()
            try:
                uid = self.config.uid + slot
                if os.getuid() == 0 and self.config.mode == "rlimits":  # bwrap: the launcher's copy-in does it
                    await asyncio.to_thread(_chown_tree, workdir, uid)
                return await run_sandboxed(self.config, workdir, argv, stdin=stdin, uid=uid)
            finally:
                self._free.append(slot)


def _chown_tree(root: Path, uid: int) -> None:
    """Give the slot's uid everything in the work dir (files the host or another slot wrote), links untouched."""
    os.lchown(root, uid, uid)
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lchown(os.path.join(base, name), uid, uid)
