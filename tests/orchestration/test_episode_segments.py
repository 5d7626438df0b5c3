"""Episodes whose conversation is rewritten, played on a real generator (the tiny byte-level model in process,
with a sharper head so that log-probs are far from uniform): a summary that replaces the first two turns, and a
long tool result cut short. Each episode becomes two training samples, each a prefix chain: its prompt ids are
exactly the ids its first turn was sampled from (the conversation rendered fresh by the chat template), its turns
are the sampled ids with the sampler's log-probs, its loss mask covers exactly its own policy turns, and the
trainer's recomputed log-probs equal the sampler's on every policy token of both. The segments share the
episode's reward and status and are marked as one episode."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from composer_mesh.actors.backends.generation.hf_generator import HFGenerator, HFGeneratorSettings
from composer_mesh.actors.backends.trainer.train_batch import TrainRows, completion_logprobs
from composer_mesh.actors.messages import GenerationRequest, Prompt, Rollout, TrainBatch
from composer_mesh.envs.session import Message, Observation, StepResult
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.chat import chat_token_ids
from composer_mesh.models.config import ModelConfig
from composer_mesh.orchestration.rollout.episode import Episode, EpisodeLimits, play_episode
from composer_mesh.orchestration.rollout.multi_turn import scored_episodes

BYTE = ModelConfig(tokenizer="byte", max_position_embeddings=512, seed=5)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
OPENING = [{"role": "user", "content": "12*7?"}]
SUMMARY = [{"role": "user", "content": "Summary so far: the calculator gave 84. Answer."}]
LONG = "8" * 90


def tool(content: str) -> Message:
    return {"role": "tool", "name": "calculator", "content": content}


def summarised(actions: list[str]) -> StepResult:
    """After turns 1-2 (a tool call and its result, then a second turn): a summary replaces all of it."""
    return StepResult(rewrite=SUMMARY)


def truncated(actions: list[str]) -> StepResult:
    """After turn 2: the conversation again, with turn 1's long tool result cut short, and turn 2's result."""
    return StepResult(messages=[tool("ok")], rewrite=[
        *OPENING, {"role": "assistant", "content": actions[0]}, tool(LONG[:8] + " [cut]"),
        {"role": "assistant", "content": actions[1]}])


Script = list[Callable[[list[str]], StepResult]]
SCRIPTS: dict[str, tuple[Script, int]] = {  # what the environment answers after each turn; turns in segment 0
    "summary": ([lambda a: StepResult([tool("84")]), summarised, lambda a: StepResult([tool("ok")]),
                 lambda a: StepResult(reward=1.0, done=True)], 2),
    "truncated tool result": ([lambda a: StepResult([tool(LONG)]), truncated,
                               lambda a: StepResult(reward=1.0, done=True)], 2),
}


class ScriptedSession:
    """Answers turn k with `script[k]` of the actions so far, whatever the policy said."""

    def __init__(self, script: Script) -> None:
        self.script, self.actions = script, []

    async def reset(self) -> Observation:
        return Observation([dict(m) for m in OPENING], TOOLS)

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        return self.script[len(self.actions) - 1](self.actions)

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> HFGenerator:
    g = HFGenerator(HFGeneratorSettings(cache_dir=str(tmp_path_factory.mktemp("models")), max_batch=4))
    g.start(BYTE)
    with torch.no_grad():
        g.model.lm_head.weight.mul_(6.0)  # log-probs far from uniform: matching them means something
    return g


def play(gen: HFGenerator, script: Script) -> tuple[Episode, list[Rollout], ScriptedSession]:
    """The scripted episode at temperature 1 (6 tokens a turn) and each turn as the generator sampled it."""
    sampled: list[Rollout] = []

    async def sample(p: Prompt, seed: int) -> Any:
        request = GenerationRequest([p], samples_per_prompt=1, max_new_tokens=6, temperature=1.0, seeds=[seed])
        sampled.append(gen.generate(request, weight_version=3)[0].rollouts[0])
        return sampled[-1]

    session = ScriptedSession(script)
    limits = EpisodeLimits(max_turns=6, max_new_tokens=6, max_context=None, step_timeout_s=30, episode_timeout_s=None)
    episode = asyncio.run(play_episode(session, Prompt("p0", "12*7?", messages=OPENING, tools=TOOLS), 7, limits,
                                       sample))
    return episode, sampled, session


def assert_prefix_chain(segment: Rollout, turns: list[Rollout]) -> None:
    """`segment` opens with the ids its first turn was sampled from, and each turn was sampled from exactly the
    segment's ids before it; its mask is 1 on exactly the sampled tokens."""
    assert segment.prompt_ids == turns[0].prompt_ids
    policy = [t for t in segment.turns or [] if t.policy]
    assert len(policy) == len(turns)
    for t, r in zip(policy, turns, strict=True):
        assert segment.prompt_ids + segment.completion_ids[: t.start] == r.prompt_ids
        assert segment.completion_ids[t.start : t.end] == r.completion_ids
        assert segment.logprobs[t.start : t.end] == r.logprobs
    mask = segment.loss_mask()
    assert [i for i, m in enumerate(mask) if m] == [i for t in policy for i in range(t.start, t.end)]


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_a_rewritten_episode_trains_as_prefix_chains_with_exact_masks_and_logprobs(gen, case: str) -> None:
    script, split = SCRIPTS[case]
    episode, sampled, session = play(gen, script)
    first, second = episode.segments
    assert (first.episode_id, first.segment, second.episode_id, second.segment) == ("p0/7", 0, "p0/7", 1)
    assert first.status == second.status == "done" and episode.reward == 1.0
    assert_prefix_chain(first, sampled[:split])
    assert_prefix_chain(second, sampled[split:])
    result = script[split - 1](session.actions[:split])
    rewritten = [*(result.rewrite or []), *result.messages]  # the new conversation, then what the turn added
    assert second.prompt_ids == chat_token_ids(gen.tokenizer, rewritten, tools=TOOLS)  # rendered fresh, tools too
    assert first.prompt_ids == chat_token_ids(gen.tokenizer, OPENING, tools=TOOLS)

    segments = [first, second]
    with torch.no_grad():
        logps, mask = completion_logprobs(gen.model, [s.prompt_ids for s in segments],
                                          [s.completion_ids for s in segments], 1.0,
                                          loss_masks=[s.loss_mask() for s in segments])
    for b, s in enumerate(segments):
        n = len(s.completion_ids)
        policy = torch.tensor(s.loss_mask(), dtype=torch.bool)
        assert torch.equal(mask[b, :n], policy) and not mask[b, n:].any()
        torch.testing.assert_close(logps[b, :n][policy].double(), torch.tensor(s.logprobs).double()[policy],
                                   atol=1e-5, rtol=0)
    assert min(lp for s in segments for lp in s.logprobs) < -6.0  # not a near-uniform model (that is -5.56)

    group = scored_episodes(Prompt("p0", "12*7?"), [episode])
    assert [rw.score for rw in group.rewards] == [1.0, 1.0]  # the episode's reward on each of its samples
    assert group.rewards[0].components["turns"] == len(sampled)
    assert TrainRows.of(TrainBatch([group]), LossConfig(alpha_sdpo=0.0)).episode_ids.tolist() == [0, 0]
