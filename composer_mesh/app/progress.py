"""The run's progress on the console, in the two places people read it.

In a terminal: one live line, redrawn in place, that fits the terminal's width: the step counter, the clock, the
ETA, the train reward and the policy lag come first and are never cut; the bar and the less important fields
(loss channels, throughput, sync and train times) get whatever room is left, in that order.

Anywhere else (a Slurm log, nohup, `> log`): plain timestamped lines, flushed as written, one every
`run.progress.every_steps` steps or `every_s` seconds (whichever first), each complete on its own: a log read
with `tail` or `grep step` says where the run is. Held-out evaluations get a line of their own as they happen, in
both places.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.text import Text

from composer_mesh.orchestration.config import ProgressConfig
from composer_mesh.orchestration.metrics import StepRecord

MIN_BAR = 10  # the bar is drawn only when this many columns are left for it
MAX_BAR = 30


def clock(seconds: float | None) -> str:
    """`H:MM:SS` (`?` when not known yet)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


@dataclass
class ProgressState:
    """What both displays show: the step counter, the clock (from when the display opened), the newest record,
    and rates measured over this session's steps (a resumed run's earlier steps do not count)."""

    total: int
    done: int = 0
    status: str = "starting"
    record: StepRecord | None = None
    started: float = field(default_factory=time.monotonic)
    _first_at: float | None = None  # when this session's first step was recorded, and the counter then
    _first_done: int = 0
    _first_elapsed: float = 0.0  # that record's `elapsed_s` and the rollouts trained since
    _rollouts_since: int = 0

    def step(self, record: StepRecord) -> None:
        if self._first_at is None:
            self._first_at, self._first_done, self._first_elapsed = time.monotonic(), record.step, record.elapsed_s
        else:
            self._rollouts_since += record.rollouts
        self.done, self.record = record.step, record

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def eta_s(self) -> float | None:
        """Seconds left at this session's pace so far (None before two steps)."""
        if self._first_at is None or self.done <= self._first_done:
            return None
        per_step = (time.monotonic() - self._first_at) / (self.done - self._first_done)
        return per_step * (self.total - self.done)

    def rollouts_per_s(self) -> float | None:
        """Rollouts trained per second since this session's first step (that step's own rate before a second)."""
        r = self.record
        if r is None:
            return None
        if self.done > self._first_done and r.elapsed_s > self._first_elapsed:
            return self._rollouts_since / (r.elapsed_s - self._first_elapsed)
        return r.rollouts / r.step_s if r.step_s > 0 else None

    def essentials(self) -> list[str]:
        """The fields never dropped, in order: step M/N, elapsed, ETA, then reward and lag (or the status)."""
        head = [f"{self.done}/{self.total}", clock(self.elapsed_s()), f"eta {clock(self.eta_s())}"]
        if self.record is None:
            return [*head, self.status]
        return [*head, f"reward {_num(self.record.reward)}", f"lag {self.record.policy_lag}"]

    def extras(self) -> list[str]:
        """The fields shown when there is room, most useful first."""
        r = self.record
        if r is None:
            return []
        rate = self.rollouts_per_s()
        out = [f"loss {_num(r.loss)}", *(f"{k}={_num(v)}" for k, v in sorted(r.channels.items()))]
        out.append(f"{rate:.3g} rollouts/s" if rate is not None else "? rollouts/s")
        out += [f"sync {r.weight_sync_s * 1000:.0f}ms", f"train {r.timing.get('train_s', 0.0):.2f}s",
                f"idle {r.timing.get('trainer_idle_s', 0.0):.2f}s"]
        if r.dropped_batches:
            out.append(f"dropped {r.dropped_batches}")
        restarts = r.metrics.get("faults/restarts", 0.0)
        if restarts:
            out.append(f"restarts {restarts:.0f} reissued {r.metrics.get('faults/reissued', 0.0):.0f}")
        return out


