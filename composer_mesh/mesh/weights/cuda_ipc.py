"""CUDA IPC transport: a subscriber on the publisher's GPU opens the slots' CUDA allocations once (IPC
handles) and copies with `copy_` (device-to-device, no host round trip, no network).

What crosses between processes is `CudaIpcHandle`: bytes, ints, a bool and a GPU UUID string, taken
from `torch.multiprocessing.reductions.reduce_tensor` after checking that the rebuild it asks for is the
plain one (torch.Tensor over a TypedStorage of uint8) and rebuilt here with those classes fixed, so no
class or callable travels and nothing is unpickled. The seqlock headers stay on the CPU, in a header-only
shared-memory segment (`shm.ShmSegment(with_slots=False)`).

Ordering: the publisher stores header 2v+1, launches the copy, synchronizes its device, stores 2v; the
subscriber copies, synchronizes, then loads the header. A copy that saw any byte of v+k started after the
writer's launch, hence after its 2v+1 store, so the header check catches it.

A CUDA IPC handle cannot be opened in the process that created it; a subscriber in the publisher's own
process uses the slot tensors directly (`_LOCAL_SLOTS`). Opening a handle from another visible GPU of the
same host works where the devices have P2P access; `auto` does not pick it (docs/weights.md).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from composer_mesh.mesh.weights.errors import TransportUnavailableError
from composer_mesh.mesh.weights.hostid import gpu_uuid, visible_gpu_index
from composer_mesh.mesh.weights.shm import ShmLayout, ShmMapping

_LOCAL_SLOTS: dict[str, list[torch.Tensor]] = {}  # publisher id -> its CUDA slots, for same-process readers


@dataclass(frozen=True)
class CudaIpcHandle:
    """One slot's CUDA allocation as plain data (what reduce_tensor returns, minus classes and dtype)."""

    device_uuid: str
    handle: bytes  # cudaIpcMemHandle of the allocation holding the slot
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    tensor_offset: int  # offset of the slot in its storage (uint8 elements = bytes)
    nbytes: int


def _plain(value: Any, kinds: tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kinds):
        raise TypeError(f"CUDA IPC export: {what} is a {type(value).__name__}, expected {kinds}")
    return value


def handle_from_reduction(args: tuple[Any, ...], device_uuid: str) -> CudaIpcHandle:
    """reduce_tensor's argument tuple for a flat uint8 CUDA tensor -> CudaIpcHandle (checked field by field)."""
    (
        tensor_cls,
        size,
        stride,
        offset,
        storage_cls,
        dtype,
        _device,
        handle,
        ssize,
        soff,
        _grad,
        rc,
        rco,
        ev,
        sync,
    ) = args
    if (
        tensor_cls is not torch.Tensor
        or storage_cls is not torch.storage.TypedStorage
        or dtype != torch.uint8
    ):
        raise TypeError(
            f"CUDA IPC export: expected a plain uint8 tensor, got {tensor_cls.__name__} over "
            f"{getattr(storage_cls, '__name__', storage_cls)} of {dtype}"
        )
    if len(size) != 1 or tuple(stride) != (1,):
        raise TypeError(
            f"CUDA IPC export: expected a flat contiguous slot, got size {tuple(size)} stride {stride}"
        )
    return CudaIpcHandle(
        device_uuid=device_uuid,
        handle=bytes(_plain(handle, (bytes,), "handle")),
        storage_size_bytes=int(_plain(ssize, (int,), "storage size")),
        storage_offset_bytes=int(_plain(soff, (int,), "storage offset")),
        ref_counter_handle=bytes(_plain(rc, (bytes,), "ref counter handle")),
        ref_counter_offset=int(_plain(rco, (int,), "ref counter offset")),
        event_handle=None if ev is None else bytes(_plain(ev, (bytes,), "event handle")),
        event_sync_required=bool(sync),
        tensor_offset=int(offset),
        nbytes=int(size[0]),
    )


def export_slots(publisher_id: str, slots: list[torch.Tensor]) -> tuple[CudaIpcHandle, ...]:
    """IPC handles of the publisher's CUDA slots (made once: the slots never move)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _LOCAL_SLOTS[publisher_id] = slots
    out = []
    for slot in slots:
        _rebuild, args = reduce_tensor(slot)
        out.append(handle_from_reduction(args, gpu_uuid(slot.device.index)))
    return tuple(out)


def release_slots(publisher_id: str) -> None:
    _LOCAL_SLOTS.pop(publisher_id, None)


def open_slot(h: CudaIpcHandle, device_index: int) -> torch.Tensor:
    """Map a slot exported by another process on local device `device_index` (fixed classes, uint8)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([h.nbytes]),
        (1,),
        h.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device_index,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        False,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )


class CudaIpcReader:
    """Seqlock reads from IPC-opened CUDA slots; headers from the publisher's header-only shm segment."""

    transport = "cuda_ipc"

    def __init__(
        self, handles: tuple[CudaIpcHandle, ...], header: ShmLayout, publisher_id: str, same_process: bool
    ) -> None:
        if not handles:
            raise TransportUnavailableError("the publisher's weights are not on a GPU (no CUDA IPC handles)")
        index = visible_gpu_index(handles[0].device_uuid)
        if index is None:
            raise TransportUnavailableError(
                f"the publisher's GPU {handles[0].device_uuid} is not visible to this proc "
                f"(CUDA available: {torch.cuda.is_available()})"
            )
        self._map = ShmMapping(header)
        self._publisher_id = publisher_id
        local = _LOCAL_SLOTS.get(publisher_id) if same_process else None
        try:
            self._slots = list(local) if local is not None else [open_slot(h, index) for h in handles]
        except Exception as e:  # any CUDA error here means "cannot use IPC"
            raise TransportUnavailableError(
                f"cannot open the CUDA IPC handles: {type(e).__name__}: {e}"
            ) from e

    def _copy(self, slot: int, staging: torch.Tensor) -> None:
        src = self._slots[slot]
        staging.copy_(src)
        torch.cuda.synchronize(src.device)  # the copy must be complete before the header is checked
        if staging.is_cuda and staging.device != src.device:
            torch.cuda.synchronize(staging.device)

    async def read_slot(self, slot: int, version: int, staging: torch.Tensor) -> None:
        # A closed publisher may have freed the allocation: check first rather than copy from freed memory.
        self._map.headers(self._publisher_id)
        await asyncio.to_thread(self._copy, slot, staging)

    async def read_header(self) -> list[int]:
        return self._map.headers(self._publisher_id)

    def close(self) -> None:
        self._slots = []
