"""Every message that crosses an actor boundary.

Plain dataclasses: Monarch pickles them between our own processes. Token data are lists of ints/floats
(small, per request); dense per-token distributions are tensors. Nothing of model size travels here:
weights go over the weight plane (`composer_mesh.mesh.weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from composer_mesh.actors.teacher_topk import AUTO, TopK
from composer_mesh.tasks.episode import EPISODE_STATUSES, EpisodeStatus


@dataclass
class Prompt:
    """One task instance. `answer` is what verifiable rewards check against (may be None).

    `messages` ([{"role", "content"}, ...]) makes it a chat prompt: local models see it through their
    tokenizer's chat template (`composer_mesh.models.chat`), hosted ones get it as is. `extra` holds further
    dataset columns, passed through to rewards.
    """

    prompt_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)  # empty: the model's tokenizer encodes text (or messages)
    answer: str | None = None
    messages: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Agentic prompts: JSON schemas of the tools declared to the chat template when `messages` are rendered.
    tools: list[dict[str, Any]] | None = None
    # A turn of an episode: `token_ids` are the exact conversation so far; these environment messages (tool
    # results, a user turn) are rendered by the model's chat template as the suffix that bridges from the last
    # assistant turn to the next one, and appended to `token_ids` (`models.chat.bridge_token_ids`).
    bridge_messages: list[dict[str, Any]] | None = None
    # A turn of an episode: the lengths of its earlier turns' prompts (prefixes of `token_ids`). A generator with
    # a prefix cache prefills in chunks that end there, cached or not: a hit skips the chunks a miss would run.
    prefix_lengths: list[int] | None = None


@dataclass
class GenerationRequest:
    prompts: list[Prompt]
    samples_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    # One seed per prompt (samples_per_prompt must be 1): a batch of episodes' turns keeps each turn's seed
    # whatever else is in the request. None: row i samples with `seed + i`.
    seeds: list[int] | None = None


@dataclass
class Turn:
    """One span `[start, end)` of an episode's `completion_ids`: sampled by the policy, or added by the
    environment (tool results, user turns, the chat template's bridge between them).

    `weight_version` is the oldest weights that sampled a policy turn (None for environment spans); `reward` a
    per-turn reward the environment gave after the turn (None: none)."""

    start: int
    end: int
    policy: bool
    weight_version: int | None = None
    reward: float | None = None


def turn_mask(turns: list[Turn] | None, length: int) -> list[int]:
    """1 on the tokens of policy turns, 0 on the environment's; all 1 without turns (a single completion)."""
    if turns is None:
        return [1] * length
    mask = [0] * length
    for t in turns:
        if t.policy:
            mask[t.start : t.end] = [1] * (t.end - t.start)
    return mask


@dataclass
class Rollout:
    """One sampled completion with the sampling policy's per-token log-probs.

    `weight_version` is the OLDEST weight version that produced any of its tokens: a rollout's policy lag counts
    from it. `token_versions[t]` is the version that produced token t, given by generators that can take new weights
    while a request runs (in-flight weight updates); None from those that cannot (one version made every token).
    """

    prompt_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int
    text: str = ""
    finish_reason: str = "length"
    generator: str = ""
    token_versions: list[int] | None = None
    # An episode: the spans of `completion_ids` in order (policy turns and environment additions; the
    # environment's tokens carry log-prob 0.0 and are never trained on). None: one policy turn, a completion.
    turns: list[Turn] | None = None
    status: EpisodeStatus = "done"
    # An episode whose conversation was rewritten (a summary replaced earlier turns, a tool result was cut) is
    # several rollouts, one per prefix chain: `segment` k of the episode `episode_id` (unique within its group).
    # They share the episode's reward and status, and GRPO counts the episode once (`loss.grpo.
    # episode_advantages`). None: the rollout is its episode whole (or a single completion).
    episode_id: str | None = None
    segment: int = 0

    def __post_init__(self) -> None:
        if self.status not in EPISODE_STATUSES:
            raise ValueError(f"Rollout {self.prompt_id!r}: status {self.status!r} is not one of {EPISODE_STATUSES}")
        if self.segment < 0 or (self.segment > 0 and self.episode_id is None):
            raise ValueError(f"Rollout {self.prompt_id!r}: segment {self.segment} needs an episode_id and must be >= 0")
        if self.turns is not None:
            check_turns(self)
        if len(self.completion_ids) != len(self.logprobs):
            raise ValueError(
                f"Rollout {self.prompt_id!r}: completion_ids has {len(self.completion_ids)} tokens "
                f"but logprobs has {len(self.logprobs)}"
            )
        if self.token_versions is not None:
            if len(self.token_versions) != len(self.completion_ids):
                raise ValueError(
                    f"Rollout {self.prompt_id!r}: token_versions has {len(self.token_versions)} entries "
                    f"for {len(self.completion_ids)} tokens"
                )
            if self.token_versions and min(self.token_versions) != self.weight_version:
                raise ValueError(
                    f"Rollout {self.prompt_id!r}: weight_version {self.weight_version} is not the oldest of "
                    f"token_versions (min {min(self.token_versions)})"
                )

    def loss_mask(self) -> list[int]:
        """1 on every policy token of `completion_ids`, 0 on the environment's (all 1 for a completion)."""
        return turn_mask(self.turns, len(self.completion_ids))

    @property
    def policy_tokens(self) -> int:
        return sum(self.loss_mask())

    @property
    def opens_episode(self) -> bool:
        """Whether this rollout is the first (or only) segment of its episode: what counts an episode once."""
        return self.segment == 0


def check_turns(r: Rollout) -> None:
    """Turns tile `completion_ids` from 0 in order; policy turns carry versions no older than the rollout's."""
    assert r.turns is not None
    at = 0
    for i, t in enumerate(r.turns):
        if t.start != at or t.end < t.start:
            raise ValueError(f"Rollout {r.prompt_id!r}: turn {i} spans [{t.start}, {t.end}), expected to start at {at}")
        if t.policy and t.weight_version is not None and t.weight_version < r.weight_version:
            raise ValueError(f"Rollout {r.prompt_id!r}: turn {i} has weight_version {t.weight_version}, older than "
                             f"the rollout's {r.weight_version} (the oldest turn's)")
        at = t.end
    if at != len(r.completion_ids):
        raise ValueError(f"Rollout {r.prompt_id!r}: turns cover {at} of {len(r.completion_ids)} completion tokens")


@dataclass
class RolloutGroup:
    """All samples for one prompt: GRPO normalises advantages within a group."""

    prompt: Prompt
    rollouts: list[Rollout]

    @property
    def weight_version(self) -> int:
        return min(r.weight_version for r in self.rollouts)


@dataclass
class RewardResult:
    """Score of one rollout. A grader failure is data (`ok=False`, `error`), never an exception."""

    score: float
    ok: bool = True
    error: str | None = None
    components: dict[str, float] = field(default_factory=dict)


@dataclass
class ScoreRequest:
    groups: list[RolloutGroup]


@dataclass
class ScoredGroup:
    group: RolloutGroup
    rewards: list[RewardResult]

    def __post_init__(self) -> None:
        if len(self.rewards) != len(self.group.rollouts):
            raise ValueError(
                f"group {self.group.prompt.prompt_id!r}: {len(self.rewards)} rewards for "
                f"{len(self.group.rollouts)} rollouts"
            )


@dataclass
class TokenDistribution:
    """A teacher's per-token distribution over the student's completion tokens (channel 2).

    Either dense `logits` [T, V] in the student's vocabulary, or sparse top-k: `topk_ids` [T, k] (student
    vocabulary ids) with `topk_logprobs` [T, k]. Only teachers that share the student's tokenizer can give it.
    Row t is completion token `offset + t`: a teacher that scores only the tokens after some point (the policy
    conditioned on a hint inserted there, `orchestration/rollout/hints.py`) covers `completion_ids[offset:]`, and
    only those tokens are distilled.
    """

    teacher: str
    logits: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        dense = self.logits is not None
        sparse = self.topk_ids is not None or self.topk_logprobs is not None
        if dense == sparse:
            raise ValueError(f"TokenDistribution from {self.teacher!r}: give either logits or top-k, not both/neither")
        if sparse and (self.topk_ids is None or self.topk_logprobs is None
                       or self.topk_ids.shape != self.topk_logprobs.shape):
            raise ValueError(f"TokenDistribution from {self.teacher!r}: topk_ids and topk_logprobs must match in shape")
        if self.offset < 0:
            raise ValueError(f"TokenDistribution from {self.teacher!r}: offset {self.offset} is negative")

    @property
    def num_tokens(self) -> int:
        t = self.logits if self.logits is not None else self.topk_ids
        assert t is not None
        return int(t.shape[0])


@dataclass
class TeacherTrace:
    """A full teacher completion for one prompt (channel 3: chosen = teacher, rejected = student).

    `completion_ids` are in the student's vocabulary (re-tokenised from `text` when the teacher's tokenizer differs).
    A trace with a `reward` makes a replay pair only when it scores above the student rollout it would be
    preferred to (None: not scored, always paired).
    """

    teacher: str
    prompt_id: str
    text: str
    completion_ids: list[int]
    reward: float | None = None  # the rewarder's score of `text`; a replay pair needs it above the rejected's
    # A teacher's episode (it played the same task): the spans of `completion_ids`; only its policy turns are
    # trained on. None: one completion.
    turns: list[Turn] | None = None
    # The ids the teacher continued from, filled by local teachers that share the student's tokenizer (empty: a
    # teacher that re-tokenises, e.g. OpenRouter). Episodes need them token in, token out: a teacher's episode
    # holds its opening conversation here, and each of its turns is found in the conversation by them.
    prompt_ids: list[int] = field(default_factory=list)
    # A turn of a teacher that plays at the message level (a hosted model): the turn as a chat message (`content`,
    # OpenAI `tool_calls`), which the episode's next request carries back; `prompt_ids` and `completion_ids` are
    # then the conversation and the turn rendered by the student's chat template (`prompt_ids` empty: the template
    # cannot render the turn as a continuation of the conversation, and the episode is not trained on).
    message: dict[str, Any] | None = None
    # What this trace cost its teacher (`prompt_tokens`, `completion_tokens` in its own tokenizer; `cost` in USD as
    # its provider reports it); a teacher's episode sums its turns'. Empty: not counted.
    usage: dict[str, float] = field(default_factory=dict)

    def loss_mask(self) -> list[int]:
        """1 on the teacher's own tokens, 0 on the environment's (all 1 for a completion)."""
        return turn_mask(self.turns, len(self.completion_ids))


@dataclass
class TeacherRequest:
    """Ask the pool for channel-2 distributions over `rollouts` and/or channel-3 traces for `prompts`."""

    rollouts: list[Rollout] = field(default_factory=list)
    prompts: list[Prompt] = field(default_factory=list)
    top_k: TopK = AUTO  # "auto" (dense for small student vocabularies, else top-k), 0 = dense, k > 0 = top-k;
    # each teacher resolves it with `teacher_topk.resolve_top_k` against the student's vocabulary
    max_new_tokens: int = 16
    seed: int | None = None  # seeds the teachers' trace sampling (None: each teacher's own call counter)
    # One seed per prompt (a teacher's episode turns, like `GenerationRequest.seeds`): prompt i's trace samples
    # with `seeds[i]` whatever else shares the request (local teachers; hosted ones sample as they do). None: `seed`.
    seeds: list[int] | None = None
    # Only these replay teachers answer (by member name; None: every replay member). Distributions are unaffected.
    teachers: list[str] | None = None


@dataclass
class SelfTeacherRequest:
    """Ask a generator for the current policy's distributions over `continuations[i]` (student token ids) given
    `prompts[i]`, which the generator renders as it renders a turn's prompt (chat `messages` and `tools`, or the
    exact `token_ids` plus `bridge_messages`). Targeted feedback: the prompt is an episode's conversation with a
    hint inserted, the continuation the student's own tokens after that point (`orchestration/rollout/hints.py`).
    `top_k` follows channel 2's rules (`teacher_topk.resolve_top_k` against the policy's vocabulary)."""

    prompts: list[Prompt]
    continuations: list[list[int]]
    top_k: TopK = AUTO

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.continuations):
            raise ValueError(f"SelfTeacherRequest: {len(self.prompts)} prompts for {len(self.continuations)} "
                             "continuations")


