"""Launch pieces that need no proc: GPU pinning, Slurm 22.05 squeue layout, actor resolution, errors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from composer_mesh.mesh.launch import (
    DEFAULT_ACTORS,
    LaunchError,
    MeshFailureError,
    RoleConfig,
    RoleFailure,
    _FailureSink,
    hostname_is_loopback_only,
    normalize_squeue_job,
    resolve_role_actors,
    role_sections,
    select_squeue_job,
)
from composer_mesh.mesh.runtime import visible_devices
from composer_mesh.topology import load_topology

HERE = Path(__file__).parent


def test_visible_devices_splits_host_gpus_per_proc() -> None:
    assert visible_devices(0, 1, None) == "0"
    assert visible_devices(3, 2, None) == "6,7"
    assert visible_devices(1, 2, "4,5,6,7") == "6,7"  # scheduler-given list is sliced, not renumbered
    assert visible_devices(2, 0, "0,1") == ""  # CPU-only procs see no GPU
    with pytest.raises(RuntimeError, match="only exposes CUDA_VISIBLE_DEVICES='0,1'"):
        visible_devices(1, 2, "0,1")


# `squeue --json` from Debian 12's Slurm 22.05.8 (openapi v0.0.38), trimmed: it ignores `--job`.
SQUEUE_2205 = {
    "meta": {"plugin": {"type": "openapi/v0.0.38"}},
    "jobs": [
        {"job_id": 4, "job_state": "COMPLETED", "job_resources": {}},
        {
            "job_id": 5,
            "job_state": "RUNNING",
            "job_resources": {"nodes": "vm", "allocated_hosts": 1, "allocated_nodes": [{"nodename": "vm"}]},
        },
    ],
}
SQUEUE_2411 = {
    "jobs": [
        {
            "job_id": 9,
            "job_state": ["RUNNING"],
            "job_resources": {"nodes": {"count": 1, "allocation": [{"name": "gpu-001"}]}},
        }
    ]
}


def test_squeue_2205_layout_is_filtered_and_rewritten_for_monarch() -> None:
    job = select_squeue_job(SQUEUE_2205, "5")
    assert job is not None
    assert job["job_state"] == ["RUNNING"]
    assert [n["name"] for n in job["job_resources"]["nodes"]["allocation"]] == ["vm"]
    assert select_squeue_job(SQUEUE_2205, "6") is None


def test_squeue_new_layout_passes_unchanged() -> None:
    job = select_squeue_job(SQUEUE_2411, "9")
    assert job == SQUEUE_2411["jobs"][0]
    assert normalize_squeue_job(dict(job)) == job


def test_loopback_detection() -> None:
    assert hostname_is_loopback_only("localhost")
    assert not hostname_is_loopback_only("192.0.2.7")


def _local() -> object:
    return load_topology(HERE / "local_probe.yaml")


def test_default_role_actors_resolve_lazily_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_mesh.mesh import launch

    monkeypatch.setitem(
        launch.DEFAULT_ACTORS, "rewarder", "composer_mesh.actors.no_such_module:RewarderActor"
    )
    with pytest.raises(LaunchError, match=r"role 'rewarder' \(the default; pass actors=.*no_such_module"):
        resolve_role_actors(_local(), {"trainer": "tests.launch.probe_actors:ProbeActor"})


def test_actor_overrides_are_checked() -> None:
    topo = _local()
    with pytest.raises(LaunchError, match="unknown role"):
        resolve_role_actors(topo, {"critic": "tests.launch.probe_actors:ProbeActor"})
    with pytest.raises(LaunchError, match=r"must be a monarch\.actor\.Actor subclass"):
        resolve_role_actors(topo, dict.fromkeys(DEFAULT_ACTORS, "tests.launch.probe_actors:ProbeBinding"))
    with pytest.raises(LaunchError, match="no attribute 'Nope'"):
        resolve_role_actors(topo, dict.fromkeys(DEFAULT_ACTORS, "tests.launch.probe_actors:Nope"))
    classes = resolve_role_actors(topo, dict.fromkeys(DEFAULT_ACTORS, "tests.launch.probe_actors:ProbeActor"))
    assert sorted(classes) == sorted(role_sections(topo))


def test_role_config_exposes_section_and_shared_sections() -> None:
    topo = _local()
    cfg = RoleConfig(role="generators", mesh="rollout", topology=topo)
    assert cfg.section is topo.roles.generators
    assert cfg.mesh_spec.procs_per_host == 2
    assert cfg.loss is topo.loss and cfg.run is topo.run and cfg.model is topo.model
    import pickle

    assert pickle.loads(pickle.dumps(cfg)).section.binding == "tests.launch.probe_actors:ProbeBinding"


def test_failure_sink_maps_monarch_names_to_role_and_mesh() -> None:
    sink = _FailureSink()
    sink.names["rewarder_ab12cd34"] = ("rewarder", "pool")
    sink.names["mesh_pool_ab12cd34"] = (None, "pool")
    report = SimpleNamespace(report=lambda: "process exited with code 3")
    assert sink(SimpleNamespace(mesh_name="rewarder_ab12cd34-XyZ", **vars(report)))
    assert sink(SimpleNamespace(mesh_name="mesh_pool_ab12cd34-Q", **vars(report)))
    assert not sink(SimpleNamespace(mesh_name="logger-abc", **vars(report)))
    assert [(f.role, f.mesh) for f in sink.failures] == [("rewarder", "pool"), (None, "pool")]
    sink.stopping = True
    assert sink(SimpleNamespace(mesh_name="rewarder_ab12cd34-XyZ", **vars(report)))
    assert len(sink.failures) == 2  # failures while stopping are expected and not recorded
    err = MeshFailureError(sink.failures, during="while running")
    assert "role 'rewarder' on mesh 'pool'" in str(err) and "code 3" in str(err)
    assert err.roles == ["rewarder"]


def test_mesh_failure_error_names_every_role() -> None:
    err = MeshFailureError(
        [
            RoleFailure("trainer", "learner", "trainer_x-1", "died"),
            RoleFailure("rewarder", "learner", "r-2", "d"),
        ],
        during="inside the launch block",
    )
    assert "role 'rewarder' on mesh 'learner', role 'trainer' on mesh 'learner'" in str(err)
