"""The run's plot: the PNG is written, and what it draws (checked on `plot_data`, not pixels) has the held-out
evaluations, the rolling mean of the train reward and one median per phase of a step."""

from __future__ import annotations

import math
from pathlib import Path

from composer_mesh.orchestration.metrics import MetricsWriter, StepRecord
from composer_mesh.orchestration.plotting import PHASES, plot_data, plot_run, rolling_mean, smoothing_window


def _records(n: int) -> list[StepRecord]:
    return [StepRecord(step=s, weight_version=s, reward=float(s % 2), loss=1.0 / s, channels={"grpo": 0.5},
                       policy_lag=1, weight_sync_s=0.01, step_s=1.0, dropped_batches=0, rollouts=8,
                       timing={"generate_s": 0.5 + s, "score_s": 0.1, "teacher_s": 0.0, "train_s": 0.3,
                               "sync_s": 0.01, "trainer_idle_s": 0.6, "generator_idle_s": 0.0})
            for s in range(1, n + 1)]


EVALS = [{"event": "eval", "when": "before", "step": 0, "reward": 0.25, "pass_at_k": 0.5, "k": 4},
         {"event": "eval", "when": "during", "step": 20, "reward": 0.5, "pass_at_k": 0.75, "k": 4},
         {"event": "eval", "when": "after", "step": 40, "reward": 0.875, "pass_at_k": 1.0, "k": 4}]


def test_rolling_mean_smooths_and_skips_nans() -> None:
    assert rolling_mean([0.0, 1.0, 0.0, 1.0], 2) == [0.0, 0.5, 0.5, 0.5]
    smoothed = rolling_mean([math.nan, 1.0, math.nan], 2)
    assert math.isnan(smoothed[0]) and smoothed[1:] == [1.0, 1.0]
    assert smoothing_window(3) == 1 and smoothing_window(40) == 4 and smoothing_window(10_000) == 25


def test_plot_data_has_eval_points_smoothing_and_phase_medians() -> None:
    data = plot_data(_records(40), EVALS)
    assert data.window == 4
    assert data.reward == [float(s % 2) for s in range(1, 41)]  # the raw series, drawn faint
    assert data.reward_smooth[3:] == [0.5] * 37  # the alternating 0/1 rewards, smoothed
    assert data.evals == [(0, 0.25), (20, 0.5), (40, 0.875)]
    assert data.pass_at_k == [(0, 0.5), (20, 0.75), (40, 1.0)] and data.k == 4
    assert set(data.losses) == {"grpo", "total"} and len(data.losses_smooth["total"]) == 40
    assert data.phase_medians[PHASES["generate_s"]] == 21.0  # median of 1.5 .. 40.5
    assert data.phase_medians[PHASES["train_s"]] == 0.3 and len(data.phase_medians) == len(PHASES)


def test_the_png_is_written_with_the_writers_evaluations(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    before, *later = [{k: v for k, v in e.items() if k != "event"} for e in EVALS]
    writer.write_event("eval", **before)
    for record in _records(12):
        writer.write(record)
    for e in later:
        writer.write_event("eval", **e)
    writer.close()
    assert [e["step"] for e in writer.evals()] == [0, 20, 40]
    resumed = MetricsWriter(tmp_path, resume_step=12)  # a resumed run keeps the evaluations up to its step
    assert [e["step"] for e in resumed.evals()] == [0]
    resumed.close()
    path = plot_run(writer.records, tmp_path / "plot.png", writer.evals())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
