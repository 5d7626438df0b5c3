"""The trainer's full state: a trainer stopped after k steps and resumed from its state continues bitwise."""

from __future__ import annotations

import json
import random

import pytest
import torch

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.trainer_state import (
    TrainerStateError,
    check_trainer_state,
    write_trainer_state,
)
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.config import ModelConfig
from tests.actors.backends.trainer.test_hf_trainer import make_batch

MODEL = ModelConfig(source="tiny", seed=3)
# Every channel, KL to the reference, and adaptive TAID: the state the loss carries across steps is saved too.
LOSS = LossConfig(kl_beta=0.05, sdpo_wrapper="taid", taid_total_steps=10)


def trainer(model: ModelConfig = MODEL) -> HFTrainer:
    t = HFTrainer(HFTrainerSettings(lr=1e-2))
    t.start(model, LOSS)
    return t


def state_of(t: HFTrainer) -> dict[str, torch.Tensor]:
    out = {f"w/{k}": v.clone() for k, v in t.model.state_dict().items()}
    for i, s in t.optimizer.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def test_resumed_trainer_continues_bitwise(tmp_path):
    a = trainer()
    batch = make_batch(a)
    for _ in range(2):
        a.train_step(batch)
    a.save_state(str(tmp_path / "s"), extra={"weight_version": 3})
    after_save = (torch.rand(4), random.random())  # what the RNGs give right after the save
    for _ in range(2):
        a.train_step(batch)

    b = trainer()
    b.train_step(batch)  # a different history before loading: the state replaces all of it
    assert b.load_state(str(tmp_path / "s")) == {"weight_version": 3} and b.step == 2
    resumed = (torch.rand(4), random.random())
    assert torch.equal(resumed[0], after_save[0]) and resumed[1] == after_save[1]  # RNGs restored
    for _ in range(2):
        b.train_step(batch)
    sa, sb = state_of(a), state_of(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])][:3]
    assert a.loss_state.state_dict() == b.loss_state.state_dict() and a.step == b.step == 4


def test_half_written_foreign_or_mismatched_states_are_refused(tmp_path):
    a = trainer()
    a.save_state(str(tmp_path / "s"))
    (tmp_path / "s" / "COMPLETE").unlink()
    with pytest.raises(TrainerStateError, match="no COMPLETE marker"):
        a.load_state(str(tmp_path / "s"))
    with pytest.raises(TrainerStateError, match="no COMPLETE marker: not a trainer state"):  # --resume's check
        check_trainer_state(str(tmp_path / "s"))
    a.save_state(str(tmp_path / "s"))
    meta = json.loads((tmp_path / "s" / "state.json").read_text())
    (tmp_path / "s" / "state.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(TrainerStateError, match=r"state\.json: \d+ bytes, COMPLETE says \d+"):  # changed after its commit
        a.load_state(str(tmp_path / "s"))
    from composer_mesh.mesh.storage import CommittedDir, FsspecBlobs

    recommit = CommittedDir(FsspecBlobs(str(tmp_path / "s")), marker="COMPLETE")  # as another version wrote it
    for name in ("state.safetensors", "state.json"):
        recommit.note(name)
    recommit.commit()
    with pytest.raises(TrainerStateError, match="format 99"):
        a.load_state(str(tmp_path / "s"))
    wider = trainer(ModelConfig(source="tiny", seed=3, hidden_size=32, num_heads=2, num_kv_heads=1))
    wider.save_state(str(tmp_path / "w"))
    with pytest.raises(TrainerStateError, match=r"another model: .*embed_tokens.weight: saved \(\d+, 32\)"):
        a.load_state(str(tmp_path / "w"))


def test_state_goes_to_any_fsspec_url(tmp_path):
    a = trainer()
    a.train_step(make_batch(a))
    a.save_state(f"file://{tmp_path}/s")
    b = trainer()
    b.load_state(f"file://{tmp_path}/s")
    sa, sb = state_of(a), state_of(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_snapshot_is_a_copy_that_training_no_longer_changes(tmp_path):
    """`snapshot_state` copies (also CPU tensors, which a plain `.cpu()` would alias); the write comes later."""
    a = trainer()
    batch = make_batch(a)
    a.train_step(batch)
    snapshot = a.snapshot_state(extra={"weight_version": 2})
    captured = state_of(a)
    after_capture = torch.rand(4)
    a.train_step(batch)  # AdamW updates weights and state in place
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(1.0)
    write_trainer_state(str(tmp_path / "s"), snapshot)

    b = trainer()
    assert b.load_state(str(tmp_path / "s")) == {"weight_version": 2} and b.step == 1
    assert torch.equal(torch.rand(4), after_capture)  # the RNG as it was at the capture
    sb = state_of(b)
    assert sb.keys() == captured.keys() and all(torch.equal(sb[k], captured[k]) for k in captured)
    assert not torch.equal(sb["w/model.embed_tokens.weight"], a.model.state_dict()["model.embed_tokens.weight"])


def test_resumed_service_republishes_under_the_saved_version(tmp_path):
    from composer_mesh.actors.trainer import TrainerService
    from composer_mesh.mesh.weights.config import WeightPlaneConfig
    from composer_mesh.mesh.weights.plane import WeightPlaneError

    config = WeightPlaneConfig(transport="endpoint")
    first = TrainerService(HFTrainer(HFTrainerSettings(lr=1e-2)), config)
    first.start(MODEL, LOSS, temperature=1.0)
    first.publish()
    for _ in range(3):
        first.train_step(make_batch(first.backend))
    assert first.version == 4
    first.save_state(str(tmp_path / "s"))
    resumed = TrainerService(HFTrainer(HFTrainerSettings(lr=1e-2)), config)
    resumed.start(MODEL, LOSS, temperature=1.0)
    resumed.publish()  # setup publishes version 1 ...
    manifest = resumed.load_state(str(tmp_path / "s"))  # ... and the resumed weights continue the run's numbering
    assert manifest.version == 4 and resumed.version == 4
    metrics, next_manifest = resumed.train_step(make_batch(resumed.backend))
    assert next_manifest.version == metrics.weight_version == 5
    with pytest.raises(WeightPlaneError, match="not newer"):
        resumed.publish(version=5)
    first.close()
    resumed.close()


def test_background_writes_are_reported_by_the_next_step_and_failures_raise(tmp_path):
    from composer_mesh.actors.trainer import TrainerService
    from composer_mesh.mesh.weights.config import WeightPlaneConfig

    service = TrainerService(HFTrainer(HFTrainerSettings(lr=1e-2)), WeightPlaneConfig(transport="endpoint"))
    service.start(MODEL, LOSS, temperature=1.0)
    service.publish()
    batch = make_batch(service.backend)
    service.train_step(batch)
    url = str(tmp_path / "bg")
    assert service.save_state(url, wait=False) == url  # copied now, written by the writer thread
    saved = state_of(service.backend)
    reported = [service.train_step(batch)[0].states_written]  # training goes on while the state is written
    while not reported[-1] and len(reported) < 500:  # the first step that starts after the write reports it
        reported.append(service.train_step(batch)[0].states_written)
    assert reported[-1] == [url] and not any(reported[:-1]) and service.flush_states() == []
    fresh = trainer()
    fresh.load_state(url)
    assert all(torch.equal(v, state_of(fresh)[k]) for k, v in saved.items())  # the state of the step it followed

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    service.save_state(str(blocker / "state"), wait=False)
    with pytest.raises(RuntimeError, match=r"writing the trainer state to .*file/state failed"):
        service.flush_states()
    service.close()
