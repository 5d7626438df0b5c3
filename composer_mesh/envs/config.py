"""`run.environment`: prompts and scoring from an environment library (reasoning-gym), in one typed section.

Import-cheap (pydantic only): topology validation imports it without torch, Monarch or the library itself
(only whether the library is installed is checked here; the dataset name and its config are checked when the
run builds its prompt source, which imports the library).

Why one section under `run:`: the prompt source is the run's (`run.task`, `run.data`), and everything the
reward function needs travels with each prompt (`Prompt.extra`), so the rewarder section names only the
function and the dataset's settings are written once.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# reasoning-gym seeds entry i of a dataset with `seed + i`: eval entries use seeds train entries never reach.
EVAL_SEED_OFFSET = 10**9
MAX_SIZE = 10**8  # so `seed + index` of a train entry stays below the eval seeds


def library_missing(module: str, extra: str) -> str:
    """The error for an environment whose library is not installed, naming the extra that installs it."""
    return f"run.environment needs the {module!r} package: pip install 'composer-mesh[{extra}]'"


class ReasoningGymConfig(BaseModel):
    """A reasoning-gym dataset as the run's prompts, scored by the library's own `score_answer`.

    reasoning-gym (https://github.com/open-thought/reasoning-gym) generates entries procedurally and offline; the
    reward function is `composer_mesh.envs.reasoning_gym:score`. See docs/reasoning_gym.md."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reasoning_gym"] = Field(description="Which environment library: 'reasoning_gym'.")
    dataset: str = Field(min_length=1, description="A reasoning-gym dataset name, e.g. 'basic_arithmetic', "
                         "'leg_counting', 'chain_sum' (`reasoning_gym.factory.DATASETS` lists them).")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The dataset's config fields (its config dataclass, e.g. {min_terms: 2, "
        "max_digits: 1}); `seed` and `size` are set by this section."
    )
    size: int = Field(10_000, ge=1, le=MAX_SIZE, description="Train entries (indices 0..size-1 of the train seed), "
                      "generated when drawn, in index order; the stream starts over after the last.")
    eval_size: int = Field(64, ge=0, description="Distinct held-out questions (from their own seed; train entries "
                           "asking one of them are skipped). run.eval_prompts scores the first ones.")
    seed: int | None = Field(None, ge=0, description="Seed of the train entries (eval: seed + 10^9); null: run.seed.")
    system_prompt: str | None = Field(
        "default", description="A system message before each question: a name of reasoning-gym's SYSTEM_PROMPTS "
        "('default', 'DeepSeekZero', 'simple', 'direct', 'chain_of_draft'; they ask for the final answer in "
        "<answer></answer> tags) or the text itself; null: none (the question alone, e.g. for a tiny model)."
    )

    @field_validator("kind")
    @classmethod
    def _installed(cls, v: str) -> str:
        if importlib.util.find_spec("reasoning_gym") is None:
            raise ValueError(library_missing("reasoning_gym", "reasoning-gym"))
        return v

    @field_validator("config")
    @classmethod
    def _no_seed_or_size(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted({"seed", "size"} & set(v))
        if taken:
            raise ValueError(f"set {', '.join(taken)} as run.environment.{taken[0]} (the section's own field), "
                             "not inside run.environment.config")
        try:  # it travels with every prompt (Prompt.extra) to the reward function
            json.dumps(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"run.environment.config must hold JSON values only: {e}") from None
        return v


# The `run.environment` section: one model per environment kind (a discriminated union once there are two).
EnvironmentConfig = ReasoningGymConfig
