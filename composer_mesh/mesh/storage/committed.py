"""A committed directory: files first, a JSON commit marker last; readers use only committed directories.

The marker is a JSON object: the writer's own fields (a format, a step, a run id, ...) plus

    "marker_version": 1
    "files": [{"name": "state.safetensors", "size": 123456}, ...]   every file written through it, in order

Markers written before the storage primitive existed hold only the writer's fields (or, for trainer states, the
text "ok"): they read as version 0 with no file list. The file list is where later checks go (each file's content
hash, verified on resume) and what a sharded writer fills with many files per rank (`note` records files that
another writer, e.g. torch.distributed.checkpoint, put there itself).

A directory without a marker is not committed (never written to the end, or being written). A marker that cannot
be read is refused with a `MarkerError` naming it: storage that lies must not silently restart a run.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from composer_mesh.mesh.storage.blobs import Blobs

if TYPE_CHECKING:
    import torch

MARKER_VERSION = 1
COMMITTED = "COMMITTED.json"


class StorageError(RuntimeError):
    """Stored data that cannot be used; the message names the object."""


class MarkerError(StorageError):
    """A commit marker that is present but unreadable: `key` names it, `problem` says why."""

    def __init__(self, where: str, key: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.key = key
        self.problem = problem


def join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


class CommittedDir:
    """One directory under `prefix` in `blobs`, committed by its `marker` file.

    `legacy`: marker bodies of an older writer, accepted as a version-0 marker with no fields (trainer states
    wrote "ok\\n"). `where` names the directory in errors (a URL; the key by default)."""

    def __init__(self, blobs: Blobs, prefix: str = "", marker: str = COMMITTED, *,
                 legacy: frozenset[bytes] = frozenset(), where: str | None = None) -> None:
        self.blobs = blobs
        self.prefix = prefix
        self.marker_name = marker
        self.legacy = legacy
        self.where = where if where is not None else prefix
        self._files: list[dict[str, Any]] = []  # written (or noted) since this object was made or reopened

    @property
    def files(self) -> list[dict[str, Any]]:
        """The files the next marker lists: `{"name", "size"}` each, in the order written."""
        return list(self._files)

    def key(self, name: str) -> str:
        return join(self.prefix, name)

    # ---- writing ----------------------------------------------------------------------------------------------
    def reopen(self) -> None:
        """Before writing over an earlier commit: remove its marker first, so that a write that dies half-way
        never leaves a marker over a mix of old and new files."""
        if self.blobs.exists(self.key(self.marker_name)):
            self.blobs.rm_prefix(self.key(self.marker_name))
        self._files = []

    def write(self, name: str, data: bytes) -> None:
        self.blobs.put(self.key(name), data)
        self.note(name, len(data))

    def write_json(self, name: str, obj: Any) -> None:
        """`obj` as JSON text, as `json.dumps` writes it (no sorting: the bytes are the writer's)."""
        self.write(name, json.dumps(obj).encode())

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save

        self.write(name, save(tensors))

    def note(self, name: str, size: int) -> None:
        """Record a file that was written here by another writer (it is listed in the marker like the others)."""
        self._files.append({"name": name, "size": int(size)})

    def commit(self, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the marker, last: the writer's `fields` plus the version and the files written. Returns it."""
        doc = {**(fields or {}), "marker_version": MARKER_VERSION, "files": self.files}
        self.blobs.put(self.key(self.marker_name), json.dumps(doc, sort_keys=True).encode())
        return doc

    # ---- reading ----------------------------------------------------------------------------------------------
    def committed(self) -> bool:
        """Whether the marker exists (not read: listings check many directories; `marker()` reads it)."""
        return self.blobs.exists(self.key(self.marker_name))

    def marker(self) -> dict[str, Any] | None:
        """The marker's contents, or None if the directory is not committed; MarkerError if unreadable."""
        try:
            data = self.blobs.get(self.key(self.marker_name))
        except FileNotFoundError:
            return None
        return parse_marker(bytes(data), self.legacy, f"{join(self.where, self.marker_name)}", self.key(
            self.marker_name))

    def read(self, name: str) -> bytes | bytearray:
        return self.blobs.get(self.key(name))

    def read_committed(self, json_name: str, tensors_name: str, *, missing: str,
                       what: str) -> tuple[Any, dict[str, torch.Tensor]]:
        """A committed directory's JSON document and tensors, the one way its readers open it: a directory
        without a marker is `StorageError(missing)`, a garbled marker a `MarkerError`, and a file that cannot be
        read or parsed a `StorageError` naming the directory and `what` it should have held."""
        from safetensors import SafetensorError

        if self.marker() is None:
            raise StorageError(missing)
        try:
            return self.read_json(json_name), self.read_tensors(tensors_name)
        except (OSError, ValueError, SafetensorError) as e:
            raise StorageError(f"{self.where}: unreadable {what}: {type(e).__name__}: {e}") from e

    def read_json(self, name: str) -> Any:
        return json.loads(self.read(name))

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(bytes(self.read(name)))


def parse_marker(data: bytes, legacy: frozenset[bytes], where: str, key: str) -> dict[str, Any]:
    """A marker's fields; `marker_version` 0 and no `files` for a marker written before the storage primitive."""
    if data in legacy:
        return {"marker_version": 0, "files": []}
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MarkerError(where, key, f"unreadable commit marker: {e}") from None
    if not isinstance(doc, dict):
        raise MarkerError(where, key, f"unreadable commit marker: a JSON {type(doc).__name__}, not an object")
    version = doc.setdefault("marker_version", 0)
    if not isinstance(version, int) or version > MARKER_VERSION:
        raise MarkerError(where, key, f"commit marker version {version!r}, this composer-mesh reads up to "
                                      f"{MARKER_VERSION}")
    files = doc.setdefault("files", [])
    if not isinstance(files, list) or not all(isinstance(f, dict) and "name" in f for f in files):
        raise MarkerError(where, key, "unreadable commit marker: `files` is not a list of {name, size}")
    return doc
