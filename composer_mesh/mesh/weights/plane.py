"""Weight plane: the trainer publishes versioned weights, generators pull them with one-sided reads.

Protocol (details and reasoning in docs/weights.md):

* The trainer (`WeightPublisher`) owns `num_slots` staging slots (2 with `double_buffer`), each ONE flat
  byte buffer that holds every tensor at a fixed, aligned offset, plus one int64 header per slot. The slots
  are registered once as `RDMABuffer`s (in chunks of `bucket_mb`) and never reallocated, so handles stay
  valid for the life of the publisher.
* `publish(params)` writes version v into slot `v % num_slots`: header := 2v+1 (writing), copy every
  tensor into the slot, header := 2v (stable). Training keeps its own parameters; generators only ever read
  the slots, so the trainer's cost is one memcpy per version, whatever the number of generators.
* A generator (`WeightSubscriber`) reads the slot's chunks concurrently into its own staging buffer, then
  reads the header again (seqlock check). If the header still says "v stable", no write touched the slot
  since v was completed (versions only grow), so the copy is exactly version v. Otherwise the read was torn
  or stale: it re-reads the headers, picks the newest stable slot and retries, at most `max_retries` times.
* The caller swaps staged weights into its model between requests (`apply_to`), so pulling never disturbs
  in-flight generation.

The `endpoint` transport keeps the same slots and interface but ships the newest stable slot as
safetensors bytes through a small actor that lives in the trainer's process.

Monarch is imported lazily (inside functions), so importing this module never imports Monarch before
`composer_mesh.mesh.runtime` has set its environment. The `weights:` section's settings live in
`composer_mesh.mesh.weights.config`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import struct
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from composer_mesh.mesh.weights.config import WeightPlaneConfig

_ALIGN = 64  # byte alignment of every tensor inside a slot (any dtype view of the flat buffer is legal)
_MIB = 1 << 20


# --------------------------------------------------------------------------------------------- errors


class WeightPlaneError(RuntimeError):
    """Base class of weight-plane failures."""


class ManifestMismatchError(WeightPlaneError, ValueError):
    """The published tensors do not match what this side expects (names, shapes or dtypes)."""


class StaleVersionError(WeightPlaneError):
    """The requested version was overwritten before it could be read and `allow_newer` is off."""


class TornReadError(WeightPlaneError):
    """Every retry overlapped a publish; no consistent version could be read."""


class WeightTransferError(WeightPlaneError):
    """A read (RDMA or endpoint) failed or timed out."""


# ------------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives inside a slot."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    offset: int  # byte offset inside the slot
    nbytes: int


@dataclass(frozen=True)
class WeightManifest:
    """What a generator needs to pull one version: small and picklable (no tensor data).

    `handles[slot][chunk]` are RDMABuffer handles (rdma transport); `server` is the endpoint actor
    (endpoint transport). The controller passes this from the trainer to the generators.
    """

    publisher_id: str
    version: int
    slot: int
    transport: Literal["rdma", "endpoint"]
    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    chunks: tuple[tuple[int, int], ...]  # (byte offset, byte size) of each chunk of a slot
    num_slots: int
    handles: tuple[tuple[Any, ...], ...] = ()
    header: Any = None
    server: Any = None

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    def layout_key(self) -> tuple[Any, ...]:
        """Identity of the layout: two manifests with equal keys fit the same staging buffer."""
        return (self.total_bytes, tuple((t.name, t.shape, t.dtype, t.offset) for t in self.tensors))

    def tensors_in(self, start: int, size: int) -> list[str]:
        """Names of the tensors overlapping the byte range [start, start + size)."""
        end = start + size
        return [t.name for t in self.tensors if t.offset < end and t.offset + t.nbytes > start]


@dataclass
class PulledWeights:
    """Result of one pull. `tensors` are views into the subscriber's staging buffer: valid until the next
    pull, so copy them (`WeightSubscriber.apply_to`) before pulling again."""

    version: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    seconds: float
    retries: int
    transport: str


# ------------------------------------------------------------------------------------------- helpers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ManifestMismatchError(f"weight manifest: unknown dtype {name!r}")
    return dt


def _quiet_tcp_fallback() -> None:
    """Monarch warns once per process when RDMA falls back to TCP; that is expected here."""
    from monarch.rdma import RDMATcpFallbackWarning

    warnings.filterwarnings("ignore", category=RDMATcpFallbackWarning)


def _build_layout(params: Mapping[str, torch.Tensor]) -> tuple[tuple[TensorSpec, ...], int]:
    if not params:
        raise ValueError("weight plane: no tensors to publish (params is empty)")
    specs: list[TensorSpec] = []
    offset = 0
    for name, t in params.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight plane: {name!r} is a {type(t).__name__}, expected a torch.Tensor")
        nbytes = t.numel() * t.element_size()
        offset = -(-offset // _ALIGN) * _ALIGN
        specs.append(TensorSpec(name, tuple(t.shape), _dtype_name(t.dtype), offset, nbytes))
        offset += nbytes
    return tuple(specs), max(offset, 1)


def _views(flat: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Typed, shaped views of the tensors inside one flat uint8 slot (no copies)."""
    out = {}
    for s in specs:
        raw = flat[s.offset : s.offset + s.nbytes]
        out[s.name] = raw.view(_dtype(s.dtype)).view(s.shape)
    return out


