"""A committed directory: files first, a JSON commit marker last; readers use only committed directories.

The marker is a JSON object: the writer's own fields (a format, a step, a run id, ...) plus

    "marker_version": 2
    "files": [{"name": "state.safetensors", "size": 123456, "sha256": "9f86d0..."}, ...]

every file written through it, in order, with its size and the sha256 of its bytes. Why hashes: a directory is
only as good as its contents, and storage can lie without a marker noticing (a disk that flips bytes, a copy cut
short, a hand that edited a file): 64 bytes of 0xFF in a trainer state once loaded without complaint and made
the next step's loss NaN. Readers that load a file check its bytes against the marker (`read`), and a resume
checks every file before anything launches (`verify`, streamed: no file is held in memory whole for it).

A directory is committed only when its marker is there *and* is one of this version's markers: valid JSON, an
object, `marker_version` 2, a file list of names, sizes and hashes, and the writer's own `fields` with their
types. Anything else (a missing marker, half a marker, `xx`, an older composer-mesh's marker without hashes) is
"not committed": listings skip it (`CommittedSeries`), and a reader that names it gets a `NotCommitted` saying
why. A committed directory whose file differs from its marker is a `ContentError` naming the file and what
differs (its size, or its hash).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from composer_mesh.mesh.storage.blobs import Blobs

if TYPE_CHECKING:
    import torch

MARKER_VERSION = 2
COMMITTED = "COMMITTED.json"
Fields = Mapping[str, type | tuple[type, ...]]  # a writer's own marker fields and their JSON types


class StorageError(RuntimeError):
    """Stored data that cannot be used; the message names the object."""


class NotCommitted(StorageError):
    """A directory that is not committed: its marker is missing or is not a valid marker. `key` names the marker,
    `problem` says why."""

    def __init__(self, where: str, key: str, problem: str, missing: bool = False) -> None:
        super().__init__(f"{where}: {problem}")
        self.key = key
        self.problem = problem
        self.missing = missing  # no marker at all: being written, or never finished (not bad contents)


class ContentError(StorageError):
    """A file of a committed directory whose size or content hash differs from its marker's entry (or that is
    missing): `where` names the file, `problem` says what differs."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


def join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def digest(chunks: Iterable[bytes | bytearray | memoryview]) -> tuple[int, str]:
    """(size, sha256 hex) of the bytes `chunks` yields, one chunk at a time."""
    h, size = hashlib.sha256(), 0
    for chunk in chunks:
        h.update(chunk)
        size += memoryview(chunk).nbytes
    return size, h.hexdigest()


