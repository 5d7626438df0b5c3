"""`composer-mesh plan`'s trainer memory estimate (`topology/memory.py`): parameter counts equal transformers'
own for the same config, sharding divides the sharded parts, and a replica too large for an 80 GB GPU warns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_mesh.actors.backends.trainer.config import HFTrainerSettings
from composer_mesh.topology import load_topology
from composer_mesh.topology.memory import Shapes, rank_memory
from composer_mesh.topology.plan import make_plan

QWEN25_7B = {"vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "tie_word_embeddings": False}


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_equals_the_built_models(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {"vocab_size": 300, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6,
           "num_key_value_heads": 2, "intermediate_size": 96, "tie_word_embeddings": tied}
    model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    assert Shapes.of_config(cfg).parameters == sum(p.numel() for p in model.parameters())
    assert Shapes.of_config(QWEN25_7B).parameters == 7_615_616_512  # Qwen2.5-7B's published count


def test_sharding_divides_weights_gradients_and_adamw():
    shapes, settings = Shapes.of_config(QWEN25_7B), HFTrainerSettings(precision="bf16-mixed")
    one = rank_memory(shapes, settings, 1, reference=False, tokens=None)
    assert one.parts["weights"] + one.parts["gradients"] + one.parts["AdamW"] == 16 * shapes.parameters
    for ranks in (2, 4, 8):
        sharded = rank_memory(shapes, settings, ranks, reference=False, tokens=None)
        state = sum(sharded.parts[k] for k in ("weights", "gradients", "AdamW"))
        assert state <= 16 * shapes.parameters / ranks + 1
        assert sharded.parts["gathered"] > 0  # the root and two layers gathered at once


def topology(tmp_path: Path, procs: int) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(QWEN25_7B))
    text = f"""\
name: q7
model: {{source: {tmp_path / "model"}}}
meshes:
  trainer: {{backend: local, procs_per_host: {procs}, gpus_per_proc: 1}}
  generators: {{backend: local, gpus_per_proc: 1}}
roles:
  trainer:
    mesh: trainer
    binding: hf
    procs_per_replica: {procs}
    settings: {{device: cuda, precision: bf16-mixed, micro_batch_tokens: 16384, activation_checkpointing: true}}
  generators: {{mesh: generators, binding: hf, settings: {{device: cuda}}}}
  rewarder:
    mesh: generators
    binding: python
    settings: {{functions: [{{path: "composer_mesh.tasks.arithmetic:exact_match"}}]}}
loss: {{alpha_sdpo: 0, beta_replay: 0}}
"""
    path = tmp_path / f"q7_{procs}.yaml"
    path.write_text(text)
    return path


def test_plan_warns_when_a_rank_does_not_fit_an_80_gb_gpu(tmp_path):
    rows = dict(make_plan(load_topology(topology(tmp_path, 1)), host_gpus=(8, "test")).training)
    assert "7.62B parameters" in rows["trainer memory"] and "warning: more than an 80 GB GPU" in rows["trainer memory"]
    rows = dict(make_plan(load_topology(topology(tmp_path, 8)), host_gpus=(8, "test")).training)
    assert "sharded over 8 ranks" in rows["trainer memory"] and "warning" not in rows["trainer memory"]
