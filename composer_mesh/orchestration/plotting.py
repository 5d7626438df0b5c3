"""The run's plot (`plot.png` in the run dir): rewards, losses, where the time goes and, for runs of episodes,
how the policy behaves, as one PNG.

`plot_data` computes everything drawn (so tests check the data, not pixels); `plot_run` draws it. Per-step
series are noisy at a few prompts per step, so each is drawn faint with its rolling mean over it; the held-out
evaluations (greedy reward and pass@k, from metrics.jsonl's `eval` events) are points on the reward panel; the
time panel is one bar per phase, the median seconds per step, instead of a spiky line each. The behaviour panel
(only when the records have episode metrics) draws the tool-error and parse-error rates per step and the coding
environment's behaviour counters per episode: a reward hack (tool calls broken on purpose, the visible tests
rewritten, paths probed) moves these lines while the reward climbs, so it shows up next to the reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_mesh.orchestration.metrics import StepRecord

# The phases of a step, as the time panel names them (`StepRecord.timing` keys). The trainer's three add up to
# the step's wall time; the others are work done for the step elsewhere (summed over requests: generators overlap).
PHASES = {
    "trainer_idle_s": "trainer: waiting for a batch", "train_s": "trainer: training", "sync_s": "trainer: weight sync",
    "generate_s": "generate (all generators)", "score_s": "score rewards", "teacher_s": "teacher signals",
    "generator_idle_s": "generators idle",
}
# The behaviour panel's series (`StepRecord.metrics` keys, `orchestration/episode_metrics.py`): rates in [0, 1] on
# its left axis; the coding environment's counters (`envs/coding/session.py` BEHAVIOUR), per episode, on its right.
RATES = {"episode/tool_error_rate": "tool-error rate", "episode/parse_error_rate": "parse-error rate"}
COUNTERS = {
    "episode/run_tests": "run_tests", "episode/run_python": "run_python",
    "episode/writes_outside_solution": "writes outside solution.py", "episode/paths_refused": "paths refused",
    "episode/sandbox_kills": "sandbox kills", "episode/untested_submits": "ends without run_tests",
}
MAX_WINDOW = 25


def smoothing_window(n: int) -> int:
    """Steps in the rolling mean: a tenth of the run, 1 to `MAX_WINDOW`."""
    return max(1, min(MAX_WINDOW, round(n / 10)))


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (NaNs skipped; NaN where all are)."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1): i + 1] if not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _median(values: list[float]) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


@dataclass
class PlotData:
    """What the plot shows. `evals`: (step, greedy reward) and `pass_at_k`: (step, pass@k) of each held-out
    evaluation; `phase_medians`: the label of each phase → median seconds per step."""

    steps: list[int]
    reward: list[float]
    reward_smooth: list[float]
    window: int
    losses: dict[str, list[float]] = field(default_factory=dict)
    losses_smooth: dict[str, list[float]] = field(default_factory=dict)
    evals: list[tuple[int, float]] = field(default_factory=list)
    pass_at_k: list[tuple[int, float]] = field(default_factory=list)
    k: int | None = None
    phase_medians: dict[str, float] = field(default_factory=dict)
    rates: dict[str, list[float]] = field(default_factory=dict)  # label -> per step (NaN: not measured)
    counters: dict[str, list[float]] = field(default_factory=dict)  # label -> per episode, per step


def behaviour_series(records: list[StepRecord], names: dict[str, str]) -> dict[str, list[float]]:
    """Of the metrics `names` lists, those some record has: label -> value per step (NaN where absent)."""
    seen = {k for r in records for k in r.metrics}
    return {label: [r.metrics.get(key, math.nan) for r in records] for key, label in names.items() if key in seen}


def plot_data(records: list[StepRecord], evals: list[dict[str, Any]] | None = None) -> PlotData:
    """The series of `records` with their rolling means, the evaluations' points, the phases' medians."""
    window = smoothing_window(len(records))
    reward = [r.reward for r in records]
    losses = {ch: [r.channels.get(ch, math.nan) for r in records] for ch in sorted({k for r in records for k in r.channels})}
    losses["total"] = [r.loss for r in records]
    points = [e for e in evals or [] if isinstance(e.get("reward"), (int, float))]
    data = PlotData(
        steps=[r.step for r in records], reward=reward, reward_smooth=rolling_mean(reward, window), window=window,
        losses=losses, losses_smooth={k: rolling_mean(v, window) for k, v in losses.items()},
        evals=[(int(e.get("step", 0)), float(e["reward"])) for e in points],
        pass_at_k=[(int(e.get("step", 0)), float(e["pass_at_k"])) for e in points
                   if isinstance(e.get("pass_at_k"), (int, float))],
        k=next((int(e["k"]) for e in points if e.get("k")), None),
        rates=behaviour_series(records, RATES), counters=behaviour_series(records, COUNTERS),
    )
    timed = [r for r in records if r.timing]
    for key, label in PHASES.items():
        seen = [r.timing[key] for r in timed if key in r.timing] or ([r.weight_sync_s for r in timed] if key == "sync_s" else [])
        if seen:
            data.phase_medians[label] = _median(seen)
    return data


def plot_run(records: list[StepRecord], path: Path, evals: list[dict[str, Any]] | None = None) -> Path:
    """PNG with the rewards (train, smoothed, held-out), the loss channels, and the median time per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = plot_data(records, evals)
    panels = 4 if data.rates or data.counters else 3
    fig, axes = plt.subplots(1, panels, figsize=(16 + 5 * (panels - 3), 4.2),
                             gridspec_kw={"width_ratios": [1.2, 1.2, 1, 1.2][:panels]})
    ax_r, ax_l, ax_t = axes[:3]
    _reward_panel(ax_r, data)
    for i, (name, values) in enumerate(data.losses.items()):
        color = "black" if name == "total" else f"C{i}"
        ax_l.plot(data.steps, values, color=color, alpha=0.2, linewidth=0.8)
        ax_l.plot(data.steps, data.losses_smooth[name], color=color, linewidth=1.6, label=name)
    ax_l.set(xlabel="step", ylabel="loss", title=f"loss per channel (faint: per step; line: mean of {data.window})")
    ax_l.grid(alpha=0.3)
    ax_l.legend(fontsize=8)
    _time_panel(ax_t, data)
    if panels == 4:
        _behaviour_panel(axes[3], data)
    for ax in axes:
        ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _reward_panel(ax: Any, data: PlotData) -> None:
    ax.plot(data.steps, data.reward, color="C0", alpha=0.25, linewidth=0.8, label="train reward (per step)")
    ax.plot(data.steps, data.reward_smooth, color="C0", linewidth=2, label=f"train reward (mean of {data.window})")
    if data.evals:
        ax.plot(*zip(*data.evals, strict=True), color="C3", marker="o", linewidth=1.2, label="held-out greedy reward")
    if data.pass_at_k:
        ax.plot(*zip(*data.pass_at_k, strict=True), color="C2", marker="s", linewidth=1, linestyle="--",
                label=f"held-out pass@{data.k}")
    ax.set(xlabel="step", ylabel="reward", title="reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _time_panel(ax: Any, data: PlotData) -> None:
    labels = list(data.phase_medians)
    values = [data.phase_medians[k] for k in labels]
    colors = ["C0" if k.startswith("trainer") else "C1" for k in labels]
    ax.barh(labels, values, color=colors)
    ax.invert_yaxis()
    for y, v in enumerate(values):
        if not math.isnan(v):
            ax.text(v, y, f" {v:.2f}s", va="center", fontsize=8)
    ax.set(xlabel="median seconds per step", title="where the time goes (blue: the trainer's step, adds up to it)")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(alpha=0.3, axis="x")


def _behaviour_panel(ax: Any, data: PlotData) -> None:
    """Rates (solid, left axis) and the coding counters per episode (dashed, right axis), each smoothed."""
    for i, (label, values) in enumerate(data.rates.items()):
        ax.plot(data.steps, values, color=f"C{i}", alpha=0.2, linewidth=0.8)
        ax.plot(data.steps, rolling_mean(values, data.window), color=f"C{i}", linewidth=1.6, label=label)
    ax.set(xlabel="step", ylabel="rate", ylim=(-0.02, 1.02), title="behaviour (solid: rates; dashed: per episode)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if data.counters:
        right = ax.twinx()
        for i, (label, values) in enumerate(data.counters.items(), start=len(data.rates)):
            right.plot(data.steps, rolling_mean(values, data.window), color=f"C{i}", linewidth=1.2, linestyle="--",
                       label=label)
        right.set_ylabel("per episode")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=7)
