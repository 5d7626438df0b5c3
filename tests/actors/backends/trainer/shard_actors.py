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


class DiLoCoShardedRank(Actor):
    """Rank `current_rank() % world` of DiLoCo replica `current_rank() // world`: each replica is `world`
    consecutive procs of the mesh, meeting at its own address."""

    @endpoint
    async def train(self, addresses: list[str], world: int, settings: dict[str, Any], loss: dict[str, Any],
                    model: ModelConfig, diloco: Any, batches: list[list[TrainBatch]],
                    save_at: int | None = None, url: str | None = None) -> dict[str, Any]:
        """Replica r trains `batches[r]` (saving its state under `url` after `save_at` steps; loading it first when
        `save_at` is None and `url` is given); its steps' losses, the last round's report and (rank 0) weights."""
        me = current_rank().rank
        replica, rank = divmod(me, world)
        trainer = HFTrainer(HFTrainerSettings(**settings))
        trainer.start(model, LossConfig(**loss), diloco=diloco, replica_id=replica,
                      shard=ShardGroup(rank, world, addresses[replica]))
        if url is not None and save_at is None:
            trainer.load_state(f"{url}/replica{replica}")
        losses = []
        for i, batch in enumerate(batches[replica], start=trainer.step):
            losses.append(trainer.train_step(batch).loss)
            if save_at is not None and i + 1 == save_at:
                trainer.save_state(f"{url}/replica{replica}")
        report = trainer.diloco.last_report
        out = {"replica": replica, "rank": rank, "losses": losses, "outer_step": trainer.diloco.outer_step,
               "numel": report.numel, "bytes_read": report.bytes_read, "members": report.members,
               "weights": trainer.named_weights()}
        trainer.close()
        if rank != 0:
            out["weights"] = {}
        return out
