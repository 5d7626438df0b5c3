"""Playing one episode: policy turns sampled token-in/token-out, the environment's answers between them.

Token consistency is the point of this module. The first turn is the prompt's messages through the chat
template (rendered by the generator); every later turn sends the exact ids of the conversation so far plus the
environment's new messages (`Prompt.bridge_messages`), which the generator renders as the template's suffix
bridging to the next assistant turn and appends. The returned `prompt_ids` must start with the ids sent: an
episode whose tokens drifted raises `TokenDrift` rather than training on ids the policy never saw. The episode
is one `Rollout`: `prompt_ids` = the opening conversation, `completion_ids` = every later token, with `turns`
marking the policy's spans (trained on) and the environment's (log-prob 0.0, never trained on).

An environment that rewrites the conversation (`StepResult.rewrite`: a summary in place of earlier turns, a tool
result cut short) breaks the prefix: the next turn is rendered fresh from the new messages, like the opening, and
starts a new segment. The episode is then one `Rollout` per segment, each a prefix chain with exact log-probs,
marked with the episode's id (`Rollout.episode_id`, `segment`) and sharing its reward and status.
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
    (one per policy turn the environment answered). An episode whose environment rewrote the conversation is
    several segments (`StepResult.rewrite`): `rollout` is the last, `earlier` the ones before it, in order."""

    rollout: Rollout
    reward: float
    info: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    steps: list[EpisodeStep] = field(default_factory=list)
    earlier: list[Rollout] = field(default_factory=list)

    @property
    def segments(self) -> list[Rollout]:
        """Every training sample of the episode, in order (one unless the conversation was rewritten)."""
        return [*self.earlier, self.rollout]

    def reward_result(self) -> RewardResult:
        """The episode's score as the trainer takes it. An environment that failed gave no reward: the episode is
        a failed score (`ok` false, reward 0), counted in the step's reward failures."""
        turns = sum(t.policy for r in self.segments for t in r.turns or [])
        components = {**self.info, "turns": float(turns)}
        if self.rollout.status == "error_environment":
            return RewardResult(0.0, ok=False, error=self.error or "the environment failed", components=components)
        return RewardResult(self.reward, components=components)


@dataclass
class Segment:
    """One prefix chain of an episode: the ids its first turn was sampled from (`prompt_ids`) and every later
    token, with the spans that say whose each token is."""

    prompt_ids: list[int]
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    generators: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def span(self, ids: list[int], logprobs: list[float], version: int | None) -> Turn:
        turn = Turn(len(self.completion), len(self.completion) + len(ids), policy=version is not None,
                    weight_version=version)
        self.completion += ids
        self.logprobs += logprobs
        self.turns.append(turn)
        return turn

    def rollout(self, prompt: Prompt, status: EpisodeStatus, text: str, episode_id: str | None,
                index: int) -> Rollout:
        versions = [t.weight_version for t in self.turns if t.policy and t.weight_version is not None]
        return Rollout(prompt_id=prompt.prompt_id, prompt_ids=list(self.prompt_ids),
                       completion_ids=list(self.completion), logprobs=list(self.logprobs),
                       weight_version=min(versions, default=0), text=text, finish_reason="stop",
                       generator=",".join(dict.fromkeys(self.generators)), turns=list(self.turns), status=status,
                       episode_id=episode_id, segment=index)


