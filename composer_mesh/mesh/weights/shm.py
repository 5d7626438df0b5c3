"""Shared-memory transport: the publisher's slots and seqlock headers live in one POSIX shared-memory
file, which a subscriber on the same host maps once (read-only) and copies from with memcpy.

Segment layout (one file under /dev/shm, named `cmesh-wp-<host tag>-<pid>-<publisher id>`):
bytes 0-15 a random token (the manifest carries it: a subscriber that opens a namesake in another
/dev/shm, e.g. another container's, notices), int64 headers from byte 64, slots from byte 4096, each
page-aligned. A header-only segment (no slots) carries the seqlock of the CUDA IPC transport.

Memory ordering: the publisher stores header 2v+1, fences, copies, stores 2v; the subscriber copies and
then loads the header. On x86 (TSO) ordinary stores become visible in program order and loads are not
reordered with older loads; the fence (a locked instruction inside a lock acquire/release) also orders the
non-temporal stores a large memcpy uses. Weakly ordered CPUs (Arm) would need explicit barriers on both
sides: not provided, so use `rdma` there (docs/weights.md).

Cleanup: the publisher unlinks its file on close and at interpreter exit; a publisher killed with
SIGKILL leaves it behind, so creating a segment first removes this host's segments whose process is gone.
Mappings stay valid after the unlink until the last view is dropped (POSIX), so nothing dangles.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import mmap
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from composer_mesh.mesh.weights.errors import TransportUnavailableError, WeightTransferError
from composer_mesh.mesh.weights.hostid import this_host_identity

SHM_DIR = "/dev/shm"
PREFIX = "cmesh-wp"
CLOSED = -1  # header value after the publisher closed: mapped subscribers fail instead of reading stale data
_PAGE = 4096
_TOKEN_BYTES = 16
_HEADERS_AT = 64
_MIB = 1 << 20
_LIVE: set[str] = set()  # paths this process created and has not unlinked yet
_STATE = {"atexit": False, "swept": False}
_FENCE = threading.Lock()


@dataclass(frozen=True)
class ShmLayout:
    """Where a publisher's segment is and what is in it (plain data, carried by the manifest)."""

    name: str  # file name under SHM_DIR
    nbytes: int  # file size
    token: bytes  # random; must match the segment's first bytes
    num_slots: int
    slot_offsets: tuple[int, ...]  # byte offset of each slot in the file; () for a header-only segment
    slot_bytes: int

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)


def full_fence() -> None:
    """Order the header store before the data stores that follow (see the module docstring)."""
    with _FENCE:
        pass


def segment_names(publisher_id: str) -> list[str]:
    """Files in SHM_DIR that belong to `publisher_id` (tests use it to prove nothing leaked)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and n.endswith(publisher_id))
    except OSError:
        return []


def _unlink(path: str) -> None:
    _LIVE.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _unlink_live() -> None:
    for path in list(_LIVE):
        _unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink this host's segments whose creating process is gone (a publisher killed with SIGKILL)."""
    prefix = f"{PREFIX}-{this_host_identity().tag()}-"
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid_text = name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        _unlink(os.path.join(SHM_DIR, name))
        removed.append(name)
    return removed


