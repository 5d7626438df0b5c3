"""The interfaces each role's binding implements (plain classes, no Monarch).

Actors own one backend each and delegate every endpoint to it. A binding class also carries
`Settings` (its pydantic settings model) and `capabilities` (see `composer_mesh.bindings`).
`model` below is the topology's policy `ModelConfig` (`composer_mesh.models.config`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from pydantic import BaseModel

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    TeacherTrace,
    TokenDistribution,
)
from composer_mesh.actors.teacher_topk import TopK


@runtime_checkable
class GeneratorBackend(Protocol):
    """Samples completions with per-token log-probs and swaps in new weights between requests (or between
    decode steps, for a backend whose `in_flight_updates` is True)."""

    Settings: ClassVar[type[BaseModel]]

    def start(self, model: Any) -> None:
        """Build/load the policy model described by `model` (a ModelConfig). Called once."""

    def generate(self, request: GenerationRequest, weight_version: int) -> list[RolloutGroup]:
        """One group per prompt, `request.samples_per_prompt` rollouts each, stamped with `weight_version`.

        Optional: a backend that can take weights mid-request has a property `in_flight_updates` (True when
        enabled) and accepts `generate(request, weight_version, refresh=...)`. `refresh() -> int` is then
        called between decode steps (it may call `load_weights` from inside `generate`, on the same thread) and
        returns the version now active; each rollout gets `token_versions` (the version that produced each
        token) and `weight_version` = the oldest of them. Callers pass `refresh` only to such backends."""

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the tensors `load_weights` accepts (the trainer's state-dict names)."""

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace the policy weights (already complete and consistent)."""


@runtime_checkable
class TeacherBackend(Protocol):
    """Supplies channel-2 distributions over the student's tokens and/or channel-3 traces. Async, batched."""

    Settings: ClassVar[type[BaseModel]]
    capabilities: ClassVar[frozenset[str]]  # subset of {"distill", "replay"}

    def start(self, student_model: Any, name: str) -> None:
        """Prepare; `student_model` (ModelConfig) gives the student's tokenizer for ids/retokenising."""

    async def distributions(self, rollouts: list[Rollout], top_k: TopK) -> list[TokenDistribution]:
        """One distribution per rollout over its completion tokens (only with capability "distill"). `top_k`
        ("auto", 0 = dense, or k) is resolved by the teacher against the student's vocabulary
        (`teacher_topk.resolve_top_k`)."""

    async def traces(self, prompts: list[Prompt], max_new_tokens: int, seed: int | None = None) -> list[TeacherTrace]:
        """One full completion per prompt (only with capability "replay"). A sampling teacher seeds the call with
        `seed` when given (the loop derives it from the prompts' place in the run, so traces do not depend on
        the order calls arrive in), else with its own call counter."""

    def usage(self) -> dict[str, float]:
        """Cumulative counters (tokens, cost, requests, failures) for the run's metrics."""


@runtime_checkable
class RewardBackend(Protocol):
    Settings: ClassVar[type[BaseModel]]

    def score(self, prompt: Prompt, rollout: Rollout) -> RewardResult:
        """Never raises for a grader failure: returns `RewardResult(ok=False, error=...)`."""
