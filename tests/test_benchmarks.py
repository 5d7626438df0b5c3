"""The benchmarks run end to end at CI size (their numbers are read by people, never asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # ~50 s on 2 cores: seven fresh processes that each import torch and transformers
def test_bench_trainer_quick_writes_both_implementations(tmp_path: Path) -> None:
    out = tmp_path / "bench_trainer.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_trainer.py"), "--quick", "--device", "cpu",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ours/bare tok/s" in proc.stdout and "KiB/token" in proc.stdout
    result = json.loads(out.read_text())
    assert result["hardware"] and result["versions"] and result["params"] > 0
    sweep = result["sweep"]
    for impl in ("bare", "ours"):
        rows = [r for r in sweep if r["impl"] == impl]
        assert len(rows) >= 2, f"no sweep rows for {impl}: {sweep}"
        assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    assert all(r["micro_batches"] >= 1 for r in sweep)
    table = [r for r in result["micro_batch_table"] if r["impl"] == "ours"]
    budgets = [r["micro_batch_tokens"] for r in table]
    assert None in budgets and len(set(budgets)) >= 3  # the whole batch and at least two budgets
    for row in table:
        assert row["status"] == "ok" and row["peak_bytes_per_token"] > 0, row
        assert row["micro_batches"] >= 1


@pytest.mark.slow  # ~40 s on 2 cores: the HF implementations, then a vLLM engine in a child when vllm imports
def test_bench_generate_quick_writes_every_implementation(tmp_path: Path) -> None:
    out = tmp_path / "bench_generate.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_generate.py"), "--quick", "--device", "cpu",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ours/generate" in proc.stdout and "hardware:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["hardware"] and result["versions"] and result["params"] > 0
    rows = result["rows"]
    batches = result["settings"]["batches"]
    for impl in ("ours", "generate"):
        got = {r["batch"]: r for r in rows if r["impl"] == impl}
        assert sorted(got) == sorted(batches), rows
        for b, r in got.items():  # every implementation made exactly batch x new tokens
            assert r["status"] == "ok" and r["tokens_per_s"] > 0, r
            assert r["new_tokens"] == b * result["settings"]["new"], r
    vllm = [r for r in rows if r["impl"] == "vllm"]
    assert sorted(r["batch"] for r in vllm) == sorted(batches)  # a rate, or why there is none
    assert all(r["tokens_per_s"] > 0 if r["status"] == "ok" else r["status"] for r in vllm)
