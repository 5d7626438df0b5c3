"""`MeshSpec` as a union on `backend`: each member's own fields, refusals that say whose a field is, and what the
rest of the code asks of a member instead of branching on its backend."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from composer_mesh.mesh.spec import (
    BACKENDS,
    HostGpus,
    LocalMeshSpec,
    ProcessMeshSpec,
    SlurmMeshSpec,
    SlurmOptions,
    mesh_spec,
)


def _error(**fields: object) -> dict:
    with pytest.raises(ValidationError) as info:
        mesh_spec(**fields)
    (error,) = info.value.errors(include_url=False)
    return error


def test_backend_picks_the_member() -> None:
    assert BACKENDS == ("local", "process", "slurm")
    assert type(mesh_spec(backend="local")) is LocalMeshSpec
    assert type(mesh_spec(backend="process", hosts=2)) is ProcessMeshSpec
    slurm = mesh_spec(backend="slurm", slurm=None)  # null is the defaults, as when omitted
    assert type(slurm) is SlurmMeshSpec and slurm.slurm == SlurmOptions()


def test_a_field_of_another_backend_says_whose_it_is() -> None:
    error = _error(backend="process", gpu_devices=[0])
    assert error["loc"] == ("process", "gpu_devices")
    assert "gpu_devices is only for backend 'local' (this mesh is 'process': each of its hosts starts at GPU 0)" in (
        error["msg"]
    )
    assert "slurm is only for backend 'slurm' (this mesh is 'local')" in _error(backend="local", slurm={})["msg"]
    assert _error(backend="local", colour="red")["type"] == "extra_forbidden"  # nobody's field: unknown


def test_host_gpus_only_for_meshes_on_this_host() -> None:
    assert mesh_spec(backend="local").host_gpus() == HostGpus(0, [])
    assert mesh_spec(backend="local", procs_per_host=2, gpus_per_proc=2).host_gpus() == HostGpus(4, None)
    pinned = mesh_spec(backend="local", gpus_per_proc=2, gpu_offset=3).host_gpus()
    assert pinned == HostGpus(2, [3, 4], "gpu_offset")
    assert mesh_spec(backend="slurm", gpus_per_proc=1).host_gpus() is None
    assert mesh_spec(backend="process", gpus_per_proc=1).host_gpus() is None


def test_job_names_and_launch_lines() -> None:
    assert mesh_spec(backend="local").job_name("run", "cpu") == "run_cpu"
    named = mesh_spec(backend="slurm", slurm={"job_name": "pool", "partition": "gpu", "exclusive": False})
    assert named.job_name("run", "gen") == "pool"
    assert named.launch_summary("run", "gen") == "Slurm: job pool, partition=gpu, shared nodes"
    assert mesh_spec(backend="process", hosts=2).launch_summary("run", "sim") == "local ProcessJob, 2 worker processes"
    assert mesh_spec(backend="local").launch_summary("run", "cpu") == "this host"


def test_gpus_held_counts_a_slurm_override() -> None:
    spec = mesh_spec(backend="slurm", hosts=2, procs_per_host=2, gpus_per_proc=1, slurm={"gpus_per_node": 8})
    assert (spec.gpus, spec.gpus_per_node, spec.gpus_held) == (4, 8, 16)
    assert mesh_spec(backend="local", procs_per_host=2, gpus_per_proc=1).gpus_held == 2


def test_slurm_meshes_sharing_a_node_need_their_own_ports() -> None:
    shared = {"exclusive": False, "partition": "p"}
    meshes = {
        "a": mesh_spec(backend="slurm", slurm=shared),
        "b": mesh_spec(backend="slurm", slurm=shared),
        "c": mesh_spec(backend="slurm", slurm={**shared, "monarch_port": 22223}),
        "d": mesh_spec(backend="local"),
    }
    problems = list(SlurmMeshSpec.check_meshes(meshes))
    assert [loc for loc, _ in problems] == [("meshes", "b", "slurm", "monarch_port")]
    assert list(LocalMeshSpec.check_meshes(meshes)) == []
