"""What a teacher needs to play an episode (channel 3 on episodes): the pool asks only the replay teachers a request
names, passing its per-prompt seeds; a local teacher that shares the student's tokenizer continues a turn's exact ids
as a generator does (and says which in `TeacherTrace.prompt_ids`), and samples prompt i with `seeds[i]` alone.

The tiny byte-tokenizer model (random weights, no warm start: built in a second) is both the student's generator
and the teacher, so a teacher turn with a generator turn's seed must be that turn, token for token."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from composer_mesh.actors.messages import GenerationRequest, Prompt, TeacherRequest
from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool
from composer_mesh.models.config import ModelConfig
from tests.actors.teacher_pool.scripted_teachers import ScriptedSettings, ScriptedTeacher

MODEL = ModelConfig(tokenizer="byte", max_position_embeddings=256)
OPENING = Prompt("p0", "", messages=[{"role": "user", "content": "add 2 and 3"}],
                 tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])


def scripted(name: str, channels: set[str]) -> PoolMember:
    return PoolMember(name, frozenset(channels), ScriptedTeacher(ScriptedSettings()))


async def test_the_pool_asks_only_the_named_replay_teachers_with_the_requests_seeds() -> None:
    pool = TeacherPool([scripted("d", {"distill"}), scripted("a", {"replay"}), scripted("b", {"distill", "replay"})])
    pool.start(None)
    ps = [Prompt("p0", "1+2="), Prompt("p1", "3+4=")]
    out = await pool.signals(TeacherRequest(prompts=ps, seeds=[7, 9], teachers=["b"]))
    assert [(t.teacher, t.prompt_id) for t in out.traces] == [("b", "p0"), ("b", "p1")]
    backends = {m.name: m.backend for m in pool.members}
    assert backends["a"].trace_seeds == [] and backends["b"].trace_seeds == [[7, 9]]  # type: ignore[attr-defined]
    out = await pool.signals(TeacherRequest(prompts=ps))  # no names: every replay teacher; no seeds: none passed
    assert sorted({t.teacher for t in out.traces}) == ["a", "b"] and backends["a"].trace_seeds == [None]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="2 prompts"):
        await pool.signals(TeacherRequest(prompts=ps, seeds=[1]))


@pytest.fixture(scope="module")
def teacher_and_generator() -> tuple[Any, Any]:
    from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
    from composer_mesh.actors.backends.teachers.hf_teacher import HFTeacher, HFTeacherSettings

    teacher = HFTeacher(HFTeacherSettings(model=MODEL, trace_temperature=1.0, stop_at_task_eos=False, max_batch=2))
    teacher.start(MODEL, "t0")
    generator = HFGenerator(HFGeneratorSettings(stop_at_task_eos=False))
    generator.start(MODEL)
    return teacher, generator


def turns(generator: Any) -> list[Prompt]:
    """The opening and a later turn of an episode: the conversation so far (the opening's ids and a sampled
    reply) with a tool result to bridge."""
    [g] = generator.generate(GenerationRequest([OPENING], 1, 6, seeds=[11]), 0)
    r = g.rollouts[0]
    later = Prompt("p0", "", token_ids=[*r.prompt_ids, *r.completion_ids],
                   bridge_messages=[{"role": "tool", "content": "5"}])
    return [OPENING, later]


def test_a_teacher_turn_continues_the_exact_ids_a_generator_continues(teacher_and_generator: Any) -> None:
    teacher, generator = teacher_and_generator
    ps, seeds = turns(generator), [5, 5 + (1 << 48)]
    traces = asyncio.run(teacher.traces(ps, 6, seeds=seeds))
    groups = generator.generate(GenerationRequest(ps, 1, 6, temperature=1.0, seeds=seeds), 0)
    for t, g in zip(traces, groups):
        r = g.rollouts[0]
        assert t.prompt_ids == r.prompt_ids  # the chat template's opening, then the bridge the generator appends
        assert t.completion_ids == r.completion_ids  # same weights, same seed: the same turn, token for token
        # what the turn cost (a teacher episode's tokens sum these): the ids it read and the ids it wrote
        assert t.usage == {"prompt_tokens": float(len(t.prompt_ids)), "completion_tokens": float(len(t.completion_ids))}
    assert traces[1].prompt_ids[: len(ps[1].token_ids)] == ps[1].token_ids


def test_a_teacher_turn_samples_with_its_own_seed_whatever_shares_the_call(teacher_and_generator: Any) -> None:
    teacher, generator = teacher_and_generator
    ps = turns(generator)
    both = asyncio.run(teacher.traces(ps, 8, seeds=[21, 22]))
    alone = asyncio.run(teacher.traces([ps[1]], 8, seeds=[22]))
    other = asyncio.run(teacher.traces([ps[1]], 8, seeds=[23]))
    assert alone[0].completion_ids == both[1].completion_ids
    assert other[0].completion_ids != both[1].completion_ids
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        asyncio.run(teacher.traces(ps, 8, seeds=[1]))
