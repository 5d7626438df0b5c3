"""launch() on real Monarch proc meshes: local and process backends, probe actors on several meshes.

Each launch costs a few seconds (procs start ~0.5-1 s each on 2 cores), so every test checks several
things on one launch. Cleanup is checked on the process tree: no new live descendant of the test
process may remain once the `async with` block has been left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from monarch.actor import ActorError
from services import require
from waiting import eventually

from composer_mesh.app.launch import launch
from composer_mesh.mesh.launch import MeshFailureError
from composer_mesh.roles import ROLES
from composer_mesh.topology import load_topology
from tests.mesh.launch.probe_actors import ProbeActor
from tests.mesh.launch.proc_utils import alive, descendants, new_descendants_after_exit, wait_gone

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
PROBES = dict.fromkeys(ROLES, ProbeActor)
ROLE_CONFIGS = {
    "trainer": "TrainerConfig",
    "generators": "GeneratorConfig",
    "rewarder": "RewarderConfig",
    "teachers": "TeachersConfig",
}


async def _where(handle) -> list[dict]:
    return list((await handle.where.call()).values())


async def test_local_topology_roles_reach_their_meshes_and_clean_up() -> None:
    before = descendants()
    async with launch(HERE / "local_probe.yaml", actors=PROBES) as mesh:
        assert {r: p.mesh for r, p in mesh.roles.items()} == {
            "trainer": "learner",
            "generators": "rollout",
            "rewarder": "learner",
            "teachers": "learner",
        }
        assert set(mesh.launched.proc_meshes) == {"learner", "rollout"}
        trainer, gens, rewarder, teachers = (
            await _where(mesh.trainer),
            await _where(mesh.generators),
            await _where(mesh.rewarder),
            await _where(mesh.teachers),
        )
        # Each handle reaches actors of its own role, running in procs of the role's mesh.
        for role, got, mesh_name in [
            ("trainer", trainer, "learner"),
            ("generators", gens, "rollout"),
            ("rewarder", rewarder, "learner"),
            ("teachers", teachers, "learner"),
        ]:
            assert {(w["role"], w["mesh"], w["env_mesh"]) for w in got} == {(role, mesh_name, mesh_name)}
            # ... each built with exactly its role's config.
            assert {w["config"] for w in got} == {ROLE_CONFIGS[role]}
        # Shape {hosts, procs} on local too; one actor per proc; local procs are our children.
        assert sorted((w["rank"]["hosts"], w["rank"]["procs"]) for w in gens) == [(0, 0), (0, 1)]
        assert len({w["pid"] for w in gens}) == 2 and all(w["ppid"] == os.getpid() for w in gens)
        # Meshes are separate procs; roles on one mesh share its procs.
        assert not {w["pid"] for w in trainer} & {w["pid"] for w in gens}
        assert {w["pid"] for w in trainer} == {w["pid"] for w in rewarder} == {w["pid"] for w in teachers}
        # Per-proc GPU pinning (gpus_per_proc: 1 on rollout, 0 on learner) and the mesh env.
        assert sorted(w["cuda_visible_devices"] for w in gens) == ["0", "1"]
        assert trainer[0]["cuda_visible_devices"] == ""
        assert all(w["probe_env"] == {"PROBE_MESH_TAG": "rollout"} for w in gens)
        assert trainer[0]["probe_env"] == {}
        # An endpoint error is the caller's ActorError, not a mesh failure; the actor stays up.
        with pytest.raises(ActorError, match="endpoint error on purpose"):
            await mesh.rewarder.boom.call()
        assert (await _where(mesh.rewarder))[0]["pid"] == rewarder[0]["pid"]
        mesh.check()
        assert mesh.failures == []
        pids = {w["pid"] for w in trainer + gens}
    assert not wait_gone(pids)
    assert not new_descendants_after_exit(before)


async def test_process_topology_exception_in_block_propagates_and_cleans_up() -> None:
    before = descendants()
    seen: list[dict] = []
    with pytest.raises(ZeroDivisionError):
        async with launch(load_topology(HERE / "process_probe.yaml"), actors=PROBES) as mesh:
            assert "teachers" not in mesh.roles
            with pytest.raises(LookupError, match="declares no 'teachers' role"):
                mesh.teachers  # noqa: B018
            gens = await _where(mesh.generators)
            trainer = await _where(mesh.trainer)
            seen = gens + trainer + await _where(mesh.rewarder)
            # Two "hosts" = two ProcessJob worker processes, each parenting its proc.
            assert sorted(w["rank"]["hosts"] for w in gens) == [0, 1]
            assert len({w["ppid"] for w in gens}) == 2
            assert os.getpid() not in {w["ppid"] for w in gens + trainer}
            assert {w["mesh"] for w in gens} == {"rollout"} and {w["mesh"] for w in trainer} == {"learner"}
            assert all(w["probe_env"] == {"PROBE_MESH_TAG": "rollout"} for w in gens)
            assert (await mesh.generators.slice(hosts=1).where.call_one())["pid"] in {w["pid"] for w in gens}
            _ = 1 / 0
    assert seen, "the block ran"
    assert not wait_gone({w["pid"] for w in seen} | {w["ppid"] for w in seen} - {os.getpid()})
    assert not new_descendants_after_exit(before)


async def test_actor_init_failure_is_a_mesh_failure_naming_role_and_mesh() -> None:
    before = descendants()
    topo = load_topology(HERE / "solo_probe.yaml")
    solo = topo.meshes["solo"].model_copy(update={"env": {"PROBE_FAIL_INIT": "rewarder"}})
    topo = topo.model_copy(update={"meshes": {"solo": solo}})
    with pytest.raises(MeshFailureError) as err:
        async with launch(topo, actors=PROBES):
            pytest.fail("launch must not yield when a role's __init__ fails")
    # Only the rewarder failed; the trainer and generators on the same proc did not.
    assert err.value.actors == ["rewarder"]
    assert "'rewarder' on mesh 'solo'" in str(err.value)
    assert "RuntimeError: probe rewarder fails in __init__ on purpose" in str(err.value)
    assert not new_descendants_after_exit(before)


async def test_dead_proc_inside_block_surfaces_as_mesh_failure() -> None:
    before = descendants()
    with pytest.raises(MeshFailureError) as err:
        async with launch(HERE / "process_probe.yaml", actors=PROBES) as mesh:
            with pytest.raises(RuntimeError) as call_err:
                await mesh.generators.slice(hosts=1).crash.call()
            assert type(call_err.value).__name__ == "SupervisionError"
            # check() reports it, naming the role and mesh (the fault hook may trail the call's error).
            await eventually(lambda: mesh.failures, "the dead proc's fault reported")
            with pytest.raises(MeshFailureError, match="'generators' on mesh 'rollout'"):
                mesh.check()
            # The controller survived; the other meshes still answer.
            assert (await mesh.trainer.where.call_one())["mesh"] == "learner"
            # A call that fails on the dead proc and leaves the block becomes a MeshFailureError.
            await mesh.generators.where.call()
    # The dead proc belonged to the generators; nothing else was on it.
    assert err.value.actors == ["generators"]
    assert {f.mesh for f in err.value.failures} == {"rollout"}
    assert "'generators' on mesh 'rollout'" in str(err.value)
    assert type(err.value.__cause__).__name__ == "SupervisionError"
    assert not new_descendants_after_exit(before)


async def test_cancelled_task_cleans_up() -> None:
    before = descendants()
    inside = asyncio.Event()
    pids: set[int] = set()

    async def run() -> None:
        async with launch(HERE / "solo_probe.yaml", actors=PROBES) as mesh:
            pids.update(w["pid"] for w in await _where(mesh.generators))
            inside.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(run())
    await asyncio.wait_for(inside.wait(), 120)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pids and not wait_gone(pids)
    assert not new_descendants_after_exit(before)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_signal_to_a_controller_script_leaves_no_process(sig: signal.Signals) -> None:
    """Ctrl-C or SIGTERM to a real controller process: it exits and takes procs and workers with it."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "ctrl_c_main.py"), str(HERE / "solo_process_probe.yaml")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    pids: set[int] = set()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                pids = {int(p) for p in line.split()[1:]}
                break
        assert pids, f"controller never got ready: {proc.stderr.read() if proc.stderr else ''}"
        assert all(alive(p) for p in pids)
        proc.send_signal(sig)
        _out, errs = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    expected = "KeyboardInterrupt" if sig == signal.SIGINT else "CancelledError"
    assert expected in errs, errs[-2000:]
    assert not wait_gone(pids), "procs or ProcessJob workers outlived the controller"


