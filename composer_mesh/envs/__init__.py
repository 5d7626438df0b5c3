"""Environments: prompt sets that bring their own scoring from an outside library (reasoning-gym, OpenEnv,
verifiers), or built in and played as tool-using episodes (the calculator and coding tasks).

An environment (`run.environment`) gives the controller's prompt source a train stream and a fixed eval set of
`DataRow`s that share no question, and puts in each row's `extra` what its reward function needs, so the
rewarder is configured with a function path alone. `load_environment` imports the library only when a run
uses it; `composer_mesh.envs.config` holds the section and stays import-cheap.
"""

from __future__ import annotations

from composer_mesh.envs.base import Environment, EnvironmentConfigError, EnvironmentStateError
from composer_mesh.envs.config import EnvironmentConfig
from composer_mesh.tasks.data import DataRow

__all__ = ["Environment", "EnvironmentConfigError", "EnvironmentStateError", "load_environment",
           "sample_environment_rows"]


def load_environment(cfg: EnvironmentConfig, seed: int) -> Environment:
    """The environment of `run.environment` (`seed`: run.seed, used unless the section sets its own). Builds
    the eval set now, so a bad dataset name or config stops the run before any work; for coding, checks that
    the sandbox runs here (`SandboxUnavailable`)."""
    if cfg.kind == "reasoning_gym":
        from composer_mesh.envs.reasoning_gym import ReasoningGymEnvironment

        return ReasoningGymEnvironment(cfg, cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "openenv" and cfg.episodes:
        from composer_mesh.envs.openenv_session import OpenEnvEpisodes

        return OpenEnvEpisodes(cfg, cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "openenv":
        from composer_mesh.envs.openenv import OpenEnvEnvironment

        return OpenEnvEnvironment(cfg, cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "verifiers":
        from composer_mesh.envs.verifiers_agent import VerifiersEpisodes

        return VerifiersEpisodes(cfg, cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "calculator":
        from composer_mesh.envs.calculator import CalculatorEnvironment

        return CalculatorEnvironment(cfg, cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "coding":
        from composer_mesh.envs.coding.environment import CodingEnvironment

        coding = CodingEnvironment(cfg, cfg.seed if cfg.seed is not None else seed)
        coding.check()  # no bubblewrap here: one line (SandboxUnavailable) now, not an error in every episode
        return coding
    raise ValueError(f"run.environment: unknown kind {cfg.kind!r}")


def sample_environment_rows(cfg: EnvironmentConfig, seed: int, n: int) -> list[DataRow] | None:
    """A few train prompts of `run.environment`, drawn cheaply for the check before launch (dataset name,
    config, the tokenizer reading them); None for kinds whose prompts need a server or a whole environment
    built (openenv, verifiers): those are checked when the run starts."""
    if cfg.kind == "reasoning_gym":
        from composer_mesh.envs.reasoning_gym import sample_rows

        return sample_rows(cfg, cfg.seed if cfg.seed is not None else seed, n)
    if cfg.kind == "calculator":
        from composer_mesh.envs.calculator import sample_rows as calculator_rows

        return calculator_rows(cfg, cfg.seed if cfg.seed is not None else seed, n)
    if cfg.kind == "coding":  # the rows alone: the sandbox is checked when the run builds the environment
        from composer_mesh.envs.coding.environment import sample_rows as coding_rows

        return coding_rows(cfg.seed if cfg.seed is not None else seed, n)
    return None
