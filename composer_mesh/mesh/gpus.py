"""Which of this host's GPUs each `local` mesh uses: one answer for launch, the topology checks and `plan`.

Local meshes share the host, so numbering every mesh's procs from GPU 0 would stack them all on the first
GPUs. `assign_gpus` decides once: a mesh with `gpu_devices` or `gpu_offset` gets exactly those GPUs, and the
others take the lowest GPUs nobody else holds, in mesh order. Indices count what the host exposes (an
inherited `CUDA_VISIBLE_DEVICES` list, else 0..N-1), as `runtime.visible_devices` reads them.

`slurm` and `process` meshes are not assigned here (their spec's `host_gpus()` is None): Slurm gives each job
its own allocation, and a `process` mesh stands in for separate hosts, each numbered from 0.

No torch, no CUDA: `plan` and `validate` import this, and must not initialise a GPU to count them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from itertools import count, islice

from composer_mesh.mesh.spec import MeshSpecBase


def assign_gpus(meshes: Mapping[str, MeshSpecBase]) -> dict[str, list[int]]:
    """Host GPU indices of every mesh on this host (`local`), in mesh order ([] for CPU-only meshes); meshes on
    other hosts are absent (`MeshSpec.host_gpus()` is None for them).

    Pinned meshes get what they ask for, even where they overlap (`shared_gpus` finds that); then each
    unpinned mesh takes the lowest GPUs held neither by a pinned mesh nor by an earlier mesh.
    """
    wanted = {name: gpus for name, spec in meshes.items() if (gpus := spec.host_gpus()) is not None}
    taken = {gpu for want in wanted.values() if want.pinned for gpu in want.pinned}
    out: dict[str, list[int]] = {}
    for name, want in wanted.items():
        gpus = want.pinned
        if gpus is None:
            free = (gpu for gpu in count() if gpu not in taken)
            gpus = list(islice(free, want.count))
            taken.update(gpus)
        out[name] = list(gpus)
    return out


def shared_gpus(assignment: Mapping[str, list[int]]) -> list[tuple[str, str, list[int]]]:
    """(earlier mesh, later mesh, GPUs both use) for every overlapping pair, in mesh order."""
    names = list(assignment)
    out = []
    for j, later in enumerate(names):
        for earlier in names[:j]:
            common = sorted(set(assignment[earlier]) & set(assignment[later]))
            if common:
                out.append((earlier, later, common))
    return out


def format_gpus(gpus: Iterable[int]) -> str:
    """GPU indices as ranges, e.g. `GPUs 0-3, 6` or `GPU 2`: how `plan` and the error messages show them."""
    unique = sorted(set(gpus))
    ranges: list[list[int]] = []
    for gpu in unique:
        if ranges and gpu == ranges[-1][1] + 1:
            ranges[-1][1] = gpu
        else:
            ranges.append([gpu, gpu])
    text = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)
    return "no GPU" if not unique else f"GPU {text}" if len(unique) == 1 else f"GPUs {text}"


def host_gpu_count(timeout: float = 10.0) -> tuple[int | None, str]:
    """(GPUs this host exposes, where that came from), or (None, why unknown), without initialising CUDA.

    An inherited `CUDA_VISIBLE_DEVICES` wins (it is what the procs index into); else `nvidia-smi -L` if it is
    on PATH. A planning machine without either is not an error: the count is just unknown.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()]), "CUDA_VISIBLE_DEVICES"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "CUDA_VISIBLE_DEVICES is unset and nvidia-smi is not on PATH"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"nvidia-smi -L failed ({type(e).__name__})"
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()), "nvidia-smi -L"