def _check_against(
    specs: Sequence[TensorSpec], expected: Mapping[str, tuple[tuple[int, ...], str]], where: str
) -> None:
    """Raise ManifestMismatchError naming the first tensors that differ from `expected`."""
    got = {s.name: (s.shape, s.dtype) for s in specs}
    missing = [n for n in expected if n not in got]
    extra = [n for n in got if n not in expected]
    if missing or extra:
        raise ManifestMismatchError(
            f"{where}: tensor names differ; missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    for name, (shape, dtype) in expected.items():
        gshape, gdtype = got[name]
        if tuple(gshape) != tuple(shape):
            raise ManifestMismatchError(
                f"{where}: tensor {name!r} has shape {tuple(gshape)}, expected {tuple(shape)}"
            )
        if gdtype != dtype:
            raise ManifestMismatchError(f"{where}: tensor {name!r} has dtype {gdtype}, expected {dtype}")


def _signature(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(t.shape), _dtype_name(t.dtype)) for n, t in tensors.items()}


def _chunks(total: int, chunk_bytes: int) -> tuple[tuple[int, int], ...]:
    return tuple((o, min(chunk_bytes, total - o)) for o in range(0, total, chunk_bytes))


def _stable_version(h: int) -> int | None:
    """Header value -> the version it holds, or None while empty or being written."""
    return h // 2 if h > 0 and h % 2 == 0 else None


def _backoff(attempt: int) -> float:
    return min(1.0, 0.05 * (2**attempt))


# ------------------------------------------------------------------------------------------ publisher

_LOCAL_PUBLISHERS: dict[str, WeightPublisher] = {}  # publisher_id -> publisher, for the endpoint server


