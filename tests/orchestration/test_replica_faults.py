"""kill -9 of one DiLoCo trainer replica in the middle of a real run: a one-proc stand-in rejoins from the store
while the other replica goes on, the run finishes every step with every prompt trained exactly once, the next
rounds have both replicas in them, and both end with identical parameters."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from composer_mesh.app.launch import launch
from composer_mesh.app.runner import apply_overrides, checkpoint_policy
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.orchestration.metrics import StepRecord
from composer_mesh.topology import Topology, load_topology

TOPOLOGY = Path(__file__).with_name("diloco_run.yaml")


def topology(run_dir: Path, steps: int) -> Topology:
    topo = apply_overrides(load_topology(TOPOLOGY), steps, run_dir)
    topo = topo.model_copy(update={"run": topo.run.model_copy(update={"eval_prompts": 0, "max_policy_lag": 1})})
    assert topo.diloco is not None
    return topo.model_copy(update={"diloco": topo.diloco.model_copy(update={"store_uri": f"file://{run_dir}/store"})})


async def test_a_killed_diloco_replica_rejoins_from_the_store_and_ends_identical(tmp_path):
    steps, victim = 8, 0  # replica 0: its weights also feed the generators
    topo = topology(tmp_path / "run", steps)
    tasks: list[asyncio.Task[None]] = []
    killed: list[int] = []
    async with launch(topo) as mesh:
        loop: RLLoop

        async def kill() -> None:
            where = await loop.trainers.handles[victim].process.call_one()
            os.kill(int(where["pid"]), signal.SIGKILL)
            killed.append(int(where["pid"]))

        def progress(record: StepRecord) -> None:
            if record.step == 3:
                tasks.append(asyncio.get_running_loop().create_task(kill()))

        loop = RLLoop(mesh, topo.run, topo.loss, progress=progress, checkpoints=checkpoint_policy(topo),
                      diloco=topo.diloco)
        summary = await loop.run()
        await asyncio.gather(*tasks)
        digests = [await h.weights_digest.call_one() for h in loop.trainers.handles]
        pids = [int((await h.process.call_one())["pid"]) for h in loop.trainers.handles]

    assert killed and killed[0] not in pids and summary.stopped is None and summary.steps == steps
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    trained = sorted((p for r in rows for p in r["prompts"]), key=lambda p: int(p[1:]))
    assert trained == [f"p{i}" for i in range(steps * 2 * 2)]  # 2 prompts per replica per step: none twice or lost
    last = rows[-1]["metrics"]
    assert last["faults/restarts/trainer"] == 1.0 and last["faults/reissued"] >= 1.0
    assert digests[0] == digests[1] and digests[0][0] == rows[-1]["weight_version"]  # step 8 ends a round
    rounds = sorted((tmp_path / "run" / "store").rglob("members/e0.json"))
    assert rounds, "no DiLoCo round left in the store"
    assert json.loads(rounds[-1].read_text())["members"] == [0, 1]  # the stand-in took part in the last round