def fit_line(state: ProgressState, width: int) -> Text:
    """One line of at most `width` columns: the essentials, then the bar and the extras that fit (the extras
    before a bar wider than `MIN_BAR`)."""
    counter, *rest = state.essentials()
    essentials = " ".join(rest)
    used = len(counter) + 1 + len(essentials)
    bar = MIN_BAR if width - used - 1 >= MIN_BAR else 0
    used += bar + 1 if bar else 0
    extras: list[str] = []
    for part in state.extras():
        if used + 1 + len(part) > width:
            break
        extras.append(part)
        used += 1 + len(part)
    if bar:
        bar = min(MAX_BAR, bar + width - used)
    line = Text()
    line.append(counter, style="bold")
    if bar:
        filled = round(bar * state.done / state.total) if state.total else bar
        line.append(" ")
        line.append("━" * filled, style="bar.complete")
        line.append("━" * (bar - filled), style="bar.back")
    line.append(" " + essentials)
    if extras:
        line.append(" " + " ".join(extras), style="dim")
    line.no_wrap, line.overflow = True, "ellipsis"
    line.truncate(width, overflow="ellipsis")
    return line


class StepLine:
    """The live line as a rich renderable: fitted to the width it is drawn at, each time it is drawn."""

    def __init__(self, state: ProgressState) -> None:
        self.state = state

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield fit_line(self.state, options.max_width)


def eval_line(values: dict[str, Any]) -> str:
    """A held-out evaluation, said in words: when, the greedy reward and pass@k."""
    when = {"before": "before training", "after": "after training"}.get(values.get("when", ""), "during training")
    text = f"held-out eval at step {values.get('step', '?')} ({when}): greedy reward {_num(values.get('reward'))}"
    if values.get("k"):
        text += f", pass@{values['k']} {_num(values.get('pass_at_k'))}"
    return text


class RunProgress(Protocol):
    """What the runner tells a display: a status while nothing trains yet, each step's record, the events."""

    state: ProgressState

    def set_status(self, status: str) -> None: ...
    def step(self, record: StepRecord) -> None: ...
    def event(self, kind: str, values: dict[str, Any]) -> None: ...


class LiveProgress:
    """The terminal display: `StepLine` redrawn in place; evaluations printed above it."""

    def __init__(self, console: Console, state: ProgressState) -> None:
        self.console, self.state = console, state
        self._live = Live(StepLine(state), console=console, refresh_per_second=2, transient=False)

    def __enter__(self) -> LiveProgress:
        self._live.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._live.__exit__(kind, exc, tb)

    def set_status(self, status: str) -> None:
        self.state.status = status

    def step(self, record: StepRecord) -> None:
        self.state.step(record)
        self._live.refresh()

    def event(self, kind: str, values: dict[str, Any]) -> None:
        if kind == "eval":
            self.console.print(eval_line(values), highlight=False)


class PlainProgress:
    """The display for logs: timestamped lines, flushed as written (never wrapped or cut: a log has no width)."""

    def __init__(self, console: Console, state: ProgressState, every: ProgressConfig) -> None:
        self.out, self.state, self.every = console.file, state, every
        self._printed_step: int | None = None
        self._printed_at = time.monotonic()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.state.record is not None and self._printed_step != self.state.done:
            self._line(self._step_text())  # the last step seen, even when the run stopped between lines

    def _line(self, text: str) -> None:
        self.out.write(f"{datetime.now():%Y-%m-%d %H:%M:%S} {text}\n")
        self.out.flush()
        self._printed_at = time.monotonic()

    def _step_text(self) -> str:
        self._printed_step = self.state.done
        return "step " + " ".join(self.state.essentials() + self.state.extras())

    def set_status(self, status: str) -> None:
        self.state.status = status
        self._line(f"{status} (elapsed {clock(self.state.elapsed_s())})")

    def step(self, record: StepRecord) -> None:
        self.state.step(record)
        since = record.step - self._printed_step if self._printed_step is not None else None
        if (since is None or since >= self.every.every_steps or record.step >= self.state.total
                or time.monotonic() - self._printed_at >= self.every.every_s):
            self._line(self._step_text())

    def event(self, kind: str, values: dict[str, Any]) -> None:
        if kind == "eval":
            self._line(eval_line(values))


def open_progress(console: Console, total: int, done: int, every: ProgressConfig) -> LiveProgress | PlainProgress:
    """The display for `console`: the live line in a terminal, plain lines otherwise. `done`: the step a resumed
    run starts from."""
    state = ProgressState(total=total, done=done)
    if console.is_terminal and not console.is_dumb_terminal:
        return LiveProgress(console, state)
    return PlainProgress(console, state, every)
