"""The `hf` teacher binding: channel-2 distributions aligned like the trainer, channel-3 traces, tokenizer check."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from pydantic import ValidationError

from composer_mesh.actors.backends.teachers.hf_teacher import HFTeacher, HFTeacherSettings
from composer_mesh.actors.backends.teachers.local_teacher import TeacherTokenizerMismatch
from composer_mesh.actors.messages import Prompt, Rollout
from composer_mesh.models.config import ModelConfig

STUDENT = ModelConfig(warmstart={"steps": 30})  # the same configs as tests/models: one cache build per session


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "composer_mesh_models")


@pytest.fixture(scope="module")
def teacher(cache):
    t = HFTeacher(HFTeacherSettings(cache_dir=cache, max_batch=3))  # default model: tiny + 150-step warm start
    t.start(STUDENT, "t0")
    return t


@pytest.fixture(scope="module")
def teacher_copy(teacher, cache):
    from composer_mesh.models.loading import load_pretrained

    return load_pretrained(teacher.settings.model, cache)


def prompts(tok, n: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        text = f"{a}+{b}="
        out.append(Prompt(f"p{i}", text, tok.encode(text, add_special_tokens=False), str(a + b)))
    return out


def rollouts(tok) -> list[Rollout]:
    """Student-like rollouts of different lengths (one empty completion), as the trainer receives them."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    items = [("1+2=", "3;"), ("9+9+1=", "19;"), ("4+4=", "13579;"), ("0+0=", "")]
    return [Rollout(f"r{i}", enc(p), enc(c), [0.0] * len(enc(c)), weight_version=0) for i, (p, c) in enumerate(items)]


def manual_rows(model, r: Rollout) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([r.prompt_ids + r.completion_ids])).logits[0].float()
    p = len(r.prompt_ids)
    return logits[p - 1 : p - 1 + len(r.completion_ids)]  # row t scores completion token t


async def test_dense_distributions_align_with_a_manual_forward(teacher, teacher_copy):
    model, tok = teacher_copy
    rs = rollouts(tok)
    dists = await teacher.distributions(rs, top_k=0)
    assert len(dists) == len(rs)
    for r, d in zip(rs, dists):
        assert d.teacher == "t0" and d.topk_ids is None
        assert d.logits.shape == (len(r.completion_ids), len(tok))
        assert torch.allclose(d.logits, manual_rows(model, r), atol=1e-5)


