"""Checks every integration (reasoning-gym, OpenEnv, verifiers, your own model) shares: a shipped topology,
shortened, run for a few RL steps on real local Monarch meshes with every loss channel on; and a reward function
scoring completions in the `python` rewarder's worker processes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml


def shortened(topology: Path, tmp_path: Path, steps: int = 3, **run: Any) -> dict[str, Any]:
    """The topology's data with a short lag-0 run into `tmp_path` (no checkpoints, one eval before and after);
    `run` overrides further run fields."""
    data = yaml.safe_load(topology.read_text())
    data["run"].update(steps=steps, prompts_per_step=8, samples_per_prompt=2, max_policy_lag=0, eval_prompts=4,
                       eval_every=0, eval_pass_k=0, run_dir=str(tmp_path / "run"), checkpoint_every=0, **run)
    return data


async def run_every_channel(data: dict[str, Any], where: Path) -> list[dict[str, Any]]:
    """Run the topology `data` (read from `where`) and check what every environment run must show: all steps, the
    environment scored every rollout without a failure, finite losses with GRPO and distillation every step, a
    teacher trace per prompt for replay, and replay trained at least once. Returns the metrics.jsonl records."""
    from composer_mesh.app.launch import launch
    from composer_mesh.orchestration.loop import RLLoop
    from composer_mesh.topology import parse_topology

    topo = parse_topology(yaml.safe_dump(data), str(where))
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, topo.run, topo.loss).run()
        stats = list((await mesh.rewarder.stats.call()).values())
    run = topo.run
    assert summary.steps == run.steps
    assert sum(s["calls"] for s in stats) > 0 and sum(s["failures"] for s in stats) == 0
    lines = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, run.steps + 1))
    for r in steps:
        assert math.isfinite(r["loss"]) and {"grpo", "sdpo"} <= set(r["channels"])
        assert r["metrics"]["replay/pairs"] + r["metrics"]["replay/traces_not_better"] == run.prompts_per_step
    assert any("replay" in r["channels"] for r in steps)  # a teacher trace beat a sample: channel 3 trained
    assert [e["when"] for e in lines if e.get("event") == "eval"] == ["before", "after"]
    return lines


def scores_in_workers(prompt: Any, texts: tuple[str, ...], path: str, workers: int = 1) -> list[float]:
    """The scores of completions `texts` of `prompt` by the reward function `path`, run the way a run runs it:
    in the `python` rewarder's worker processes (each imports the library). Every one must have been scored."""
    from composer_mesh.actors.backends.rewards.rewards import PythonRewarder, PythonRewarderSettings
    from composer_mesh.actors.messages import Rollout

    rollouts = [Rollout(prompt.prompt_id, [1], [2], [-0.1], 1, text=t) for t in texts]
    rewarder = PythonRewarder(PythonRewarderSettings(functions=[{"path": path, "timeout_s": 60}], workers=workers))
    try:
        results = rewarder.score_batch([(prompt, r) for r in rollouts])
    finally:
        rewarder.close()
    assert [r.ok for r in results] == [True] * len(texts), [r.error for r in results]
    return [r.score for r in results]