class WeightPublisher:
    """Trainer side. Build once (registers the slots), then `publish(params)` after each optimizer step.

    Needs a Monarch context (inside an actor, or the controller). Not thread-safe: call `publish` from
    one thread at a time.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], config: WeightPlaneConfig | None = None) -> None:
        self.config = config or WeightPlaneConfig()
        self.transport = self.config.resolved_transport()
        self.id = uuid.uuid4().hex
        self._specs, self._total = _build_layout(params)
        self._signature = {s.name: (s.shape, s.dtype) for s in self._specs}
        devices = {t.device for t in params.values()}
        if len(devices) != 1:
            raise ValueError(
                f"weight plane: params live on several devices {sorted(map(str, devices))}; use one"
            )
        device = devices.pop()
        self.num_slots = 2 if self.config.double_buffer else 1
        # Stable storage for the life of the publisher: registered handles point at these bytes.
        self._slots = [
            torch.zeros(self._total, dtype=torch.uint8, device=device) for _ in range(self.num_slots)
        ]
        self._slot_views = [_views(s, self._specs) for s in self._slots]
        self._header = torch.zeros(self.num_slots, dtype=torch.int64)  # CPU: 2v stable, 2v+1 writing, 0 empty
        self._chunks = _chunks(self._total, self.config.bucket_mb * _MIB)
        self._version = 0
        self._handles: tuple[tuple[Any, ...], ...] = ()
        self._header_handle: Any = None
        self._server: Any = None
        self._lock = threading.Lock()  # guards the endpoint server's serialization cache
        self._cache: tuple[int, bytes] | None = None
        if self.transport == "rdma":
            from monarch.rdma import RDMABuffer

            _quiet_tcp_fallback()
            self._header_handle = RDMABuffer(self._header)
            self._handles = tuple(
                tuple(RDMABuffer(slot[o : o + n]) for o, n in self._chunks) for slot in self._slots
            )
        else:
            from monarch.actor import this_proc

            _LOCAL_PUBLISHERS[self.id] = self
            self._server = this_proc().spawn(f"weight_server_{self.id[:8]}", _server_class(), self.id)

    @property
    def version(self) -> int:
        """The last published version (0 before the first publish)."""
        return self._version

    @property
    def nbytes(self) -> int:
        return self._total

    def publish(self, params: Mapping[str, torch.Tensor]) -> WeightManifest:
        """Copy `params` into the next slot as version `version + 1` and return its manifest."""
        _check_against(self._specs, _signature(params), "WeightPublisher.publish")
        version = self._version + 1
        slot = version % self.num_slots
        self._header[slot] = 2 * version + 1  # writing: readers of this slot will see a torn read
        self._write_slot(slot, params)
        self._header[slot] = 2 * version  # stable
        self._version = version
        return self.manifest()

    def _write_slot(self, slot: int, params: Mapping[str, torch.Tensor]) -> None:
        views = self._slot_views[slot]
        with torch.no_grad():
            for name, t in params.items():
                views[name].copy_(t.detach())
        if self._slots[slot].is_cuda:
            torch.cuda.synchronize(self._slots[slot].device)

    def manifest(self) -> WeightManifest:
        """The manifest of the last published version."""
        if self._version == 0:
            raise WeightPlaneError("WeightPublisher.manifest: nothing published yet; call publish() first")
        return WeightManifest(
            publisher_id=self.id,
            version=self._version,
            slot=self._version % self.num_slots,
            transport=self.transport,
            tensors=self._specs,
            total_bytes=self._total,
            chunks=self._chunks,
            num_slots=self.num_slots,
            handles=self._handles,
            header=self._header_handle,
            server=self._server,
        )

    def close(self) -> None:
        """Release the registered buffers; readers holding old manifests then get WeightTransferError
        (rdma) or WeightPlaneError "publisher is closed" (endpoint; the server actor stays, idle)."""
        for per_slot in self._handles:
            for h in per_slot:
                h.drop()  # eager: Monarch starts the release without being awaited
        if self._header_handle is not None:
            self._header_handle.drop()
        self._handles, self._header_handle = (), None
        self._cache = None
        _LOCAL_PUBLISHERS.pop(self.id, None)

    # ----- endpoint transport (runs in the server actor's thread, same process)

    def serialize_latest(self, min_version: int) -> bytes:
        """Newest stable slot as safetensors bytes (metadata: version); cached per version."""
        from safetensors.torch import save

        for attempt in range(self.config.max_retries + 1):
            snap = self._header.tolist()
            versions = [_stable_version(h) for h in snap]
            best = max((v for v in versions if v is not None), default=None)
            if best is None or best < min_version:
                time.sleep(_backoff(attempt))
                continue
            with self._lock:
                if self._cache is not None and self._cache[0] == best:
                    return self._cache[1]
            slot = versions.index(best)
            data = save(self._slot_views[slot], metadata={"version": str(best)})
            if int(self._header[slot]) == 2 * best:  # no publish touched the slot while serializing
                with self._lock:
                    self._cache = (best, data)
                return data
        raise TornReadError(
            f"weight server: no stable version >= {min_version} after {self.config.max_retries} retries "
            f"(headers {self._header.tolist()})"
        )


@functools.cache
def _server_class() -> type:
    """The endpoint-transport actor class, built on first use so this module never imports Monarch at
    import time. Module `__getattr__` below resolves `WeightServer` for unpickling in child processes."""
    from monarch.actor import Actor, endpoint

    class WeightServer(Actor):
        """Serves a local WeightPublisher's newest version as safetensors bytes."""

        def __init__(self, publisher_id: str) -> None:
            self.publisher_id = publisher_id

        @endpoint
        async def fetch(self, min_version: int) -> bytes:
            pub = _LOCAL_PUBLISHERS.get(self.publisher_id)
            if pub is None:
                raise WeightPlaneError(f"weight server: publisher {self.publisher_id} is closed")
            return await asyncio.to_thread(pub.serialize_latest, min_version)

    WeightServer.__module__ = __name__
    WeightServer.__qualname__ = "WeightServer"
    return WeightServer


