"""What the teacher pool needs of each member's binding (a plain class, no Monarch): `TeacherBackend`.

The pool owns one backend per member and delegates to it. A binding class also carries `Settings` (its pydantic
settings model) and `capabilities` (see `composer_mesh.bindings`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel

from composer_mesh.actors.messages import Prompt, Rollout, TeacherTrace, TokenDistribution
from composer_mesh.actors.teacher_topk import TopK


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

    async def traces(self, prompts: list[Prompt], max_new_tokens: int, seed: int | None = None,
                     seeds: list[int] | None = None) -> list[TeacherTrace]:
        """One full completion per prompt (only with capability "replay"). A sampling teacher seeds the call with
        `seed` when given (the loop derives it from the prompts' place in the run, so traces do not depend on
        the order calls arrive in), else with its own call counter. `seeds` (one per prompt; the pool passes it
        only when a request has it: a teacher's episode turns) seeds prompt i alone. A teacher that continues
        the student's exact ids sets each trace's `prompt_ids` (what episodes need to be played by it)."""

    def usage(self) -> dict[str, float]:
        """Cumulative counters (tokens, cost, requests, failures) for the run's metrics."""
