"""Helpers for whole runs of `examples/teacher_swap.py` on the teacher-swap topologies (not a test module).

A run is the example script in a subprocess, exactly as a user starts it, on a copy of one of the
`topologies/teachers_*.yaml` files. The copy changes the same few `run:` fields in every file (a short, small
run for tests) and, for openrouter, the member's `base_url` (the fake server on localhost); nothing else.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "teacher_swap.py"
TOPOLOGIES = {b: ROOT / "topologies" / f"teachers_{b}.yaml" for b in ("hf", "vllm", "openrouter")}
# Applied to every file alike: fewer prompts per step and a small held-out eval keep a run short.
SMALL_RUN = {"prompts_per_step": 4, "samples_per_prompt": 4, "eval_prompts": 8}
RUN_TIMEOUT_S = 420


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def small_copy(binding: str, dst: Path, teacher_settings: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write `teachers_<binding>.yaml` with `SMALL_RUN` applied (and `teacher_settings[name]` merged into
    that teacher member's settings) to `dst`."""
    data = load_yaml(TOPOLOGIES[binding])
    data["run"].update(SMALL_RUN)
    for member in data["roles"]["teachers"]["members"]:
        extra = (teacher_settings or {}).get(member["name"])
        if extra:
            member["settings"] = {**member.get("settings", {}), **extra}
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout (tail) ---\n{self.stdout[-4000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}"

    def steps(self) -> list[dict[str, Any]]:
        """The per-step records of metrics.jsonl (events left out)."""
        return [r for r in self._lines() if "event" not in r]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self._lines() if r.get("event") == kind]

    def _lines(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_example(topology: Path, run_dir: Path, steps: int, env: dict[str, str]) -> RunResult:
    """`python examples/teacher_swap.py <topology> --steps N --run-dir D` with `env` added to ours."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(topology), "--steps", str(steps), "--run-dir", str(run_dir)],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    return RunResult(proc.returncode, proc.stdout, proc.stderr, run_dir)


def check_run(result: RunResult, steps: int, teachers: dict[str, list[str]]) -> dict[str, Any]:
    """Assert what every swapped run must show; return the last step record.

    `teachers` maps each teacher name to the usage counters that must have grown (> 0) by the end.
    """
    assert result.returncode == 0, result.explain()
    records = result.steps()
    assert [r["step"] for r in records] == list(range(1, steps + 1)), result.explain()
    assert (result.run_dir / "plot.png").stat().st_size > 0
    checkpoint = result.run_dir / "checkpoint"
    assert (checkpoint / "model.safetensors").stat().st_size > 0
    assert [e["when"] for e in result.events("eval")] == ["before", "after"]
    assert len(result.events("checkpoint")) == len(result.events("model")) == 1  # full state + HF model
    for r in records:
        assert math.isfinite(r["loss"]), r
        # every file has alpha_sdpo > 0 and beta_replay > 0: both teacher channels feed every step
        for channel in ("grpo", "sdpo", "replay"):
            assert channel in r["channels"] and math.isfinite(r["channels"][channel]), (channel, r["channels"])
    last = records[-1]["metrics"]
    for name, counters in teachers.items():
        assert last.get(f"teacher/{name}/failures") == 0.0, (name, {k: v for k, v in last.items() if k.startswith("teacher/")})
        for counter in counters:
            assert last.get(f"teacher/{name}/{counter}", 0.0) > 0, (name, counter, sorted(last))
    return records[-1]
