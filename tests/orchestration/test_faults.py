"""kill -9 of a generator, rewarder or teacher proc in the middle of a real run: its mesh is replaced, the
requests it had in flight are re-issued, and the run finishes every step with every prompt trained exactly
once; metrics show the restart. A role that keeps dying stops the run with a checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

import pytest

from composer_mesh.app.launch import launch
from composer_mesh.app.runner import apply_overrides, checkpoint_policy
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.orchestration.metrics import RunSummary, StepRecord
from composer_mesh.topology import Topology, load_topology

TOPOLOGY = Path(__file__).with_name("tiny_run.yaml")  # every role, teachers too
SLIM = Path(__file__).with_name("slim_run.yaml")  # one proc per role, no teachers: cheaper where they are not killed


def topology(run_dir: Path, source: Path = TOPOLOGY, **run: object) -> Topology:
    topo = apply_overrides(load_topology(source), None, run_dir)
    return topo.model_copy(update={"run": topo.run.model_copy(update={"eval_prompts": 0, **run})})


async def run_killing(topo: Topology, kills: dict[int, str]) -> tuple[RunSummary, list[int]]:
    """The run, with one proc of role `kills[step]` killed (SIGKILL) once that step is recorded."""
    killed: list[int] = []
    tasks: list[asyncio.Task[None]] = []
    async with launch(topo) as mesh:

        async def kill(role: str) -> None:
            where = await getattr(mesh, role).process.call()
            pid = int(sorted(w["pid"] for w in where.values())[0])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

        def progress(record: StepRecord) -> None:
            if record.step in kills:
                tasks.append(asyncio.get_running_loop().create_task(kill(kills.pop(record.step))))

        loop = RLLoop(mesh, topo.run, topo.loss, progress=progress, checkpoints=checkpoint_policy(topo))
        summary = await loop.run()
        await asyncio.gather(*tasks)
    return summary, killed


def records(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" not in r]


@pytest.mark.slow  # three procs killed and replaced in one run: about 50 s in CI
async def test_killed_generator_rewarder_and_teacher_procs_are_replaced_and_the_run_finishes(tmp_path):
    steps = 8
    topo = topology(tmp_path / "run", steps=steps, max_policy_lag=1)
    summary, killed = await run_killing(topo, {2: "generators", 3: "rewarder", 4: "teachers"})
    assert len(killed) == 3 and summary.stopped is None and summary.steps == steps
    rows = records(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    trained = sorted((p for r in rows for p in r["prompts"]), key=lambda p: int(p[1:]))
    assert trained == [f"p{i}" for i in range(steps * 4)]  # none twice, none lost
    last = rows[-1]["metrics"]
    assert {role: last[f"faults/restarts/{role}"] for role in ("generators", "rewarder", "teachers")} == {
        "generators": 1.0, "rewarder": 1.0, "teachers": 1.0}
    assert last["faults/restarts"] == 3.0 and last["faults/reissued"] >= 3.0 and last["faults/lost_s"] > 0
    assert all(r["metrics"].get("faults/restarts", 0.0) == 0.0 for r in rows[:2])  # nothing died before step 2


async def test_a_role_that_keeps_dying_stops_the_run_with_a_checkpoint(tmp_path, caplog):
    topo = topology(tmp_path / "run", SLIM, steps=30, max_policy_lag=1, max_restarts=1)
    with caplog.at_level(logging.INFO):
        summary, killed = await run_killing(topo, {2: "rewarder", 4: "rewarder"})
    assert len(killed) == 2
    # Handled deaths read as such: no ERROR line (the run's outcome is the summary's, or the CLI's message).
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    assert any("rewarder on mesh rewarder died" in r.getMessage() and "replacing its procs" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert summary.stopped is not None and "rewarder died again after 1 restart(s)" in summary.stopped
    assert summary.checkpoint is not None and Path(summary.checkpoint, "COMMITTED.json").is_file()
    stopped_at = int(summary.checkpoint.rsplit("step-", 1)[1])
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, stopped_at + 1))


async def test_a_warm_spare_takes_over_and_a_new_one_is_prepared(tmp_path):
    """Killed once its spare is ready (the run is long enough to wait for it), stopped 5 steps after the kill."""
    topo = topology(tmp_path / "run", SLIM, steps=2000, max_policy_lag=1)
    meshes = dict(topo.meshes)
    meshes["generators"] = meshes["generators"].model_copy(update={"spare": True})
    topo = topo.model_copy(update={"meshes": meshes})
    killed: list[int] = []
    async with launch(topo) as mesh:
        before: set[int] = set()

        async def kill() -> None:
            where = await mesh.generators.process.call()
            before.update(int(w["pid"]) for w in where.values())
            pid = min(before)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

        tasks: list[asyncio.Task[None]] = []
        kill_step: list[int] = []

        def progress(record: StepRecord) -> None:
            if record.step >= 2 and mesh.launched.spares.get("generators") and not tasks:  # once the spare is ready
                tasks.append(asyncio.get_running_loop().create_task(kill()))
                kill_step.append(record.step)
            elif kill_step and record.step >= kill_step[0] + 5:
                loop.request_stop("test stop")

        loop = RLLoop(mesh, topo.run, topo.loss, progress=progress, checkpoints=checkpoint_policy(topo))
        summary = await loop.run()
        await asyncio.gather(*tasks)
        after = {int(w["pid"]) for w in (await mesh.generators.process.call()).values()}
        assert mesh.launched.has_spare("generators")  # the next spare, prepared after the takeover
    assert killed and summary.stopped == "test stop" and summary.steps >= kill_step[0] + 5
    (event,) = loop.recovery.events
    assert event["warm"] is True and event["roles"] == ["generators"]
    assert after.isdisjoint(before)  # the spare's procs serve now
    trained = sorted((p for r in records(tmp_path / "run") for p in r["prompts"]), key=lambda p: int(p[1:]))
    assert trained == [f"p{i}" for i in range(summary.steps * 4)]


def test_spares_are_only_for_cpu_meshes_off_slurm():
    from pydantic import ValidationError

    from composer_mesh.mesh.spec import mesh_spec

    assert mesh_spec(backend="local", spare=True).spare and mesh_spec(backend="process", spare=True).spare
    with pytest.raises(ValidationError, match="spare is not supported on backend 'slurm'"):
        mesh_spec(backend="slurm", spare=True)
    with pytest.raises(ValidationError, match=r"spare would hold gpus_per_proc=1 GPU\(s\) per proc idle"):
        mesh_spec(backend="local", gpus_per_proc=1, spare=True)
