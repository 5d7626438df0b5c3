"""Object-store access for the DiLoCo plane: atomic puts, create-only puts, checksummed safetensors shards.

Why this layer exists: fsspec backends differ exactly where a multi-writer protocol cares. What differs per
protocol is one row of `mesh.storage.backends.BACKENDS` (listing cache, how create-only is made atomic, whether
the store is a local filesystem); this class only dispatches on that row, and opens its own client:
- local (file://): a plain write is visible half-written, so puts go to a temp name then `os.replace`;
  create-only `link`s the finished temp file (fails atomically if the target exists).
- precondition (s3://, gs://): a single PUT (or a completed multipart/resumable upload) is atomic; create-only
  is the server's precondition (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`), refused with 412.
- lock (memory://): one process only (threads); create-only is guarded by a process-wide lock.
Nothing read from the store is ever unpickled: tensors are safetensors, small records are JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.storage.backends import backend_for, open_filesystem
from composer_mesh.mesh.storage.blobs import CHUNK

SHARD_FORMAT = "composer-mesh-shard-v1"
_MEMORY_LOCK = threading.Lock()


class ShardError(ValueError):
    """A shard read from the store is unusable; `key` names the object and `problem` says why."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem



def _write_temp(path: str, parts: list[bytes | memoryview]) -> str:
    """Write `parts` to a fresh temp file next to `path` (file://); the caller renames or links it into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        for b in parts:
            f.write(b)
    return tmp

class StoreError(RuntimeError):
    """The store itself is unusable (bad URI, missing credentials variable, I/O failure)."""


_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _ST_DTYPES.items()}


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (t must be contiguous and on CPU)."""
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _prepare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
        out[name] = t
    return out


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, size and raw bytes, in sorted-name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{_ST_DTYPES[t.dtype]}|{t.numel()};".encode())
        h.update(_raw(t))
    return h.hexdigest()


