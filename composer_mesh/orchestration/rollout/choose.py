"""Which rollout driver a run uses: `run.rollout.kind` (the built-in loop's and `composer-mesh eval`'s default)."""

from __future__ import annotations

from composer_mesh.errors import UserInputError
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.prompts import PromptSource
from composer_mesh.orchestration.rollout import harness, multi_turn, single_turn
from composer_mesh.orchestration.rollout.base import RolloutFactory


class NoEpisodeEnvironment(UserInputError, ValueError):
    """`run.rollout.kind: multi_turn` with a prompt source that cannot play episodes."""


def rollout_factory(run: RunConfig, prompts: PromptSource) -> RolloutFactory:
    """`single_turn` completions, `multi_turn` episodes against the prompt source's environment, or `harness`
    episodes played by your agent through the OpenAI-compatible endpoint."""
    if run.rollout.kind == "single_turn":
        return single_turn.factory(run)
    if run.rollout.kind == "harness":
        return harness.factory(run, run.rollout.max_context)
    environment = prompts.episode_environment()
    if environment is None:
        raise NoEpisodeEnvironment(
            f"run.rollout.kind is multi_turn but the run's prompts ({prompts.kind}) are not an environment that plays "
            "episodes: set run.environment to one that does (calculator, coding, openenv), see docs/agentic.md")
    return multi_turn.factory(run, environment)
