"""`composer-mesh run` with its output piped (as in a Slurm log): timestamped progress lines arrive while the
run is still going, each with the step, reward, losses, lag, throughput and ETA; then the summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "tests" / "orchestration" / "slim_run.yaml"


@pytest.mark.slow  # a real run through the CLI, piped: about a minute
def test_piped_run_prints_progress_lines_as_it_goes(tmp_path: Path) -> None:
    topology = tmp_path / "run.yaml"
    topology.write_text(TOPOLOGY.read_text() + "  progress: {every_steps: 1}\n")  # the run: section is last
    exe = Path(sys.executable).parent / "composer-mesh"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "composer_mesh.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([*cmd, "run", str(topology), "--run-dir", str(tmp_path / "run"), "--steps", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen_running: list[str] = []  # lines read while the process had not exited
    lines: list[str] = []
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if proc.poll() is None:
            seen_running.append(lines[-1])
        assert time.monotonic() < deadline, lines
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    steps = [line for line in lines if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step \d+/4 ", line)]
    assert [line.split(" step ")[1].split("/")[0] for line in steps] == ["1", "2", "3", "4"], lines
    assert any(" step 1/4 " in line for line in seen_running), (seen_running, lines)  # not only at the end
    for part in ("reward ", "loss ", "grpo=", "lag ", "rollouts/s", "eta "):
        assert all(part in line for line in steps), (part, steps)
    text = "\n".join(lines)
    assert "launching meshes…" in text and "held-out eval at step 0 (before training): greedy reward" in text
    assert "held-out eval at step 4 (after training)" in text
    assert "rollouts trained" in text and "rollouts/s (startup excluded)" in text
    assert max(len(line) for line in lines if "│" in line) <= 80  # the summary table fits a piped log's width
