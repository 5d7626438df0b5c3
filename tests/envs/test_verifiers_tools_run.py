"""`topologies/verifiers_tools.yaml`, shortened, on real local Monarch meshes: the tiny model's hf generators serve
the OpenAI-compatible endpoint, the shipped agent (`composer_mesh.envs.verifiers_agent:play`, through a wrapper
that records what it returned) plays every task of the verifiers calculator taskset through it, calling the
taskset's toolset, and the hf trainer trains on the episodes without a rewarder role.

What must show: episodes of more than one policy turn with the tool results bridged in and never trained on
(GRPO counts the policy's tokens only), every episode's reward the task's own (the agent's return, the
step's rewards), no agent failure, and held-out episodes evaluated before and after. The same taskset then trains
as the episode driver's multi_turn episodes (`VerifiersSession`). Both share the warm start of
tests/orchestration/tiny_agentic.yaml (one cached build per test session: the e2e tier builds it once)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer_mesh.envs.verifiers_agent import play
from envs.e2e import shortened

pytest.importorskip("verifiers", reason="verifiers 0.4 needs Python >= 3.11 (the test extra installs it there)")

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "topologies" / "verifiers_tools.yaml"
PLAYED: list[tuple[str, float]] = []  # (episode id, the reward `play` returned) of every episode it finished


async def recorded_play(task: Any) -> float:
    reward = await play(task)
    PLAYED.append((task.episode_id, reward))
    return reward


@pytest.mark.e2e  # a shipped topology run end to end: its own tier (`pytest -m e2e`), run by .ci/run
async def test_the_verifiers_tools_topology_trains_on_tool_episodes_scored_by_the_task(tmp_path: Path) -> None:
    import envs.test_verifiers_tools_run as here  # the module the run imports the agent from (not pytest's)
    from composer_mesh.app.launch import launch, run_config
    from composer_mesh.orchestration.loop import RLLoop
    from composer_mesh.topology import parse_topology

    data = shortened(TOPOLOGY, tmp_path, steps=2)
    data["run"].update(prompts_per_step=4, eval_prompts=2)
    # tests/orchestration/tiny_agentic.yaml's warm start (one cached build for every test): it calls the tool
    data["model"]["warmstart"].update(steps=300)
    data["run"]["rollout"]["harness"]["agent"] = "envs.test_verifiers_tools_run:recorded_play"
    topo = parse_topology(yaml.safe_dump(data), str(TOPOLOGY))
    here.PLAYED.clear()
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, run_config(topo), topo.loss).run()
    assert summary.steps == 2
    lines = [json.loads(line) for line in (topo.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "event" not in r]
    trained = {k: v for k, v in here.PLAYED if not k.startswith("eval-")}
    assert len(trained) == 2 * 4 * 2  # 2 steps x 4 prompts x 2 episodes, each played by the agent
    for r in steps:
        m = r["metrics"]
        assert math.isfinite(r["loss"]) and r["reward_failures"] == 0  # no agent failed
        assert m["grpo/tokens"] == m["episode/policy_tokens"] > 0  # the policy's tokens only
        assert m["episode/status_error_environment"] == 0
    assert sum(r["metrics"]["episode/policy_turns"] for r in steps) > len(trained)  # tool calls, then turns on
    assert sum(r["metrics"]["episode/env_tokens"] for r in steps) > 0  # tool results bridged in
    assert set(trained.values()) <= {0.0, 1.0}  # the task's `correct`: 0/1
    assert math.isclose(sum(r["reward"] * r["rollouts"] for r in steps), sum(trained.values()))
    assert [e["when"] for e in lines if e.get("event") == "eval"] == ["before", "after"]
    held_out = [k for k, _ in here.PLAYED if k.startswith("eval-")]  # played by the agent too, before and after
    assert held_out and len(held_out) == 2 * len(set(held_out))


@pytest.mark.e2e
async def test_the_same_taskset_trains_as_multi_turn_episodes_of_the_episode_driver(tmp_path: Path) -> None:
    """`run.rollout.kind: multi_turn`: `VerifiersSession` answers the driver's turns with the toolset's results."""
    from composer_mesh.app.launch import launch, run_config
    from composer_mesh.orchestration.loop import RLLoop
    from composer_mesh.topology import parse_topology

    data = shortened(TOPOLOGY, tmp_path, steps=2)
    data["run"].update(prompts_per_step=4, eval_prompts=2, rollout={"kind": "multi_turn", "max_turns": 3})
    data["model"]["warmstart"].update(steps=300)
    topo = parse_topology(yaml.safe_dump(data), str(TOPOLOGY))
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, run_config(topo), topo.loss).run()
    assert summary.steps == 2
    lines = [json.loads(line) for line in (topo.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "event" not in r]
    for r in steps:
        m = r["metrics"]
        assert math.isfinite(r["loss"]) and r["reward_failures"] == 0
        assert m["grpo/tokens"] == m["episode/policy_tokens"] > 0
        assert m["episode/status_error_environment"] == 0
    assert sum(r["metrics"]["episode/tool_calls"] for r in steps) > 0  # calls that reached the toolset
    assert sum(r["metrics"]["episode/env_tokens"] for r in steps) > 0
    assert [e["when"] for e in lines if e.get("event") == "eval"] == ["before", "after"]
