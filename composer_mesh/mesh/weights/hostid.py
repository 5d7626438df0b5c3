"""Who is where: the host identity a publisher puts in its manifest and the GPU identity of a device.

A subscriber compares them with its own to decide whether same-host transports (shared memory, CUDA
IPC) can work. The hostname alone is not enough (containers may share one); the kernel's boot id tells
machines apart. Both only narrow the choice: the subscriber still proves it can open the segment.
"""

from __future__ import annotations

import functools
import hashlib
import socket
from dataclasses import dataclass
from typing import Any

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class HostIdentity:
    """Hostname plus kernel boot id: equal on two procs of one machine (and one UTS namespace)."""

    hostname: str
    boot_id: str

    def describe(self) -> str:
        return f"{self.hostname} (boot {self.boot_id[:8] or '?'})"

    def tag(self) -> str:
        """Short stable hash, used in shared-memory segment names so a sweep only touches this host's."""
        return hashlib.sha1(f"{self.hostname}/{self.boot_id}".encode()).hexdigest()[:8]


@functools.cache
def this_host_identity() -> HostIdentity:
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:  # not Linux, or /proc hidden: the hostname alone decides (the open check remains)
        boot = ""
    return HostIdentity(socket.gethostname(), boot)


def gpu_uuid(index: int) -> str:
    """The physical identity of visible CUDA device `index` (stable across CUDA_VISIBLE_DEVICES orders)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpu_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid`, or None when it is not visible here."""
    import torch

    if not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == uuid), None)


def device_gpu_uuid(device: Any) -> str | None:
    """UUID of the GPU a torch device lives on (None for CPU)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return gpu_uuid(device.index if device.index is not None else torch.cuda.current_device())