def _readonly_view(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns about non-writable buffers; subscribers only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


def _check_space(nbytes: int) -> None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:
        raise TransportUnavailableError(f"no shared memory: {SHM_DIR} is not usable ({e.strerror})") from e
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise TransportUnavailableError(
            f"{SHM_DIR} has {free / _MIB:.0f} MiB free, the slots need {nbytes / _MIB:.0f} MiB "
            "(raise the shm size, e.g. docker --shm-size)"
        )


class ShmSegment:
    """Publisher side: creates the segment; `header` and `slots` are writable tensors over it."""

    def __init__(self, publisher_id: str, num_slots: int, slot_bytes: int, with_slots: bool = True) -> None:
        if not _STATE["atexit"]:
            atexit.register(_unlink_live)
            _STATE["atexit"] = True
        if not _STATE["swept"]:
            sweep_stale()
            _STATE["swept"] = True
        aligned = -(-slot_bytes // _PAGE) * _PAGE
        offsets = tuple(_PAGE + i * aligned for i in range(num_slots)) if with_slots else ()
        nbytes = _PAGE + len(offsets) * aligned
        _check_space(nbytes)
        name = f"{PREFIX}-{this_host_identity().tag()}-{os.getpid()}-{publisher_id}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _LIVE.add(path)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full tmpfs fails here, not with SIGBUS later
            mm = mmap.mmap(fd, nbytes)
        except OSError as e:
            _unlink(path)
            raise TransportUnavailableError(
                f"cannot allocate {nbytes / _MIB:.0f} MiB in {SHM_DIR}: {e.strerror}"
            ) from e
        finally:
            os.close(fd)
        token = os.urandom(_TOKEN_BYTES)
        whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive; never close it explicitly
        whole[:_TOKEN_BYTES].copy_(torch.tensor(list(token), dtype=torch.uint8))
        self.path = path
        self.header = whole[_HEADERS_AT : _HEADERS_AT + 8 * num_slots].view(torch.int64)
        self.slots = [whole[o : o + slot_bytes] for o in offsets]
        self.layout = ShmLayout(name, nbytes, token, num_slots, offsets, slot_bytes)

    def close(self) -> None:
        """Mark every header closed (mapped subscribers then fail), unlink, drop this side's views."""
        if self.path in _LIVE:
            self.header.fill_(CLOSED)
            _unlink(self.path)
        self.header, self.slots = torch.zeros(0, dtype=torch.int64), []


class ShmMapping:
    """Subscriber side: the publisher's segment mapped read-only, checked against the manifest."""

    def __init__(self, layout: ShmLayout) -> None:
        try:
            fd = os.open(layout.path, os.O_RDONLY)
        except OSError as e:
            raise TransportUnavailableError(
                f"cannot open shared-memory segment {layout.path}: {e.strerror} "
                "(this proc sees another /dev/shm, e.g. a container with a private one)"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size != layout.nbytes:
                raise TransportUnavailableError(
                    f"shared-memory segment {layout.path} has {size} bytes, the manifest says {layout.nbytes}"
                )
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        whole = _readonly_view(mm)
        if bytes(whole[:_TOKEN_BYTES].tolist()) != layout.token:
            raise TransportUnavailableError(
                f"shared-memory segment {layout.path} is not the publisher's (token differs): "
                "a namesake in another /dev/shm"
            )
        self.layout = layout
        self.header = whole[_HEADERS_AT : _HEADERS_AT + 8 * layout.num_slots].view(torch.int64)
        self.slots = [whole[o : o + layout.slot_bytes] for o in layout.slot_offsets]

    def headers(self, publisher_id: str) -> list[int]:
        """A snapshot of the seqlock headers (fresh loads from the shared pages)."""
        heads = self.header.tolist()
        if CLOSED in heads:
            raise WeightTransferError(
                f"publisher {publisher_id[:8]} is closed (its shared-memory segment {self.layout.name} was released)"
            )
        return heads


class ShmReader:
    """Seqlock reads from a mapped segment: a memcpy per slot (in a worker thread: the GIL is released)."""

    transport = "shm"

    def __init__(self, layout: ShmLayout, publisher_id: str) -> None:
        self._map = ShmMapping(layout)
        self._publisher_id = publisher_id

    async def read_slot(self, slot: int, version: int, staging: torch.Tensor) -> None:
        await asyncio.to_thread(staging.copy_, self._map.slots[slot])

    async def read_header(self) -> list[int]:
        return self._map.headers(self._publisher_id)

    def close(self) -> None:
        """Drop the views; the mapping goes when the last one is collected."""
        self._map.slots, self._map.header = [], torch.zeros(0, dtype=torch.int64)
