"""Playing one episode: policy turns sampled token-in/token-out, the environment's answers between them.

Token consistency is the point of this module. The first turn is the prompt's messages through the chat
template (rendered by the generator); every later turn sends the exact ids of the conversation so far plus the
environment's new messages (`Prompt.bridge_messages`), which the generator renders as the template's suffix
bridging to the next assistant turn and appends. The returned `prompt_ids` must start with the ids sent: an
episode whose tokens drifted raises `TokenDrift` rather than training on ids the policy never saw. The episode
is one `Rollout`: `prompt_ids` = the opening conversation, `completion_ids` = every later token, with `turns`
marking the policy's spans (trained on) and the environment's (log-prob 0.0, never trained on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.actors.messages import Prompt, RewardResult, Rollout, Turn
from composer_mesh.envs.session import EnvSession, Message, StepResult
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.tasks.episode import EpisodeStatus

log = logging.getLogger("composer_mesh.episodes")

TurnSampler = Callable[[Prompt, int], Awaitable[Rollout]]  # (the turn's prompt, its seed) -> the sampled turn
TURN_SEED_STRIDE = 1 << 48  # turn k of an episode samples with its seed + k * this: no two rows of a run share one


class TokenDrift(RuntimeError):
    """A turn's prompt ids do not start with the conversation sent: the generator re-tokenized earlier turns."""


@dataclass(frozen=True)
class EpisodeLimits:
    """What ends an episode besides the environment: turns, context, and time."""

    max_turns: int
    max_new_tokens: int  # per policy turn
    max_context: int | None  # prompt + every turn, in tokens (None: the generator's own check only)
    step_timeout_s: float
    episode_timeout_s: float | None

    @classmethod
    def of(cls, run: RunConfig, context: int | None = None) -> EpisodeLimits:
        r = run.rollout
        return cls(max_turns=r.max_turns, max_new_tokens=run.max_new_tokens,
                   max_context=r.max_context or context, step_timeout_s=r.step_timeout_s,
                   episode_timeout_s=r.episode_timeout_s)


@dataclass
class EpisodeStep:
    """One policy turn as the environment saw it: the messages bridged in before it (turn 0: the opening
    conversation, with the tools declared), the turn's text, and the environment's answer to it. Kept on the
    controller for targeted feedback (`hints.py`: where a hint goes and what it says); never sent to the trainer."""

    before: list[Message]
    text: str
    reward: float | None = None
    feedback: str | None = None
    info: dict[str, float] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # turn 0 only: the tool schemas the opening declared


@dataclass
class Episode:
    """A played episode: its rollout, the sum of its turns' rewards, the environment's counters and its steps
    (one per policy turn the environment answered)."""

    rollout: Rollout
    reward: float
    info: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    steps: list[EpisodeStep] = field(default_factory=list)

    def reward_result(self) -> RewardResult:
        """The episode's score as the trainer takes it. An environment that failed gave no reward: the episode is
        a failed score (`ok` false, reward 0), counted in the step's reward failures."""
        components = {**self.info, "turns": float(sum(t.policy for t in self.rollout.turns or []))}
        if self.rollout.status == "error_environment":
            return RewardResult(0.0, ok=False, error=self.error or "the environment failed", components=components)
        return RewardResult(self.reward, components=components)


class EpisodeTokens:
    """An episode's token ids as they grow, with the spans that say whose each token is."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.completion: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.generators: list[str] = []

    def conversation(self) -> list[int]:
        return [*(self.prompt_ids or []), *self.completion]

    def prompt_lengths(self) -> list[int]:
        """The length of each policy turn's prompt so far (the conversation before the turn's tokens)."""
        return [len(self.prompt_ids or []) + t.start for t in self.policy_turns()]

    def add(self, sampled: Rollout) -> Turn:
        """A sampled turn: the environment's bridge (what the generator appended to the conversation), then the
        policy's tokens."""
        if self.prompt_ids is None:
            self.prompt_ids = list(sampled.prompt_ids)
        else:
            sent = self.conversation()
            if sampled.prompt_ids[: len(sent)] != sent:
                raise TokenDrift(f"episode {sampled.prompt_id!r}: the generator's prompt for turn "
                                 f"{len(self.policy_turns())} does not start with the conversation's exact ids")
            self._span(sampled.prompt_ids[len(sent):], [0.0] * (len(sampled.prompt_ids) - len(sent)), None)
        turn = self._span(sampled.completion_ids, sampled.logprobs, sampled.weight_version)
        self.generators.append(sampled.generator)
        return turn

    def _span(self, ids: list[int], logprobs: list[float], version: int | None) -> Turn:
        turn = Turn(len(self.completion), len(self.completion) + len(ids), policy=version is not None,
                    weight_version=version)
        self.completion += ids
        self.logprobs += logprobs
        self.turns.append(turn)
        return turn

    def policy_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.policy]

    def rollout(self, prompt: Prompt, status: EpisodeStatus, text: str) -> Rollout:
        versions = [t.weight_version for t in self.policy_turns() if t.weight_version is not None]
        return Rollout(prompt_id=prompt.prompt_id, prompt_ids=list(self.prompt_ids or []),
                       completion_ids=list(self.completion), logprobs=list(self.logprobs),
                       weight_version=min(versions, default=0), text=text, finish_reason="stop",
                       generator=",".join(dict.fromkeys(self.generators)), turns=list(self.turns), status=status)


