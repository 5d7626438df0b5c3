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
                    save: str | None = None, checkpoint: str | None = None,
                    ) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        """Train `batches` in order (after loading the state at `load`; then saving it at `save`, and the final
        model as a checkpoint directory at `checkpoint`); every step's loss, channels and metrics, and the final
        full weights."""
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
        if checkpoint is not None:
            from pathlib import Path

            trainer.save_checkpoint(Path(checkpoint), weight_version=len(batches) + 1)
        weights = dict(trainer.named_weights())  # a sharded trainer gathers each tensor as it is read
        return steps, weights if current_rank().rank == 0 else {}


class PublishingRank(Actor):
    """Rank `current_rank()` of a sharded replica publishing on the weight plane (shm) as the trainer actor does."""

    def __init__(self) -> None:
        self.service: Any = None

    @endpoint
    async def train_and_publish(self, address: str, world: int, settings: dict[str, Any], loss: dict[str, Any],
                                model: ModelConfig, batch: TrainBatch) -> dict[str, Any]:
        """One step, then publish while counting the gathered (whole) tensors alive at once; the manifest (rank 0)
        and that peak. The publisher stays up for the caller to pull until `close`."""
        import weakref

        from torch.distributed.tensor import DTensor

        from composer_mesh.actors.backends.trainer.sharding import GatheredWeights
        from composer_mesh.actors.trainer import TrainerService
        from composer_mesh.mesh.weights.config import WeightPlaneConfig

        rank = current_rank().rank
        self.service = TrainerService(HFTrainer(HFTrainerSettings(**settings)), WeightPlaneConfig(transport="shm"))
        self.service.start(model, LossConfig(**loss), 1.0, shard=ShardGroup(rank, world, address))
        self.service.train_step(batch)
        # Whole tensors alive at once: the gathers' outputs, and what GatheredWeights hands out (in publish dtype).
        alive, peak = {"gathered": 0, "read": 0}, {"gathered": 0, "read": 0}
        gather, read = DTensor.full_tensor, GatheredWeights.__getitem__

        def counting(kind: str, fn: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
                out = fn(*args, **kwargs)
                alive[kind] += 1
                peak[kind] = max(peak[kind], alive[kind])
                weakref.finalize(out, lambda: alive.__setitem__(kind, alive[kind] - 1))
                return out
            return wrapped

        DTensor.full_tensor = counting("gathered", gather)  # type: ignore[method-assign]
        GatheredWeights.__getitem__ = counting("read", read)  # type: ignore[method-assign]
        try:
            manifest = self.service.publish()
        finally:
            DTensor.full_tensor, GatheredWeights.__getitem__ = gather, read  # type: ignore[method-assign]
        return {"manifest": manifest, "peak": peak, "version": self.service.version}

    @endpoint
    async def close(self) -> None:
        self.service.close()


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
               "weights": dict(trainer.named_weights())}
        trainer.close()
        if rank != 0:
            out["weights"] = {}
        return out
