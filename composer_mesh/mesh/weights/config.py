"""The topology's `weights:` section: how a publisher's weights reach its subscribers.

Import-cheap (pydantic only): topology validation imports it without torch or Monarch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

Transport = Literal["auto", "rdma", "shm", "cuda_ipc", "endpoint"]
# What actually moves a subscriber's bytes: `transport` resolved, with RDMA split by what carries it
# ('rdma': ibverbs; 'rdma_tcp': Monarch's TCP fallback, when either side has no ibverbs device).
UsedTransport = Literal["cuda_ipc", "shm", "rdma", "rdma_tcp", "endpoint"]
# The metric `weights/transport/<subscriber>` is the index here: slowest first, so a higher code is faster.
USED_TRANSPORTS: tuple[str, ...] = ("endpoint", "rdma_tcp", "rdma", "shm", "cuda_ipc")
# What each setting can end up using: a `require` outside it can never be met.
CAN_USE: dict[str, tuple[str, ...]] = {
    "auto": ("cuda_ipc", "shm", "rdma", "rdma_tcp"),
    "rdma": ("rdma", "rdma_tcp"),
    "shm": ("shm",),
    "cuda_ipc": ("cuda_ipc",),
    "endpoint": ("endpoint",),
}


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
    require: list[UsedTransport] | None = Field(
        None,
        description=(
            "Transports a subscriber may end up using (one name or a list); any other fails the run at start, "
            "before any training step, naming the subscriber, the transport and why it was chosen. Names are "
            "what actually moves the bytes: 'cuda_ipc', 'shm', 'rdma' (RDMA over ibverbs), 'rdma_tcp' "
            "(RDMA over Monarch's TCP fallback: no ibverbs device on one side), 'endpoint'. E.g. [cuda_ipc, "
            "rdma] refuses the TCP fallback. Unset: anything goes, and a fallback is one WARNING line at start."
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

    @field_validator("require", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        """`require: rdma` means `require: [rdma]` (an unknown name is refused on the field's own line)."""
        if not isinstance(value, str):
            return value
        if value not in USED_TRANSPORTS:
            raise ValueError(f"{value!r} is not a transport; use one or a list of {list(CAN_USE['auto'])} "
                             "or 'endpoint'")
        return [value]

    @field_validator("require")
    @classmethod
    def _can_be_met(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        """A `require` that the transport setting can never give is known before launch: refuse it here."""
        if value is None:
            return None
        if not value:
            raise ValueError("an empty list allows no transport; leave require out to allow any")
        setting = info.data.get("transport")
        if setting is None:  # the transport itself was refused: that error says it
            return value
        possible = CAN_USE[setting]
        if not set(value) & set(possible):
            raise ValueError(
                f"{value} can never be met with transport {setting!r}, which uses one of {list(possible)}"
            )
        return value