async def test_topk_distributions(teacher, teacher_copy):
    model, tok = teacher_copy
    rs = rollouts(tok)
    for r, d in zip(rs, await teacher.distributions(rs, top_k=3)):
        assert d.logits is None and d.topk_ids.shape == d.topk_logprobs.shape == (len(r.completion_ids), 3)
        ref_vals, ref_ids = torch.log_softmax(manual_rows(model, r), -1).topk(3, dim=-1)
        assert torch.equal(d.topk_ids, ref_ids)
        assert torch.allclose(d.topk_logprobs, ref_vals, atol=1e-5)
    # The teacher knows the task: its top-1 at the answer position of '1+2=' is '3'.
    [d] = await teacher.distributions(rs[:1], top_k=1)
    assert int(d.topk_ids[0, 0]) == tok.encode("3", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        await teacher.distributions(rs, top_k=-1)


async def test_traces_solve_the_task_and_decode_to_their_text(teacher, teacher_copy):
    from composer_mesh.tasks.arithmetic import exact_match

    _, tok = teacher_copy
    ps = prompts(tok, 20, seed=3)
    traces = await teacher.traces(ps, max_new_tokens=4)
    assert [t.prompt_id for t in traces] == [p.prompt_id for p in ps]
    for t in traces:
        assert t.teacher == "t0" and t.text == tok.decode(t.completion_ids, skip_special_tokens=True)
    accuracy = sum(exact_match(p.text, t.text, p.answer) for p, t in zip(ps, traces)) / len(ps)
    assert accuracy >= 0.8
    assert all(t.text.endswith(";") for t in traces)


async def test_calls_run_off_the_event_loop_and_are_counted(teacher, teacher_copy):
    _, tok = teacher_copy
    before = teacher.usage()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.gather(teacher.distributions(rollouts(tok), 0), teacher.traces(prompts(tok, 4), 4))
    task.cancel()
    assert ticks > 10  # the loop kept running while the teacher computed (blocking would allow ~2)
    after = teacher.usage()
    assert after["requests"] == before["requests"] + 2
    assert after["distill_rollouts"] == before["distill_rollouts"] + 4
    assert after["trace_prompts"] == before["trace_prompts"] + 4
    assert after["failures"] == before["failures"] == 0


def _other_tokenizer_student(tmp_path, alphabet: str = ";=+9876543210") -> ModelConfig:
    """A local student checkpoint whose char tokenizer has another alphabet/order (different ids)."""
    from composer_mesh.models.tiny import build_tiny_model
    from composer_mesh.models.tokenizer import build_tokenizer, stop_token_ids

    tok = build_tokenizer(alphabet)
    model = build_tiny_model(ModelConfig(), len(tok), stop_token_ids(tok, (";",)), tok.pad_token_id)
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    return ModelConfig(source=str(tmp_path))


async def test_other_tokenizer_gives_retokenised_traces_but_no_distributions(cache, tmp_path, teacher_copy):
    from composer_mesh.models.loading import load_tokenizer

    _, tok = teacher_copy
    student = _other_tokenizer_student(tmp_path)
    t = HFTeacher(HFTeacherSettings(cache_dir=cache))
    t.start(student, "t_other")
    assert not t.shares_tokenizer
    with pytest.raises(TeacherTokenizerMismatch, match=r"teacher 't_other'.*channels: \[replay\]"):
        t.check_distill()
    with pytest.raises(TeacherTokenizerMismatch, match="t_other"):
        await t.distributions(rollouts(tok), 0)
    student_tok = load_tokenizer(student)
    ps = [Prompt(p.prompt_id, p.text, student_tok.encode(p.text, add_special_tokens=False), p.answer)
          for p in prompts(tok, 5, seed=9)]
    traces = await t.traces(ps, 4)
    assert len(traces) == 5
    for trace in traces:
        assert trace.completion_ids == student_tok.encode(trace.text, add_special_tokens=False)
        assert trace.completion_ids != tok.encode(trace.text, add_special_tokens=False)  # really other ids
    assert t.usage()["requests"] == 1 and t.usage()["failures"] == 0


async def test_traces_the_student_cannot_write_are_dropped(cache, tmp_path):
    from composer_mesh.models.loading import load_tokenizer

    student = _other_tokenizer_student(tmp_path, "02468+=;")  # no odd digits
    t = HFTeacher(HFTeacherSettings(cache_dir=cache))
    t.start(student, "t_even")
    tok = load_tokenizer(student)
    ps = [Prompt(f"p{i}", text, tok.encode(text, add_special_tokens=False), None)
          for i, text in enumerate(["2+2=", "2+4=", "1+2=", "4+4="])]  # the teacher answers 4; 6; 3; 8;
    traces = await t.traces(ps, 4)
    assert [x.prompt_id for x in traces] == ["p0", "p1", "p3"]
    assert [x.text for x in traces] == ["4;", "6;", "8;"]
    assert t.usage()["untokenizable_traces"] == 1


def test_settings_are_validated_and_the_binding_resolves():
    from composer_mesh.roles import resolve_binding

    with pytest.raises(ValidationError, match=r"model\.source"):
        HFTeacherSettings.model_validate({"model": {"source": "/does/not/exist"}})
    with pytest.raises(ValidationError, match="trace_temperature"):
        HFTeacherSettings(trace_temperature=-1)
    with pytest.raises(ValidationError, match="top_k"):
        HFTeacherSettings.model_validate({"top_k": 3})
    b = resolve_binding("teachers", "hf")
    assert b.cls is HFTeacher and b.capabilities == {"distill", "replay"}
    assert HFTeacherSettings().model.warmstart is not None
    for name, field in HFTeacherSettings.model_fields.items():
        assert field.description, name


# -- top_k "auto" and token-budgeted scoring ------------------------------------------------------------------


def test_resolve_top_k_is_dense_up_to_the_limit_then_top_k():
    from composer_mesh.actors.teacher_topk import DEFAULT_TOP_K, DENSE_VOCAB_LIMIT, resolve_top_k

    assert DENSE_VOCAB_LIMIT == 32_768 and DEFAULT_TOP_K > 0
    assert resolve_top_k("auto", 32_768) == 0
    assert resolve_top_k("auto", 32_769) == DEFAULT_TOP_K
    assert resolve_top_k("auto", 151_936) == DEFAULT_TOP_K
    assert resolve_top_k(0, 151_936) == 0  # forced dense
    assert resolve_top_k(5, 14) == 5 and resolve_top_k(64, 151_936) == 64  # explicit k kept
    for bad in (-1, "dense", 2.0, True):
        with pytest.raises(ValueError, match="top_k"):
            resolve_top_k(bad, 100)


def test_run_config_defaults_to_auto_and_takes_dense_or_k():
    from composer_mesh.actors.messages import TeacherRequest
    from composer_mesh.orchestration.config import RunConfig

    assert RunConfig().teacher_top_k == "auto" and TeacherRequest().top_k == "auto"
    assert RunConfig.model_validate({"teacher_top_k": 0}).teacher_top_k == 0
    assert RunConfig.model_validate({"teacher_top_k": 16}).teacher_top_k == 16
    for bad in (-1, "dense"):
        with pytest.raises(ValidationError, match="teacher_top_k"):
            RunConfig.model_validate({"teacher_top_k": bad})


def _count_forwards(model) -> tuple[list[tuple[int, int]], object]:
    """(rows, width) of every forward of `model`, and the hook handle to remove."""
    shapes: list[tuple[int, int]] = []

    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        shapes.append(tuple(ids.shape))

    return shapes, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_token_budget_chunks_keep_order_and_the_budget():
    from composer_mesh.models.sampling import token_budget_chunks

    assert token_budget_chunks([6, 9, 10, 4], 20) == [range(0, 2), range(2, 4)]  # 2x9, then 2x10
    assert token_budget_chunks([6, 9, 10, 4], 7) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert token_budget_chunks([6, 9, 10, 4], 1000, max_rows=3) == [range(0, 3), range(3, 4)]
    assert token_budget_chunks([30, 2, 2], 8) == [range(0, 1), range(1, 3)]  # over budget: alone
    assert token_budget_chunks([], 8) == []


async def test_token_budget_bounds_every_forward_and_changes_no_distribution(cache, teacher_copy):
    _, tok = teacher_copy
    rs = rollouts(tok) * 3  # prompt+completion lengths 6, 9, 10, 4, 6, 9, ...
    ref_teacher = HFTeacher(HFTeacherSettings(cache_dir=cache, max_batch=64, score_batch_tokens=10_000))
    ref_teacher.start(STUDENT, "t")
    ref = {k: await ref_teacher.distributions(rs, k) for k in (0, 3)}
    for budget, n_forwards in ((10_000, 1), (20, 6), (7, 12)):
        t = HFTeacher(HFTeacherSettings(cache_dir=cache, max_batch=64, score_batch_tokens=budget))
        t.start(STUDENT, "t")
        shapes, handle = _count_forwards(t.model)
        for k in (0, 3):
            shapes.clear()
            for d, e in zip(await t.distributions(rs, k), ref[k], strict=True):
                if k == 0:
                    assert torch.allclose(d.logits, e.logits, atol=1e-5)
                    # its own storage, not a view that would keep the whole batch's logits alive
                    assert d.logits.untyped_storage().nbytes() == d.logits.numel() * 4
                else:
                    assert torch.equal(d.topk_ids, e.topk_ids)
                    assert torch.allclose(d.topk_logprobs, e.topk_logprobs, atol=1e-5)
            assert len(shapes) == n_forwards and sum(rows for rows, _ in shapes) == len(rs)
            # every forward is within the budget, or one rollout longer than it, scored alone
            assert all(rows * width <= budget or rows == 1 for rows, width in shapes), shapes
        handle.remove()
        if budget == 7:
            assert {w for _, w in shapes} == {6, 9, 10, 4}  # the 9- and 10-token rollouts ran alone


def _padded_vocab_model(path, vocab: int) -> ModelConfig:
    """A local checkpoint of a 1-layer tiny model whose head has `vocab` rows (the char tokenizer's ids first,
    the rest unused, as real checkpoints pad their heads): a large-vocabulary model that builds in a second."""
    from composer_mesh.models.tiny import build_tiny_model
    from composer_mesh.models.tokenizer import stop_token_ids, tiny_tokenizer

    small = ModelConfig(hidden_size=16, num_layers=1, intermediate_size=16)
    tok = tiny_tokenizer(small)
    model = build_tiny_model(small, vocab, stop_token_ids(tok, (";",)), tok.pad_token_id)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return ModelConfig(source=str(path))


async def test_auto_is_top_k_for_a_large_student_vocabulary_and_dense_for_a_small_one(cache, tmp_path, teacher):
    from composer_mesh.actors.messages import TeacherRequest
    from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool
    from composer_mesh.actors.teacher_topk import DEFAULT_TOP_K, DENSE_VOCAB_LIMIT

    big = _padded_vocab_model(tmp_path / "big", DENSE_VOCAB_LIMIT + 7_232)  # 40,000 ids
    t = HFTeacher(HFTeacherSettings(model=big, cache_dir=cache))
    t.start(big, "t_big")
    assert t.shares_tokenizer and t.student_vocab == 40_000
    rs = rollouts(t.tokenizer)
    for r, d in zip(rs, await t.distributions(rs, "auto"), strict=True):
        assert d.logits is None and d.topk_ids.shape == (len(r.completion_ids), DEFAULT_TOP_K)
    [d] = await t.distributions(rs[:1], 0)  # forcing dense still works
    assert d.logits.shape == (len(rs[0].completion_ids), 40_000)
    # The default request through the pool: top-k for the large vocabulary, dense for the tiny student's 14 ids.
    for member, dense in ((t, False), (teacher, True)):
        pool = TeacherPool([PoolMember(member.name, frozenset({"distill"}), member)])
        signals = await pool.signals(TeacherRequest(rollouts=rs))
        assert all((d.logits is not None) == dense for d in signals.distributions)
    assert teacher.student_vocab <= DENSE_VOCAB_LIMIT


async def test_sampled_traces_follow_the_request_seed_not_the_call_order(cache, teacher_copy):
    _, tok = teacher_copy
    t = HFTeacher(HFTeacherSettings(cache_dir=cache, trace_temperature=1.5))
    t.start(STUDENT, "t_sampling")
    ps = prompts(tok, 8, seed=5)
    first = await t.traces(ps, 6, seed=11)
    await t.traces(ps, 6)  # another call in between moves the teacher's own call counter
    again = await t.traces(ps, 6, seed=11)
    other = await t.traces(ps, 6, seed=12)
    assert [x.completion_ids for x in first] == [x.completion_ids for x in again]
    assert [x.completion_ids for x in first] != [x.completion_ids for x in other]


def test_a_prompt_that_leaves_no_room_for_the_trace_is_named(teacher) -> None:
    context = teacher.model.config.max_position_embeddings  # 128 for the tiny model
    tok = teacher.tokenizer
    text = "1+2=" * (context // 4)
    long = Prompt("too-long", text, tok.encode(text, add_special_tokens=False), "3")
    with pytest.raises(ValueError, match=rf"teacher 't0': prompt 'too-long' is {context} tokens; with "
                       rf"max_new_tokens=8 that is more than the model's context of {context} tokens"):
        asyncio.run(teacher.traces([long], max_new_tokens=8))
    fits = Prompt("fits", text[: 4 * 20], tok.encode(text[: 4 * 20], add_special_tokens=False), "3")
    assert len(asyncio.run(teacher.traces([fits], max_new_tokens=8))) <= 1
