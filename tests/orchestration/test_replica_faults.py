"""kill -9 of one DiLoCo trainer replica in the middle of a real run: a one-proc stand-in rejoins from the store
while the other replica goes on, the run finishes every step with every prompt trained exactly once, the next
rounds have both replicas in them, and both end with identical parameters. With replicas sharded over two procs
(slow tier), kill -9 of one rank replaces its replica whole (two new ranks, a new process group), the same way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from composer_mesh.app.launch import launch
from composer_mesh.app.runner import apply_overrides, checkpoint_policy
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.orchestration.metrics import StepRecord
from composer_mesh.topology import Topology, load_topology

TOPOLOGY = Path(__file__).with_name("diloco_run.yaml")


def topology(run_dir: Path, steps: int, procs_per_replica: int = 1) -> Topology:
    source = TOPOLOGY
    if procs_per_replica > 1:  # each replica sharded over procs_per_replica procs of a bigger trainer mesh
        text = TOPOLOGY.read_text()
        for old, new in (("trainer:    {backend: local, procs_per_host: 2}",
                          f"trainer:    {{backend: local, procs_per_host: {2 * procs_per_replica}}}"),
                         ("replicas: 2, settings:", f"replicas: 2, procs_per_replica: {procs_per_replica}, settings:")):
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        source = run_dir.parent / "sharded_diloco_run.yaml"
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(text)
    topo = apply_overrides(load_topology(source), steps, run_dir)
    topo = topo.model_copy(update={"run": topo.run.model_copy(update={"eval_prompts": 0, "max_policy_lag": 1})})
    assert topo.diloco is not None
    return topo.model_copy(update={"diloco": topo.diloco.model_copy(update={"store_uri": f"file://{run_dir}/store"})})


@pytest.mark.parametrize("procs_per_replica", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["one-proc", "sharded"])
async def test_a_killed_diloco_replica_rejoins_from_the_store_and_ends_identical(tmp_path, procs_per_replica):
    steps, victim = 8, 0  # replica 0: its weights also feed the generators
    topo = topology(tmp_path / "run", steps, procs_per_replica)
    tasks: list[asyncio.Task[None]] = []
    killed: list[int] = []
    before: list[int] = []  # the victim replica's procs
    async with launch(topo) as mesh:
        loop: RLLoop

        async def kill() -> None:
            handle = loop.trainers.handles[victim]  # a sharded replica: its last rank
            before.extend([int((await r.process.call_one())["pid"]) for r in getattr(handle, "ranks", [handle])])
            os.kill(before[-1], signal.SIGKILL)
            killed.append(before[-1])

        def progress(record: StepRecord) -> None:
            if record.step == 3:
                tasks.append(asyncio.get_running_loop().create_task(kill()))

        loop = RLLoop(mesh, topo.run, topo.loss, progress=progress, checkpoints=checkpoint_policy(topo),
                      diloco=topo.diloco)
        summary = await loop.run()
        await asyncio.gather(*tasks)
        digests = [await h.weights_digest.call_one() for h in loop.trainers.handles]
        ranks = [r for h in loop.trainers.handles for r in getattr(h, "ranks", [h])]
        pids = [int((await r.process.call_one())["pid"]) for r in ranks]

    assert killed and killed[0] not in pids and summary.stopped is None and summary.steps == steps
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    trained = sorted((p for r in rows for p in r["prompts"]), key=lambda p: int(p[1:]))
    assert trained == [f"p{i}" for i in range(steps * 2 * 2)]  # 2 prompts per replica per step: none twice or lost
    last = rows[-1]["metrics"]
    assert last["faults/restarts/trainer"] == 1.0 and last["faults/reissued"] >= 1.0
    assert digests[0] == digests[1] and digests[0][0] == rows[-1]["weight_version"]  # step 8 ends a round
    assert len(set(pids)) == 2 * procs_per_replica and not set(before) & set(pids)  # the survivor was replaced too
    groups = [f"shard-{k}-of-{procs_per_replica}" for k in range(procs_per_replica)] if procs_per_replica > 1 else [""]
    for group in groups:  # each rank's own rounds (a sharded replica's ranks sync their shards apart)
        rounds = sorted((tmp_path / "run" / "store" / "test" / group / "rounds").glob("*/members/e0.json"))
        assert rounds, f"no DiLoCo round left in the store {group}"
        assert json.loads(rounds[-1].read_text())["members"] == [0, 1]  # the stand-in took part in the last round
