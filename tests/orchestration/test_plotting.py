"""The run's plot: the PNG is written, and what it draws (checked on `plot_data`, not pixels) has the held-out
evaluations, the rolling mean of the train reward and one median per phase of a step."""

from __future__ import annotations

import math
from pathlib import Path

from composer_mesh.orchestration.metrics import MetricsWriter, StepRecord
from composer_mesh.orchestration.plotting import (
    COUNTERS,
    PHASES,
    RATES,
    plot_data,
    plot_run,
    rolling_mean,
    smoothing_window,
)


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


def _episode_records(n: int) -> list[StepRecord]:
    """A run of episodes whose policy starts breaking its tool calls at step 6, and whose first step's episodes
    made no tool call (no rates measured); coding counters from step 2."""
    records = _records(n)
    for r in records:
        if r.step > 1:
            r.metrics["episode/tool_error_rate"] = 0.05 if r.step < 6 else 0.6
            r.metrics["episode/parse_error_rate"] = 0.0 if r.step < 6 else 0.3
            r.metrics["episode/run_tests"] = 2.0 if r.step < 6 else 0.0
            r.metrics["episode/writes_outside_solution"] = 0.0 if r.step < 6 else 1.0
        r.metrics["episode/tool_calls"] = 4.0  # an episode counter the panel does not draw
    return records


def test_plot_data_has_a_behaviour_panel_for_runs_of_episodes(tmp_path: Path) -> None:
    data = plot_data(_episode_records(10))
    nan = math.nan
    assert list(data.rates) == [RATES["episode/tool_error_rate"], RATES["episode/parse_error_rate"]]
    tool = data.rates[RATES["episode/tool_error_rate"]]
    assert math.isnan(tool[0]) and tool[1:] == [0.05] * 4 + [0.6] * 5  # the hack shows up at step 6
    assert list(data.counters) == [COUNTERS["episode/run_tests"], COUNTERS["episode/writes_outside_solution"]]
    assert data.counters[COUNTERS["episode/writes_outside_solution"]][1:] == [0.0] * 4 + [1.0] * 5
    assert str(data.counters[COUNTERS["episode/run_tests"]][0]) == str(nan)
    assert not plot_data(_records(10)).rates and not plot_data(_records(10)).counters  # single turns: no panel
    path = plot_run(_episode_records(10), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
