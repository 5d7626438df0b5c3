"""Numbered committed directories (`<root>/step-00000007/`, `ckpt/q00000007/`): newest by listing, retention.

There is no mutable "latest" pointer (one read-then-written by a slow writer could move backwards, and s3 has no
compare-and-swap): the latest is the highest-numbered directory that holds its marker, found by listing.

Retention (`retain`) keeps the `keep` newest committed directories and deletes every older one, committed or
not: an older directory without a marker was abandoned half-written by a stopped writer. So one writer must
commit its directories in step order: committing step k while its own step k-1 is still being written would
delete k-1 as abandoned (seen in CI: a resumed run failed with a part of its step 150 missing when step 151
committed first; the run's loop waits for its earlier commits before each commit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_mesh.mesh.storage.blobs import Blobs
from composer_mesh.mesh.storage.committed import COMMITTED, CommittedDir, join


@dataclass(frozen=True)
class Committed:
    """A committed directory found by listing: its number, its key in the blobs, its marker's fields."""

    step: int
    key: str
    marker: dict[str, Any]


class CommittedSeries:
    """Directories `<root>/<name><step>` (the step zero-padded to `digits` when written), each a `CommittedDir`."""

    def __init__(self, blobs: Blobs, root: str = "", name: str = "step-", digits: int = 8,
                 marker: str = COMMITTED, *, legacy: frozenset[bytes] = frozenset(), where: str | None = None) -> None:
        self.blobs = blobs
        self.root = root
        self.name = name
        self.digits = digits
        self.marker = marker
        self.legacy = legacy
        self.where = where if where is not None else root

    def key(self, step: int) -> str:
        return join(self.root, f"{self.name}{step:0{self.digits}d}")

    def at(self, step: int) -> CommittedDir:
        """Step `step`'s directory, to write or to read."""
        return self._dir(self.key(step), f"{self.name}{step:0{self.digits}d}")

    def _dir(self, key: str, entry: str) -> CommittedDir:
        return CommittedDir(self.blobs, key, self.marker, legacy=self.legacy, where=join(self.where, entry))

    def entries(self) -> list[tuple[int, str]]:
        """(step, entry name) of every directory here, committed or not, by step."""
        found = []
        for entry in self.blobs.list(self.root):
            digits = entry[len(self.name):]
            if entry.startswith(self.name) and digits.isdigit():
                found.append((int(digits), entry))
        return sorted(found)

    def steps(self) -> list[int]:
        """Every step that has a directory here, committed or not (listed afresh: other processes write here)."""
        return [step for step, _ in self.entries()]

    def committed(self) -> list[int]:
        """The steps whose marker exists (not read: see `newest` for a read one)."""
        return [step for step, entry in self.entries() if self.blobs.exists(join(join(self.root, entry), self.marker))]

    def newest(self) -> Committed | None:
        """The highest-numbered directory whose marker is there, with the marker read; None if there is none.
        A directory without one is skipped (being written, or deleted meanwhile); an unreadable one raises
        MarkerError (bad contents must never silently send a reader back to an older step)."""
        for step, entry in reversed(self.entries()):
            found = self._dir(join(self.root, entry), entry)
            marker = found.marker()
            if marker is not None:
                return Committed(step, found.prefix, marker)
        return None

    def remove(self, entry: str) -> None:
        """Delete the directory named `entry` (a name from `entries`)."""
        self.blobs.rm_prefix(join(self.root, entry))

    def retain(self, step: int, keep: int) -> list[int]:
        """After committing `step`: delete every directory below it that is not committed or not among the `keep`
        newest committed (keep=0 keeps every committed one). Returns the steps deleted. Commits in step order."""
        done = self.committed()
        newest = done[-keep:]
        dropped = []
        for old, entry in self.entries():
            if old < step and (old not in done or old not in newest):
                self.remove(entry)
                dropped.append(old)
        return dropped
