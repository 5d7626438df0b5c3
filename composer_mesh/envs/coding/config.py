"""`run.environment` for the coding tasks (kind: coding). Import-cheap (pydantic only)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from composer_mesh.sandbox.config import SandboxConfig


class CodingConfig(BaseModel):
    """Coding episodes: the shipped tasks (`envs/coding/catalog.py`; eval tasks held out), their tools run in
    `sandbox`. See docs/sandbox.md."""

    model_config = ConfigDict(extra="forbid")
    plays_episodes: ClassVar[bool] = True  # its prompts are played as episodes (run.rollout.kind: multi_turn)

    kind: Literal["coding"] = Field(description="Which environment: 'coding'.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Where tool calls run code.")
    max_turns: int = Field(8, ge=1, description="Policy turns per episode; the last one is graded as if it "
                           "submitted (status truncated_turns).")
    max_calls_per_turn: int = Field(8, ge=1, description="Tool calls run per policy turn; the rest are answered "
                                    "with an error.")
    seed: int | None = Field(None, ge=0, description="Seed of the train stream's per-epoch shuffle of the train "
                             "tasks; null: run.seed.")
