"""Numbered committed directories (`<root>/step-00000007/`, `ckpt/q00000007/`): newest by listing, retention.

There is no mutable "latest" pointer (one read-then-written by a slow writer could move backwards, and s3 has no
compare-and-swap): the latest is the highest-numbered directory that holds a valid marker, found by listing. A
directory whose marker is invalid (`xx`, half a marker, one without hashes) is not committed: listings skip it,
with a warning, and retention deletes it like an abandoned one. Only when markers are there and none is valid
does `newest` refuse (`NotCommitted`): a reader must never silently start over as if nothing had been committed.

Retention (`retain`) keeps the `keep` newest committed directories and deletes every older one, committed or
not: an older directory without a marker was abandoned half-written by a stopped writer. So one writer must
commit its directories in step order: committing step k while its own step k-1 is still being written would
delete k-1 as abandoned (seen in CI: a resumed run failed with a part of its step 150 missing when step 151
committed first; the run's loop waits for its earlier commits before each commit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from composer_mesh.mesh.storage.blobs import Blobs
from composer_mesh.mesh.storage.committed import COMMITTED, CommittedDir, Fields, NotCommitted, join

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Committed:
    """A committed directory found by listing: its number, its key in the blobs, its marker's fields."""

    step: int
    key: str
    marker: dict[str, Any]


class CommittedSeries:
    """Directories `<root>/<name><step>` (the step zero-padded to `digits` when written), each a `CommittedDir`."""

    def __init__(self, blobs: Blobs, root: str = "", name: str = "step-", digits: int = 8,
                 marker: str = COMMITTED, *, fields: Fields | None = None, where: str | None = None) -> None:
        self.blobs = blobs
        self.root = root
        self.name = name
        self.digits = digits
        self.marker = marker
        self.fields = fields
        self.where = where if where is not None else root

    def key(self, step: int) -> str:
        return join(self.root, f"{self.name}{step:0{self.digits}d}")

    def at(self, step: int) -> CommittedDir:
        """Step `step`'s directory, to write or to read."""
        return self._dir(self.key(step), f"{self.name}{step:0{self.digits}d}")

    def _dir(self, key: str, entry: str) -> CommittedDir:
        return CommittedDir(self.blobs, key, self.marker, fields=self.fields, where=join(self.where, entry))

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
        """The steps whose marker is there and valid (each marker read: one small object per directory)."""
        return [step for step, entry in self.entries() if self._dir(join(self.root, entry), entry).committed()]

    def newest(self, below: int | None = None) -> Committed | None:
        """The highest-numbered committed directory (below step `below`, if given), with its marker; None if
        there is none. A directory without a marker is skipped (being written, or deleted meanwhile), and so is
        one whose marker is invalid, with a warning; if markers are there but none is valid, `NotCommitted` of
        the newest (bad contents must never silently send a reader back to the start)."""
        refused: NotCommitted | None = None
        for step, entry in reversed(self.entries()):
            if below is not None and step >= below:
                continue
            found = self._dir(join(self.root, entry), entry)
            try:
                return Committed(step, found.prefix, found.read_marker())
            except NotCommitted as e:
                if not e.missing:  # bad contents; a missing marker is a directory being written (or abandoned)
                    log.warning("skipping %s", e)
                    refused = refused or e
        if refused is not None:
            raise refused
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