def encode_shard_parts(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[bytes | memoryview]:
    """A safetensors object as buffers [length, header, tensor bytes...], without copying tensor data.

    The header's metadata carries `meta` (stringified), the format tag and the payload's sha256. Tensors
    are laid out by decreasing element size, so every tensor is aligned for zero-copy reads.
    """
    clean = _prepare(tensors)
    md = {k: str(v) for k, v in meta.items()}
    md["format"] = SHARD_FORMAT
    md["sha256"] = tensor_digest(clean)
    header: dict[str, Any] = {"__metadata__": md}
    parts: list[bytes | memoryview] = []
    off = 0
    for name in sorted(clean, key=lambda k: (-clean[k].element_size(), k)):
        t = clean[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        parts.append(_raw(t))
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return [struct.pack("<Q", len(hb)), hb, *parts]


def encode_shard(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """safetensors bytes (readable by `safetensors.torch.load`) with metadata and the payload's sha256."""
    return b"".join(encode_shard_parts(tensors, meta))


def read_header(key: str, data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header without touching tensor data; returns (header, expected total size)."""
    if len(data) < 8:
        raise ShardError(key, f"truncated: {len(data)} bytes, not even a safetensors header length")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8:
        raise ShardError(key, f"truncated: the header alone needs {8 + n} bytes but the object has {len(data)}")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(key, f"not a safetensors object (unreadable header: {e})") from None
    if not isinstance(header, dict):
        raise ShardError(key, "not a safetensors object (header is not a JSON object)")
    meta = header.get("__metadata__", {})
    # safetensors metadata is a str -> str mapping; anything else is foreign or corrupt (and would otherwise
    # surface as an AttributeError/TypeError far from the object that caused it).
    if not isinstance(meta, dict):
        raise ShardError(key, f"not a safetensors object (__metadata__ is a JSON {type(meta).__name__}, "
                              "not an object)")
    bad_meta = sorted(k for k, v in meta.items() if not isinstance(v, str))
    if bad_meta:
        raise ShardError(key, f"not a safetensors object (__metadata__ values must be strings: {bad_meta})")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            if any(d < 0 for d in shape) or not all(isinstance(d, int) for d in info["shape"]):
                raise ValueError(f"shape {info['shape']!r}")
            numel = 1
            for d in shape:
                numel *= d
            dtype = _TORCH_DTYPES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise ShardError(key, f"not a safetensors object (bad entry {name!r})") from None
        if stop - start != numel * dtype.itemsize or start < 0:
            raise ShardError(key, f"not a safetensors object (entry {name!r}: offsets do not match its shape)")
        end = max(end, stop)
    return header, 8 + n + end


def _check_meta(key: str, header: dict[str, Any], expect: Mapping[str, Any]) -> dict[str, str]:
    meta = header.get("__metadata__", {})  # a str -> str mapping: checked by read_header
    if meta.get("format") != SHARD_FORMAT:
        raise ShardError(key, f"not a composer-mesh shard (format={meta.get('format')!r})")
    for field, want in expect.items():
        got = meta.get(field)
        if got != str(want):
            what = "a shard from another run" if field == "run_id" else f"wrong {field}"
            raise ShardError(key, f"{what}: metadata {field}={got!r}, expected {str(want)!r}")
    return dict(meta)


def decode_shard(
    key: str, data: bytes | bytearray, expect: Mapping[str, Any], expected_size: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Validate and load a shard: size, header, run/round/replica metadata, then the sha256 of the payload.

    Every failure is a ShardError naming `key` and the problem (truncated, checksum mismatch, another run...).
    Tensors are zero-copy views of `data` (pass a bytearray to get writable tensors without a warning).
    """
    if not isinstance(data, bytearray):  # torch tensors over immutable bytes would be "read-only" views
        data = bytearray(data)
    header, total = read_header(key, data)
    if len(data) < total:
        raise ShardError(key, f"truncated: {len(data)} bytes, the safetensors header describes {total}")
    if expected_size is not None and len(data) != expected_size:
        raise ShardError(key, f"size mismatch: {len(data)} bytes, the writer announced {expected_size}")
    meta = _check_meta(key, header, expect)
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    base = 8 + n
    mv = memoryview(data)
    h = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        dtype, shape = _TORCH_DTYPES[info["dtype"]], [int(d) for d in info["shape"]]
        start, stop = (int(x) for x in info["data_offsets"])
        numel = (stop - start) // dtype.itemsize
        h.update(f"{name}|{info['dtype']}|{numel};".encode())
        h.update(mv[base + start : base + stop])
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif (base + start) % dtype.itemsize:  # unaligned (a foreign writer): copy instead of viewing
            tensors[name] = torch.frombuffer(bytearray(mv[base + start : base + stop]), dtype=dtype).reshape(shape)
        else:
            tensors[name] = torch.frombuffer(data, dtype=dtype, count=numel, offset=base + start).reshape(shape)
    digest = h.hexdigest()
    if digest != meta.get("sha256"):
        raise ShardError(key, f"checksum mismatch: payload sha256 {digest[:16]}…, metadata says "
                              f"{str(meta.get('sha256'))[:16]}…")
    return tensors, dict(meta)


class Store:
    """A run-namespaced view of an fsspec store with byte accounting (for benchmarks and round reports)."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.scheme = self.uri.partition("://")[0]
        self.backend = backend_for(self.uri)
        try:
            self.fs, self.root = open_filesystem(self.uri, storage_options, own_client=True)  # one per replica
        except Exception as e:
            raise StoreError(f"cannot open store {self.uri!r}: {type(e).__name__}: {e}") from None
        self.root = self.root.rstrip("/")
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0

    @classmethod
    def from_config(cls, config: DiLoCoConfig, under: str | None = None) -> Store:
        """Open `config.store_uri` under `config.run_id` (and `under` inside it: a sharded replica's rank keeps
        its shards' rounds and checkpoints apart); secrets come from the env vars named in config."""
        opts: dict[str, Any] = dict(config.storage_options)
        for opt, env in config.credentials_env.items():
            if env not in os.environ:
                raise StoreError(f"diloco.credentials_env[{opt!r}]: environment variable {env} is not set")
            opts[opt] = os.environ[env]
        root = f"{config.store_uri}/{config.run_id}"
        return cls(f"{root}/{under}" if under else root, opts)

    def __repr__(self) -> str:  # never show storage options (they may hold secrets)
        return f"Store({self.uri!r})"

    # ---- paths and accounting -------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written

    def counters(self) -> tuple[int, int]:
        with self._lock:
            return self.bytes_read, self.bytes_written

    # ---- writes --------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes | list[bytes | memoryview]) -> None:
        """Atomic put: readers see nothing or the whole object. `data` may be a list of buffers."""
        p = self.path(key)
        parts = data if isinstance(data, list) else [data]
        size = sum(memoryview(b).nbytes for b in parts)
        if self.backend.local:
            os.replace(_write_temp(p, parts), p)
        else:
            self.fs.pipe_file(p, parts[0] if len(parts) == 1 else b"".join(parts))
        self._count(written=size)

    def put_if_absent(self, key: str, data: bytes | list[bytes | memoryview]) -> bool:
        """Create-only put; False if the key already exists (someone else won). Atomic on every backend."""
        p = self.path(key)
        parts = data if isinstance(data, list) else [data]
        size = sum(memoryview(b).nbytes for b in parts)
        create = {"link": self._create_by_link, "lock": self._create_under_lock,
                  "precondition": self._create_by_precondition}[self.backend.create_only]
        won = create(p, parts)
        if won:
            self._count(written=size)
        return won

    @staticmethod
    def _create_by_link(p: str, parts: list[bytes | memoryview]) -> bool:
        """Local files: link a finished temp file to the name, which fails if the name exists."""
        tmp = _write_temp(p, parts)
        try:
            os.link(tmp, p)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _create_under_lock(self, p: str, parts: list[bytes | memoryview]) -> bool:
        """memory://: every writer is a thread of this process, so one lock makes check-then-write atomic."""
        with _MEMORY_LOCK:
            if self.fs.exists(p):
                return False
            self.fs.pipe_file(p, b"".join(parts))
            return True

    def _create_by_precondition(self, p: str, parts: list[bytes | memoryview]) -> bool:
        """Object stores: the server refuses to replace an existing key (412); fsspec raises FileExistsError."""
        try:
            self.fs.pipe_file(p, parts[0] if len(parts) == 1 else b"".join(parts), mode="create")
            return True
        except FileExistsError:
            return False
        except OSError as e:  # some s3fs versions surface 412 PreconditionFailed as a plain OSError
            if "PreconditionFailed" in str(e) or "412" in str(e):
                return False
            raise

    def put_json(self, key: str, obj: Any) -> None:
        self.put(key, json.dumps(obj, sort_keys=True).encode())

    def put_json_if_absent(self, key: str, obj: Any) -> bool:
        return self.put_if_absent(key, json.dumps(obj, sort_keys=True).encode())

    # ---- reads ---------------------------------------------------------------------------------------
    def get(self, key: str) -> bytearray:
        """Whole object as a (writable) bytearray; FileNotFoundError if absent."""
        p = self.path(key)
        if self.backend.local:
            with open(p, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(data)
            del data[got:]
        else:
            data = bytearray(self.fs.cat_file(p))
        self._count(read=len(data))
        return data

    def chunks(self, key: str) -> Iterator[bytes]:
        """The object in pieces of at most `CHUNK` bytes (`mesh.storage.Blobs`: a file hashed without holding it
        whole); FileNotFoundError if absent."""
        with self.fs.open(self.path(key), "rb") as f:
            while block := f.read(CHUNK):
                self._count(read=len(block))
                yield block

    def read_shard_into(
        self, key: str, out: torch.Tensor, expect: Mapping[str, Any], expected_size: int | None = None
    ) -> dict[str, str]:
        """Read a one-tensor ("data") shard straight into `out` (contiguous, 1-D), validated like decode_shard.

        On file:// the payload is read into `out`'s memory directly: no intermediate buffer, no extra copy.
        """
        if not out.is_contiguous():
            raise ValueError("read_shard_into needs a contiguous destination tensor")
        if not self.backend.local:
            tensors, meta = decode_shard(key, self.get(key), expect, expected_size)
            t = tensors.get("data")
            if len(tensors) != 1 or t is None or t.dtype != out.dtype or t.numel() != out.numel():
                raise ShardError(key, f"unexpected payload {[(k, v.dtype, v.numel()) for k, v in tensors.items()]}, "
                                      f"expected one 'data' tensor of {out.numel()} x {out.dtype}")
            out.copy_(t.reshape(out.shape))
            return meta
        with open(self.path(key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                head += f.read(min(n, max(0, size - 8)))
            header, total = read_header(key, head)
            if size < total:
                raise ShardError(key, f"truncated: {size} bytes, the safetensors header describes {total}")
            if expected_size is not None and size != expected_size:
                raise ShardError(key, f"size mismatch: {size} bytes, the writer announced {expected_size}")
            meta = _check_meta(key, header, expect)
            info = header.get("data")
            names = [k for k in header if k != "__metadata__"]
            dtype = _TORCH_DTYPES[info["dtype"]] if info else None
            start, stop = (int(x) for x in info["data_offsets"]) if info else (0, 0)
            if names != ["data"] or dtype != out.dtype or (stop - start) != out.numel() * out.element_size():
                raise ShardError(key, f"unexpected payload {names} ({info and info['dtype']}, {stop - start} bytes), "
                                      f"expected one 'data' tensor of {out.numel()} x {out.dtype}")
            mv = _raw(out)
            f.seek(len(head) + start)
            got = f.readinto(mv) if mv.nbytes else 0
            if got != mv.nbytes:
                raise ShardError(key, f"truncated while reading: {got} of {mv.nbytes} payload bytes")
        self._count(read=size)
        h = hashlib.sha256()
        h.update(f"data|{info['dtype']}|{out.numel()};".encode())
        h.update(mv)
        digest = h.hexdigest()
        if digest != meta.get("sha256"):
            raise ShardError(key, f"checksum mismatch: payload sha256 {digest[:16]}…, metadata says "
                                  f"{str(meta.get('sha256'))[:16]}…")
        return meta

    def get_or_none(self, key: str) -> bytearray | None:
        try:
            return self.get(key)
        except FileNotFoundError:
            return None

    def get_json(self, key: str) -> Any:
        data = self.get(key)
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardError(key, f"unreadable JSON record: {e}") from None

    def get_json_or_none(self, key: str) -> Any | None:
        try:
            return self.get_json(key)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        p = self.path(key)
        if self.backend.local:
            return os.path.exists(p)
        return bool(self.fs.exists(p))  # fresh: the backend's row turns listing caches off where they exist

    def list(self, prefix: str) -> list[str]:
        """Names (not paths) directly under `prefix`, fresh from the store (no listing cache)."""
        p = self.path(prefix)
        if self.backend.local:
            try:
                return sorted(n for n in os.listdir(p) if ".tmp-" not in n)
            except FileNotFoundError:
                return []
        try:
            entries = self.fs.ls(p, detail=False)  # fresh: the backend's row turns listing caches off
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def rm_prefix(self, prefix: str) -> None:
        """Delete the object `prefix` or everything under it (best effort: garbage collection must not fail a
        round)."""
        p = self.path(prefix)
        try:
            if self.backend.local:
                import shutil

                if os.path.isfile(p):  # one object (a commit marker: `mesh.storage.Blobs` deletes those too)
                    os.unlink(p)
                else:
                    shutil.rmtree(p, ignore_errors=True)
            else:
                self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass
