"""Targeted feedback on a constructed episode: the hint goes before the mistaken turn, the policy conditioned on
it (a real hf generator backend, the tiny byte-level model) scores the student's own tokens from that turn on,
and the trainer's channel-2 targets are exactly those distributions on exactly the post-hint policy tokens."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
from composer_mesh.actors.backends.trainer.train_batch import build_loss_batch
from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RewardResult,
    RolloutGroup,
    ScoredGroup,
    SelfTeacherRequest,
    TokenDistribution,
    TrainBatch,
)
from composer_mesh.envs.session import Observation, StepResult
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.chat import chat_token_ids, next_turn_token_ids
from composer_mesh.models.config import ModelConfig
from composer_mesh.orchestration.config import HintsConfig
from composer_mesh.orchestration.rollout.episode import Episode, EpisodeLimits, play_episode
from composer_mesh.orchestration.rollout.hints import (
    BadHint,
    Hint,
    Hinted,
    SelfTeacher,
    hinted,
    mistake_shift,
)

BYTE = ModelConfig(tokenizer="byte", max_position_embeddings=320, seed=5)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
OPENING = [{"role": "user", "content": "12*7?"}]
ANSWERS = [  # what the environment says after policy turns 0, 1 and 2, and the feedback it gives
    StepResult(messages=[{"role": "tool", "name": "calculator", "content": "84"}]),
    StepResult(messages=[{"role": "tool", "name": "calculator", "content": "error: calculator: bad"}],
               feedback="error: calculator: bad"),
    StepResult(reward=0.0, done=True, feedback="'83' is not the product"),
]


class ScriptedSession:
    """An environment that answers each turn with the next of `ANSWERS`, whatever the policy said."""

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self) -> Observation:
        return Observation([dict(m) for m in OPENING], TOOLS)

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        return ANSWERS[self.turn - 1]

    async def close(self) -> None:
        pass


class OneGenerator:
    """`ports.Generators.distributions` over one in-process generator backend (the actor's service is a lock
    around the same call)."""

    def __init__(self, gen: HFGenerator) -> None:
        self.gen, self.requests = gen, []

    def __len__(self) -> int:
        return 1

    async def distributions(self, index: int, request: SelfTeacherRequest) -> tuple[int, list[TokenDistribution]]:
        self.requests.append(request)
        return 0, self.gen.distributions(request)


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> HFGenerator:
    g = HFGenerator(HFGeneratorSettings(cache_dir=str(tmp_path_factory.mktemp("models")), max_batch=4))
    g.start(BYTE)
    return g


@pytest.fixture(scope="module")
def episode(gen) -> tuple[Prompt, Episode]:
    """Three policy turns of the tiny model (temperature 1) against the scripted environment."""
    prompt = Prompt("p0", "12*7?", messages=OPENING, tools=TOOLS)

    async def sample(p: Prompt, seed: int) -> Any:
        request = GenerationRequest([p], samples_per_prompt=1, max_new_tokens=6, temperature=1.0, seeds=[seed])
        return gen.generate(request, weight_version=3)[0].rollouts[0]

    limits = EpisodeLimits(max_turns=3, max_new_tokens=6, max_context=None, step_timeout_s=30, episode_timeout_s=None)
    played = asyncio.run(play_episode(ScriptedSession(), prompt, 7, limits, sample))
    assert [s.feedback for s in played.steps] == [None, ANSWERS[1].feedback, ANSWERS[2].feedback]
    return prompt, played


def forward_rows(gen: HFGenerator, context: list[int], continuation: list[int]) -> torch.Tensor:
    """The policy's logits over `continuation` after `context`, computed here by hand."""
    with torch.no_grad():
        logits = gen.model(input_ids=torch.tensor([context + continuation])).logits[0].float()
    return logits[len(context) - 1 : len(context) - 1 + len(continuation)]


def targets(gen: HFGenerator, prompt: Prompt, ep: Episode, dist: TokenDistribution) -> dict[str, torch.Tensor]:
    """The channel-2 inputs the trainer builds for the episode with `dist` as its teacher."""
    batch = TrainBatch([ScoredGroup(RolloutGroup(prompt, [ep.rollout]), [RewardResult(0.0)])], [dist])
    lb = build_loss_batch(batch, gen.model, LossConfig(alpha_sdpo=1.0, beta_replay=0.0))
    return {"mask": lb.distill_mask[0], "policy": lb.mask[0], "logits": lb.teacher_logits,
            "ids": lb.teacher_topk_ids, "logprobs": lb.teacher_topk_logprobs}


def test_hint_targets_are_the_hinted_policy_on_exactly_the_post_hint_policy_tokens(gen, episode) -> None:
    prompt, ep = episode
    r = ep.rollout
    port = OneGenerator(gen)
    teacher = SelfTeacher(HintsConfig(source="environment"), port, top_k=0)
    [dist] = asyncio.run(teacher.distributions([prompt], [ep]))
    second = [t for t in r.turns if t.policy][1]  # the turn the environment found a mistake in
    assert dist is not None and dist.offset == second.start and dist.teacher == "self"
    # the teacher's context: the conversation up to the turn's bridge, the bridge rebuilt with the hint in it
    bridge_start = r.turns[r.turns.index(second) - 1].start
    hint = {"role": "user", "content": "Hint: error: calculator: bad"}
    context = next_turn_token_ids(gen.tokenizer, r.prompt_ids + r.completion_ids[:bridge_start],
                                  [*ep.steps[1].before, hint])
    assert "Hint: error: calculator: bad" in gen.tokenizer.decode(context)
    expected = forward_rows(gen, context, r.completion_ids[second.start:])
    got = targets(gen, prompt, ep, dist)
    # exactly the policy tokens from the hinted turn on: not turn 0, not the environment's spans
    positions = torch.arange(len(r.completion_ids))
    assert torch.equal(got["mask"][: len(positions)], got["policy"][: len(positions)] & (positions >= second.start))
    assert got["mask"].sum() == sum(r.loss_mask()[second.start:]) == teacher.tokens
    rows = got["logits"][0, second.start : len(r.completion_ids)]
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)
    # the hint changes the targets: without it the same tokens are scored as the student scored them
    plain = forward_rows(gen, r.prompt_ids + r.completion_ids[:second.start], r.completion_ids[second.start:])
    assert (plain - expected).abs().max() > 1e-2
    # what the hint did to the mistaken turn: the hinted policy's log-probs of the student's tokens minus the sampler's
    turn = torch.tensor(r.completion_ids[second.start:second.end])
    hinted_lp = torch.log_softmax(expected[: len(turn)], -1).gather(1, turn[:, None])[:, 0]
    shift = float((hinted_lp - torch.tensor(r.logprobs[second.start:second.end])).mean())
    counters = teacher.counters()
    assert counters.pop("hints/mistake_shift") == pytest.approx(shift, abs=1e-4)
    assert counters == {"hints/episodes": 1.0, "hints/hinted": 1.0, "hints/tokens": float(teacher.tokens),
                        "hints/too_long": 0.0}


def test_a_hint_before_the_first_turn_follows_the_opening_and_top_k_follows_channel_2(gen, episode) -> None:
    prompt, ep = episode
    r = ep.rollout
    teacher = SelfTeacher(HintsConfig(source="rule", rule="test_hints:first_turn_rule"),
                          OneGenerator(gen), top_k=4)
    [dist] = asyncio.run(teacher.distributions([prompt], [ep]))
    assert dist is not None and dist.offset == 0 and dist.topk_ids is not None and dist.topk_ids.shape[1] == 4
    context = chat_token_ids(gen.tokenizer, [*OPENING, {"role": "user", "content": "Call the tool."}], tools=TOOLS)
    expected = torch.log_softmax(forward_rows(gen, context, r.completion_ids), -1).topk(4, -1)
    got = targets(gen, prompt, ep, dist)
    assert torch.equal(got["mask"][: len(r.completion_ids)], got["policy"][: len(r.completion_ids)])
    n = len(r.completion_ids)
    assert torch.equal(got["ids"][0, :n], expected.indices)
    torch.testing.assert_close(got["logprobs"][0, :n], expected.values, atol=1e-4, rtol=1e-4)


def first_turn_rule(prompt: Prompt, steps: list[Any]) -> Hint:
    """A rule hint (run.rollout.hints.rule names it): before the first turn."""
    return Hint(0, "Call the tool.")


def test_episodes_without_a_mistake_keep_the_teachers_targets_and_bad_hints_are_refused(gen, episode) -> None:
    prompt, ep = episode
    port = OneGenerator(gen)
    clean = Episode(ep.rollout, 1.0, steps=[type(s)(s.before, s.text) for s in ep.steps])
    teacher = SelfTeacher(HintsConfig(source="environment"), port, top_k=0)
    assert asyncio.run(teacher.distributions([prompt], [clean])) == [None]
    assert port.requests == []  # nothing asked of the generators
    with pytest.raises(BadHint, match="policy turn 5"):
        hinted(prompt, ep, Hint(5, "x"), "user")
    with pytest.raises(BadHint, match="no text"):
        hinted(prompt, ep, Hint(1, " "), "user")


class PoolPort:
    """`ports.Teachers` over one in-process `TeacherPool` (the teacher-pool actor is a thin wrapper of it)."""

    def __init__(self, pool: Any) -> None:
        self.pool, self.requests = pool, []

    async def signals(self, request: Any) -> list[Any]:
        self.requests.append(request)
        return [await self.pool.signals(request)]


