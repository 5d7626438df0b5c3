"""What the generator actor needs of its binding (a plain class, no Monarch): `GeneratorBackend`.

The actor owns one backend and delegates every endpoint to it. A binding class also carries `Settings` (its
pydantic settings model) and `capabilities` (see `composer_mesh.bindings`). `model` below is the topology's
policy `ModelConfig` (`composer_mesh.models.config`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from pydantic import BaseModel

from composer_mesh.actors.messages import GenerationRequest, RolloutGroup


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

    # Optional (capability "self_teacher"): `distributions(request: SelfTeacherRequest) -> list[TokenDistribution]`,
    # the active weights' distributions over each continuation given its prompt (targeted feedback's teacher).

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the tensors `load_weights` accepts (the trainer's state-dict names)."""

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace the policy weights (already complete and consistent)."""