@dataclass
class TeacherSignals:
    """The pool's answer: `distributions[i]` belongs to `request.rollouts[i]` (None: no teacher could give one)."""

    distributions: list[TokenDistribution | None] = field(default_factory=list)
    traces: list[TeacherTrace] = field(default_factory=list)
    usage: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainBatch:
    """What the trainer needs for one optimizer step. Channels switch off when their inputs are absent."""

    groups: list[ScoredGroup]
    distributions: list[TokenDistribution | None] = field(default_factory=list)  # aligned with flat rollouts
    traces: list[TeacherTrace] = field(default_factory=list)

    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.group.rollouts]


@dataclass
class WeightVersion:
    """A generator's answer to `update_weights`: the version it holds and how its weights arrive (`transport`:
    what moves the bytes, e.g. 'shm' or 'rdma_tcp'; `reason`: why it was chosen; `fallback`: slower than this
    generator should get), so the controller can report the transport of every generator."""

    version: int
    num_params: int = 0
    num_bytes: int = 0
    generator: str = ""
    transport: str = ""
    reason: str = ""
    fallback: bool = False


@dataclass
class TrainMetrics:
    step: int
    weight_version: int
    loss: float
    channels: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    states_written: list[str] = field(default_factory=list)  # full-state writes finished since the last step
