"""The callers of the storage primitive write its marker, with every file's size and sha256, and refuse a marker
of an older composer-mesh (without hashes) as not committed: run checkpoints (`COMMITTED.json` with format, step
and time), trainer states (`COMPLETE`)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from composer_mesh.actors.backends.trainer.trainer_state import (
    TrainerStateError,
    capture_trainer_state,
    check_trainer_state,
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


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_run_checkpoint_marker_lists_the_controller_files_and_an_old_marker_is_not_committed(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.write_controller(controller_state(3))
    store.commit(3, keep=2)
    marker = json.loads((tmp_path / "step-00000003" / COMMITTED).read_text())
    assert (marker["format"], marker["step"], marker["marker_version"]) == (1, 3, 2)
    assert {f["name"]: (f["size"], f["sha256"]) for f in marker["files"]} == {
        name: ((tmp_path / "step-00000003" / name).stat().st_size, _sha(tmp_path / "step-00000003" / name))
        for name in ("controller.json", "controller.safetensors")}
    (tmp_path / "step-00000003" / COMMITTED).write_text(json.dumps({"format": 1, "step": 3, "time": 1.5}))
    with pytest.raises(RunCheckpointError, match=rf"^{tmp_path}/step-00000003/COMMITTED\.json: not committed: "
                                                 "commit marker version 0"):
        find_checkpoint(str(tmp_path))


def test_a_garbled_run_checkpoint_marker_is_not_committed_naming_it(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2):
        store.write_controller(controller_state(step))
        store.commit(step, keep=2)
    (tmp_path / "step-00000002" / COMMITTED).write_text("xx")
    assert store.committed() == [1] and find_checkpoint(str(tmp_path)) == store.step_url(1)
    assert read_checkpoint(find_checkpoint(str(tmp_path))).step == 1
    with pytest.raises(RunCheckpointError, match=rf"^{tmp_path}/step-00000002/COMMITTED\.json: not committed: the "
                                                 "commit marker is not JSON .*resume from an earlier one"):
        find_checkpoint(store.step_url(2))


def _snapshot() -> object:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return capture_trainer_state(model, optimizer, 1, None, extra={"weight_version": 2})


def test_trainer_state_marker_hashes_its_files_and_a_changed_byte_is_named(tmp_path):
    url = str(tmp_path / "s")
    snapshot = _snapshot()
    write_trainer_state(url, snapshot)
    marker = json.loads((tmp_path / "s" / "COMPLETE").read_text())
    assert [(f["name"], f["sha256"]) for f in marker["files"]] == [
        (name, _sha(tmp_path / "s" / name)) for name in ("state.safetensors", "state.json")]
    loaded = read_trainer_state(url)
    assert all(torch.equal(loaded.tensors[k], v) for k, v in snapshot.tensors.items())  # type: ignore[attr-defined]
    state = tmp_path / "s" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-8] ^= 1  # one bit of the last tensor: still a valid safetensors file, with another value
    state.write_bytes(bytes(data))
    for read in (read_trainer_state, check_trainer_state):
        with pytest.raises(TrainerStateError, match=rf"^{tmp_path}/s/state\.safetensors: content differs from "
                                                    "COMPLETE"):
            read(url)
    (tmp_path / "s" / "COMPLETE").write_text("ok\n")  # as written before the storage primitive
    with pytest.raises(TrainerStateError, match=rf"^{tmp_path}/s/COMPLETE: not committed: the commit marker is not "
                                                "JSON"):
        read_trainer_state(url)
