"""RDMA transport: one-sided reads of the publisher's registered chunks (ibverbs, else Monarch's TCP
fallback). Monarch is imported lazily, so importing this module never imports it."""

from __future__ import annotations

import asyncio
import warnings

import torch

from composer_mesh.mesh.weights.errors import WeightTransferError
from composer_mesh.mesh.weights.manifest import WeightManifest

_MIB = 1 << 20


def quiet_tcp_fallback() -> None:
    """Monarch warns once per process when RDMA falls back to TCP; that is expected here."""
    from monarch.rdma import RDMATcpFallbackWarning

    warnings.filterwarnings("ignore", category=RDMATcpFallbackWarning)


class RdmaReader:
    """Seqlock reads over RDMA: a slot's chunks concurrently (`max_concurrent_reads`), the headers in one read."""

    transport = "rdma"

    def __init__(self, manifest: WeightManifest, max_concurrent_reads: int, timeout_s: int) -> None:
        quiet_tcp_fallback()
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
