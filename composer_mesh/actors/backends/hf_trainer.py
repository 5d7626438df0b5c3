"""The transformers trainer: a causal LM + AdamW (optionally wrapped in DiLoCo) taking one `compose_loss` step
per `TrainBatch`. The batch becomes `compose_loss` inputs in `train_batch.build_loss_batch`.

Weight versions are not counted here: the trainer service's weight publisher is the one counter, and it
stamps `TrainMetrics.weight_version` and hands the version to `save_checkpoint`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, Field

from composer_mesh.actors.backends.local_model import TorchSettings
from composer_mesh.actors.backends.train_batch import build_loss_batch
from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.loss.compose import LossResult, compose_loss, new_loss_state
from composer_mesh.loss.config import LossConfig


class HFTrainerSettings(TorchSettings):
    device: str = Field("cpu", description="torch device of the policy: 'cpu', 'cuda', 'cuda:<index>' or 'mps'.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads in the trainer process.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the inner optimizer.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this (None: off).")
    reference_model: bool = Field(
        True,
        description="Keep a frozen copy of the initial policy for the KL term and DPO reference log-probs. "
        "Without it those terms are off.",
    )


class HFTrainer:
    """Binding `hf` for the trainer role: a transformers causal LM + AdamW + `compose_loss`."""

    Settings: ClassVar[type[BaseModel]] = HFTrainerSettings
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: HFTrainerSettings) -> None:
        self.settings = settings
        self.model: torch.nn.Module | None = None
        self.step = 0  # optimizer steps taken
        self.loss_state: Any = None

    # ---- setup -----------------------------------------------------------------------------------
    def start(
        self, model_config: Any, loss: LossConfig, temperature: float = 1.0,
        diloco: Any = None, replica_id: int = 0,
    ) -> None:
        """Build model, reference, AdamW and the loss state; with `diloco` (a `DiLoCoConfig`), wrap the
        optimizer in DiLoCo so every `sync_every` inner steps this replica syncs through the object store."""
        from composer_mesh.models.loading import load_pretrained

        torch.set_num_threads(self.settings.torch_threads)
        self.model, self.tokenizer = load_pretrained(model_config, device=self.settings.device)
        self.model.train()
        self.loss = loss
        self.temperature = temperature
        self.reference = None
        if self.settings.reference_model and (loss.kl_beta > 0 or (loss.beta_replay > 0 and loss.dpo_variant == "dpo")):
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.settings.lr, weight_decay=self.settings.weight_decay,
            betas=self.settings.betas,
        )
        self.loss_state = new_loss_state(loss)
        self.diloco = None
        if diloco is not None:
            from composer_mesh.mesh.objectstore.diloco import ObjectStoreDiLoCo

            self.diloco = ObjectStoreDiLoCo(self.model, self.optimizer, diloco, replica_id)
            self.diloco.__enter__()

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The tensors generators need (parameters, tied ones once, and persistent buffers), by HF name."""
        from composer_mesh.models.loading import named_weights

        assert self.model is not None, "call start() first"
        return named_weights(self.model)

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        """Forward, `compose_loss`, backward, clip, AdamW step."""
        assert self.model is not None, "call start() first"
        self.optimizer.zero_grad(set_to_none=True)
        loss_batch = build_loss_batch(
            batch, self.model, self.loss, temperature=self.temperature, reference=self.reference
        )
        result: LossResult = compose_loss(loss_batch, self.loss, step=self.step, state=self.loss_state)
        if not torch.isfinite(result.total):
            raise FloatingPointError(f"non-finite loss at step {self.step}: {result.total.item()}")
        result.total.backward()
        metrics = dict(result.metrics)
        if self.settings.grad_clip is not None:
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip))
        self.optimizer.step()  # with DiLoCo: every sync_every steps, the outer step happens inside this call
        if self.diloco is not None:
            metrics["diloco/outer_step"] = float(self.diloco.outer_step)
            metrics["diloco/round"] = float(self.diloco.round_id)
        self.step += 1
        rewards = torch.tensor([rw.score for g in batch.groups for rw in g.rewards])
        metrics["reward_mean"] = float(rewards.mean())
        metrics["reward_failures"] = float(sum(not rw.ok for g in batch.groups for rw in g.rewards))
        # weight_version=0: the trainer service publishes these weights and stamps the version it published.
        return TrainMetrics(
            step=self.step, weight_version=0, loss=float(result.total.detach()),
            channels={k: float(v.detach()) for k, v in result.parts.items()}, metrics=metrics,
        )

    def close(self) -> None:
        """Finish DiLoCo's pending store writes (no-op without DiLoCo)."""
        if self.diloco is not None:
            self.diloco.close()
            self.diloco = None

    def save_checkpoint(self, directory: Path, weight_version: int) -> Path:
        """Weights as safetensors + the tokenizer, loadable with `from_pretrained` (no pickles), and
        `trainer_state.json` with the optimizer step and `weight_version` (the published version, given by the
        trainer service: the one weight-version counter)."""
        assert self.model is not None
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)
        state = {"step": self.step, "weight_version": weight_version}
        (directory / "trainer_state.json").write_text(json.dumps(state) + "\n")
        return directory

