"""The transformers trainer: a causal LM + AdamW (optionally wrapped in DiLoCo) taking one optimizer step per
`TrainBatch`, over micro-batches of at most `micro_batch_tokens` tokens with gradient accumulation.

Each micro-batch becomes `compose_loss` inputs in `train_batch.build_piece` and is one piece of a
`LossAccumulator`, whose channel losses divide by the whole batch's counts: the accumulated gradient is the
gradient of the whole batch's loss, however it is cut. Precision: `fp32`; `bf16-mixed` (forward under bf16
autocast, float32 master weights and AdamW state); `bf16` (weights and AdamW state in bf16).

With `lora` (a `LoraConfig`), peft adapters are injected into the loaded model (`models/lora.py`): only they
train and only they are in AdamW and the trainer state (the frozen base is rebuilt from `model.source`); the KL /
DPO reference is the same model with its adapters disabled, not a copy; generators get the merged weights, or
the adapter tensors alone with `lora.sync: adapter` (`weight_kind`).

Weight versions are not counted here: the trainer service's weight publisher is the one counter, and it
stamps `TrainMetrics.weight_version` and hands the version to `save_checkpoint`.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import BaseModel

from composer_mesh.actors.backends.trainer.base import NonFiniteError, OnNonFinite
from composer_mesh.actors.backends.trainer.config import (
    HF_TRAINER_CAPABILITIES,
    HFTrainerSettings,
    scheduled_lr,
)
from composer_mesh.actors.backends.trainer.train_batch import (
    Piece,
    StudentPass,
    TrainRows,
    build_piece,
    check_chunked_head,
    episode_metrics,
)
from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.loss.compose import LossAccumulator, LossResult, new_loss_state
from composer_mesh.loss.config import LossConfig

if TYPE_CHECKING:
    from composer_mesh.actors.backends.trainer.sharding import ShardGroup, TorchRanks
    from composer_mesh.actors.backends.trainer.trainer_state import TrainerSnapshot

WeightKind = Literal["full", "adapter"]
log = logging.getLogger(__name__)


class HFTrainer:
    """Binding `hf` for the trainer role: a transformers causal LM + AdamW + `compose_loss`."""

    Settings: ClassVar[type[BaseModel]] = HFTrainerSettings
    capabilities: ClassVar[frozenset[str]] = HF_TRAINER_CAPABILITIES

    def __init__(self, settings: HFTrainerSettings) -> None:
        self.settings = settings
        self.model: torch.nn.Module | None = None
        self.shard: ShardGroup | None = None
        self._ranks: TorchRanks | None = None
        self.step = 0  # optimizer steps taken
        self.loss_state: Any = None
        # What `named_weights` holds: the full weights ('full'), or the LoRA adapter tensors ('adapter', with
        # lora.sync: adapter), for generators that apply the same LoRA config (`models.lora.load_adapter_weights`).
        self.weight_kind: WeightKind = "adapter" if settings.lora is not None and settings.lora.sync == "adapter" else "full"

    # ---- setup -----------------------------------------------------------------------------------
    def start(
        self, model_config: Any, loss: LossConfig, temperature: float = 1.0,
        diloco: Any = None, replica_id: int = 0, shard: ShardGroup | None = None, on_nonfinite: OnNonFinite = "stop",
    ) -> None:
        """Build model (with LoRA adapters if set), reference, AdamW and the loss state; with `diloco` (a
        `DiLoCoConfig`), wrap the optimizer in DiLoCo so every `sync_every` inner steps this replica syncs
        through the object store. With `shard`, this proc is one rank of a replica sharded with FSDP2 over
        `shard.world` procs (`sharding.py`): policy and reference are sharded, AdamW holds this rank's shards."""
        from composer_mesh.models.loading import load_pretrained, torch_dtype

        check_with_diloco(diloco, lora=self.settings.lora is not None, skip=on_nonfinite == "skip")
        self.shard, self.on_nonfinite = shard, on_nonfinite
        torch.set_num_threads(self.settings.torch_threads)
        self.model, self.tokenizer = load_pretrained(model_config, device=self.settings.device)
        # Training keeps its own dtype (float32 master weights unless precision is 'bf16'); generators load
        # `model.dtype`, so that is the dtype the weights are published in.
        self.publish_dtype = torch_dtype(model_config.dtype)
        self.model.to({"bf16": torch.bfloat16, "fp64": torch.float64}.get(self.settings.precision, torch.float32))
        if self.settings.attn_implementation is not None:
            self.model.set_attn_implementation(self.settings.attn_implementation)
        if self.settings.lora is not None:
            from composer_mesh.models.lora import apply_lora

            self.model = apply_lora(self.model, self.settings.lora)
        if self.settings.lm_head == "chunked":
            check_chunked_head(self.model)
        if self.settings.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.loss = loss
        self.temperature = temperature
        self._build_reference(loss)
        self._ranks: TorchRanks | None = None
        if shard is not None:  # FSDP2 on policy and reference, before AdamW takes the (sharded) parameters
            from composer_mesh.actors.backends.trainer.sharding import shard_trainer

            self._ranks = shard_trainer(self.model, self.reference, shard, self.settings)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA: the adapters only
            lr=self.settings.lr, weight_decay=self.settings.weight_decay,
            betas=self.settings.betas, foreach=True,  # one multi-tensor update (torch picks it on GPUs, not on CPU)
        )
        self.loss_state = new_loss_state(loss)
        self.diloco = None
        if diloco is not None:
            from composer_mesh.mesh.objectstore.diloco import ObjectStoreDiLoCo

            # A sharded replica's rank syncs its own shards with the same rank of the other replicas.
            self.diloco = ObjectStoreDiLoCo(self.model, self.optimizer, diloco, replica_id,
                                            shard=None if shard is None else (shard.rank, shard.world))
            self.diloco.__enter__()

    def _build_reference(self, loss: LossConfig) -> None:
        """The KL / DPO reference, when a term needs it: a frozen copy of the initial policy, or with LoRA the
        policy itself run under `_base_policy` (adapters off: the initial policy, since the base never trains)."""
        assert self.model is not None
        self.reference: torch.nn.Module | None = None
        self.reference_scope: Callable[[], AbstractContextManager[Any]] = nullcontext  # a reference forward's context
        if not (self.settings.reference_model and (loss.kl_beta > 0 or (loss.beta_replay > 0 and loss.dpo_variant == "dpo"))):
            return
        if self.settings.lora is not None:
            self.reference, self.reference_scope = self.model, self._base_policy
            return
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self.settings.precision == "bf16-mixed":  # it only ever runs under bf16 autocast: half the memory
            self.reference.to(torch.bfloat16)

    @contextmanager
    def _base_policy(self) -> Iterator[None]:
        """The LoRA policy as its frozen base, in eval mode (as the copied reference is), for a reference forward."""
        from composer_mesh.models.lora import adapter_disabled

        assert self.model is not None
        training = self.model.training
        self.model.eval()
        try:
            with adapter_disabled(self.model):
                yield
        finally:
            self.model.train(training)

    def rejoin(self, round_id: int) -> int:
        """Right after `start`, in place of a dead DiLoCo replica: heal from the store at round `round_id`
        (`ObjectStoreDiLoCo.rejoin`, waiting up to half the quorum deadline for its checkpoint). Returns the
        optimizer steps behind the healed weights, which become this trainer's step count."""
        if self.diloco is None:
            raise RuntimeError("only a DiLoCo replica can rejoin: a lone trainer's state dies with its proc")
        self.step = self.diloco.rejoin(round_id, wait_s=self.diloco.config.quorum_deadline_s / 2)
        if self._ranks is not None:  # every rank healed its own shards: from the same round, or not at all
            from composer_mesh.actors.backends.trainer.sharding import check_same_round

            check_same_round(self._ranks, self.diloco.manager.replica_id, self.diloco.round_id)
        return self.step

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """What generators get (`weight_kind`). 'full': the tensors generators need (parameters, tied ones once,
        and persistent buffers), by HF name, in the model config's dtype (a copy only where the training dtype
        differs); with LoRA the adapters merged in, under the plain model's names. 'adapter': the LoRA adapter
        tensors by the injected model's names (`models.lora.adapter_weights`), in their training dtype (float32).
        On a sharded replica a `sharding.GatheredWeights`: each tensor is gathered when read, a collective of the
        replica's ranks, so the weight plane never holds the whole model unsharded."""
        from composer_mesh.models.loading import named_weights

        assert self.model is not None, "call start() first"
        if self.shard is not None:  # every rank gathers, tensor by tensor as they are read; rank 0 publishes
            return self._gathered(self.publish_dtype if self.weight_kind == "full" else None, self.weight_kind)
        if self.settings.lora is not None:
            from composer_mesh.models.lora import adapter_weights, merged_weights

            if self.weight_kind == "adapter":
                return adapter_weights(self.model)
            return merged_weights(self.model, self.publish_dtype)
        weights = named_weights(self.model)
        return {name: t.to(self.publish_dtype) if t.is_floating_point() else t for name, t in weights.items()}

    def _gathered(self, dtype: torch.dtype | None, kind: WeightKind) -> Mapping[str, torch.Tensor]:
        from composer_mesh.actors.backends.trainer.sharding import gathered_weights

        assert self.model is not None
        return gathered_weights(self.model, dtype, self.settings.lora is not None, kind)

    # ---- one step ----------------------------------------------------------------------------------
    def _autocast(self) -> Any:
        if self.settings.precision != "bf16-mixed":
            return nullcontext()
        return torch.autocast(torch.device(self.settings.device).type, dtype=torch.bfloat16)

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        """Micro-batched forward + `compose_loss` + backward, then clip and one AdamW step."""
        assert self.model is not None, "call start() first"
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        data = TrainRows.of(batch, self.loss)
        run = StudentPass(self.model, self.loss, self.temperature, self.reference, s.lm_head, s.packing,
                          self.reference_scope)
        advantages = data.advantages(self.loss)  # [N] or [N, T] per token (per-turn credit); each episode once
        accumulator = LossAccumulator(self.loss, data.totals(), step=self.step, state=self.loss_state)
        pieces: list[Piece | None] = list(data.micro_batches(s.micro_batch_tokens, s.packing))
        if self.shard is not None:  # this rank's share, padded to the busiest rank's count
            from composer_mesh.actors.backends.trainer.sharding import rank_pieces

            pieces = rank_pieces(data, self.shard.world, self.shard.rank, s.micro_batch_tokens, s.packing)
        for piece in pieces:
            with self._autocast():
                if piece is None:  # a sharded rank with fewer micro-batches than the busiest
                    from composer_mesh.actors.backends.trainer.sharding import idle_pass

                    idle_pass(data, run)
                    continue
                loss_batch = build_piece(data, piece, run, advantages, uniform=self.shard is not None)
            accumulator.add(loss_batch).total.backward()
            del loss_batch
        # one host sync for the whole step, not one per micro-batch; sharded: merged over the replica's ranks
        result: LossResult = accumulator.finish(self._ranks, sorted({t.teacher for t, _ in data.pairs}))
        grad_norm = total_grad_norm(self.optimizer, s.grad_clip)
        if not (torch.isfinite(result.total) and torch.isfinite(torch.tensor(grad_norm))):
            nonfinite(float(result.total), grad_norm, self.step + 1, self.on_nonfinite)  # raises with stop
            self.optimizer.zero_grad(set_to_none=True)  # skipped: no optimizer step, the weights as they were
            self.step += 1  # counted: the LR schedule moves on
            return skipped_step(self.step, float(result.total), batch, data)
        metrics = dict(result.metrics)
        metrics["micro_batches"] = float(len(pieces))
        metrics.update(episode_metrics(data.rollouts))
        if self.loss.beta_replay > 0 and batch.traces:  # next to replay/pairs (also when no trace was paired)
            metrics.setdefault("replay/pairs", float(len(data.pairs)))
            metrics["replay/traces_not_better"] = float(data.traces_not_better)
        if s.grad_clip is not None:
            metrics["grad_norm"] = grad_norm
        metrics.update({"faults/nonfinite_skipped": 0.0} if self.on_nonfinite == "skip" else {})
        if s.lr_decay_steps is not None or s.lr_warmup_steps:
            metrics["lr"] = scheduled_lr(s, self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = metrics["lr"]
        self.optimizer.step()  # with DiLoCo: every sync_every steps, the outer step happens inside this call
        if self.diloco is not None:
            metrics["diloco/outer_step"] = float(self.diloco.outer_step)
            metrics["diloco/round"] = float(self.diloco.round_id)
        self.step += 1
        metrics["reward_mean"] = float(data.episode_rewards().mean())
        metrics["reward_failures"] = float(sum(not rw.ok for g in batch.groups for rw in g.rewards))
        # weight_version=0: the trainer service publishes these weights and stamps the version it published.
        return TrainMetrics(
            step=self.step, weight_version=0, loss=float(result.total),
            channels={k: float(v) for k, v in result.parts.items()}, metrics=metrics,
        )

    def close(self) -> None:
        """Finish DiLoCo's pending store writes (no-op without DiLoCo)."""
        if self.diloco is not None:
            self.diloco.close()
            self.diloco = None

    def snapshot_state(self, extra: dict[str, Any] | None = None) -> TrainerSnapshot:
        """A copy of everything needed to continue training bitwise (`trainer_state.py`): weights, AdamW state,
        the step, the RNGs, the loss state and, on a DiLoCo replica, its DiLoCo state. Taken on the training
        thread between steps, and cheap (CPU copies, no serialisation, no I/O): write it with
        `write_trainer_state`, also from another thread while training goes on. The reference model is not
        saved: `start` rebuilds it from the model source. With LoRA only the adapters (the trainable parameters)
        and their AdamW state are saved, and the adapter's shape (`lora` in `extra_json`): the frozen base is
        rebuilt from the model source too. A DiLoCo replica refuses while a fragment's sync is in flight
        (`DiLoCoConfig.checkpointable`)."""
        from composer_mesh.actors.backends.trainer.trainer_state import capture_trainer_state

        assert self.model is not None, "call start() first"
        extra_tensors, extra_json = None, {}
        if self.diloco is not None:
            tensors, meta = diloco_call(self.diloco.replica_state)
            extra_tensors, extra_json = {"diloco": tensors}, {"diloco": meta}
        if self.settings.lora is not None:
            extra_json["lora"] = self._lora_shape()
        if self.shard is not None:
            extra_json["shard"] = {"rank": self.shard.rank, "world": self.shard.world}
        loss_state = self.loss_state.state_dict() if self.loss_state is not None else None
        return capture_trainer_state(self.model, self.optimizer, self.step, loss_state, extra, extra_tensors,
                                     extra_json or None, trainable_only=self.settings.lora is not None)

    def _lora_shape(self) -> dict[str, Any] | None:
        """What a saved adapter must share with this trainer's to be loaded (dropout and sync may differ)."""
        lora = self.settings.lora
        return None if lora is None else lora.model_dump(mode="json", include={"r", "alpha", "target_modules"})

    def write_state(self, url: str, snapshot: TrainerSnapshot) -> None:
        """Write `snapshot` (from `snapshot_state`) under `url` (any fsspec URL): `trainer_state.py`'s files. It
        touches nothing of the live trainer, so the trainer service runs it on its writer thread."""
        from composer_mesh.actors.backends.trainer.trainer_state import write_trainer_state

        write_trainer_state(self._state_url(url), snapshot)

    def _state_url(self, url: str) -> str:
        """Where this proc's state goes: `url`, or for rank r of a sharded replica `url/rank<r>` (its shards)."""
        return url if self.shard is None else f"{url.rstrip('/')}/rank{self.shard.rank}"

    def save_state(self, url: str, extra: dict[str, Any] | None = None) -> None:
        """`snapshot_state` written under `url` (any fsspec URL), on this thread."""
        self.write_state(url, self.snapshot_state(extra))

    def load_state(self, url: str) -> dict[str, Any]:
        """Continue from a state written by `save_state` (after `start` with the same topology); its `extra`.

        Everything is checked before anything is loaded. A DiLoCo replica also rewinds the object store to the
        saved round (`ObjectStoreDiLoCo.load_replica_state`): the controller loads every replica and waits for
        all of them before any replica trains again."""
        from composer_mesh.actors.backends.trainer.trainer_state import (
            TrainerStateError,
            restore_trainer_state,
        )

        assert self.model is not None, "call start() first"
        snapshot = read_snapshot(url, self._state_url(url), self.shard, self.model, self.optimizer)
        shard = None if self.shard is None else {"rank": self.shard.rank, "world": self.shard.world}
        check_same_setup(url, snapshot.meta, self.loss_state is not None, self._lora_shape(), shard)
        saved = snapshot.meta["extra_json"].get("diloco")
        if (saved is None) != (self.diloco is None):
            live = ("no DiLoCo" if self.diloco is None else
                    f"DiLoCo replica {self.diloco.manager.replica_id} of {self.diloco.config.replicas}")
            was = "no DiLoCo" if saved is None else f"DiLoCo replica {saved['replica_id']} of {saved['replicas']}"
            raise TrainerStateError(f"{url}: saved by a trainer with {was}, this trainer has {live}")
        if self.diloco is not None:
            diloco_call(self.diloco.check_replica_state, snapshot.group("diloco"), saved, url=url)
        restore_trainer_state(url, snapshot, self.model, self.optimizer, trainable_only=self.settings.lora is not None)
        if self.loss_state is not None:
            self.loss_state.load_state_dict(snapshot.meta["loss_state"])
        if self.diloco is not None:
            diloco_call(self.diloco.load_replica_state, snapshot.group("diloco"), saved, url=url)
        self.step = snapshot.step
        return snapshot.extra

    def save_checkpoint(self, directory: Path, weight_version: int) -> Path:
        """Weights as safetensors + the tokenizer, loadable with `from_pretrained` (no pickles), and
        `trainer_state.json` with the optimizer step and `weight_version` (the published version, given by the
        trainer service: the one weight-version counter). With LoRA the weights are the merged model (a plain
        transformers model), and the adapter alone is under `adapter/` in peft's format. A sharded replica's
        ranks all gather the weights; rank 0 writes them."""
        assert self.model is not None
        state_dict, adapters, lora = None, None, self.settings.lora is not None
        if self.shard is not None:  # every rank gathers (training dtype), the whole model at once, to write it
            state_dict = dict(self._gathered(None, "full"))
            adapters = dict(self._gathered(None, "adapter")) if lora else None
            if self.shard.rank != 0:
                return directory
        return write_checkpoint(self.model, self.tokenizer, directory, state_dict, lora,
                                {"step": self.step, "weight_version": weight_version}, adapters)


def write_checkpoint(model: torch.nn.Module, tokenizer: Any, directory: Path, state_dict: dict[str, torch.Tensor] | None,
                     lora: bool, state: dict[str, int], adapters: dict[str, torch.Tensor] | None = None) -> Path:
    """`HFTrainer.save_checkpoint`'s files: `state_dict` (gathered shards; LoRA: merged) or the model's own
    weights (LoRA: merged), with LoRA the adapter under `adapter/` (`adapters`: gathered), the tokenizer, and
    `trainer_state.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    if lora:
        from composer_mesh.models.lora import merged_weights, save_adapter

        state_dict = merged_weights(model) if state_dict is None else state_dict
        save_adapter(model, directory / "adapter", adapters)
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / "trainer_state.json").write_text(json.dumps(state) + "\n")
    return directory


def check_same_setup(url: str, meta: dict[str, Any], loss_state: bool, lora: dict[str, Any] | None,
                     shard: dict[str, int] | None) -> None:
    """A trainer state loads only into a trainer set up like the one that saved it: adaptive TAID on or off, the
    same LoRA shape, the same sharding (rank r of a replica of the same number of procs)."""
    from composer_mesh.actors.backends.trainer.trainer_state import TrainerStateError

    extra = meta["extra_json"]
    if extra.get("shard") != shard:
        def procs(s: dict[str, int] | None) -> str:
            return "one proc" if s is None else f"{s['world']} sharded procs"

        raise TrainerStateError(f"{url}: saved by a replica of {procs(extra.get('shard'))}, this replica has "
                                f"{procs(shard)}: resume with the same roles.trainer.procs_per_replica")
    if (meta["loss_state"] is None) == loss_state:
        raise TrainerStateError(f"{url}: the loss state does not match this loss config (adaptive TAID on/off)")
    if extra.get("lora") != lora:
        raise TrainerStateError(f"{url}: saved by a trainer with lora {extra.get('lora') or 'off'}, this trainer has "
                                f"lora {lora or 'off'}")


def total_grad_norm(optimizer: torch.optim.Optimizer, clip: float | None) -> float:
    """The gradient's total norm (after clipping it to `clip`, when set): a collective on a sharded replica, so
    every rank sees the same value and takes the same decision on it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = (torch.nn.utils.clip_grad_norm_(params, clip) if clip is not None
            else torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def check_with_diloco(diloco: Any, lora: bool, skip: bool) -> None:
    """What a DiLoCo replica cannot do: LoRA (DiLoCo would synchronise and checkpoint the whole frozen model, not
    the adapters), skipping a non-finite step (the replica would leave its rounds' cadence)."""
    if lora and diloco is not None:
        raise ValueError("trainer.settings.lora and diloco (roles.trainer.replicas > 1) cannot be combined: "
                         "DiLoCo would synchronise and checkpoint the whole frozen model, not the adapters; "
                         "drop one of them")
    if skip and diloco is not None:
        raise ValueError("run.on_nonfinite: skip cannot be combined with diloco: a replica that skips a step "
                         "would leave its rounds' cadence")


def skipped_step(step: int, loss: float, batch: TrainBatch, data: TrainRows) -> TrainMetrics:
    """The metrics of a step skipped for a non-finite loss or gradient (`run.on_nonfinite: skip`)."""
    return TrainMetrics(step=step, weight_version=0, loss=loss, metrics={
        "faults/nonfinite_skipped": 1.0, "reward_mean": float(data.episode_rewards().mean()),
        "reward_failures": float(sum(not rw.ok for g in batch.groups for rw in g.rewards))})


def nonfinite(loss: float, grad_norm: float, step: int, on_nonfinite: str) -> None:
    """Trainer step `step` has a non-finite loss or gradient, found before the optimizer step (the weights are
    still those of the step before). `stop`: NonFiniteError naming the step and the quantity; `skip`: a warning
    (the caller skips the update)."""
    what = f"loss ({loss})" if not torch.isfinite(torch.tensor(loss)) else f"gradient (total norm {grad_norm})"
    if on_nonfinite != "skip":
        raise NonFiniteError(f"trainer step {step}: non-finite {what}; the update was not applied (a learning rate "
                             "too high, a bad row, reward or loss setting?); run.on_nonfinite: skip skips such steps "
                             "instead")
    log.warning("trainer step %d: non-finite %s: skipped, the weights are unchanged (run.on_nonfinite: skip)", step,
                what)


def diloco_call(fn: Any, *args: Any, url: str | None = None) -> Any:
    """`fn(*args)` with a DiLoCo state refusal raised as the TrainerStateError callers of the state expect."""
    from composer_mesh.actors.backends.trainer.trainer_state import TrainerStateError
    from composer_mesh.mesh.objectstore.diloco import DiLoCoStateError

    try:
        return fn(*args)
    except DiLoCoStateError as e:
        raise TrainerStateError(f"{url}: {e}" if url else str(e)) from e


def read_snapshot(url: str, own_url: str, shard: ShardGroup | None, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer) -> TrainerSnapshot:
    """The state under `url` for this proc (its own part at `own_url`), or, when it was saved by another number of
    ranks (or one unsharded proc), every saved part cut again for this proc (`sharding.reshard_snapshot`)."""
    from composer_mesh.actors.backends.trainer.trainer_state import read_trainer_state, sharded_world

    saved_world = sharded_world(url)
    if saved_world == (None if shard is None else shard.world):
        return read_trainer_state(own_url)
    from composer_mesh.actors.backends.trainer.sharding import reshard_snapshot
    from composer_mesh.actors.backends.trainer.trainer_state import TrainerStateError

    urls = [url] if saved_world is None else [f"{url.rstrip('/')}/rank{r}" for r in range(saved_world)]
    snapshots = [read_trainer_state(u) for u in urls]
    if "diloco" in snapshots[0].meta["extra_json"]:  # its rounds live in the store per shard of that world
        live = "one proc" if shard is None else f"{shard.world} procs"
        raise TrainerStateError(f"{url}: a DiLoCo replica saved by {saved_world or 1} proc(s) cannot resume on {live}: "
                                "its object-store rounds are kept per shard; resume with the same "
                                "roles.trainer.procs_per_replica")
    return reshard_snapshot(snapshots, model, optimizer, shard)
