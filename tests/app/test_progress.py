"""The run's progress display: the live line keeps the step counter and the clock whole at 80 columns; plain
lines for logs are complete, timestamped and paced by `run.progress`; the summary table names its units."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

from rich.console import Console

from composer_mesh.app.progress import PlainProgress, ProgressState, StepLine, fit_line, open_progress
from composer_mesh.app.runner import summary_table
from composer_mesh.orchestration.config import ProgressConfig
from composer_mesh.orchestration.metrics import RunSummary, StepRecord

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def _record(step: int, elapsed: float) -> StepRecord:
    return StepRecord(step=step, weight_version=step, reward=0.531, loss=0.123,
                      channels={"grpo": 0.1, "sdpo": 0.02, "replay": 0.003}, policy_lag=1, weight_sync_s=0.012,
                      step_s=1.5, dropped_batches=0, rollouts=64, elapsed_s=elapsed,
                      timing={"train_s": 0.4, "trainer_idle_s": 1.1})


def _state_at_step_240() -> ProgressState:
    state = ProgressState(total=1000, started=time.monotonic() - 3725)  # 1:02:05 since the display opened
    state.step(_record(1, 10.0))
    state._first_at = time.monotonic() - 239 * 15.0  # 15 s a step since then
    state.step(_record(240, 10.0 + 239 * 15.0))
    return state


def _render(state: ProgressState, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(StepLine(state))
    return out.getvalue()


def test_the_live_line_at_80_columns_keeps_counter_clock_eta_reward_and_lag() -> None:
    text = _render(_state_at_step_240(), 80)
    assert text.count("\n") == 1 and len(text.rstrip("\n")) <= 80, text
    assert text.startswith("240/1000 ")
    for part in ("1:02:05", "eta 3:10:00", "reward 0.531", "lag 1"):
        assert part in text, (part, text)
    assert "…" not in text


def test_a_wide_terminal_gets_the_bar_and_the_extras() -> None:
    text = _render(_state_at_step_240(), 200)
    assert "━" in text and "grpo=0.100" in text and "rollouts/s" in text and "sync 12ms" in text
    narrow = _render(_state_at_step_240(), 80)
    assert "sync" not in narrow  # dropped first: the least important fields go when the width is short


def test_the_line_is_cut_only_below_the_essentials() -> None:
    line = fit_line(_state_at_step_240(), 30)
    assert line.plain.startswith("240/1000 1:02:05") and len(line.plain) <= 30


def test_before_the_first_step_the_line_says_what_is_happening() -> None:
    state = ProgressState(total=40)
    state.status = "launching meshes…"
    text = _render(state, 80)
    assert text.startswith("0/40 ") and "0:00:00" in text and "launching meshes…" in text


def test_plain_lines_are_timestamped_complete_and_paced(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=80)  # not a terminal
    progress = open_progress(console, 30, 0, ProgressConfig(every_steps=10, every_s=3600))
    assert isinstance(progress, PlainProgress)
    with progress:
        progress.set_status("launching meshes…")
        progress.event("eval", {"when": "before", "step": 0, "reward": 0.25, "pass_at_k": 0.5, "k": 4})
        for step in range(1, 26):
            progress.step(_record(step, float(step)))
    lines = out.getvalue().splitlines()
    assert all(re.match(STAMP + " ", line) for line in lines), lines
    steps = [int(m.group(1)) for line in lines if (m := re.search(r" step (\d+)/30 ", line))]
    assert steps == [1, 11, 21, 25]  # the first, every 10th since, and the last seen when the display closed
    assert "held-out eval at step 0 (before training): greedy reward 0.250, pass@4 0.500" in out.getvalue()
    step_line = next(line for line in lines if " step 11/30 " in line)
    for part in ("reward 0.531", "loss 0.123", "grpo=0.100", "sdpo=0.020", "lag 1", "rollouts/s", "eta "):
        assert part in step_line, (part, step_line)


def test_plain_lines_also_come_every_so_many_seconds() -> None:
    out = io.StringIO()
    progress = open_progress(Console(file=out), 100, 0, ProgressConfig(every_steps=50, every_s=0.01))
    with progress:
        for step in range(1, 4):
            time.sleep(0.02)
            progress.step(_record(step, float(step)))
    assert [line.split(" step ")[1].split()[0] for line in out.getvalue().splitlines()] == ["1/100", "2/100", "3/100"]


def test_the_summary_names_its_units_and_fits_80_columns() -> None:
    summary = RunSummary(steps=240, run_dir=Path("runs/local"), reward_first=0.31, reward_last=0.78,
                         eval_before=0.41, eval_after=0.92, dropped_batches=0, dropped_rollouts=0, seconds=312.4,
                         rollouts_trained=1280, train_seconds=1.65, launch_seconds=40.0, eval_prompts=64, pass_k=4, pass_before=0.6,
                         pass_after=0.98, weight_transports=[
                             "generator0: shm (auto: on the publisher's host)",
                             "generator1: rdma_tcp (auto: not shm: publisher on host a; RDMA over Monarch's TCP "
                             "fallback: no ibverbs device on this host)"])
    out = io.StringIO()
    Console(file=out, width=80).print(summary_table(summary))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "rollouts trained       │ 1,280" in text
    assert "776 rollouts/s (startup excluded)" in text
    assert "0.410 → 0.920 (before → after, 64 held-out prompts)" in text and "held-out pass@4" in text
    flat = " ".join(text.replace("│", " ").split())  # a value wraps within its cell: join it back
    assert "0:05:52: launch 0:00:40, setup and evaluations 0:05:11, training 0:00:02" in flat
    assert "run finished after 0:05:52" in text and " / " not in text
    assert ("weight transport generator0: shm (auto: on the publisher's host); generator1: rdma_tcp (auto: not shm: "
            "publisher on host a; RDMA over Monarch's TCP fallback: no ibverbs device on this host)") in flat
