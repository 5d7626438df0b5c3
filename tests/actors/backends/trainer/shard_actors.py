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


def local_state(trainer: HFTrainer) -> dict[str, torch.Tensor]:
    """This rank's own part of the trainer's state, copied: its weight shards (and plain buffers) and every AdamW
    state tensor of its shards (moments and step). Local tensors only: comparing them needs no collective."""
    from torch.distributed.tensor import DTensor

    def mine(t: Any) -> torch.Tensor:
        t = torch.as_tensor(t)
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    assert trainer.model is not None
    out = {f"w/{k}": mine(v) for k, v in trainer.model.state_dict().items()}
    for i, entry in trainer.optimizer.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": mine(v) for k, v in entry.items()})
    return out


def own_grads_finite(trainer: HFTrainer) -> bool:
    """Whether every gradient shard this rank holds (None: dropped) is finite: no collective."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]  # type: ignore[union-attr]
    return all(bool(torch.isfinite(g.to_local() if isinstance(g, DTensor) else g).all()) for g in grads)


def poison_one_gradient_shard(trainer: HFTrainer) -> Any:
    """Make this rank's shard of one gradient non-finite, after FSDP2's reduce-scatter: the state in which a
    gradient element overflowed on some rank's backward and the sum landed in the shard of the rank that owns the
    element (an inf in an element the OTHER rank owns would be in that rank's shard only). FSDP2 calls a sharded
    parameter's post-accumulate-grad hooks right after it sets or adds the reduced shard (the hook optimizers in
    backward use), so the hook sees exactly the gradient the optimizer would; the loss stays finite. The handle;
    `remove()` it after the step."""
    from torch.distributed.tensor import DTensor

    param = next(p for p in trainer.model.parameters()  # type: ignore[union-attr]
                 if isinstance(p, DTensor) and p.requires_grad and p.to_local().numel() > 0)

    def poison(p: torch.Tensor) -> None:
        with torch.no_grad():
            p.grad.to_local().view(-1)[-1] = float("inf")  # type: ignore[union-attr]

    return param.register_post_accumulate_grad_hook(poison)


class NonFiniteRank(Actor):
    """Rank `current_rank()` of a replica whose rank `poisoned_rank` gets a non-finite gradient shard at some steps."""

    @endpoint
    async def train(self, address: str, world: int, settings: dict[str, Any], loss: dict[str, Any],
                    model: ModelConfig, batches: list[TrainBatch], poisoned_steps: list[int], poisoned_rank: int,
                    on_nonfinite: str) -> dict[str, Any]:
        """Train `batches` in order (step i+1 is `batches[i]`; the steps in `poisoned_steps` poisoned on
        `poisoned_rank`) until one raises NonFiniteError; per step this rank's state before and after it, and its
        metrics or the error's text, and whether its own gradient shards are finite after it; then (rank 0, when no step raised) the final full weights."""
        from composer_mesh.actors.backends.trainer.base import NonFiniteError

        rank = current_rank().rank
        trainer = HFTrainer(HFTrainerSettings(**settings))
        # A short process-group timeout (where this call creates the proc's group; a proc joins one only once):
        # ranks that decided differently fail the test in a minute, not hang it.
        trainer.start(model, LossConfig(**loss), shard=ShardGroup(rank, world, address, timeout_s=60.0),
                      on_nonfinite=on_nonfinite)  # type: ignore[arg-type]
        steps: list[dict[str, Any]] = []
        for step, batch in enumerate(batches, start=1):
            hook = poison_one_gradient_shard(trainer) if step in poisoned_steps and rank == poisoned_rank else None
            out: dict[str, Any] = {"before": local_state(trainer)}
            try:
                m = trainer.train_step(batch)
                out.update(step=m.step, loss=m.loss, metrics=m.metrics)
            except NonFiniteError as e:
                out["raised"] = str(e)
            finally:
                if hook is not None:
                    hook.remove()
            out["after"] = local_state(trainer)
            out["own_grads_finite"] = own_grads_finite(trainer)
            steps.append(out)
            if "raised" in out:
                return {"rank": rank, "steps": steps, "weights": {}}
        weights = dict(trainer.named_weights())  # a collective: every rank reads every tensor
        return {"rank": rank, "steps": steps, "weights": weights if rank == 0 else {}}
