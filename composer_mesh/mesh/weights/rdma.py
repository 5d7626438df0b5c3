"""RDMA transport: one-sided reads of the publisher's registered chunks (ibverbs, else Monarch's TCP
fallback). Monarch is imported lazily, so importing this module never imports it.

The TCP fallback is reported, not hidden: each side says which RDMA backend it has (`rdma_backend`; the
publisher's rides in the manifest), a subscriber on the fallback uses transport 'rdma_tcp' (a metric, one
WARNING line at the run's start, refused by `weights.require`). Monarch's own `RDMATcpFallbackWarning` is
silenced only around the plane's own buffer registrations (`registering`), where that report replaces it:
Monarch's text, printed once per publishing process, names no subscriber and suggests a
`monarch.configure` call the topology cannot make. Buffers anyone else registers still warn.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import Iterator

import torch

from composer_mesh.mesh.weights.errors import WeightTransferError
from composer_mesh.mesh.weights.manifest import WeightManifest

_MIB = 1 << 20


@contextlib.contextmanager
def registering() -> Iterator[None]:
    """Around the plane's `RDMABuffer(...)` calls: Monarch's fallback warning off (the plane reports it)."""
    from monarch.rdma import RDMATcpFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RDMATcpFallbackWarning)
        yield


def rdma_backend() -> str:
    """This process's RDMA backend: 'ibverbs', 'tcp' (Monarch's fallback) or 'none'."""
    from monarch.rdma import get_rdma_backend

    return str(get_rdma_backend())


def tcp_fallback_reason(mine: str, publisher: str) -> str | None:
    """Why reads between a subscriber with backend `mine` and a publisher with `publisher` go over TCP, or
    None when both have ibverbs. A publisher that did not say (''): only this side decides."""
    missing = [who for who, backend in (("this host", mine), ("the publisher's host", publisher))
               if backend not in ("ibverbs", "")]
    if not missing:
        return None
    return f"RDMA over Monarch's TCP fallback: no ibverbs device on {' or '.join(missing)}"


class RdmaReader:
    """Seqlock reads over RDMA: a slot's chunks concurrently (`max_concurrent_reads`), the headers in one read."""

    transport = "rdma"

    def __init__(self, manifest: WeightManifest, max_concurrent_reads: int, timeout_s: int) -> None:
        self._m = manifest
        self._concurrency = max_concurrent_reads
        self._timeout = timeout_s
        self._header_buf = torch.zeros(manifest.num_slots, dtype=torch.int64)

    async def read_slot(self, slot: int, version: int, staging: torch.Tensor) -> None:
        m, timeout = self._m, self._timeout
        sem = asyncio.Semaphore(self._concurrency)

        async def one(i: int) -> None:
            off, size = m.chunks[i]
            async with sem:
                try:
                    await m.handles[slot][i].read_into(staging[off : off + size], timeout=timeout)
                except Exception as e:
                    names = m.tensors_in(off, size)
                    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                    raise WeightTransferError(
                        f"RDMA read of v{version} slot {slot} chunk {i} ({size / _MIB:.1f} MiB, tensors {shown}) "
                        f"failed (timeout {timeout}s): {type(e).__name__}: {e}"
                    ) from e

        await asyncio.gather(*(one(i) for i in range(len(m.chunks))))

    async def read_header(self) -> list[int]:
        try:
            await self._m.header.read_into(self._header_buf, timeout=self._timeout)
        except Exception as e:
            raise WeightTransferError(
                f"RDMA read of the version header of publisher {self._m.publisher_id[:8]} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        return self._header_buf.tolist()

    def close(self) -> None:
        """Nothing to release: the handles belong to the publisher."""
