"""Launch pieces that need no proc: GPU pinning, Slurm 22.05 squeue layout, actor resolution, errors."""

from __future__ import annotations

import dataclasses
import logging
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from composer_mesh.actors.configs import GeneratorConfig, TrainerConfig
from composer_mesh.app.launch import role_placements
from composer_mesh.mesh.jobs.slurm_compat import (
    controller_transport,
    hostname_is_loopback_only,
    normalize_squeue_job,
    select_squeue_job,
)
from composer_mesh.mesh.launch import ActorFailure, LaunchError, MeshFailureError, _FailureSink
from composer_mesh.mesh.runtime import visible_devices
from composer_mesh.roles import ROLE_TABLE, ROLES
from composer_mesh.topology import Topology, load_topology

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


def test_controller_transport_listens_on_the_named_address() -> None:
    assert controller_transport("192.0.2.7") == "tcp://192.0.2.7:0"
    assert controller_transport("localhost") == "tcp://127.0.0.1:0"
    with pytest.raises(ValueError, match=r"COMPOSER_MESH_CONTROLLER_HOST='no-such-host\.invalid' does not resolve"):
        controller_transport("no-such-host.invalid")


def _local() -> Topology:
    return load_topology(HERE / "local_probe.yaml")


def test_default_role_actors_resolve_lazily_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = dataclasses.replace(ROLE_TABLE["rewarder"], actor="composer_mesh.actors.no_such_module:RewarderActor")
    monkeypatch.setitem(ROLE_TABLE, "rewarder", broken)
    with pytest.raises(LaunchError, match=r"role 'rewarder' \(the default; pass actors=.*no_such_module"):
        role_placements(_local(), {"trainer": "tests.mesh.launch.probe_actors:ProbeActor"})


def test_actor_overrides_are_checked() -> None:
    topo = _local()
    with pytest.raises(LaunchError, match="unknown role"):
        role_placements(topo, {"critic": "tests.mesh.launch.probe_actors:ProbeActor"})
    with pytest.raises(LaunchError, match=r"must be a monarch\.actor\.Actor subclass"):
        role_placements(topo, dict.fromkeys(ROLES, "tests.mesh.launch.probe_actors:ProbeBinding"))
    with pytest.raises(LaunchError, match="no attribute 'Nope'"):
        role_placements(topo, dict.fromkeys(ROLES, "tests.mesh.launch.probe_actors:Nope"))
    placements = role_placements(topo, dict.fromkeys(ROLES, "tests.mesh.launch.probe_actors:ProbeActor"))
    assert sorted(p.name for p in placements) == sorted(ROLES)


def test_each_role_actor_gets_only_its_config() -> None:
    topo = _local()
    by_role = {p.name: p for p in role_placements(topo)}
    generators = by_role["generators"]
    assert generators.mesh == "rollout" and generators.actor_class.__name__ == "GeneratorActor"
    (config,) = generators.args
    assert isinstance(config, GeneratorConfig)
    assert config.model == topo.model and config.weights == topo.weights
    assert config.binding.import_path == "tests.mesh.launch.probe_actors:ProbeBinding"
    assert config.binding.settings == topo.generators.settings
    (trainer,) = by_role["trainer"].args
    assert isinstance(trainer, TrainerConfig) and trainer.temperature == topo.run.temperature
    assert pickle.loads(pickle.dumps(config)) == config  # Monarch pickles it to the procs


def test_failure_sink_maps_monarch_names_to_actor_and_mesh() -> None:
    sink = _FailureSink()
    sink.names["rewarder_ab12cd34"] = ("rewarder", "pool")
    sink.names["mesh_pool_ab12cd34"] = (None, "pool")
    report = SimpleNamespace(report=lambda: "process exited with code 3")
    assert sink(SimpleNamespace(mesh_name="rewarder_ab12cd34-XyZ", **vars(report)))
    assert sink(SimpleNamespace(mesh_name="mesh_pool_ab12cd34-Q", **vars(report)))
    assert not sink(SimpleNamespace(mesh_name="logger-abc", **vars(report)))
    assert [(f.actor, f.mesh) for f in sink.failures] == [("rewarder", "pool"), (None, "pool")]
    sink.stopping = True
    assert sink(SimpleNamespace(mesh_name="rewarder_ab12cd34-XyZ", **vars(report)))
    assert len(sink.failures) == 2  # failures while stopping are expected and not recorded
    err = MeshFailureError(sink.failures, during="while running")
    assert "'rewarder' on mesh 'pool'" in str(err) and "code 3" in str(err)
    assert err.actors == ["rewarder"]


def test_mesh_failure_error_names_every_actor_mesh() -> None:
    err = MeshFailureError(
        [
            ActorFailure("trainer", "learner", "trainer_x-1", "died"),
            ActorFailure("rewarder", "learner", "r-2", "d"),
        ],
        during="inside the launch block",
    )
    assert "'rewarder' on mesh 'learner', 'trainer' on mesh 'learner'" in str(err)


def test_a_proc_death_seen_by_monarchs_own_meshes_is_info_and_an_unknown_mesh_failure_is_an_error() -> None:
    """Monarch's `setup` and `logger` meshes fail alongside every dead proc, whose launch claims and handles the
    death through its own actors: their report reads as what it is. A failure nobody owns stays loud."""
    from composer_mesh.mesh.runtime import unclaimed_failure_log

    report = ("The actor <root>.<SetupActor setup{'hosts': 0/1}> and all its descendants have failed:\n"
              "  the process this actor was running on failed: Killed(sig=9)")
    level, line = unclaimed_failure_log("setup-xSThdE7BjF1", report)
    assert level == logging.INFO and "unhandled" not in line
    assert line.startswith("a proc died under Monarch's 'setup-xSThdE7BjF1' mesh (the process this actor was "
                           "running on failed: Killed(sig=9))")
    assert unclaimed_failure_log("logger-abc", report)[0] == logging.INFO
    level, line = unclaimed_failure_log("mystery-abc", report)
    assert level == logging.ERROR and line.startswith("unhandled Monarch mesh failure on mystery-abc: The actor")
    assert unclaimed_failure_log("setupper-abc", report)[0] == logging.ERROR  # only Monarch's own names
