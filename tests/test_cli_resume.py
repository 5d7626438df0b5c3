"""`composer-mesh run` stopped by a real SIGTERM writes a checkpoint and exits with a message saying how to
resume; `--resume` continues it to the end; a missing checkpoint is one clear message."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_mesh import cli

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "tests" / "orchestration" / "slim_run.yaml"


def _command(*argv: str) -> tuple[list[str], dict[str, str]]:
    exe = Path(sys.executable).parent / "composer-mesh"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "composer_mesh.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return [*cmd, *argv], env


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return [r["step"] for r in rows if "event" not in r]


def _start(cmd: list[str], env: dict[str, str], run_dir: Path, records: int) -> subprocess.Popen[str]:
    """`composer-mesh run` in the background, once it has written `records` step records."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while len(_steps(run_dir)) < records and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    return proc


@pytest.mark.slow  # ~70 s: three CLI runs (SIGTERM, a killed trainer, the resume), each launching meshes
def test_sigterm_then_a_dead_trainer_then_resume_finish_the_run(tmp_path: Path) -> None:
    """One run, three sessions: SIGTERM checkpoints and exits 143 with the resume line; the resumed session's
    trainer is SIGKILLed: exit 3 naming the last checkpoint (no older than checkpoint_every); `--resume`
    finishes the run. Then a corrupted trainer state in the newest checkpoint is one 'cannot resume' message."""
    topology = tmp_path / "run.yaml"
    topology.write_text(TOPOLOGY.read_text() + "  checkpoint_every: 2\n")  # the run: section is the file's last
    run_dir = tmp_path / "run"
    cmd, env = _command("run", str(topology), "--run-dir", str(run_dir), "--steps", "16")
    resume_line = f"resume with: composer-mesh run {topology} --run-dir {run_dir} --resume"

    proc = _start(cmd, env, run_dir, records=1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == cli.EXIT_TERMINATED, err
    assert "Traceback" not in err and resume_line in err
    stopped = _steps(run_dir)
    assert 1 <= stopped[-1] < 16 and stopped == list(range(1, stopped[-1] + 1))
    assert (run_dir / "checkpoints" / f"step-{stopped[-1]:08d}" / "COMMITTED.json").is_file()

    proc = _start([*cmd, "--resume"], env, run_dir, records=stopped[-1] + 3)
    for pid in _procs_of_mesh(proc.pid, "trainer"):
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == cli.EXIT_RUN_FAILED, err
    assert "run failed" in err and "'trainer' on mesh 'trainer'" in err and "Traceback" not in err
    assert "the last full checkpoint is" in err and resume_line in err
    committed = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step-*/COMMITTED.json"))
    last = int(committed[-1].removeprefix("step-"))
    assert last % 2 == 0 and last >= _steps(run_dir)[-1] - 4  # no older than checkpoint_every (+ the pipeline)

    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == cli.EXIT_OK, done.stderr
    assert _steps(run_dir) == list(range(1, 17)) and "resumed from step" in done.stdout
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "resumed"][-1] == last

    state = run_dir / "checkpoints" / f"step-{16:08d}" / "trainer" / "r0" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == cli.EXIT_INVALID, done.stderr
    # found before launch (app/preflight/resume.py), not by the trainer after the meshes started
    assert "cannot resume: trainer replica 0's state" in done.stderr
    assert "state.safetensors: 100 bytes, COMPLETE says" in done.stderr and "Traceback" not in done.stderr
    assert f"the newest checkpoint that verifies is {run_dir / 'checkpoints' / f'step-{16 - 2:08d}'}" in done.stderr


def test_resume_without_a_checkpoint_is_one_message(tmp_path: Path) -> None:
    cmd, env = _command("run", str(TOPOLOGY), "--run-dir", str(tmp_path / "nothing"), "--resume")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == cli.EXIT_INVALID
    assert "cannot resume" in done.stderr and "no such checkpoint or run directory" in done.stderr
    assert "Traceback" not in done.stderr


def _procs_of_mesh(root: int, mesh: str) -> list[int]:
    """Descendant pids of `root` whose environment says they are procs of mesh `mesh`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                if f"COMPOSER_MESH_MESH={mesh}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except OSError:
                pass
    return found


@pytest.mark.slow  # ~25 s: one CLI run that launches meshes and trains until the loss is NaN
def test_a_nan_loss_stops_the_run_with_one_line_and_a_checkpoint_from_before_it(tmp_path: Path) -> None:
    """lr 1e12 makes the tiny model's loss NaN within a few steps (a real input, no test hook): the run stops
    with exit 3 and one line naming the trainer step, no traceback, and points at the checkpoint of the step right
    before it, which verifies file by file (issue 29). That checkpoint is still being written when the step is
    refused: the pipeline salvages it (it used to be abandoned, and the run pointed one step further back)."""
    from composer_mesh.actors.backends.trainer.trainer_state import check_trainer_state
    from composer_mesh.orchestration.checkpoint import verify_checkpoint

    topology = tmp_path / "run.yaml"
    text = TOPOLOGY.read_text().replace("settings: {lr: 0.003}", "settings: {lr: 1.0e12}")
    topology.write_text(text.replace("max_policy_lag: 1", "max_policy_lag: 0") + "  checkpoint_every: 1\n")
    run_dir = tmp_path / "run"
    cmd, env = _command("run", str(topology), "--run-dir", str(run_dir), "--steps", "20")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == cli.EXIT_RUN_FAILED, done.stderr
    assert "Traceback" not in done.stderr and "is a bug" not in done.stderr
    failed = re.search(r"^composer-mesh: run failed: trainer step (\d+): non-finite (loss|gradient) .*"
                       r"run\.on_nonfinite: skip skips such steps instead$", done.stderr, re.M)
    assert failed, done.stderr
    last = re.search(r"^the last full checkpoint is (\S+)$", done.stderr, re.M)
    assert last and f"resume with: composer-mesh run {topology} --run-dir {run_dir} --resume" in done.stderr
    step = int(Path(last[1]).name.removeprefix("step-"))
    assert step == int(failed[1]) - 1  # the step right before: its checkpoint, still being written, committed
    verify_checkpoint(last[1])  # every file as its marker lists it
    check_trainer_state(f"{last[1]}/trainer/r0")
