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
    messages: list[dict[str, str]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationRequest:
    prompts: list[Prompt]
    samples_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None


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

    def __post_init__(self) -> None:
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
    """

    teacher: str
    logits: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        dense = self.logits is not None
        sparse = self.topk_ids is not None or self.topk_logprobs is not None
        if dense == sparse:
            raise ValueError(f"TokenDistribution from {self.teacher!r}: give either logits or top-k, not both/neither")
        if sparse and (self.topk_ids is None or self.topk_logprobs is None
                       or self.topk_ids.shape != self.topk_logprobs.shape):
            raise ValueError(f"TokenDistribution from {self.teacher!r}: topk_ids and topk_logprobs must match in shape")

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


@dataclass
class TeacherRequest:
    """Ask the pool for channel-2 distributions over `rollouts` and/or channel-3 traces for `prompts`."""

    rollouts: list[Rollout] = field(default_factory=list)
    prompts: list[Prompt] = field(default_factory=list)
    top_k: TopK = AUTO  # "auto" (dense for small student vocabularies, else top-k), 0 = dense, k > 0 = top-k;
    # each teacher resolves it with `teacher_topk.resolve_top_k` against the student's vocabulary
    max_new_tokens: int = 16
    seed: int | None = None  # seeds the teachers' trace sampling (None: each teacher's own call counter)


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
    version: int
    num_params: int = 0
    num_bytes: int = 0


@dataclass
class TrainMetrics:
    step: int
    weight_version: int
    loss: float
    channels: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    states_written: list[str] = field(default_factory=list)  # full-state writes finished since the last step
