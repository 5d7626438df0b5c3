"""Weight plane: a publisher writes versioned weights into slots, subscribers copy them out with seqlock reads.

Protocol (details and reasoning in docs/weights.md):

* The publisher (`WeightPublisher`) owns `num_slots` staging slots (2 with `double_buffer`), each ONE flat
  byte buffer that holds every tensor at a fixed, aligned offset, plus one int64 header per slot. The slots
  are allocated once and never move: in POSIX shared memory for CPU weights when a same-host transport is
  served, registered as `RDMABuffer`s (in chunks of `bucket_mb`) for RDMA, exported as CUDA IPC handles for
  CUDA weights; handles stay valid for the life of the publisher.
* `publish(params)` writes version v into slot `v % num_slots`: header := 2v+1 (writing), copy every
  tensor into the slot, header := 2v (stable). The publisher's own parameters are never shared; subscribers
  only read the slots, so the cost per version is one memcpy, whatever the number of subscribers.
* A subscriber (`WeightSubscriber`) copies the slot into its own staging buffer (RDMA reads, memcpy from
  shared memory, or a device copy from CUDA IPC memory), then reads the header again (seqlock check). If
  it still says "v stable", no write touched the slot since v was completed (versions only grow), so the
  copy is exactly version v. Otherwise the read was torn or stale: it re-reads the headers, picks the
  newest stable slot and retries, at most `max_retries` times.
* The caller swaps staged weights into its model between requests (`apply_to`), so pulling never disturbs
  work in flight.

Which transport a subscriber uses is decided per publisher on its first pull (`transports.choose`): the
manifest says where the slots are (host, GPU) and what is served. The `endpoint` transport keeps the same
slots and interface but ships the newest stable slot as safetensors bytes through a small actor that
lives in the publisher's process.

Monarch is imported lazily (inside functions), so importing this module never imports Monarch before
`composer_mesh.mesh.runtime` has set its environment. The `weights:` section's settings live in
`composer_mesh.mesh.weights.config`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import struct
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.cuda_ipc import CudaIpcHandle, export_slots, release_slots
from composer_mesh.mesh.weights.errors import (
    ManifestMismatchError,
    StaleVersionError,
    TornReadError,
    TransportRequiredError,
    TransportUnavailableError,
    WeightPlaneError,
    WeightTransferError,
)
from composer_mesh.mesh.weights.hostid import device_gpu_uuid, this_host_identity
from composer_mesh.mesh.weights.manifest import PulledWeights, TensorSpec, WeightManifest
from composer_mesh.mesh.weights.rdma import rdma_backend, registering
from composer_mesh.mesh.weights.shm import ShmSegment, full_fence
from composer_mesh.mesh.weights.transports import SAME_HOST, Choice, SlotReader, choose, publisher_offers

__all__ = [
    "ManifestMismatchError",
    "PulledWeights",
    "StaleVersionError",
    "TensorSpec",
    "TornReadError",
    "TransportUnavailableError",
    "WeightManifest",
    "WeightPlaneError",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightTransferError",
]

_log = logging.getLogger(__name__)
_ALIGN = 64  # byte alignment of every tensor inside a slot (any dtype view of the flat buffer is legal)
_MIB = 1 << 20


# ------------------------------------------------------------------------------------------- helpers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ManifestMismatchError(f"weight manifest: unknown dtype {name!r}")
    return dt


@runtime_checkable
class ShapedWeights(Protocol):
    """Weights that tell their names, shapes, dtypes and device without being read, and are read one tensor at
    a time (a sharded trainer's: each tensor gathered from its shards when read). A publisher lays out its
    slots from `shapes()` and copies the tensors in one pass, so the whole model never exists twice."""

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    @property
    def device(self) -> torch.device: ...


def _shapes(params: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype), without reading a `ShapedWeights`' tensors."""
    if isinstance(params, ShapedWeights):
        return params.shapes()
    for name, t in params.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight plane: {name!r} is a {type(t).__name__}, expected a torch.Tensor")
    return {name: (tuple(t.shape), t.dtype) for name, t in params.items()}


def _build_layout(params: Mapping[str, torch.Tensor]) -> tuple[tuple[TensorSpec, ...], int]:
    if not params:
        raise ValueError("weight plane: no tensors to publish (params is empty)")
    specs: list[TensorSpec] = []
    offset = 0
    for name, (shape, dtype) in _shapes(params).items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        offset = -(-offset // _ALIGN) * _ALIGN
        specs.append(TensorSpec(name, tuple(shape), _dtype_name(dtype), offset, nbytes))
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
    return {n: (tuple(shape), _dtype_name(dtype)) for n, (shape, dtype) in _shapes(tensors).items()}


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
    """Publisher side. Build once (allocates and shares the slots), then `publish(params)` per new version.

    Needs a Monarch context (inside an actor, or the controller) for the rdma and endpoint transports.
    A forced transport that cannot serve these params raises TransportUnavailableError here. Not
    thread-safe: call `publish` from one thread at a time.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], config: WeightPlaneConfig | None = None) -> None:
        self.config = config or WeightPlaneConfig()
        self.transport = self.config.transport
        self.id = uuid.uuid4().hex
        self._specs, self._total = _build_layout(params)
        self._signature = {s.name: (s.shape, s.dtype) for s in self._specs}
        devices = {params.device} if isinstance(params, ShapedWeights) else {t.device for t in params.values()}
        if len(devices) != 1:
            raise ValueError(
                f"weight plane: params live on several devices {sorted(map(str, devices))}; use one"
            )
        device = devices.pop()
        self.offers = publisher_offers(self.transport, device)
        self.num_slots = 2 if self.config.double_buffer else 1
        self._chunks = _chunks(self._total, self.config.bucket_mb * _MIB)
        self._version = 0
        self._closed = False
        self._handles: tuple[tuple[Any, ...], ...] = ()
        self._header_handle: Any = None
        self._server: Any = None
        self._lock = threading.Lock()  # guards the endpoint server's serialization cache
        self._cache: tuple[int, bytes] | None = None
        self._shm: ShmSegment | None = None
        self._ipc: tuple[CudaIpcHandle, ...] = ()
        self._rdma_backend = ""  # set when rdma is served: 'ibverbs' or 'tcp'
        self._device_uuid = device_gpu_uuid(device)
        # Stable storage for the life of the publisher: shared handles point at these bytes.
        self._slots, self._header = self._allocate(device)  # header: 2v stable, 2v+1 writing, 0 empty
        self._slot_views = [_views(s, self._specs) for s in self._slots]
        self._share()

    def _allocate(self, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Slots and headers; in shared memory when a same-host transport is served (headers only for
        CUDA weights). 'auto' without usable shared memory drops to rdma alone, with a warning."""
        if any(t in SAME_HOST for t in self.offers):
            try:
                self._shm = ShmSegment(self.id, self.num_slots, self._total, with_slots=device.type == "cpu")
            except TransportUnavailableError as e:
                if self.transport != "auto":
                    raise TransportUnavailableError(f"transport {self.transport!r}: {e}") from e
                warnings.warn(f"weight plane: no shared memory ({e}); serving rdma only", stacklevel=3)
                self.offers = tuple(t for t in self.offers if t not in SAME_HOST)
        if self._shm is not None and self._shm.slots:
            slots = list(self._shm.slots)
        else:
            slots = [
                torch.zeros(self._total, dtype=torch.uint8, device=device) for _ in range(self.num_slots)
            ]
        header = self._shm.header if self._shm is not None else torch.zeros(self.num_slots, dtype=torch.int64)
        return slots, header

    def _share(self) -> None:
        """Hand out what each served transport needs: IPC handles, RDMA registrations, the endpoint actor."""
        if "cuda_ipc" in self.offers:
            self._ipc = export_slots(self.id, self._slots)
        if "rdma" in self.offers:
            from monarch.rdma import RDMABuffer

            self._rdma_backend = rdma_backend()
            with registering():
                self._header_handle = RDMABuffer(self._header)
                self._handles = tuple(
                    tuple(RDMABuffer(slot[o : o + n]) for o, n in self._chunks) for slot in self._slots
                )
        if "endpoint" in self.offers:
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

    def publish(self, params: Mapping[str, torch.Tensor], version: int | None = None) -> WeightManifest:
        """Copy `params` into the next slot as version `version + 1` (or as `version`, which must be newer: a
        resumed trainer continues its run's numbering) and return its manifest."""
        if self._closed:
            raise WeightPlaneError("WeightPublisher.publish: the publisher is closed")
        _check_against(self._specs, _signature(params), "WeightPublisher.publish")
        if version is not None and version <= self._version:
            raise WeightPlaneError(f"WeightPublisher.publish: version {version} is not newer than {self._version}")
        version = self._version + 1 if version is None else version
        slot = version % self.num_slots
        self._header[slot] = 2 * version + 1  # writing: readers of this slot will see a torn read
        full_fence()  # the odd header is visible before any byte of the new version (shared memory)
        self._write_slot(slot, params)
        self._header[slot] = 2 * version  # stable
        self._version = version
        return self.manifest()

    def _write_slot(self, slot: int, params: Mapping[str, torch.Tensor]) -> None:
        views = self._slot_views[slot]
        with torch.no_grad():
            for name, t in params.items():  # one at a time: a `ShapedWeights` reads (gathers) each here
                views[name].copy_(t.detach())
                del t  # before the next one is read: one gathered tensor alive at a time
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
            offers=self.offers,
            host=this_host_identity(),
            pid=os.getpid(),
            device_uuid=self._device_uuid,
            shm=self._shm.layout if self._shm is not None else None,
            ipc=self._ipc,
            rdma_backend=self._rdma_backend,
        )

    def close(self) -> None:
        """Release the slots and everything that shares them; readers holding old manifests then get
        WeightTransferError (rdma, shm, cuda_ipc) or WeightPlaneError "publisher is closed" (endpoint;
        the server actor stays, idle). The shared-memory segment is unlinked."""
        for per_slot in self._handles:
            for h in per_slot:
                h.drop()  # eager: Monarch starts the release without being awaited
        if self._header_handle is not None:
            self._header_handle.drop()
        self._handles, self._header_handle = (), None
        self._cache = None
        _LOCAL_PUBLISHERS.pop(self.id, None)
        release_slots(self.id)
        if self._shm is not None:
            self._shm.close()  # headers := closed, unlink; mapped subscribers fail on their next check
        self._closed = True
        self._slots, self._slot_views, self._ipc = [], [], ()
        self._header = self._header.clone()  # drops the last view of the shared mapping

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
    """Subscriber side: `await pull(manifest)` into private staging, then `apply_to(model_tensors)` between
    requests. `device` is where staging lives (and, for 'auto', which GPU this subscriber is on). `expected` (name -> tensor, e.g. the model's state dict) makes mismatching manifests fail
    with the tensor's name; without it the first manifest defines the layout. `name` says who subscribes in
    messages (a transport that `config.require` refuses names it).
    """

    def __init__(
        self,
        config: WeightPlaneConfig | None = None,
        expected: Mapping[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
        name: str = "subscriber",
    ) -> None:
        self.config = config or WeightPlaneConfig()
        self.name = name
        self._expected = _signature(expected) if expected is not None else None
        self._device = torch.device(device)
        self._staging: torch.Tensor | None = None
        self._specs: tuple[TensorSpec, ...] = ()
        self._views: dict[str, torch.Tensor] = {}
        self._pulling = False
        self._layout: tuple[Any, ...] | None = None
        self._choice: Choice | None = None
        self._choice_for: str | None = None  # publisher id the choice was made for
        self.staged_version: int | None = None  # version sitting in staging
        self.version: int | None = None  # version last applied with apply_to
        self.last: PulledWeights | None = None
        self.torn_reads = 0  # reads that overlapped a publish, over this subscriber's life (seen while pulling)

    @property
    def transport(self) -> str | None:
        """The transport in use ('rdma', 'shm', 'cuda_ipc', 'endpoint'); None before the first pull."""
        return self._choice.transport if self._choice is not None else None

    @property
    def transport_reason(self) -> str:
        """Why that transport (e.g. "auto: not shm: publisher on host a (boot ...), this subscriber on ...")."""
        return self._choice.reason if self._choice is not None else ""

    @property
    def choice(self) -> Choice | None:
        """The transport decision (what is used, why, whether it is a fallback); None before the first pull."""
        return self._choice

    def _choose(self, m: WeightManifest) -> Choice:
        """Decide the transport once per publisher (opening shared memory / IPC handles once); one that
        `config.require` does not allow raises TransportRequiredError before any byte is read."""
        if self._choice is None or self._choice_for != m.publisher_id:
            self.close()
            choice = choose(
                m,
                self.config.transport,
                self._device,
                self.config.max_concurrent_reads,
                self.config.read_timeout_s,
            )
            required = self.config.require
            if required is not None and choice.used not in required:
                if choice.reader is not None:
                    choice.reader.close()
                raise TransportRequiredError(
                    f"{self.name} would receive weights over {choice.used} ({choice.reason}), which "
                    f"weights.require {required} does not allow"
                )
            self._choice, self._choice_for = choice, m.publisher_id
            _log.info("weight plane: publisher %s -> %s (%s)", m.publisher_id[:8], choice.used, choice.reason)
        return self._choice

    def close(self) -> None:
        """Release the transport's mappings (shared memory, IPC handles); the next pull opens them again."""
        if self._choice is not None and self._choice.reader is not None:
            self._choice.reader.close()
        self._choice, self._choice_for = None, None

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
            choice = self._choose(manifest)
            self.staged_version = None
            t0 = time.perf_counter()
            if choice.reader is None:
                version, retries = await self._pull_endpoint(manifest), 0
            else:
                version, retries = await self._pull_seqlock(manifest, choice.reader, latest)
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
            transport=choice.transport,
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

    # ----- seqlock transports (rdma, shm, cuda_ipc)

    @staticmethod
    def _newest(heads: Sequence[int]) -> tuple[int, int] | None:
        """(version, slot) of the newest stable slot in a header snapshot, if any."""
        stable = [(v, s) for s, h in enumerate(heads) if (v := _stable_version(h)) is not None]
        return max(stable) if stable else None

    async def _pull_seqlock(self, m: WeightManifest, reader: SlotReader, latest: bool) -> tuple[int, int]:
        assert self._staging is not None
        slot, version = m.slot, m.version  # complete before the manifest existed: no header read needed
        if latest:
            newest = self._newest(await reader.read_header())
            if newest is not None and newest[0] > version:
                version, slot = newest
        for attempt in range(self.config.max_retries + 1):
            await reader.read_slot(slot, version, self._staging)
            after = await reader.read_header()
            if after[slot] == 2 * version:  # seqlock check: untouched since `version` was completed
                return version, attempt
            # Torn or stale: find the newest stable version and try that one.
            self.torn_reads += 1
            if not self.config.allow_newer:
                raise StaleVersionError(
                    f"v{m.version} (slot {m.slot}) was overwritten while reading (header now {after[slot]}); "
                    "allow_newer is off"
                )
            if attempt == self.config.max_retries:
                break
            await asyncio.sleep(_backoff(attempt))
            newest = self._newest(await reader.read_header())
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
