"""The callers of the storage primitive write its marker, and still read what they wrote before it existed:
run checkpoints (`COMMITTED.json` with format, step and time), trainer states (`COMPLETE` holding "ok")."""

from __future__ import annotations

import json

import pytest
import torch

from composer_mesh.actors.backends.trainer.trainer_state import (
    TrainerStateError,
    capture_trainer_state,
    read_trainer_state,
    write_trainer_state,
)
from composer_mesh.orchestration.checkpoint import (
    COMMITTED,
    CheckpointStore,
    RunCheckpointError,
    find_checkpoint,
    read_checkpoint,
)
from tests.orchestration.test_run_checkpoint import controller_state


def test_run_checkpoint_marker_lists_the_controller_files_and_old_markers_read(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.write_controller(controller_state(3))
    store.commit(3, keep=2)
    marker = json.loads((tmp_path / "step-00000003" / COMMITTED).read_text())
    assert (marker["format"], marker["step"], marker["marker_version"]) == (1, 3, 1)
    assert {f["name"]: f["size"] for f in marker["files"]} == {
        name: (tmp_path / "step-00000003" / name).stat().st_size for name in ("controller.json",
                                                                              "controller.safetensors")}
    (tmp_path / "step-00000003" / COMMITTED).write_text(json.dumps({"format": 1, "step": 3, "time": 1.5}))
    assert read_checkpoint(find_checkpoint(str(tmp_path))).step == 3


def test_a_garbled_run_checkpoint_marker_is_refused_naming_it(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.write_controller(controller_state(2))
    store.commit(2, keep=2)
    (tmp_path / "step-00000002" / COMMITTED).write_text("{half a mark")
    with pytest.raises(RunCheckpointError, match=rf"^{tmp_path}/step-00000002/COMMITTED\.json: unreadable commit "
                                                 "marker"):
        read_checkpoint(find_checkpoint(str(tmp_path)))


def _snapshot() -> object:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return capture_trainer_state(model, optimizer, 1, None, extra={"weight_version": 2})


def test_trainer_state_marker_is_json_and_an_old_ok_marker_still_reads(tmp_path):
    url = str(tmp_path / "s")
    snapshot = _snapshot()
    write_trainer_state(url, snapshot)
    marker = json.loads((tmp_path / "s" / "COMPLETE").read_text())
    assert [f["name"] for f in marker["files"]] == ["state.safetensors", "state.json"]
    (tmp_path / "s" / "COMPLETE").write_text("ok\n")  # as written before the storage primitive
    loaded = read_trainer_state(url)
    assert loaded.extra == {"weight_version": 2}
    assert all(torch.equal(loaded.tensors[k], v) for k, v in snapshot.tensors.items())  # type: ignore[attr-defined]
    (tmp_path / "s" / "COMPLETE").write_text("ok?")
    with pytest.raises(TrainerStateError, match=rf"^{tmp_path}/s/COMPLETE: unreadable commit marker"):
        read_trainer_state(url)
