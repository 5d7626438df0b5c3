"""Which transport a publisher serves and which one a subscriber uses.

Publisher: 'auto' serves a same-host transport next to RDMA: shared memory for CPU weights, CUDA IPC for
CUDA weights. Subscriber ('auto'): CUDA IPC when it is on the publisher's host and GPU, shared memory when
on the publisher's host, RDMA otherwise; each same-host choice is proven by opening it (a proc with a
private /dev/shm falls back). A forced transport that cannot work raises TransportUnavailableError with
the reason, at publisher creation or at the subscriber's first pull.

A choice also says what actually moves the bytes (`used`: 'rdma_tcp' for RDMA over Monarch's TCP
fallback) and whether that is a fallback: the TCP fallback, or a same-host transport that should have
worked and did not open. The run reports both (a metric, one WARNING line) and `weights.require` can
refuse them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from composer_mesh.mesh.weights.cuda_ipc import CudaIpcReader
from composer_mesh.mesh.weights.errors import TransportUnavailableError
from composer_mesh.mesh.weights.hostid import device_gpu_uuid, gpu_uuid, this_host_identity
from composer_mesh.mesh.weights.manifest import WeightManifest
from composer_mesh.mesh.weights.rdma import RdmaReader, rdma_backend, tcp_fallback_reason
from composer_mesh.mesh.weights.shm import ShmReader

SAME_HOST = ("cuda_ipc", "shm")  # auto's preference order


class SlotReader(Protocol):
    """What the subscriber's seqlock loop needs from a transport."""

    transport: str

    async def read_slot(self, slot: int, version: int, staging: torch.Tensor) -> None: ...

    async def read_header(self) -> list[int]: ...

    def close(self) -> None: ...


@dataclass
class Choice:
    """A subscriber's transport for one publisher: the reader (None for 'endpoint') and why. `used` is what
    moves the bytes (`transport`, or 'rdma_tcp' for rdma over the TCP fallback); `fallback`: slower than
    what this pair of processes should get (the TCP fallback, or a same-host transport that did not open)."""

    transport: str
    reader: SlotReader | None
    reason: str
    used: str = ""
    fallback: bool = False

    def __post_init__(self) -> None:
        self.used = self.used or self.transport


def publisher_offers(setting: str, device: torch.device) -> tuple[str, ...]:
    """Transports a publisher with `setting` and weights on `device` serves (a forced misfit raises)."""
    if setting in ("rdma", "endpoint"):
        return (setting,)
    if setting == "shm" and device.type != "cpu":
        raise TransportUnavailableError(
            f"transport 'shm' needs the weights in CPU memory; they are on {device} (use 'cuda_ipc' or 'auto')"
        )
    if setting == "cuda_ipc" and device.type != "cuda":
        raise TransportUnavailableError(
            f"transport 'cuda_ipc' needs the weights on a CUDA GPU; they are on {device} (use 'shm' or 'auto')"
        )
    if setting in SAME_HOST:
        return (setting,)
    return {"cpu": ("shm", "rdma"), "cuda": ("cuda_ipc", "rdma")}.get(device.type, ("rdma",))


def _host_problem(m: WeightManifest) -> str | None:
    mine = this_host_identity()
    if m.host is None:
        return "the manifest does not say which host the publisher is on"
    if m.host != mine:
        return f"publisher on host {m.host.describe()}, this subscriber on host {mine.describe()}"
    return None


def _gpu_problem(m: WeightManifest, device: torch.device) -> str | None:
    """Why this subscriber is not on the publisher's GPU (auto's rule), or None when it is."""
    if device.type == "cuda":
        mine = device_gpu_uuid(device)
    elif torch.cuda.is_available():
        mine = gpu_uuid(torch.cuda.current_device())
    else:
        mine = None
    if mine != m.device_uuid:
        return f"publisher on GPU {m.device_uuid}, this subscriber on {mine or 'no GPU'}"
    return None


def _open_local(transport: str, m: WeightManifest) -> SlotReader:
    if m.shm is None:
        raise TransportUnavailableError(f"publisher {m.publisher_id[:8]} has no shared-memory segment")
    if transport == "shm":
        return ShmReader(m.shm, m.publisher_id)
    return CudaIpcReader(m.ipc, m.shm, m.publisher_id, same_process=m.pid == os.getpid())


def _rdma(m: WeightManifest, concurrency: int, timeout_s: int, reason: str, fallback: bool = False) -> Choice:
    """The rdma choice, 'rdma_tcp' (and a fallback) when either side has no ibverbs device."""
    reader = RdmaReader(m, concurrency, timeout_s)
    tcp = tcp_fallback_reason(rdma_backend(), m.rdma_backend)
    if tcp is None:
        return Choice("rdma", reader, reason, fallback=fallback)
    return Choice("rdma", reader, f"{reason}; {tcp}", used="rdma_tcp", fallback=True)


def choose(m: WeightManifest, setting: str, device: torch.device, concurrency: int, timeout_s: int) -> Choice:
    """The subscriber's transport for `m`'s publisher. A subscriber setting other than 'auto' forces it;
    'auto' follows the publisher's setting, and if that is 'auto' too, picks by the rule above."""
    offers = m.offers or (m.transport,)
    want = setting if setting != "auto" else m.transport
    if want != "auto":
        if want not in offers:
            raise TransportUnavailableError(
                f"transport {want!r} is not served by publisher {m.publisher_id[:8]}: it serves "
                f"{list(offers)} (its transport setting is {m.transport!r})"
            )
        if want == "endpoint":
            return Choice(want, None, "set by the transport setting")
        if want == "rdma":
            return _rdma(m, concurrency, timeout_s, "set by the transport setting")
        problem = _host_problem(m)
        if problem is not None:
            raise TransportUnavailableError(f"transport {want!r} needs the publisher on this host: {problem}")
        try:
            return Choice(want, _open_local(want, m), "set by the transport setting")
        except TransportUnavailableError as e:
            raise TransportUnavailableError(f"transport {want!r} cannot work here: {e}") from e
    skipped, failed_to_open = [], False
    for t in (t for t in SAME_HOST if t in offers):
        problem = _host_problem(m) or (_gpu_problem(m, device) if t == "cuda_ipc" else None)
        if problem is None:
            try:
                return Choice(
                    t,
                    _open_local(t, m),
                    "auto: on the publisher's host" + (" and GPU" if t == "cuda_ipc" else ""),
                )
            except TransportUnavailableError as e:
                problem, failed_to_open = str(e), True
        skipped.append(f"not {t}: {problem}")
    if "rdma" not in offers:
        raise TransportUnavailableError(
            f"no usable transport for publisher {m.publisher_id[:8]}: {'; '.join(skipped)}"
        )
    reason = "auto: " + ("; ".join(skipped) or "only rdma served")
    return _rdma(m, concurrency, timeout_s, reason, fallback=failed_to_open)