class CommittedDir:
    """One directory under `prefix` in `blobs`, committed by its `marker` file.

    `fields`: the writer's own marker fields and their types; a marker without them is not committed. `where`
    names the directory in errors (a URL; the key by default)."""

    def __init__(self, blobs: Blobs, prefix: str = "", marker: str = COMMITTED, *, fields: Fields | None = None,
                 where: str | None = None) -> None:
        self.blobs = blobs
        self.prefix = prefix
        self.marker_name = marker
        self.fields: Fields = fields or {}
        self.where = where if where is not None else prefix
        self._files: list[dict[str, Any]] = []  # written (or noted) since this object was made or reopened

    @property
    def files(self) -> list[dict[str, Any]]:
        """The files the next marker lists: `{"name", "size", "sha256"}` each, in the order written."""
        return list(self._files)

    def key(self, name: str) -> str:
        return join(self.prefix, name)

    def url(self, name: str) -> str:
        """`name` here as errors name it."""
        return join(self.where, name)

    # ---- writing ----------------------------------------------------------------------------------------------
    def reopen(self) -> None:
        """Before writing over an earlier commit: remove its marker first, so that a write that dies half-way
        never leaves a marker over a mix of old and new files."""
        if self.blobs.exists(self.key(self.marker_name)):
            self.blobs.rm_prefix(self.key(self.marker_name))
        self._files = []

    def write(self, name: str, data: bytes) -> None:
        """Write `data` as `name` and list it with its size and hash (taken from `data`: nothing is read back)."""
        self.blobs.put(self.key(name), data)
        self._record(name, *digest([data]))

    def write_json(self, name: str, obj: Any) -> None:
        """`obj` as JSON text, as `json.dumps` writes it (no sorting: the bytes are the writer's)."""
        self.write(name, json.dumps(obj).encode())

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save

        self.write(name, save(tensors))

    def note(self, name: str) -> None:
        """List a file that another writer put here (e.g. torch.distributed.checkpoint's): read back, streamed,
        for its size and hash."""
        self._record(name, *digest(self.blobs.chunks(self.key(name))))

    def _record(self, name: str, size: int, sha256: str) -> None:
        self._files.append({"name": name, "size": size, "sha256": sha256})

    def commit(self, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the marker, last: the writer's `fields` plus the version and the files written. Returns it."""
        doc = {**(fields or {}), "marker_version": MARKER_VERSION, "files": self.files}
        check_fields(doc, self.fields, self.url(self.marker_name), self.key(self.marker_name))  # a writer's bug
        self.blobs.put(self.key(self.marker_name), json.dumps(doc, sort_keys=True).encode())
        return doc

    # ---- reading ----------------------------------------------------------------------------------------------
    def read_marker(self) -> dict[str, Any]:
        """The marker's contents; `NotCommitted` (naming the marker and why) when it is missing or invalid."""
        key = self.key(self.marker_name)
        try:
            data = self.blobs.get(key)
        except FileNotFoundError:
            raise NotCommitted(self.url(self.marker_name), key, "not committed: the commit marker is missing (never "
                                                                "finished, or being written)", missing=True) from None
        return parse_marker(bytes(data), self.fields, self.url(self.marker_name), key)

    def marker(self) -> dict[str, Any] | None:
        """The marker's contents, or None if the directory is not committed (no marker, or an invalid one)."""
        try:
            return self.read_marker()
        except NotCommitted:
            return None

    def committed(self) -> bool:
        """Whether the marker is there and valid (read: `xx` in a marker does not commit anything)."""
        return self.marker() is not None

    def verify(self) -> dict[str, Any]:
        """Check every file the marker lists, streamed, against its size and hash; the marker. `NotCommitted` or
        `ContentError` naming the file and what differs."""
        marker = self.read_marker()
        for entry in marker["files"]:
            try:
                size, sha = digest(self.blobs.chunks(self.key(entry["name"])))
            except FileNotFoundError:
                raise ContentError(self.url(entry["name"]), f"missing, although {self.marker_name} lists it") \
                    from None
            self._compare(entry, size, sha)
        return marker

    def read(self, name: str, marker: dict[str, Any] | None = None) -> bytes | bytearray:
        """File `name`'s bytes, checked against `marker`'s entry for it when given (a `ContentError` if they
        differ; a file the marker does not list is an error too)."""
        data = self.blobs.get(self.key(name))
        if marker is not None:
            entry = next((f for f in marker["files"] if f["name"] == name), None)
            if entry is None:
                raise ContentError(self.url(name), f"not listed in {self.marker_name}")
            self._compare(entry, *digest([data]))
        return data

    def _compare(self, entry: dict[str, Any], size: int, sha256: str) -> None:
        where = self.url(entry["name"])
        if size != entry["size"]:
            raise ContentError(where, f"{size} bytes, {self.marker_name} says {entry['size']} (truncated or "
                                      "overwritten)")
        if sha256 != entry["sha256"]:
            raise ContentError(where, f"content differs from {self.marker_name} (sha256 {sha256[:16]}…, the "
                                      f"marker says {entry['sha256'][:16]}…): the file was changed after its commit")

    def read_committed(self, json_name: str, tensors_name: str, *, missing: str,
                       what: str) -> tuple[Any, dict[str, torch.Tensor]]:
        """A committed directory's JSON document and tensors, the one way its readers open it, each file checked
        against the marker: a directory without a marker is `StorageError(missing)`, an invalid marker a
        `NotCommitted`, a file that differs from it a `ContentError`, and a file that cannot be read or parsed a
        `StorageError` naming the directory and `what` it should have held."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            marker = self.read_marker()
        except NotCommitted as e:
            if e.missing:
                raise StorageError(missing) from None
            raise
        try:
            doc = json.loads(self.read(json_name, marker))
            return doc, load(bytes(self.read(tensors_name, marker)))
        except (OSError, ValueError, SafetensorError) as e:
            raise StorageError(f"{self.where}: unreadable {what}: {type(e).__name__}: {e}") from e

    def read_json(self, name: str, marker: dict[str, Any] | None = None) -> Any:
        return json.loads(self.read(name, marker))

    def read_tensors(self, name: str, marker: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(bytes(self.read(name, marker)))


def parse_marker(data: bytes, fields: Fields, where: str, key: str) -> dict[str, Any]:
    """A marker's fields, or `NotCommitted` saying what is wrong with it."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotCommitted(where, key, f"not committed: the commit marker is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise NotCommitted(where, key, f"not committed: the commit marker is a JSON {type(doc).__name__}, not an "
                                       "object")
    version = doc.get("marker_version", 0)
    if version != MARKER_VERSION:
        raise NotCommitted(where, key, f"not committed: commit marker version {version!r}, this composer-mesh "
                                       f"reads version {MARKER_VERSION} (markers with each file's content hash)")
    check_fields(doc, {"files": list, **fields}, where, key)
    for i, entry in enumerate(doc["files"]):
        if not _file_entry(entry):
            raise NotCommitted(where, key, f"not committed: files[{i}] is not a {{name, size, sha256}} entry: "
                                           f"{json.dumps(entry)[:120]}")
    return doc


def check_fields(doc: dict[str, Any], fields: Fields, where: str, key: str) -> None:
    """`NotCommitted` if `doc` lacks one of `fields` or holds it with another type (a bool is no int)."""
    for name, kind in fields.items():
        value = doc.get(name)
        if name not in doc or not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise NotCommitted(where, key, f"not committed: the commit marker's {name!r} is "
                                           f"{json.dumps(value)[:60] if name in doc else 'missing'}, expected "
                                           f"{_type_name(kind)}")


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", list: "a list"}.get(k, k.__name__)
                       for k in kinds)


def _file_entry(entry: Any) -> bool:
    """A marker's file entry: a non-empty name, a size >= 0, a sha256 of 64 lowercase hex digits."""
    if not isinstance(entry, dict):
        return False
    name, size, sha = entry.get("name"), entry.get("size"), entry.get("sha256")
    return (isinstance(name, str) and bool(name) and isinstance(size, int) and not isinstance(size, bool)
            and size >= 0 and isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha))
