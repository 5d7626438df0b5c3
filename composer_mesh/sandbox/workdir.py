"""How a command's changes to the episode's work dir come back to the host, within `work_mb` and `work_files`.

bwrap mode: the command works on a sized tmpfs copy (`/work`); the launcher copies it into an `Outbox` when the
command ended and writes a status file last (`launcher.py`). The host swaps that copy in as the work dir only when
the status says saved: a command killed at its wall time, one whose work dir is over a limit, or one whose
sandbox died leaves the work dir as it was before it, and the observation says so.

rlimits mode: the command writes the host's work dir itself, so nothing can be refused; the work dir is measured
after each command (counting stops at the limit) and one over a limit is reported.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from composer_mesh.sandbox.config import SandboxConfig
from composer_mesh.sandbox.launcher import NOT_SAVED, SAVED, STATUS, UNCHANGED, Budget, Refused, walk

BEFORE = "before"  # where the replaced work dir goes, inside the outbox, to be removed with it


class Outbox:
    """A host directory beside the work dir (so that a rename swaps them) that the launcher copies `/work` into,
    passed to the sandbox as an open directory fd (`fd`): no path in the sandbox leads to it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.path = Path(tempfile.mkdtemp(prefix=f"{workdir.name}.out-", dir=workdir.parent))
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)

    def adopt(self, timed_out: bool) -> str | None:
        """Swap the saved copy in as the work dir; None when it was saved, else the observation's note."""
        state = self._status()
        if state == "saved" and (self.path / SAVED).is_dir():
            try:
                self._keep_unchanged()
            except OSError as e:
                return f"work dir not saved, left as it was before this command: an unchanged file was lost ({e})"
            os.rename(self.workdir, self.path / BEFORE)
            try:
                os.rename(self.path / SAVED, self.workdir)
            except OSError:
                os.rename(self.path / BEFORE, self.workdir)
                raise
            return None
        if state.startswith(NOT_SAVED):
            return f"work dir not saved, left as it was before this command: {state.removeprefix(NOT_SAVED)}"
        cause = "killed at the wall time before it was saved" if timed_out else "the sandbox ended before it was saved"
        return f"work dir left as it was before this command ({cause})"

    def _keep_unchanged(self) -> None:
        """Link into the saved copy the files the launcher left out of it as unchanged since they were copied in
        (a link, not a copy: writing thousands of files to disk again each command would cost seconds)."""
        with open(self.path / UNCHANGED, "rb") as f:
            names = [os.fsdecode(n) for n in f.read().split(b"\0") if n]
        for name in names:
            if name.startswith("/") or {"", ".", ".."} & set(name.split("/")):
                raise OSError(f"not a path in the work dir: {name!r}")
            os.link(self.workdir / name, self.path / SAVED / name, follow_symlinks=False)

    def _status(self) -> str:
        """What the launcher's status file says ("" when there is none: it did not get that far)."""
        try:
            fd = os.open(self.path / STATUS, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return ""
        try:
            return os.read(fd, 4096).decode(errors="replace")
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the fd and remove the outbox (what was not adopted, and the replaced work dir); idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            shutil.rmtree(self.path, ignore_errors=True)


def over_limit(config: SandboxConfig, workdir: Path) -> str | None:
    """rlimits mode: the note for a work dir over `work_files` entries or `work_mb` MB, or None. Counting stops
    at the limit, so a command that made a million files costs this check no more than a full work dir."""
    budget = Budget(config.work_files, config.work_mb)
    try:
        for name, st in walk(str(workdir)):
            budget.entry(name, st)
            if stat.S_ISREG(st.st_mode):
                budget.data(st.st_size)
    except Refused as e:
        return f"work dir over its limit: {e}"
    except OSError as e:
        return f"work dir not measured: {e.strerror}"
    return None
