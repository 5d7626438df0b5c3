"""Environments: prompt sets that bring their own scoring from an outside library (reasoning-gym, OpenEnv,
verifiers).

An environment (`run.environment`) gives the controller's prompt source a train stream and a fixed eval set of
`DataRow`s that share no question, and puts in each row's `extra` what its reward function needs, so the
rewarder is configured with a function path alone. `load_environment` imports the library only when a run
uses it; `composer_mesh.envs.config` holds the section and stays import-cheap.
"""

from __future__ import annotations

from composer_mesh.envs.base import Environment, EnvironmentStateError
from composer_mesh.envs.config import EnvironmentConfig

__all__ = ["Environment", "EnvironmentStateError", "load_environment"]


def load_environment(cfg: EnvironmentConfig, seed: int) -> Environment:
    """The environment of `run.environment` (`seed`: run.seed, used unless the section sets its own). Builds
    the eval set now, so a bad dataset name or config stops the run before any work."""
    if cfg.kind == "reasoning_gym":
        from composer_mesh.envs.reasoning_gym import ReasoningGymEnvironment

        return ReasoningGymEnvironment(cfg, cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "openenv":
        from composer_mesh.envs.openenv import OpenEnvEnvironment

        return OpenEnvEnvironment(cfg, cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "verifiers":
        from composer_mesh.envs.verifiers import VerifiersEnvironment

        return VerifiersEnvironment(cfg, cfg.seed if cfg.seed is not None else seed)
    raise ValueError(f"run.environment: unknown kind {cfg.kind!r}")
