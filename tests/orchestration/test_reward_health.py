"""The reward-failure stop replayed on step records: a run stops once every rollout's reward failed in
`stop_after` consecutive steps, naming the last error; one scored rollout resets the count; 0 never stops.
(The same stop in a real run, through the CLI: tests/app/test_reward_runs.py.)"""

from __future__ import annotations

import pytest

from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.metrics import StepRecord
from composer_mesh.orchestration.reward_health import RewardHealth, RewardHealthConfig, RewardsFailing

ERROR = "reward function 'reward' raised KeyError: 'solution'"


def record(step: int, failures: int, rollouts: int = 8) -> StepRecord:
    return StepRecord(step=step, weight_version=step + 1, reward=0.0, loss=0.1, channels={}, policy_lag=0,
                      weight_sync_s=0.0, step_s=1.0, dropped_batches=0, rollouts=rollouts, reward_failures=failures,
                      reward_error=ERROR if failures else "")


def test_every_rollout_failing_in_n_consecutive_steps_stops_with_the_function_and_its_error():
    health = RewardHealth(RewardHealthConfig.of(RunConfig(stop_after_failed_reward_steps=3)))
    health.observe(record(1, 8))
    health.observe(record(2, 8))
    with pytest.raises(RewardsFailing) as e:
        health.observe(record(3, 8))
    assert str(e.value) == (f"every rollout's reward failed in 3 consecutive steps (steps 1-3); last error: {ERROR} "
                            "(fix the reward, or set run.stop_after_failed_reward_steps: 0 to train on)")


def test_a_step_with_one_scored_rollout_resets_the_count():
    health = RewardHealth(RewardHealthConfig(stop_after=2))
    for step, failures in enumerate([8, 7, 8, 0, 8, 5, 8], start=1):
        health.observe(record(step, failures))
    with pytest.raises(RewardsFailing, match=r"in 2 consecutive steps \(steps 7-8\)"):
        health.observe(record(8, 8))


def test_zero_never_stops_and_the_default_is_small():
    health = RewardHealth(RewardHealthConfig(stop_after=0))
    for step in range(1, 50):
        health.observe(record(step, 8))
    assert 1 <= RunConfig().stop_after_failed_reward_steps <= 5
    one = RewardHealth(RewardHealthConfig(stop_after=1))
    one.observe(record(1, 0, rollouts=0))  # nothing trained: no verdict
    with pytest.raises(RewardsFailing, match=r"in 1 consecutive steps \(step 2\)"):
        one.observe(record(2, 4, rollouts=4))