def test_local_yaml_launches_with_probe_actors() -> None:
    """The shipped CPU default topology launches (probe actors stand in for the real roles)."""
    path = ROOT / "topologies" / "local.yaml"
    require(path.exists(), "topologies/local.yaml (the shipped CPU topology)")  # skip locally, fail under CI=true

    async def run() -> dict[str, set[str]]:
        async with launch(path, actors=PROBES) as mesh:
            return {r: {w["env_mesh"] for w in await _where(getattr(mesh, r))} for r in mesh.roles}

    before = descendants()
    got = asyncio.run(run())
    topo = load_topology(path)
    expected = {r: {s.mesh} for r, s in vars(topo.roles).items() if s is not None}
    assert got == expected
    assert not new_descendants_after_exit(before)


async def test_local_meshes_get_disjoint_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local meshes with GPUs on one host are pinned to disjoint GPUs, indexed into the inherited list.

    The parent's CUDA_VISIBLE_DEVICES stands for what a host exposes; no GPU is touched (nothing initialises
    CUDA), so this runs on a CPU machine.
    """
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13")
    before = descendants()
    async with launch(HERE / "gpu_probe.yaml", actors=PROBES) as mesh:
        assert mesh.launched.gpu_devices == {"learner": [0], "rollout": [2, 3], "judge": [1]}
        trainer, gens, rewarder = (
            await _where(mesh.trainer),
            await _where(mesh.generators),
            await _where(mesh.rewarder),
        )
    assert [w["cuda_visible_devices"] for w in trainer] == ["10"]
    assert sorted((w["rank"]["procs"], w["cuda_visible_devices"]) for w in gens) == [(0, "12"), (1, "13")]
    assert [w["cuda_visible_devices"] for w in rewarder] == ["11"]
    assert not new_descendants_after_exit(before)
