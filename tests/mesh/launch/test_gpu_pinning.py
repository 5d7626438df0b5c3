"""GPU placement of local meshes without procs: the assignment, the per-proc devices, the host GPU count.

`assign_gpus` is the one answer launch, the topology checks and `plan` share; `visible_devices` turns a
mesh's host GPUs into one proc's `CUDA_VISIBLE_DEVICES`. The end-to-end pinning is
test_launch_meshes.py::test_local_meshes_get_disjoint_gpus.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from composer_mesh.mesh import runtime
from composer_mesh.mesh.gpus import assign_gpus, format_gpus, host_gpu_count, shared_gpus
from composer_mesh.mesh.launch import LaunchError, _bootstrap_command, launch_meshes
from composer_mesh.mesh.runtime import visible_devices
from composer_mesh.mesh.spec import MeshSpec, mesh_spec


def mesh(backend: str = "local", **kw: Any) -> MeshSpec:
    return mesh_spec(backend=backend, **kw)


def test_local_meshes_take_consecutive_gpus_in_mesh_order() -> None:
    meshes = {
        "a": mesh(gpus_per_proc=1),
        "b": mesh(procs_per_host=2, gpus_per_proc=2),
        "c": mesh(gpus_per_proc=1),
    }
    assert assign_gpus(meshes) == {"a": [0], "b": [1, 2, 3, 4], "c": [5]}
    assert list(assign_gpus(dict(reversed(meshes.items())))) == ["c", "b", "a"]
    assert assign_gpus(dict(reversed(meshes.items()))) == {"c": [0], "b": [1, 2, 3, 4], "a": [5]}


def test_cpu_meshes_take_none_and_other_backends_are_not_assigned() -> None:
    meshes = {
        "cpu": mesh(procs_per_host=4),
        "pool": mesh("slurm", procs_per_host=8, gpus_per_proc=1),
        "sim": mesh("process", hosts=2, gpus_per_proc=1),
        "gpu": mesh(procs_per_host=2, gpus_per_proc=1),
    }
    assert assign_gpus(meshes) == {"cpu": [], "gpu": [0, 1]}


def test_pinned_meshes_get_their_gpus_and_the_others_fill_around_them() -> None:
    meshes = {
        "first": mesh(procs_per_host=2, gpus_per_proc=1),
        "offset": mesh(procs_per_host=2, gpus_per_proc=1, gpu_offset=1),
        "listed": mesh(gpus_per_proc=2, gpu_devices=[6, 4]),
        "next": mesh(procs_per_host=3, gpus_per_proc=1),
    }
    got = assign_gpus(meshes)
    # offset holds 1-2 and listed 4 and 6 (in the given order: proc i takes the i-th slice), so the
    # unpinned meshes take 0, 3 and then 5, 7, 8.
    assert got == {"first": [0, 3], "offset": [1, 2], "listed": [6, 4], "next": [5, 7, 8]}
    assert shared_gpus(got) == []


def test_shared_gpus_names_both_meshes_and_the_common_gpus() -> None:
    meshes = {
        "a": mesh(procs_per_host=2, gpus_per_proc=2, gpu_devices=[0, 3, 2, 5]),
        "b": mesh(procs_per_host=2, gpus_per_proc=1, gpu_offset=2),
        "c": mesh(gpus_per_proc=1, gpu_offset=5),
        "d": mesh(gpus_per_proc=1),
    }
    got = assign_gpus(meshes)
    assert got["d"] == [1]  # the unpinned mesh avoids every pinned GPU, overlapping or not
    assert shared_gpus(got) == [("a", "b", [2, 3]), ("a", "c", [5])]


def test_format_gpus() -> None:
    assert format_gpus([3, 0, 1, 2, 6]) == "GPUs 0-3, 6"
    assert format_gpus([4]) == "GPU 4"
    assert format_gpus([1, 3]) == "GPUs 1, 3"
    assert format_gpus([]) == "no GPU"


def test_visible_devices_with_the_meshes_host_gpus() -> None:
    assert visible_devices(0, 1, None, [2]) == "2"
    assert visible_devices(1, 2, None, [4, 5, 6, 7]) == "6,7"
    assert visible_devices(1, 1, None, [6, 4]) == "4"  # the listed order, not sorted
    # An inherited list is indexed, not renumbered: host GPU 1 is the second device it names.
    assert visible_devices(0, 2, "10,11,12,13", [1, 3]) == "11,13"
    assert visible_devices(0, 1, "GPU-aaa,GPU-bbb", [1]) == "GPU-bbb"
    assert visible_devices(0, 0, "0,1", []) == ""
    with pytest.raises(RuntimeError, match=r"needs host GPUs 3 .* only exposes CUDA_VISIBLE_DEVICES='0,1'"):
        visible_devices(0, 1, "0,1", [3])
    with pytest.raises(ValueError, match=r"needs GPUs 2\.\.3 of its mesh, which has 2"):
        visible_devices(1, 2, None, [0, 1])


def test_proc_setup_reads_the_meshes_host_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The env launch sets for a local mesh reaches `visible_devices` in the proc."""
    import monarch.actor

    monkeypatch.setattr(monarch.actor, "current_rank", lambda: {"hosts": 0, "procs": 1})
    monkeypatch.setenv(runtime.ENV_GPUS_PER_PROC, "1")
    monkeypatch.setenv(runtime.ENV_GPU_DEVICES, "5,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "a,b,c,d,e,f")
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # proc_setup also sets up a proc's logging
    monkeypatch.setattr(root, "level", root.level)
    with warnings.catch_warnings():
        runtime.proc_setup()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "d"


def test_launch_carries_the_assignment_to_local_meshes_only() -> None:
    local = _bootstrap_command("m", mesh(procs_per_host=2, gpus_per_proc=1), [2, 3])
    assert local.env[runtime.ENV_GPU_DEVICES] == "2,3" and local.env[runtime.ENV_GPUS_PER_PROC] == "1"
    remote = _bootstrap_command("s", mesh("slurm", gpus_per_proc=1), None)
    assert runtime.ENV_GPU_DEVICES not in remote.env


def test_launch_refuses_local_meshes_that_share_gpus() -> None:
    meshes = {"a": mesh(gpus_per_proc=2, gpu_devices=[0, 1]), "b": mesh(gpus_per_proc=1, gpu_offset=1)}
    with pytest.raises(LaunchError, match="local meshes 'a' and 'b' would share GPU 1"):
        launch_meshes(meshes, [], run_name="t")


def test_host_gpu_count_never_needs_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,7")
    assert host_gpu_count() == (3, "CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert host_gpu_count() == (0, "CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert host_gpu_count() == (None, "CUDA_VISIBLE_DEVICES is unset and nvidia-smi is not on PATH")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n'
        'echo "  MIG 1g.10gb     Device  0: (UUID: MIG-0)"\n'
        'echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"\n'
    )
    smi.chmod(0o755)
    assert host_gpu_count() == (2, "nvidia-smi -L")
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert host_gpu_count() == (None, "nvidia-smi -L failed (CalledProcessError)")
