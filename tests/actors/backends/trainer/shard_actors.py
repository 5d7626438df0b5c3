"""An actor that trains one rank of a sharded `HFTrainer` replica (tests/actors/backends/trainer)."""

from __future__ import annotations

from typing import Any

import torch
from monarch.actor import Actor, current_rank, endpoint

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.sharding import ShardGroup
from composer_mesh.actors.messages import TrainBatch
from composer_mesh.loss.config import LossConfig
from composer_mesh.models.config import ModelConfig


class ShardedRank(Actor):
    """Rank `current_rank()` of a replica of every proc of its mesh."""

    @endpoint
    async def train(self, address: str, world: int, settings: dict[str, Any], loss: dict[str, Any],
                    model: ModelConfig, batches: list[TrainBatch], load: str | None = None,
                    save: str | None = None) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        """Train `batches` in order (after loading the state at `load`; then saving it at `save`); every step's
        loss, channels and metrics, and the final full weights."""
        trainer = HFTrainer(HFTrainerSettings(**settings))
        trainer.start(model, LossConfig(**loss), shard=ShardGroup(current_rank().rank, world, address))
        if load is not None:
            trainer.load_state(load)
        steps = []
        for batch in batches:
            m = trainer.train_step(batch)
            steps.append({"loss": m.loss, "channels": m.channels, "metrics": m.metrics})
        if save is not None:
            trainer.save_state(save)
        weights = trainer.named_weights()
        return steps, weights if current_rank().rank == 0 else {}