class EpisodeTokens:
    """An episode's token ids as they grow, with the spans that say whose each token is: one `Segment` per
    prefix chain (a rewritten conversation, `rewrite`, starts the next)."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self._fresh = True  # the next turn opens a segment (the first turn, or one after a rewrite)

    def conversation(self) -> list[int]:
        """The current segment's ids so far (what the next bridged turn continues)."""
        if not self.segments:
            return []
        current = self.segments[-1]
        return [*current.prompt_ids, *current.completion]

    def prompt_lengths(self) -> list[int]:
        """The length of each policy turn's prompt in the current segment (the conversation before its tokens)."""
        if not self.segments:
            return []
        current = self.segments[-1]
        return [len(current.prompt_ids) + t.start for t in current.turns if t.policy]

    def rewrite(self) -> None:
        """The conversation was rewritten: the next turn starts a new segment from the ids it was sampled from."""
        self._fresh = True

    def add(self, sampled: Rollout) -> Turn:
        """A sampled turn: the environment's bridge (what the generator appended to the conversation), then the
        policy's tokens; or, opening a segment, the ids the turn was sampled from as the segment's prompt."""
        if self._fresh:
            self.segments.append(Segment(list(sampled.prompt_ids)))
            self._fresh = False
        else:
            sent = self.conversation()
            if sampled.prompt_ids[: len(sent)] != sent:
                raise TokenDrift(f"episode {sampled.prompt_id!r}: the generator's prompt for turn "
                                 f"{len(self.policy_turns())} does not start with the conversation's exact ids")
            self.segments[-1].span(sampled.prompt_ids[len(sent):], [0.0] * (len(sampled.prompt_ids) - len(sent)),
                                   None)
        current = self.segments[-1]
        current.generators.append(sampled.generator)
        current.texts.append(sampled.text)
        return current.span(sampled.completion_ids, sampled.logprobs, sampled.weight_version)

    def policy_turns(self) -> list[Turn]:
        """Every segment's policy turns, in order (turn k of the episode samples with its seed + k * stride)."""
        return [t for s in self.segments for t in s.turns if t.policy]

    def rollouts(self, prompt: Prompt, status: EpisodeStatus, episode_id: str,
                 text: Callable[[list[str]], str] = "".join) -> list[Rollout]:
        """One rollout per segment, each with `status` and its turns' texts through `text`; segments of an
        episode of several are marked `episode_id`. An episode that played no turn is one empty rollout."""
        if not self.segments:
            return [Segment([]).rollout(prompt, status, "", None, 0)]
        shared = episode_id if len(self.segments) > 1 else None
        return [s.rollout(prompt, status, text(s.texts), shared, k) for k, s in enumerate(self.segments)]


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
    reward: float = 0.0
    steps: list[EpisodeStep] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # the opening's, declared again when a rewrite is rendered fresh

    def remaining(self, cap: float | None = None) -> float | None:
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        return cap if left is None else (left if cap is None else min(cap, left))

    def fits(self, pending: list[Message], fresh: bool) -> bool:
        so_far = 0 if fresh else len(self.tokens.conversation())
        need = so_far + bridge_bound(pending) + self.limits.max_new_tokens
        return self.limits.max_context is None or need <= self.limits.max_context

    def turn_prompt(self, pending: list[Message], fresh: bool) -> Prompt:
        """The next turn's prompt: `pending` rendered fresh with the tools (the opening, or a rewritten
        conversation: a new segment), or bridged onto the exact ids of the conversation so far."""
        p = self.prompt
        if fresh:
            return Prompt(p.prompt_id, p.text, answer=p.answer, messages=pending, extra=p.extra, tools=self.tools)
        return Prompt(p.prompt_id, "", token_ids=self.tokens.conversation(), bridge_messages=pending,
                      answer=p.answer, extra=p.extra, prefix_lengths=self.tokens.prompt_lengths())


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
    *earlier, last = play.tokens.rollouts(prompt, status, f"{prompt.prompt_id}/{seed}")
    return Episode(last, play.reward, dict(play.info), error, play.steps, earlier)


async def _turns(session: EnvSession, play: _Play, sample: TurnSampler) -> EpisodeStatus:
    first = await asyncio.wait_for(session.reset(), play.remaining(play.limits.step_timeout_s))
    play.tools = first.tools or None
    pending: list[Message] = first.messages
    fresh = True  # the next turn opens a segment: the opening, or a rewritten conversation
    for k in range(play.limits.max_turns):
        if k > 0 and not play.fits(pending, fresh):
            return "truncated_context"
        sampled = await asyncio.wait_for(sample(play.turn_prompt(pending, fresh), play.seed + k * TURN_SEED_STRIDE),
                                         play.remaining())
        turn = play.tokens.add(sampled)
        step = EpisodeStep(pending, sampled.text, tools=play.tools if fresh else None)
        result: StepResult = await asyncio.wait_for(session.step(sampled.text),
                                                    play.remaining(play.limits.step_timeout_s))
        step.reward, step.feedback, step.info = result.reward, result.feedback, dict(result.info)
        play.steps.append(step)
        turn.reward = result.reward
        play.reward += result.reward or 0.0
        play.info.update(result.info)
        if result.done:
            return result.status
        pending, fresh = next_messages(result), result.rewrite is not None
        if fresh:
            play.tokens.rewrite()
    return "truncated_turns"


def next_messages(result: StepResult) -> list[Message]:
    """What the next turn is sampled after: the environment's new messages, after its rewritten conversation
    when it gave one (which must leave something to render)."""
    if result.rewrite is None:
        return result.messages
    messages = [*result.rewrite, *result.messages]
    if not messages:
        raise ValueError("StepResult.rewrite is empty and no messages follow it: nothing to sample the next turn "
                         "after")
    return messages
