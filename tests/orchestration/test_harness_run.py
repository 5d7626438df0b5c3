"""A harness run on real local Monarch meshes: the tiny model's hf generators serve the OpenAI-compatible endpoint,
an `openai`-client agent plays every episode (two turns: the opening, then a user follow-up), and the hf trainer
trains on them. What must hold: every step trained on exactly the policy tokens the endpoint served (the
agents' `usage.completion_tokens` summed equal the steps' `episode/policy_tokens`, which GRPO counts), with two
policy turns per episode and the follow-up bridged in as environment tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from composer_mesh.orchestration.rollout.harness_episodes import HarnessTask

SERVED: dict[str, int] = {}  # episode id -> completion tokens the endpoint served it (the agent's usage)

TOPOLOGY = """
name: tiny_harness
model: {source: tiny, tokenizer: byte, hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 128,
        max_position_embeddings: 320, seed: 0}
meshes:
  trainer:    {backend: local}
  generators: {backend: local}
roles:
  trainer: {mesh: trainer, binding: hf, settings: {lr: 0.003}}
  generators: {mesh: generators, binding: hf, settings: {stop_at_task_eos: false}}
loss: {alpha_sdpo: 0.0, beta_replay: 0.0, kl_beta: 0.0}
run:
  rollout: {kind: harness, max_turns: 2, harness: {agent: "orchestration.test_harness_run:two_turn_agent"}}
  environment: {kind: calculator, eval_size: 8}
  steps: 2
  prompts_per_step: 2
  samples_per_prompt: 2
  max_new_tokens: 12
  max_policy_lag: 1
  eval_prompts: 0
  checkpoint_every: 0
"""


async def two_turn_agent(task: HarnessTask) -> float:
    """Ask, send a follow-up, ask again; reward: whether the last answer is the product (the untrained model's
    answers are noise, so mostly 0, sometimes not: the rewards are the agent's to give)."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
    messages: list[Any] = list(task.messages)
    served = 0
    for follow_up in ("answer with the number only", None):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=task.tools,
                                                 extra_headers=task.headers)
        served += r.usage.completion_tokens if r.usage else 0
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        for call in r.choices[0].message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "error: no tool here"})
        if follow_up is not None and not r.choices[0].message.tool_calls:
            messages.append({"role": "user", "content": follow_up})
    SERVED[task.episode_id] = served
    return float((r.choices[0].message.content or "").strip() == task.answer)


@pytest.mark.slow  # a two-step run on real meshes: about 40 s on a busy 2-core VM
async def test_an_openai_agent_through_the_endpoint_is_trained_on_exactly_the_served_tokens(tmp_path: Path) -> None:
    import orchestration.test_harness_run as agent  # the module the run imports the agent from (not pytest's)

    from composer_mesh.app.launch import launch, run_config
    from composer_mesh.orchestration.loop import RLLoop
    from composer_mesh.topology import parse_topology

    served = agent.SERVED
    data = yaml.safe_load(TOPOLOGY)
    data["run"]["run_dir"] = str(tmp_path / "run")
    topo = parse_topology(yaml.safe_dump(data), str(tmp_path / "harness.yaml"))
    served.clear()
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, run_config(topo), topo.loss).run()
    assert summary.steps == 2
    steps = [r for r in map(json.loads, (topo.run.run_dir / "metrics.jsonl").read_text().splitlines())
             if "event" not in r]
    assert len(served) == 8  # 2 steps x 2 prompts x 2 episodes, each played by the agent
    metrics = [r["metrics"] for r in steps]
    assert sum(m["episode/policy_tokens"] for m in metrics) == sum(served.values()) > 0
    assert all(m["grpo/tokens"] == m["episode/policy_tokens"] for m in metrics)
    assert all(m["episode/policy_turns"] == 8 for m in metrics)  # 4 episodes x 2 turns per step
    assert all(m["episode/env_tokens"] > 0 for m in metrics)  # the follow-ups, bridged in, not trained on
    assert all(math.isfinite(r["loss"]) for r in steps)
