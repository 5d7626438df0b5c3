"""LoRA weight sync on real local Monarch meshes: with `lora.sync: adapter` the weight plane carries the
adapters alone, and generators (the `hf` binding, which applies the same LoRA to its copy of the base) sample
from the merged policy, exactly as generators that received the merged weights do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("peft")

from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
from composer_mesh.actors.messages import GenerationRequest, Prompt
from composer_mesh.app.launch import launch
from composer_mesh.models.config import ModelConfig
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import TopologyError, parse_topology

SLIM = Path(__file__).with_name("slim_run.yaml")
PROBE = GenerationRequest(prompts=[Prompt(f"q{i}", t, [], None) for i, t in enumerate(["1+2=", "3+4=", "7+9="])],
                          samples_per_prompt=1, max_new_tokens=3, temperature=0.0, seed=0)


def lora_topology(tmp_path: Path, sync: str, generators: str = "hf") -> str:
    data = yaml.safe_load(SLIM.read_text())
    data["roles"]["trainer"]["settings"] = {"lora": {"r": 4, "alpha": 8, "sync": sync}}
    data["roles"]["generators"]["binding"] = generators
    # Enough rollouts that some groups have mixed rewards (a GRPO gradient) and a step size the probe can see.
    data["roles"]["trainer"]["settings"]["lr"] = 0.05
    data["run"].update(max_policy_lag=0, run_dir=str(tmp_path / sync), checkpoint_every=0, prompts_per_step=8,
                       samples_per_prompt=4)
    return yaml.safe_dump(data)


def test_adapter_sync_needs_generators_that_apply_adapters(tmp_path: Path) -> None:
    topo = parse_topology(lora_topology(tmp_path, "adapter"))
    adapter = topo.role_configs()["generators"].adapter
    assert adapter is not None and adapter.r == 4  # the trainer's LoRA, derived: not a second setting
    assert parse_topology(lora_topology(tmp_path, "merged")).role_configs()["generators"].adapter is None
    assert parse_topology(lora_topology(tmp_path, "adapter", generators="vllm")).role_configs()["generators"].adapter
    with pytest.raises(TopologyError, match=r"generator binding 'topology.fake_bindings:Generator' cannot apply "
                                            r"adapters.*use lora.sync: merged"):
        parse_topology(lora_topology(tmp_path, "adapter", generators="topology.fake_bindings:Generator"))


async def run_and_probe(text: str) -> tuple[list[list[int]], list[list[float]], dict[str, int]]:
    """Run the topology; then the generators' greedy answers and log-probs on PROBE and the synced tensors."""
    topo = parse_topology(text)
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, topo.run, topo.loss).run()
        assert summary.steps == topo.run.steps
        version, digest = await mesh.trainer.weights_digest.call_one()
        assert {d for _, d in (await mesh.generators.weights_digest.call()).values()} == {digest}
        groups = next(iter((await mesh.generators.generate.call(PROBE)).values()))
    manifest = [json.loads(line) for line in (topo.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in manifest if "event" not in r]
    assert steps and all(r["weight_version"] >= 1 for r in steps)
    assert any(r["channels"]["grpo"] != 0 for r in steps)  # a gradient: the adapters moved
    rollouts = [g.rollouts[0] for g in groups]
    return [r.completion_ids for r in rollouts], [r.logprobs for r in rollouts], {"version": version}


async def test_generators_sample_the_merged_policy_from_adapters_alone(tmp_path: Path) -> None:
    adapter_ids, adapter_lps, adapter_v = await run_and_probe(lora_topology(tmp_path, "adapter"))
    merged_ids, merged_lps, merged_v = await run_and_probe(lora_topology(tmp_path, "merged"))
    assert adapter_v == merged_v  # the same number of published versions
    # Lag 0 and one seed: the two runs train the same adapters; their generators answer the same, with the same
    # log-probs up to float rounding (base + B A vs the merged matrix).
    assert adapter_ids == merged_ids
    for a, m in zip(adapter_lps, merged_lps):
        assert a == pytest.approx(m, abs=1e-4)
    # The merged policy is the run's final model (saved merged): a plain generator loading it answers the same.
    plain = HFGenerator(HFGeneratorSettings())
    plain.start(ModelConfig(source=str(tmp_path / "adapter" / "checkpoint")))
    final = plain.generate(PROBE, weight_version=0)
    assert [g.rollouts[0].completion_ids for g in final] == adapter_ids
    # And it is not the base: training moved the policy.
    base = HFGenerator(HFGeneratorSettings())
    base.start(parse_topology(lora_topology(tmp_path, "merged")).model)
    base_lps = [g.rollouts[0].logprobs for g in base.generate(PROBE, weight_version=0)]
    assert any(b != pytest.approx(a, abs=1e-4) for b, a in zip(base_lps, adapter_lps))


@pytest.mark.slow  # two LoRA runs, one stopped and resumed: about 35 s in CI
async def test_a_stopped_lora_run_resumes_bitwise_with_the_adapters_in_its_checkpoint(tmp_path: Path) -> None:
    from composer_mesh.app.runner import apply_overrides
    from tests.orchestration.test_resume import assert_bitwise, final_state, records, stop_and_resume

    def topology(name: str) -> object:
        text = lora_topology(tmp_path, "merged")
        (tmp_path / f"{name}.yaml").write_text(text)
        topo = apply_overrides(parse_topology(text, str(tmp_path / f"{name}.yaml")), 4, tmp_path / name)
        topo._source = tmp_path / f"{name}.yaml"
        return topo

    await run_and_probe(lora_topology(tmp_path, "merged").replace(str(tmp_path / "merged"), str(tmp_path / "whole"))
                        .replace("steps: 3", "steps: 4"))
    await stop_and_resume(topology("cut"), stop_after=1)
    whole, cut = final_state(tmp_path / "whole", 4), final_state(tmp_path / "cut", 4)
    assert_bitwise(whole, cut)
    weights = [k for k in cut if k.startswith("model/")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)  # the adapters, not the base
    keys = ("step", "weight_version", "reward", "loss", "channels", "prompts")
    assert [{k: r[k] for k in keys} for r in records(tmp_path / "whole")] == [
        {k: r[k] for k in keys} for r in records(tmp_path / "cut")]
