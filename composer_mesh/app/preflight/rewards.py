"""The `python` rewarder's functions called once on a sample prompt of the run, before launch: a function that
raises, hangs or returns the wrong type (a TRL-style function under the per-rollout signature, say) is named here,
not found as a failed reward on every rollout of every step."""

from __future__ import annotations

from composer_mesh.actors.messages import Prompt
from composer_mesh.app.preflight.errors import PreflightError
from composer_mesh.topology.schema import Topology


class RewardPreflightError(PreflightError):
    """Reward functions that fail on a sample prompt of the run (one per line, each naming the function)."""


def check_rewards(topology: Topology, sample: Prompt | None = None) -> None:
    """Call each of the `python` rewarder's functions once on `sample` (the preflight passes the first prompt
    its prompt check read; else the run's first train prompt), in a worker process with its timeout
    (`check_reward_functions`), so a function that raises, hangs or returns the wrong type is named before
    launch, not found as a failure on every rollout. Skipped without a rewarder (a multi-turn run: its
    environment scores), for an OpenEnv environment (scoring replays episodes on its server) and when the prompts
    cannot be read (the data checks name that)."""
    from composer_mesh.actors.backends.rewards.config import PythonRewarderSettings

    if topology.rewarder is None:
        return
    settings = topology.rewarder.bound().settings
    env = topology.run.environment
    if not isinstance(settings, PythonRewarderSettings) or not settings.functions or (env and env.kind == "openenv"):
        return
    from composer_mesh.actors.backends.rewards.rewards import check_reward_functions

    sample = sample or _first_prompt(topology)
    if sample is None:
        return
    problems = check_reward_functions(settings, sample)
    if problems:
        raise RewardPreflightError("reward functions fail on a sample prompt of the run:\n  " + "\n  ".join(problems))


def _first_prompt(topology: Topology) -> Prompt | None:
    """The run's first train prompt, read from its source (None when the source cannot be read: the data
    checks, or the run itself, name that)."""
    from composer_mesh.orchestration.prompts import prompt_source

    try:
        source = prompt_source(topology.run)
    except Exception:  # a data problem: reported by the data checks, or by the run itself
        return None
    try:
        [sample] = source.take(1)
    finally:
        source.close()
    return sample
