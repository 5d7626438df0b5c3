"""Generators working together, checked with the fixed-latency stand-in generator (real sampling padded to a
known cost per prompt): one step's groups are split over both free generators, and the stand-in's requests
take at least seconds_per_group x their prompts. Behaviour checks, not a benchmark (that is
benchmarks/bench_generator_scaling.py)."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import ValidationError

from composer_mesh.actors.backends.generation.fixed_latency import (
    FixedLatencyGenerator,
    FixedLatencyGeneratorSettings,
)
from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
from composer_mesh.actors.messages import GenerationRequest, Prompt
from composer_mesh.app.launch import launch
from composer_mesh.models.config import ModelConfig
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.roles import resolve_binding
from composer_mesh.topology import parse_topology

STAND_IN = "composer_mesh.actors.backends.generation.fixed_latency:FixedLatencyGenerator"
SECONDS_PER_GROUP = 0.2
PROMPTS, SAMPLES, STEPS = 4, 2, 3

TOPOLOGY = f"""
name: generator_scaling
model: {{source: tiny, seed: 0}}
meshes:
  trainer:    {{backend: local}}
  generators: {{backend: local, procs_per_host: 2}}
  rewarder:   {{backend: local}}
roles:
  trainer: {{mesh: trainer, binding: hf, settings: {{lr: 0.001}}}}
  generators:
    mesh: generators
    binding: "{STAND_IN}"
    settings: {{seconds_per_group: {SECONDS_PER_GROUP}}}
  rewarder:
    mesh: rewarder
    binding: python
    settings: {{functions: [{{path: "composer_mesh.tasks.arithmetic:exact_match"}}]}}
loss: {{alpha_sdpo: 0.0, beta_replay: 0.0}}
run:
  steps: {STEPS}
  prompts_per_step: {PROMPTS}
  samples_per_prompt: {SAMPLES}
  max_new_tokens: 3
  max_policy_lag: 0
  eval_prompts: 0
"""


def test_the_stand_in_is_an_hf_generator_whose_requests_take_seconds_per_group_each():
    binding = resolve_binding("generators", STAND_IN)
    assert binding.cls is FixedLatencyGenerator
    assert binding.parse_settings({"seconds_per_group": 0.5}).seconds_per_group == 0.5
    for bad in ({}, {"seconds_per_group": 0}):  # required, and > 0
        with pytest.raises(ValidationError):
            binding.parse_settings(bad)

    model = ModelConfig()
    plain = HFGenerator(HFGeneratorSettings())
    stand_in = FixedLatencyGenerator(FixedLatencyGeneratorSettings(seconds_per_group=0.15))
    plain.start(model)
    stand_in.start(model)
    texts = ["1+2=", "3+4=", "5+6="]
    request = GenerationRequest(
        prompts=[Prompt(f"p{i}", t, [], None) for i, t in enumerate(texts)], samples_per_prompt=2,
        max_new_tokens=4, temperature=1.0, seed=7,
    )
    t0 = time.perf_counter()
    got = stand_in.generate(request, weight_version=3)
    assert time.perf_counter() - t0 >= 3 * 0.15  # k prompts take at least k x seconds_per_group
    want = plain.generate(request, weight_version=3)
    assert [[(r.completion_ids, r.logprobs, r.weight_version) for r in g.rollouts] for g in got] == [
        [(r.completion_ids, r.logprobs, r.weight_version) for r in g.rollouts] for g in want
    ]


async def test_each_step_is_split_over_both_stand_in_generators(tmp_path):
    topo = parse_topology(TOPOLOGY)
    run = topo.run.model_copy(update={"run_dir": tmp_path / "run"})
    topo = topo.model_copy(update={"run": run})
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, topo.run, topo.loss).run()
    assert summary.steps == STEPS and summary.dropped_batches == 0 and summary.dropped_rollouts == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["metrics"]["sampling/generators"] == 2  # both generators sampled part of every step
        assert r["rollouts"] == PROMPTS * SAMPLES and r["dropped_batches"] == 0
        # Two requests of 2 prompts each, each at least 2 x 0.2 s (generate_s sums the step's requests).
        assert r["timing"]["generate_s"] >= 2 * SECONDS_PER_GROUP * (PROMPTS // 2), r["timing"]
