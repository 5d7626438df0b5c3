"""Progress of a model's warm start, written beside the model cache so a run's controller can show it.

A first run of a warm-started topology spends minutes building its models inside the actors' processes, which
print nothing while they train. The builder writes `<cache>/.<model>.progress.json` ({model, step, steps, loss,
updated}) at most once a second and removes it when it is done; `builds_in_progress` reads every such file
under the cache roots a run uses (JSON only; a malformed file, or one not updated for `STALE_S`, because its
builder died, is skipped) and `describe` makes the controller's status line of them.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PROGRESS_SUFFIX = ".progress.json"
STALE_S = 60.0  # a file older than this belongs to a builder that died; a live one writes every second


def progress_path(root: Path, model: str) -> Path:
    return root / f".{model}{PROGRESS_SUFFIX}"


class BuildProgress:
    """The builder's side: called with (step done, loss) after every SFT step; `close()` removes the file."""

    def __init__(self, path: Path, model: str, steps: int, every_s: float = 1.0) -> None:
        self.path, self.model, self.steps, self.every_s = path, model, steps, every_s
        self._written = -math.inf

    def __call__(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if now - self._written < self.every_s and step < self.steps:
            return
        self._written = now
        record = {"model": self.model, "step": step, "steps": self.steps, "loss": round(loss, 4),
                  "updated": time.time()}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)  # a reader sees the old record or the new one, never half of one

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def builds_in_progress(roots: Iterable[Path], now: float | None = None) -> list[dict[str, Any]]:
    """Every fresh, well-formed progress record under `roots`, by model name."""
    now = time.time() if now is None else now
    found: dict[str, dict[str, Any]] = {}
    for root in dict.fromkeys(roots):
        for path in sorted(root.glob(f".*{PROGRESS_SUFFIX}")) if root.is_dir() else []:
            record = _read(path)
            if record is not None and now - record["updated"] <= STALE_S:
                found[record["model"]] = record
    return [found[k] for k in sorted(found)]


def describe(builds: list[dict[str, Any]]) -> str:
    """'warm-starting tiny-1a2b 30% of 1200 steps, tiny-9f8e 20% of 1200 steps', or '' when none."""
    parts = [f"{b['model']} {_percent(b)}% of {b['steps']} steps" for b in builds]
    return "warm-starting " + ", ".join(parts) if parts else ""


def _percent(record: dict[str, Any]) -> int:
    """Whole tens of percent: a log gets a line per tenth of a warm start, not one per second."""
    return 10 * (10 * record["step"] // max(1, record["steps"]))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    fields = {"model": str, "step": int, "steps": int, "updated": (int, float)}
    ok = isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in fields.items())
    return record if ok else None