def __getattr__(name: str) -> Any:
    if name == "WeightServer":
        return _server_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def _parse_safetensors(data: bytes) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], int, int]]]:
    """Header of a safetensors blob -> (metadata, name -> (dtype code, shape, start, end)); no unpickling."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    entries = {
        k: (v["dtype"], v["shape"], base + v["data_offsets"][0], base + v["data_offsets"][1])
        for k, v in header.items()
    }
    return meta, entries


# ----------------------------------------------------------------------------------------- subscriber


class WeightSubscriber:
    """Generator side: `await pull(manifest)` into private staging, then `apply_to(model_tensors)` between
    requests. `expected` (name -> tensor, e.g. the model's state dict) makes mismatching manifests fail
    with the tensor's name; without it the first manifest defines the layout.
    """

    def __init__(
        self,
        config: WeightPlaneConfig | None = None,
        expected: Mapping[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config or WeightPlaneConfig()
        self._expected = _signature(expected) if expected is not None else None
        self._device = torch.device(device)
        self._staging: torch.Tensor | None = None
        self._specs: tuple[TensorSpec, ...] = ()
        self._views: dict[str, torch.Tensor] = {}
        self._pulling = False
        self._layout: tuple[Any, ...] | None = None
        self._header_buf = torch.zeros(2, dtype=torch.int64)
        self.staged_version: int | None = None  # version sitting in staging
        self.version: int | None = None  # version last applied with apply_to
        self.last: PulledWeights | None = None
        if self.config.resolved_transport() == "rdma":
            _quiet_tcp_fallback()

    def _prepare(self, m: WeightManifest) -> None:
        where = f"weight manifest v{m.version} from publisher {m.publisher_id[:8]}"
        if self._expected is not None:
            _check_against(m.tensors, self._expected, where)
        if self._layout != m.layout_key():
            if self._layout is not None and self._expected is None:
                _check_against(
                    m.tensors, {n: (t.shape, _dtype_name(t.dtype)) for n, t in self._views.items()}, where
                )
            self._staging = torch.empty(m.total_bytes, dtype=torch.uint8, device=self._device)
            self._views = _views(self._staging, m.tensors)
            self._specs = m.tensors
            self._layout = m.layout_key()
        if self._header_buf.numel() != m.num_slots:
            self._header_buf = torch.zeros(m.num_slots, dtype=torch.int64)

    async def pull(self, manifest: WeightManifest, latest: bool = False) -> PulledWeights:
        """Fetch `manifest.version` into staging, bitwise exact. If that version was overwritten meanwhile
        the newest complete one is taken instead (see `allow_newer`). `latest=True` asks the publisher
        (one header read) for its newest version first, so an old manifest is enough to stay current.

        Staging is overwritten, so `staged_version` is None until the pull succeeds."""
        if self._pulling:
            raise WeightPlaneError("WeightSubscriber.pull: a pull is already in progress on this subscriber")
        self._pulling = True
        try:
            self._prepare(manifest)
            self.staged_version = None
            t0 = time.perf_counter()
            if manifest.transport == "endpoint":
                version, retries = await self._pull_endpoint(manifest), 0
            else:
                version, retries = await self._pull_rdma(manifest, latest)
        finally:
            self._pulling = False
        if version < manifest.version:  # cannot happen unless a publisher restarted its counter
            raise StaleVersionError(f"pulled v{version} older than manifest v{manifest.version}")
        self.staged_version = version
        self.last = PulledWeights(
            version=version,
            tensors=self._views,
            nbytes=manifest.total_bytes,
            seconds=time.perf_counter() - t0,
            retries=retries,
            transport=manifest.transport,
        )
        return self.last

    def pull_blocking(self, manifest: WeightManifest, latest: bool = False) -> PulledWeights:
        """`pull` for sync (`def`-endpoint) actors, which have no running event loop."""
        return asyncio.run(self.pull(manifest, latest))

    def apply_to(self, dest: Mapping[str, torch.Tensor]) -> int:
        """Copy the staged version into `dest` (same names/shapes/dtypes) and return its version.

        Call between requests: it is a local memcpy, so generation pauses only for that long."""
        if self.staged_version is None:
            raise WeightPlaneError(
                "WeightSubscriber.apply_to: no complete pull is staged (none yet, or one is running)"
            )
        _check_against(
            self._specs, _signature(dest), "WeightSubscriber.apply_to (staged weights vs destination)"
        )
        with torch.no_grad():
            for name, t in dest.items():
                t.copy_(self._views[name])
        self.version = self.staged_version
        return self.version

    def maybe_apply(self, dest: Mapping[str, torch.Tensor]) -> int | None:
        """At a request boundary: apply the staged version if it is complete and newer than the applied
        one; returns the version applied, or None if there was nothing new."""
        if self.staged_version is None or (self.version is not None and self.staged_version <= self.version):
            return None
        return self.apply_to(dest)

    # ----- rdma

    async def _read_chunks(self, m: WeightManifest, slot: int, version: int) -> None:
        assert self._staging is not None
        sem = asyncio.Semaphore(self.config.max_concurrent_reads)
        timeout = self.config.read_timeout_s

        async def one(i: int) -> None:
            off, size = m.chunks[i]
            async with sem:
                try:
                    await m.handles[slot][i].read_into(self._staging[off : off + size], timeout=timeout)
                except Exception as e:
                    names = m.tensors_in(off, size)
                    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                    raise WeightTransferError(
                        f"RDMA read of v{version} slot {slot} chunk {i} ({size / _MIB:.1f} MiB, tensors {shown}) "
                        f"failed (timeout {timeout}s): {type(e).__name__}: {e}"
                    ) from e

        await asyncio.gather(*(one(i) for i in range(len(m.chunks))))

    async def _read_header(self, m: WeightManifest) -> list[int]:
        try:
            await m.header.read_into(self._header_buf, timeout=self.config.read_timeout_s)
        except Exception as e:
            raise WeightTransferError(
                f"RDMA read of the version header of publisher {m.publisher_id[:8]} failed: {type(e).__name__}: {e}"
            ) from e
        return self._header_buf.tolist()

    @staticmethod
    def _newest(heads: Sequence[int]) -> tuple[int, int] | None:
        """(version, slot) of the newest stable slot in a header snapshot, if any."""
        stable = [(v, s) for s, h in enumerate(heads) if (v := _stable_version(h)) is not None]
        return max(stable) if stable else None

    async def _pull_rdma(self, m: WeightManifest, latest: bool) -> tuple[int, int]:
        slot, version = m.slot, m.version  # complete before the manifest existed: no header read needed
        if latest:
            newest = self._newest(await self._read_header(m))
            if newest is not None and newest[0] > version:
                version, slot = newest
        for attempt in range(self.config.max_retries + 1):
            await self._read_chunks(m, slot, version)
            after = await self._read_header(m)
            if after[slot] == 2 * version:  # seqlock check: untouched since `version` was completed
                return version, attempt
            # Torn or stale: find the newest stable version and try that one.
            if not self.config.allow_newer:
                raise StaleVersionError(
                    f"v{m.version} (slot {m.slot}) was overwritten while reading (header now {after[slot]}); "
                    "allow_newer is off"
                )
            if attempt == self.config.max_retries:
                break
            await asyncio.sleep(_backoff(attempt))
            newest = self._newest(await self._read_header(m))
            if newest is not None:
                version, slot = newest
        raise TornReadError(
            f"weight pull of v{m.version} from publisher {m.publisher_id[:8]}: every one of "
            f"{self.config.max_retries + 1} reads overlapped a publish; raise max_retries or publish less often"
        )

    # ----- endpoint

    async def _pull_endpoint(self, m: WeightManifest) -> int:
        assert self._staging is not None
        try:
            data = await asyncio.wait_for(
                m.server.fetch.call_one(m.version), timeout=self.config.read_timeout_s
            )
        except Exception as e:
            raise WeightTransferError(
                f"endpoint fetch of v{m.version} ({m.total_bytes / _MIB:.1f} MiB, {m.num_tensors} tensors) "
                f"failed (timeout {self.config.read_timeout_s}s): {type(e).__name__}: {e}"
            ) from e
        meta, entries = _parse_safetensors(data)
        version = int(meta["version"])
        if not self.config.allow_newer and version != m.version:
            raise StaleVersionError(
                f"endpoint served v{version}, manifest is v{m.version}; allow_newer is off"
            )
        mv = memoryview(data)
        for s in m.tensors:
            entry = entries.get(s.name)
            if entry is None:
                raise ManifestMismatchError(f"endpoint payload v{version} lacks tensor {s.name!r}")
            code, shape, start, end = entry
            if tuple(shape) != s.shape or end - start != s.nbytes or end > len(data):
                raise ManifestMismatchError(
                    f"endpoint payload v{version}: tensor {s.name!r} has shape {tuple(shape)} "
                    f"({end - start} bytes), expected {s.shape} ({s.nbytes} bytes)"
                )
            if _SAFETENSORS_DTYPES.get(code, code) != s.dtype:
                raise ManifestMismatchError(
                    f"endpoint payload v{version}: tensor {s.name!r} has dtype {code}, expected {s.dtype}"
                )
            if s.nbytes:
                with warnings.catch_warnings():  # read-only bytes: we only copy out of it
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.frombuffer(mv[start:end], dtype=torch.uint8)
                self._staging[s.offset : s.offset + s.nbytes].copy_(src)
        return version
