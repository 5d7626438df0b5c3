"""The console line for steps whose rewards failed: shown at once, then at most one every `every_s` seconds."""

from __future__ import annotations

import io

from rich.console import Console

from composer_mesh.app.runner import RewardFailureNotices
from composer_mesh.orchestration.metrics import StepRecord


def record(step: int, failures: int) -> StepRecord:
    return StepRecord(step=step, weight_version=step, reward=0.0, loss=0.0, channels={}, policy_lag=0,
                      weight_sync_s=0.0, step_s=1.0, dropped_batches=0, rollouts=8, reward_failures=failures,
                      reward_error="reward function 'reward' raised KeyError: '[solution]'" if failures else "")


def test_the_first_failing_step_prints_then_at_most_one_line_every_30_s():
    out, now = io.StringIO(), [0.0]
    notices = RewardFailureNotices(Console(file=out, width=40), every_s=30.0, clock=lambda: now[0])
    for step, (t, failures) in enumerate([(0, 0), (1, 8), (2, 8), (20, 3), (40, 8), (41, 0), (100, 1)], start=1):
        now[0] = t
        notices(record(step, failures))
    assert out.getvalue().splitlines() == [
        "step 2: 8/8 rollouts' rewards failed: reward function 'reward' raised KeyError: '[solution]'",
        "step 5: 8/8 rollouts' rewards failed (2 more step(s) with failures since the last notice): reward function "
        "'reward' raised KeyError: '[solution]'",
        "step 7: 1/8 rollouts' rewards failed: reward function 'reward' raised KeyError: '[solution]'",
    ]
