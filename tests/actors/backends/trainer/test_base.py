"""`TrainerBackend` is all the trainer service needs of a binding: the service runs on a small fake of the protocol
(no model, no loss), and the hf trainer satisfies it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from composer_mesh.actors.backends.trainer.base import TrainerBackend
from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.actors.trainer import TrainerService
from composer_mesh.mesh.weights.config import WeightPlaneConfig


class FakeTrainer:
    """One weight tensor that grows by 1 per step; states kept in a dict (one per URL)."""

    Settings: ClassVar[type[BaseModel]] = BaseModel
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, states: dict[str, Any] | None = None) -> None:
        self.weight = torch.zeros(3)
        self.step = 0
        self.states = {} if states is None else states
        self.calls: list[str] = []

    def start(self, model_config: Any, loss: Any, temperature: float = 1.0, diloco: Any = None,
              replica_id: int = 0, shard: Any = None) -> None:
        self.calls.append(f"start replica {replica_id}")

    def rejoin(self, round_id: int) -> int:
        return round_id

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {"w": self.weight.clone()}

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        self.step += 1
        self.weight += 1
        return TrainMetrics(step=self.step, weight_version=0, loss=0.5)

    def snapshot_state(self, extra: dict[str, Any] | None = None) -> Any:
        return {"step": self.step, "weight": self.weight.clone(), "extra": dict(extra or {})}

    def write_state(self, url: str, snapshot: Any) -> None:
        self.states[url] = snapshot

    def load_state(self, url: str) -> dict[str, Any]:
        snapshot = self.states[url]
        self.step, self.weight = snapshot["step"], snapshot["weight"].clone()
        return snapshot["extra"]  # type: ignore[no-any-return]

    def save_checkpoint(self, directory: Path, weight_version: int) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "version").write_text(str(weight_version))
        return directory

    def close(self) -> None:
        self.calls.append("close")


def _service(backend: FakeTrainer) -> TrainerService:
    service = TrainerService(backend, WeightPlaneConfig(transport="endpoint"))
    service.start(model=None, loss=None, temperature=1.0, replica_id=1)
    return service


def test_the_service_needs_only_the_protocol(tmp_path: Path) -> None:
    backend = FakeTrainer()
    assert isinstance(backend, TrainerBackend)
    service = _service(backend)
    assert service.publish().version == 1 and backend.calls == ["start replica 1"]
    metrics, manifest = service.train_step(TrainBatch(groups=[]))
    assert metrics.weight_version == manifest.version == 2 and metrics.states_written == []

    service.save_state("mem://a", wait=True)  # stamped with the published version, written by the binding
    assert backend.states["mem://a"]["extra"] == {"weight_version": 2}
    assert service.save_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt"
    assert (tmp_path / "ckpt" / "version").read_text() == "2"
    service.train_step(TrainBatch(groups=[]))
    service.close()
    assert backend.calls[-1] == "close"

    resumed_backend = FakeTrainer(backend.states)
    resumed = _service(resumed_backend)
    resumed.publish()
    assert resumed.load_state("mem://a").version == 2  # the saved state's version, not a new one
    assert resumed_backend.step == 1 and torch.equal(resumed_backend.weight, torch.ones(3))
    resumed.close()


def test_the_hf_trainer_is_a_trainer_backend() -> None:
    assert isinstance(HFTrainer(HFTrainerSettings()), TrainerBackend)
