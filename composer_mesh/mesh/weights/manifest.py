"""What a publisher hands to its subscribers for one version: small, plain data, no tensor bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from composer_mesh.mesh.weights.cuda_ipc import CudaIpcHandle
from composer_mesh.mesh.weights.hostid import HostIdentity
from composer_mesh.mesh.weights.shm import ShmLayout


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
    """What a subscriber needs to pull one version: small and picklable (no tensor data).

    `transport` is the publisher's setting ('auto', 'rdma', 'shm', 'cuda_ipc' or 'endpoint'); `offers`
    the transports it actually serves. Per transport: `handles[slot][chunk]` and `header` are RDMABuffer
    handles (rdma); `shm` names the shared-memory segment (shm: slots and headers; cuda_ipc: headers);
    `ipc` holds one CUDA IPC handle per slot; `server` is the endpoint actor. `host`, `pid` and
    `device_uuid` say where the slots live, so a subscriber can tell whether same-host transports apply;
    `rdma_backend` ('ibverbs' or 'tcp', '' when rdma is not served) whether reads would go over TCP.
    """

    publisher_id: str
    version: int
    slot: int
    transport: str
    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    chunks: tuple[tuple[int, int], ...]  # (byte offset, byte size) of each chunk of a slot
    num_slots: int
    handles: tuple[tuple[Any, ...], ...] = ()
    header: Any = None
    server: Any = None
    offers: tuple[str, ...] = ()
    host: HostIdentity | None = None
    pid: int = 0
    device_uuid: str | None = None
    shm: ShmLayout | None = None
    ipc: tuple[CudaIpcHandle, ...] = ()
    rdma_backend: str = ""

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
    pull, so copy them (`WeightSubscriber.apply_to`) before pulling again. `transport` is the one used."""

    version: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    seconds: float
    retries: int
    transport: str