def bridge_bound(messages: list[Message]) -> int:
    """An upper bound of the tokens `messages` add as a bridge: a byte-level tokenizer gives at most one token
    per byte of content, plus the template's role markers (32 per message is generous)."""
    return sum(len(str(m.get("content", "")).encode()) + 32 for m in messages)


@dataclass
class _Play:
    """One episode in progress (what `play_episode` threads through its turns)."""

    prompt: Prompt
    seed: int
    limits: EpisodeLimits
    deadline: float | None
    tokens: EpisodeTokens = field(default_factory=EpisodeTokens)
    info: Counter[str] = field(default_factory=Counter)
    texts: list[str] = field(default_factory=list)
    reward: float = 0.0
    steps: list[EpisodeStep] = field(default_factory=list)

    def remaining(self, cap: float | None = None) -> float | None:
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        return cap if left is None else (left if cap is None else min(cap, left))

    def fits(self, pending: list[Message]) -> bool:
        need = len(self.tokens.conversation()) + bridge_bound(pending) + self.limits.max_new_tokens
        return self.limits.max_context is None or need <= self.limits.max_context


async def play_episode(session: EnvSession, prompt: Prompt, seed: int, limits: EpisodeLimits,
                       sample: TurnSampler) -> Episode:
    """Reset `session`, then alternate policy turns (`sample`) and environment steps until the environment is
    done or a limit ends the episode. The environment failing or timing out ends it with an error status."""
    deadline = None if limits.episode_timeout_s is None else time.monotonic() + limits.episode_timeout_s
    play = _Play(prompt, seed, limits, deadline)
    status: EpisodeStatus
    error = None
    try:
        status = await _turns(session, play, sample)
    except TimeoutError:
        status = "truncated_time" if play.remaining() == 0.0 else "error_timeout"
    except TokenDrift:
        raise
    except Exception as e:  # the environment's failure ends this episode, never the run
        status, error = "error_environment", f"{type(e).__name__}: {e}"
        log.warning("episode %s: the environment failed: %s", prompt.prompt_id, error)
    rollout = play.tokens.rollout(prompt, status, "".join(play.texts))
    return Episode(rollout, play.reward, dict(play.info), error, play.steps)


async def _turns(session: EnvSession, play: _Play, sample: TurnSampler) -> EpisodeStatus:
    first = await asyncio.wait_for(session.reset(), play.remaining(play.limits.step_timeout_s))
    turn_prompt = Prompt(play.prompt.prompt_id, play.prompt.text, answer=play.prompt.answer,
                         messages=first.messages, extra=play.prompt.extra, tools=first.tools or None)
    pending: list[Message] = first.messages
    for k in range(play.limits.max_turns):
        if k > 0:
            if not play.fits(pending):
                return "truncated_context"
            turn_prompt = Prompt(play.prompt.prompt_id, "", token_ids=play.tokens.conversation(),
                                 bridge_messages=pending, answer=play.prompt.answer, extra=play.prompt.extra,
                                 prefix_lengths=play.tokens.prompt_lengths())
        sampled = await asyncio.wait_for(sample(turn_prompt, play.seed + k * TURN_SEED_STRIDE), play.remaining())
        turn = play.tokens.add(sampled)
        play.texts.append(sampled.text)
        step = EpisodeStep(pending, sampled.text, tools=(first.tools or None) if k == 0 else None)
        result: StepResult = await asyncio.wait_for(session.step(sampled.text),
                                                    play.remaining(play.limits.step_timeout_s))
        step.reward, step.feedback, step.info = result.reward, result.feedback, dict(result.info)
        play.steps.append(step)
        turn.reward = result.reward
        play.reward += result.reward or 0.0
        play.info.update(result.info)
        if result.done:
            return result.status
        pending = result.messages
    return "truncated_turns"
