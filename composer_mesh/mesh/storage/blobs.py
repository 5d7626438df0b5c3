"""Where committed directories live: a six-method `Blobs` protocol, and `FsspecBlobs` for any fsspec URL.

The protocol is the least a committed directory needs (put, get, stream, exists, list, delete a prefix), so that the DiLoCo
plane's `Store` (atomic puts on file://, create-only puts, byte accounting) serves as one unchanged, and a test can
hook or fail any single operation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from composer_mesh.mesh.storage.backends import open_filesystem

CHUNK = 8 * 2**20  # bytes read at a time when a file is streamed (hashed) rather than read whole


class Blobs(Protocol):
    """Objects under string keys ("a/b/c"; "" is the root itself)."""

    def put(self, key: str, data: bytes) -> None:
        """Write the whole object (creating its parents where the storage has directories)."""

    def get(self, key: str) -> bytes | bytearray:
        """The whole object; FileNotFoundError if absent."""

    def chunks(self, key: str) -> Iterator[bytes]:
        """The object's bytes in pieces of at most `CHUNK` (to hash a large file without holding it whole);
        FileNotFoundError if absent."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Names (not keys) directly under `prefix`, fresh (other processes write here); [] if there are none."""

    def rm_prefix(self, prefix: str) -> None:
        """Delete the object `prefix`, or everything under it."""


class FsspecBlobs:
    """`Blobs` over any fsspec URL; `fs` and `root` are the fsspec filesystem and the URL's path on it."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url.rstrip("/")
        # the protocol's row (`backends.py`): on s3 and gs no listing cache, so `exists` sees other hosts' markers
        self.fs, self.root = open_filesystem(self.url, storage_options)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        # Local paths need their directory; on s3 this makes a missing bucket, as the writers did before.
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "wb") as f:
            f.write(data)

    def get(self, key: str) -> bytes:
        with self.fs.open(self.path(key), "rb") as f:
            return f.read()

    def chunks(self, key: str) -> Iterator[bytes]:
        with self.fs.open(self.path(key), "rb") as f:
            while block := f.read(CHUNK):
                yield block

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def list(self, prefix: str) -> list[str]:
        path = self.path(prefix)
        self.fs.invalidate_cache(path)
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    def rm_prefix(self, prefix: str) -> None:
        self.fs.rm(self.path(prefix), recursive=True)


def absolute(url: str) -> str:
    """A local path made absolute (other procs may run in another directory); URLs unchanged, without a final /."""
    from pathlib import Path

    return url.rstrip("/") if "://" in url else str(Path(url).resolve())
