"""A short RL run on real local Monarch meshes (tests/orchestration/slim_run.yaml, one proc per role) with
`trainer.settings.lora: {sync: adapter}`: each step publishes the adapters alone, the generators follow the
trainer's weight version with the trainer's adapters (digests: adapters with adapters), and only the adapters
trained: the run's merged checkpoint differs from the base model only in the adapted linear layers, each by a
rank <= r update, everything else bitwise the base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("peft")

from composer_mesh.app.launch import launch
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.loading import load_pretrained, named_weights
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import parse_topology

SLIM = Path(__file__).with_name("slim_run.yaml")
R = 4


def adapter_topology(run_dir: Path) -> str:
    data = yaml.safe_load(SLIM.read_text())
    # A step size and enough rollouts that groups have mixed rewards (a GRPO gradient) within three steps.
    data["roles"]["trainer"]["settings"] = {"lr": 0.05, "lora": {"r": R, "alpha": 8, "sync": "adapter"}}
    data["run"].update(max_policy_lag=0, run_dir=str(run_dir), checkpoint_every=0, prompts_per_step=8,
                       samples_per_prompt=4)
    return yaml.safe_dump(data)


async def test_an_adapter_synced_run_trains_only_the_adapters_and_generators_follow(tmp_path: Path) -> None:
    topo = parse_topology(adapter_topology(tmp_path / "run"))
    assert topo.role_configs()["generators"].adapter == topo.trainer.settings.lora
    async with launch(topo) as mesh:
        summary = await RLLoop(mesh, topo.run, topo.loss).run()
        assert summary.steps == topo.run.steps
        trainer = await mesh.trainer.weights_digest.call_one()
        generators = list((await mesh.generators.weights_digest.call()).values())
    # Version 1 is the initial policy, each step publishes the next; the generators hold the last one.
    assert trainer[0] == topo.run.steps + 1
    assert generators and all(g == trainer for g in generators)
    records = [json.loads(line) for line in (topo.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["weight_version"] for r in steps] == list(range(2, topo.run.steps + 2))
    assert all(r["policy_lag"] == 0 for r in steps)  # every step sampled the trainer's latest adapters
    assert any(r["channels"]["grpo"] != 0 for r in steps)  # a gradient: the adapters moved

    checkpoint = topo.run.run_dir / "checkpoint"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    merged = named_weights(load_pretrained(ModelConfig(source=str(checkpoint)))[0])
    base_model = load_pretrained(topo.model)[0]
    base = named_weights(base_model)
    assert merged.keys() == base.keys()
    head = base_model.get_output_embeddings()
    adapted = {f"{n}.weight" for n, m in base_model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    assert adapted and adapted <= base.keys()  # all-linear: every linear layer but the LM head
    for name, b in base.items():
        if name not in adapted:
            assert torch.equal(merged[name], b), f"{name} changed: only the adapters train"
    moved = 0
    for name in sorted(adapted):
        s = torch.linalg.svdvals((merged[name] - base[name]).double())
        moved += bool(s[0] > 0)
        assert s[R:].max() <= 1e-4 * max(float(s[0]), 1e-12), f"{name}: the update has rank > {R}"
    assert moved == len(adapted)
