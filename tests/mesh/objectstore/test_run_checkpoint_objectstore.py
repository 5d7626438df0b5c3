"""Run checkpoints on a real S3 server (moto) and a real GCS API server (gcp-storage-emulator): the controller's
part and a trainer's state go to `s3://` or `gs://`, only committed checkpoints are picked, and a resumed trainer
loads its state from there."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.config import ModelConfig
from composer_mesh.orchestration.checkpoint import CheckpointStore, find_checkpoint, read_checkpoint
from tests.orchestration.test_run_checkpoint import controller_state


@pytest.mark.parametrize("kind", [pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs", marks=pytest.mark.gcs)])
def test_run_checkpoints_go_to_the_object_store(request, kind, monkeypatch):
    fields = request.getfixturevalue(f"{kind}_store")
    # fsspec's own configuration (FSSPEC_S3_ENDPOINT_URL, FSSPEC_GCS_ENDPOINT_URL... in a real deployment) points
    # the protocol at the server; run checkpoints take no storage options of their own.
    conf = {"endpoint_url": fields["storage_options"]["endpoint_url"]}
    if kind == "gcs":
        conf.update(project="test", token=os.environ[fields["credentials_env"]["token"]])
    monkeypatch.setitem(fsspec.config.conf, kind, conf)
    url = fields["store_uri"].removesuffix("/diloco") + "/run/checkpoints"  # in the fixture's fresh bucket
    store = CheckpointStore(url)
    trainer = HFTrainer(HFTrainerSettings(lr=1e-2))
    trainer.start(ModelConfig(source="tiny", seed=3), LossConfig())
    for step in (1, 2, 3):
        trainer.save_state(store.trainer_url(step, 0), extra={"weight_version": step + 1})
        store.write_controller(controller_state(step))
        store.commit(step, keep=2)
    store.write_controller(controller_state(4))  # never committed
    assert store.committed() == [2, 3]
    latest = find_checkpoint(url)
    assert latest == store.step_url(3) and read_checkpoint(latest).step == 3
    fresh = HFTrainer(HFTrainerSettings(lr=1e-2))
    fresh.start(ModelConfig(source="tiny", seed=4), LossConfig())  # other weights until it loads
    assert fresh.load_state(f"{latest}/trainer/r0") == {"weight_version": 4}
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), fresh.model.parameters()))
