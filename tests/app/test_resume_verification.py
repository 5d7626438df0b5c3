"""`--resume` checks every file of the checkpoint against its commit marker (size and sha256) before anything
launches: a file that changed is named with what differs, and the newest checkpoint that does verify is offered
as the `--resume PATH` to give. The issue's scenario (29): 64 bytes of 0xFF written into a committed trainer
`state.safetensors` used to load without complaint and make the next step's loss NaN.

The checkpoints are real files written by the real writers (`CheckpointStore`, `save_trainer_state`) under the
topology's fingerprint; `composer-mesh run` runs in a fresh interpreter, so that Monarch never being imported
shows nothing was launched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composer_mesh.actors.backends.trainer.trainer_state import save_trainer_state
from composer_mesh.cli import EXIT_INVALID, main
from composer_mesh.orchestration.checkpoint import COMMITTED, CheckpointStore
from composer_mesh.topology import load_topology
from tests.app.test_preflight import _RUN_PROBE, ROOT, one_line, topology
from tests.orchestration.test_run_checkpoint import controller_state


def _checkpoints(tmp_path: Path, path: Path) -> CheckpointStore:
    """Committed checkpoints of steps 1 and 2 in the run dir of the topology at `path`, each with a trainer
    state of a 64x64 linear model (17 KiB of tensors)."""
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))
    fingerprint = load_topology(path).training_fingerprint()
    for step in (1, 2):
        torch.manual_seed(step)
        model = torch.nn.Linear(64, 64)
        store.write_controller(controller_state(step, fingerprint))
        save_trainer_state(store.trainer_url(step, 0), model, torch.optim.AdamW(model.parameters()), step, None)
        store.commit(step, keep=5)
    return store


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        f.write(data)


def test_ff_bytes_in_a_trainer_state_refuse_resume_before_launch_offering_the_previous_checkpoint(tmp_path: Path):
    path = topology(tmp_path, "task: addition")
    store = _checkpoints(tmp_path, path)
    state = Path(store.trainer_url(2, 0)) / "state.safetensors"
    _overwrite(state, 4096, b"\xff" * 64)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = [["run", str(path), "--resume"]]
    done = subprocess.run([sys.executable, "-c", _RUN_PROBE, json.dumps(runs)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300, check=True)
    *results, monarch_imported = json.loads(done.stdout.splitlines()[-1])
    [(code, err, _)] = results
    line = one_line(err)
    good = store.step_url(1)
    assert code == EXIT_INVALID and monarch_imported is False, err
    assert line == (f"composer-mesh: cannot resume: trainer replica 0's state: {state}: content differs from COMPLETE "
                    f"(sha256 {line.split('sha256 ')[1][:16]}…, the marker says {line.split('marker says ')[1][:16]}…): "
                    f"the file was changed after its commit; the newest checkpoint that verifies is {good}: resume "
                    f"with --resume {good}")


def test_a_garbled_marker_is_not_committed_and_a_truncated_file_is_named_with_its_sizes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`xx` in the newest checkpoint's marker: --resume takes the one before; a truncated controller file there
    is refused naming both sizes (and there is nothing else to offer)."""
    from composer_mesh.app.preflight import preflight
    from composer_mesh.app.runner import resume_point

    path = topology(tmp_path, "task: addition")
    store = _checkpoints(tmp_path, path)
    (Path(store.step_url(2)) / COMMITTED).write_text("xx")
    topo = load_topology(path)
    point = resume_point(topo, None)
    assert point.url == store.step_url(1) and point.state.step == 1
    assert any(line.startswith("resume: ") for line in preflight(topo, point))
    controller = Path(store.step_url(1)) / "controller.json"
    size = controller.stat().st_size
    controller.write_bytes(controller.read_bytes()[:100])
    capsys.readouterr()
    assert main(["run", str(path), "--resume"]) == EXIT_INVALID
    assert one_line(capsys.readouterr().err) == (
        f"composer-mesh: cannot resume: {controller}: 100 bytes, COMMITTED.json says {size} (truncated or "
        f"overwritten); there is no other checkpoint beside step-00000001")
