"""bench_weight_sync.py runs end to end at CI size with every CPU transport side by side (numbers are read
by people, never asserted; only that each method moved the version to every generator)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~30 s on 2 cores: two blocks of fresh proc meshes
def test_bench_weight_sync_quick_runs_every_cpu_transport(tmp_path: Path) -> None:
    out = tmp_path / "bench_weight_sync.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_weight_sync.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Weight sync (cpu weights)" in proc.stdout
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["hardware"]
    assert [r["generators"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row["mb_per_s"]) == {"rdma", "shm", "endpoint", "state_dict"}
        assert all(math.isfinite(v) and v > 0 for v in row["mb_per_s"].values()), row