def test_a_teacher_writes_the_hint_from_the_transcript_and_feedback(gen, episode, tmp_path) -> None:
    """`hints.source: teacher`: a real hf teacher (member with channel hint) reads the episode through its first
    turn with feedback, and what it writes is the hint the self-teacher conditions on; a replay request (no
    teacher named) never reaches a hint-only member."""
    from composer_mesh.actors.backends.teachers.hf_teacher import HFTeacher, HFTeacherSettings
    from composer_mesh.actors.messages import TeacherRequest
    from composer_mesh.actors.teacher_pool import PoolMember, TeacherPool

    prompt, ep = episode
    long_byte = BYTE.model_copy(update={"max_position_embeddings": 1024})  # the transcript is long in bytes
    writer = HFTeacher(HFTeacherSettings(model=long_byte, cache_dir=str(tmp_path), trace_temperature=0.0))
    pool = TeacherPool([PoolMember("writer", frozenset({"hint"}), writer, "stop")])
    pool.start(BYTE)
    teachers, generators = PoolPort(pool), OneGenerator(gen)
    config = HintsConfig(source="teacher", teacher="writer", max_tokens=12, instruction="Write a hint.")
    teacher = SelfTeacher(config, generators, top_k=0, teachers=teachers)
    [dist] = asyncio.run(teacher.distributions([prompt], [ep], seed=3))
    [asked] = teachers.requests
    assert asked.teachers == ["writer"] and asked.max_new_tokens == 12 and asked.seed == 3
    system, user = asked.prompts[0].messages
    assert system["content"] == config.instruction
    assert user["content"].endswith("feedback: error: calculator: bad") and "assistant: " in user["content"]
    written = asyncio.run(pool.signals(asked)).traces[0].text.strip()  # greedy: the same text again
    [scored] = generators.requests
    assert scored.prompts[0].bridge_messages[-1] == {"role": "user", "content": written}
    second = [t for t in ep.rollout.turns if t.policy][1]
    assert dist is not None and dist.offset == second.start and teacher.counters()["hints/hinted"] == 1.0
    assert asyncio.run(pool.signals(TeacherRequest(prompts=[prompt]))).traces == []  # not a replay teacher


def long_rule(prompt: Prompt, steps: list[Any]) -> Hint:
    """A hint too long for the tiny model's 320-token context once inserted."""
    return Hint(1, "x" * 400)


def test_a_hint_that_does_not_fit_the_context_is_left_out_and_counted(gen, episode) -> None:
    prompt, ep = episode
    teacher = SelfTeacher(HintsConfig(source="rule", rule="test_hints:long_rule"), OneGenerator(gen), top_k=0)
    assert asyncio.run(teacher.distributions([prompt, prompt], [ep, ep])) == [None, None]
    assert teacher.counters() == {"hints/episodes": 2.0, "hints/hinted": 0.0, "hints/tokens": 0.0,
                                  "hints/too_long": 2.0, "hints/mistake_shift": 0.0}


def rows_giving(m: Hinted, logprob: float, vocab: int = 300) -> torch.Tensor:
    """Dense rows over `m`'s continuation where each student token has probability exp(logprob)."""
    logits = torch.full((len(m.continuation), vocab), -1e4)
    rest = torch.log(torch.tensor(1 - math.exp(logprob)) / (vocab - 1))
    for t, token in enumerate(m.continuation):
        logits[t] = rest
        logits[t, token] = logprob
    return logits


def test_the_mistake_shift_is_the_hinted_log_probs_of_the_students_turn_minus_the_samplers(gen, episode) -> None:
    prompt, ep = episode
    m = hinted(prompt, ep, Hint(1, "Hint: error: calculator: bad"), "user")
    sampled = sum(m.sampled) / len(m.sampled)
    likelier = TokenDistribution("self", logits=rows_giving(m, -1e-3))  # the hint endorses the student's tokens
    unlikelier = TokenDistribution("self", logits=rows_giving(m, sampled - 2.0))
    assert mistake_shift(likelier, m) == pytest.approx(-1e-3 - sampled, abs=1e-3) and mistake_shift(likelier, m) > 0
    assert mistake_shift(unlikelier, m) == pytest.approx(-2.0, abs=1e-3)
    # top-k: a token outside the k counts at the row's lowest listed log-prob (an upper bound)
    ids = torch.tensor([[(tok + 1) % 259, (tok + 2) % 259] for tok in m.continuation])
    topk = TokenDistribution("self", topk_ids=ids, topk_logprobs=torch.tensor([[-0.5, -3.0]] * len(ids)))
    assert mistake_shift(topk, m) == pytest.approx(-3.0 - sampled, abs=1e-4)
    inside = TokenDistribution("self", topk_ids=torch.tensor([[tok, (tok + 1) % 259] for tok in m.continuation]),
                               topk_logprobs=torch.tensor([[-0.25, -3.0]] * len(ids)))
    assert mistake_shift(inside, m) == pytest.approx(-0.25 - sampled, abs=1e-4)
