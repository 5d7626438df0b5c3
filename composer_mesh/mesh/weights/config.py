"""The topology's `weights:` section: how a publisher's weights reach its subscribers.

Import-cheap (pydantic only): topology validation imports it without torch or Monarch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Transport = Literal["auto", "rdma", "shm", "cuda_ipc", "endpoint"]


class WeightPlaneConfig(BaseModel):
    """Settings of the publisher -> subscriber weight plane (the topology's `weights:` section)."""

    model_config = ConfigDict(extra="forbid")

    transport: Transport = Field(
        "auto",
        description=(
            "How subscribers fetch weights. 'auto': per subscriber, 'cuda_ipc' when it is on the "
            "publisher's GPU, 'shm' when on the publisher's host with CPU weights, else 'rdma'. 'rdma': "
            "one-sided reads of Monarch RDMABuffers (ibverbs when available, otherwise Monarch's TCP "
            "fallback). 'shm': slots in POSIX shared memory, copied with memcpy (same host, CPU weights). "
            "'cuda_ipc': slots opened through CUDA IPC handles and copied on the device (same host, CUDA "
            "weights). 'endpoint': the state dict as safetensors bytes through an actor endpoint (slower; a "
            "fallback and the benchmark baseline). A forced 'shm'/'cuda_ipc' that cannot work fails at "
            "start with the reason."
        ),
    )
    read_timeout_s: int = Field(
        600,
        ge=1,
        description=(
            "Timeout in seconds for one read of one bucket (or one endpoint fetch). Monarch's default "
            "(60 s) is too short for big models over the TCP fallback."
        ),
    )
    double_buffer: bool = Field(
        True,
        description=(
            "Keep two staging slots on the publisher so a publish never overwrites the version subscribers "
            "are reading. With False there is one slot: a read overlapping a publish is detected and retried."
        ),
    )
    bucket_mb: int = Field(
        16,
        ge=1,
        description=(
            "Each slot is registered in chunks of this many MiB; one chunk is one buffer and one read, "
            "and a subscriber reads up to max_concurrent_reads chunks at once."
        ),
    )
    max_concurrent_reads: int = Field(
        4, ge=1, description="How many chunk reads one subscriber keeps in flight at once (rdma)."
    )
    max_retries: int = Field(
        5,
        ge=0,
        description=(
            "How many times a pull is retried when the slot it read was overwritten or being written "
            "(torn or stale read) before it fails; waits grow 50 ms, 100 ms, ... up to 1 s between tries."
        ),
    )
    allow_newer: bool = Field(
        True,
        description=(
            "When the manifest's version was overwritten before a subscriber read it, take the newest "
            "complete version instead (True) or fail with StaleVersionError (False)."
        ),
    )
