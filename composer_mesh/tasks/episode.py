"""How an episode ended: one vocabulary for the messages (`Rollout.status`), the environments that end episodes
and the metrics that count them. A single completion is an episode of one turn that is "done"."""

from __future__ import annotations

from typing import Literal

EpisodeStatus = Literal[
    "done",  # the environment ended it (an answer given, a task submitted)
    "truncated_turns",  # max_turns policy turns were taken
    "truncated_context",  # the next turn would not fit the model's context
    "truncated_time",  # the episode's wall-clock budget ran out
    "error_parse",  # the environment could not read the policy's turn and ends episodes on it
    "error_tool",  # a tool failed in a way that ends the episode (a dead sandbox)
    "error_timeout",  # one environment step took longer than its timeout
    "error_environment",  # the environment itself failed (an exception, a dead server)
]
EPISODE_STATUSES: tuple[str, ...] = EpisodeStatus.__args__  # type: ignore[attr-defined]
