"""Weight plane: the trainer publishes versioned weights, generators pull them with one-sided reads.

See docs/weights.md for the protocol (double-buffered slots, a seqlock-style version header per slot).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Transport = Literal["auto", "rdma", "endpoint"]


class WeightPlaneConfig(BaseModel):
    """Settings of the trainer -> generator weight plane (the topology's `weights:` section)."""

    model_config = ConfigDict(extra="forbid")

    transport: Transport = Field(
        "auto",
        description=(
            "How generators fetch weights. 'rdma': one-sided reads of Monarch RDMABuffers (ibverbs when "
            "available, otherwise Monarch's TCP fallback). 'endpoint': the state dict as safetensors bytes "
            "through an actor endpoint (slower; a fallback and the benchmark baseline). 'auto' = 'rdma'."
        ),
    )
    read_timeout_s: int = Field(
        600,
        ge=1,
        description=(
            "Timeout in seconds for one pull of one bucket. Monarch's default (60 s) is too short for big "
            "models over the TCP fallback."
        ),
    )
    double_buffer: bool = Field(
        True,
        description=(
            "Keep two staging slots on the trainer so a publish never overwrites the version generators "
            "are reading. With False there is one slot: a read overlapping a publish is detected and retried."
        ),
    )
    bucket_mb: int = Field(
        32,
        ge=1,
        description=(
            "Tensors are packed in order into contiguous buckets of about this many MiB; each bucket is one "
            "registered buffer and one read. A tensor larger than this gets a bucket of its own."
        ),
    )
    max_concurrent_reads: int = Field(
        4, ge=1, description="How many bucket reads one generator keeps in flight at once."
    )
    max_retries: int = Field(
        3,
        ge=0,
        description=(
            "How many times a pull is retried when the slot it read was overwritten during the read "
            "(torn or stale read) before it fails."
        ),
    )
    allow_newer: bool = Field(
        True,
        description=(
            "When the manifest's version was overwritten before a generator read it, take the newest "
            "complete version instead (True) or fail with StaleVersionError (False)."
        ),
    )

    def resolved_transport(self) -> Literal["rdma", "endpoint"]:
        """The concrete transport ('auto' resolves to 'rdma', which falls back to TCP by itself)."""
        return "endpoint" if self.transport == "endpoint" else "rdma"
