"""The RL loop on real proc meshes: trainer, two generators, two rewarders and a teacher pool on separate meshes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from composer_mesh.app.launch import launch
from composer_mesh.app.runner import apply_overrides
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import load_topology

TOPOLOGY = Path(__file__).with_name("tiny_run.yaml")


async def test_each_sync_leaves_every_generator_bitwise_equal_to_the_trainer(tmp_path):
    topo = apply_overrides(load_topology(TOPOLOGY), None, tmp_path / "run")
    async with launch(topo) as mesh:
        loop = RLLoop(mesh, topo.run, topo.loss)
        await loop.setup()
        assert len(loop.generators) == 2
        for step in range(2):
            batch = await loop.make_batch(loop.generators[step % 2])
            versions = {r.weight_version for r in batch.rollouts()}
            assert versions == {loop.trainer_version}  # stamped with the version that produced them
            assert {r.generator for r in batch.rollouts()} == {f"generator{step % 2}"}
            metrics, manifest = await mesh.trainer.train_step.call_one(batch)
            assert all(math.isfinite(v) for v in metrics.channels.values())
            assert set(metrics.channels) == {"grpo", "sdpo", "replay"}
            await mesh.generators.update_weights.call(manifest)
            loop.trainer_version = manifest.version
            t_version, t_digest = await mesh.trainer.weights_digest.call_one()
            digests = await mesh.generators.weights_digest.call()
            assert t_version == manifest.version == step + 2
            assert sorted(digests.values()) == [(t_version, t_digest)] * 2
        calls = [s["calls"] for s in (await mesh.rewarder.stats.call()).values()]
        # Every rollout of both batches was scored, and the two rewarders took one batch each.
        assert calls == [4 * 2, 4 * 2]


async def test_full_run_writes_metrics_plot_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    topo = apply_overrides(load_topology(TOPOLOGY), 3, run_dir)
    seen = []
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, topo.run, topo.loss, progress=seen.append).run()
    assert summary.steps == 3 and [r.step for r in seen] == [1, 2, 3]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert math.isfinite(r["loss"]) and set(r["channels"]) == {"grpo", "sdpo", "replay"}
        assert 0 <= r["policy_lag"] <= 1 and r["weight_version"] == r["step"] + 1
        assert any(k.startswith("teacher/teacher/") for k in r["metrics"])
    evals = [r for r in lines if r.get("event") == "eval"]
    assert [e["when"] for e in evals] == ["before", "after"] and evals[1]["weight_version"] == 4
    assert (run_dir / "plot.png").stat().st_size > 1000
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    # One weight-version counter: the checkpoint says what the metrics and the eval event say.
    assert state == {"step": 3, "weight_version": 4}
