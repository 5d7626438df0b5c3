"""The transformers trainer: turns a `TrainBatch` into `compose_loss` inputs and takes an optimizer step.

Alignment used everywhere (student, reference, teachers): for a sequence `prompt + completion`, the logits at
position `len(prompt) - 1 + t` score completion token `t`.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from composer_mesh.actors.backends.local_model import check_device
from composer_mesh.actors.messages import TeacherTrace, TrainBatch, TrainMetrics
from composer_mesh.loss.compose import LossBatch, LossResult, ReplayPairs, compose_loss, new_loss_state
from composer_mesh.loss.config import LossConfig


class HFTrainerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = Field("cpu", description="torch device of the policy: 'cpu', 'cuda', 'cuda:<index>' or 'mps'.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the inner optimizer.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this (None: off).")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads in the trainer process.")
    reference_model: bool = Field(
        True,
        description="Keep a frozen copy of the initial policy for the KL term and DPO reference log-probs. "
        "Without it those terms are off.",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)


def _pad(
    rows: list[list[int]] | list[list[float]], value: float, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


def completion_logits(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """Logits [B, T, V] where [b, t] scores completion token t of row b (T = longest completion)."""
    device = next(model.parameters()).device
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids = _pad(seqs, 0, torch.long, device)
    attn = _pad([[1] * len(s) for s in seqs], 0, torch.long, device)
    logits = model(input_ids=ids, attention_mask=attn).logits  # [B, L, V]
    width = max(max((len(c) for c in completions), default=1), 1)
    index = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        pos = torch.arange(width) + len(p) - 1
        index[b] = pos.clamp(max=len(p) + len(c) - 1)
    index = index.to(device)
    return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


class HFTrainer:
    """Binding `hf` for the trainer role: a transformers causal LM + AdamW + `compose_loss`."""

    Settings: ClassVar[type[BaseModel]] = HFTrainerSettings
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: HFTrainerSettings) -> None:
        self.settings = settings
        self.model: torch.nn.Module | None = None
        self.step = 0
        self.version = 0
        self.loss_state: Any = None

    # ---- setup -----------------------------------------------------------------------------------
    def start(
        self, model_config: Any, loss: LossConfig, temperature: float = 1.0,
        diloco: Any = None, replica_id: int = 0,
    ) -> None:
        """Build model, reference, AdamW and the loss state; with `diloco` (a `DiLoCoConfig`), wrap the
        optimizer in DiLoCo so every `sync_every` inner steps this replica syncs through the object store."""
        from composer_mesh.models.tiny import load_pretrained

        torch.set_num_threads(self.settings.torch_threads)
        self.model, self.tokenizer = load_pretrained(model_config, device=self.settings.device)
        self.device = torch.device(self.settings.device)
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
        from composer_mesh.models.tiny import named_weights

        assert self.model is not None, "call start() first"
        return named_weights(self.model)

    # ---- one step ----------------------------------------------------------------------------------
    def build_loss_batch(self, batch: TrainBatch) -> LossBatch:
        assert self.model is not None, "call start() first"
        rollouts = batch.rollouts()
        if not rollouts:
            raise ValueError("TrainBatch has no rollouts")
        prompts = [r.prompt_ids for r in rollouts]
        completions = [r.completion_ids for r in rollouts]
        logits = completion_logits(self.model, prompts, completions) / self.temperature
        dev = self.device
        token_ids = _pad(completions, 0, torch.long, dev)
        mask = _pad([[1] * len(c) for c in completions], 0, torch.long, dev).bool()
        old_logprobs = _pad([r.logprobs for r in rollouts], 0.0, torch.float32, dev)
        rewards = torch.tensor([rw.score for g in batch.groups for rw in g.rewards], dtype=torch.float32, device=dev)
        group_ids = torch.tensor(
            [i for i, g in enumerate(batch.groups) for _ in g.group.rollouts], dtype=torch.long, device=dev
        )

        ref_logprobs = None
        if self.reference is not None and self.loss.kl_beta > 0:
            with torch.no_grad():
                ref_logprobs = token_logprobs(completion_logits(self.reference, prompts, completions) / self.temperature, token_ids)

        teacher_kw = self._teacher_inputs(batch, logits.shape[1], logits.shape[-1]) if self.loss.alpha_sdpo > 0 else {}
        replay = self._replay_pairs(batch, logits, token_ids, mask) if self.loss.beta_replay > 0 and batch.traces else None
        return LossBatch(
            logits=logits, token_ids=token_ids, mask=mask, old_logprobs=old_logprobs, rewards=rewards,
            group_ids=group_ids, ref_logprobs=ref_logprobs, replay=replay, **teacher_kw,
        )

    def _teacher_inputs(self, batch: TrainBatch, width: int, vocab: int) -> dict[str, torch.Tensor]:
        dists = batch.distributions
        if not dists or all(d is None for d in dists):
            return {}
        rollouts = batch.rollouts()
        if len(dists) != len(rollouts):
            raise ValueError(f"TrainBatch has {len(dists)} teacher distributions for {len(rollouts)} rollouts")
        dense = [d for d in dists if d is not None and d.logits is not None]
        distill_mask = torch.zeros(len(rollouts), width, dtype=torch.bool)
        for b, (d, r) in enumerate(zip(dists, rollouts)):
            if d is None:
                continue
            if d.num_tokens != len(r.completion_ids):
                raise ValueError(
                    f"teacher {d.teacher!r} gave {d.num_tokens} token distributions for a {len(r.completion_ids)}-token "
                    f"completion of prompt {r.prompt_id!r}"
                )
            distill_mask[b, : d.num_tokens] = True
        if dense:
            out = torch.zeros(len(rollouts), width, vocab)
            for b, d in enumerate(dists):
                if d is not None and d.logits is not None:
                    if d.logits.shape[-1] != vocab:
                        raise ValueError(f"teacher {d.teacher!r} logits have vocab {d.logits.shape[-1]}, student has {vocab}")
                    out[b, : d.num_tokens] = d.logits.float()
            return {"teacher_logits": out.to(self.device), "distill_mask": distill_mask.to(self.device)}
        k = max(d.topk_ids.shape[-1] for d in dists if d is not None and d.topk_ids is not None)
        ids = torch.zeros(len(rollouts), width, k, dtype=torch.long)
        lps = torch.full((len(rollouts), width, k), -math.inf)
        for b, d in enumerate(dists):
            if d is not None and d.topk_ids is not None:
                n, kk = d.topk_ids.shape
                ids[b, :n, :kk] = d.topk_ids
                lps[b, :n, :kk] = d.topk_logprobs.float()
        return {k: v.to(self.device) for k, v in
                {"teacher_topk_ids": ids, "teacher_topk_logprobs": lps, "distill_mask": distill_mask}.items()}

    def _replay_pairs(
        self, batch: TrainBatch, logits: torch.Tensor, token_ids: torch.Tensor, mask: torch.Tensor
    ) -> ReplayPairs | None:
        """chosen = each teacher trace, rejected = the lowest-reward student rollout of the same prompt."""
        assert self.model is not None
        row_of: dict[str, int] = {}
        best: dict[str, float] = {}
        row = 0
        for g in batch.groups:
            for r, rw in zip(g.group.rollouts, g.rewards):
                if r.prompt_id not in best or rw.score < best[r.prompt_id]:
                    best[r.prompt_id], row_of[r.prompt_id] = rw.score, row
                row += 1
        traces: list[TeacherTrace] = [t for t in batch.traces if t.prompt_id in row_of and t.completion_ids]
        if not traces:
            return None
        prompt_of = {r.prompt_id: r.prompt_ids for r in batch.rollouts()}
        rows = [row_of[t.prompt_id] for t in traces]
        chosen_prompts = [prompt_of[t.prompt_id] for t in traces]
        chosen_ids = [t.completion_ids for t in traces]
        chosen_tok = _pad(chosen_ids, 0, torch.long, self.device)
        chosen_mask = _pad([[1] * len(c) for c in chosen_ids], 0, torch.long, self.device).bool()
        chosen_logps = token_logprobs(completion_logits(self.model, chosen_prompts, chosen_ids) / self.temperature, chosen_tok)
        rejected_logps = token_logprobs(logits[rows], token_ids[rows])
        ref_chosen = ref_rejected = None
        if self.reference is not None and self.loss.dpo_variant == "dpo":
            rollouts = batch.rollouts()
            rej_prompts = [rollouts[i].prompt_ids for i in rows]
            rej_ids = [rollouts[i].completion_ids for i in rows]
            rej_tok = _pad(rej_ids, 0, torch.long, self.device)
            rej_mask = _pad([[1] * len(c) for c in rej_ids], 0, torch.long, self.device).bool()
            with torch.no_grad():
                rc = token_logprobs(completion_logits(self.reference, chosen_prompts, chosen_ids) / self.temperature, chosen_tok)
                rr = token_logprobs(completion_logits(self.reference, rej_prompts, rej_ids) / self.temperature, rej_tok)
            ref_chosen = (rc * chosen_mask).sum(-1)
            ref_rejected = (rr * rej_mask).sum(-1)
        return ReplayPairs(
            chosen_logps=chosen_logps, chosen_mask=chosen_mask, rejected_logps=rejected_logps,
            rejected_mask=mask[rows], ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
            teachers=[t.teacher for t in traces],
        )

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        """Forward, `compose_loss`, backward, clip, AdamW step; the new weights are version + 1."""
        assert self.model is not None, "call start() first"
        self.optimizer.zero_grad(set_to_none=True)
        loss_batch = self.build_loss_batch(batch)
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
        self.version += 1
        rewards = torch.tensor([rw.score for g in batch.groups for rw in g.rewards])
        metrics["reward_mean"] = float(rewards.mean())
        metrics["reward_failures"] = float(sum(not rw.ok for g in batch.groups for rw in g.rewards))
        return TrainMetrics(
            step=self.step, weight_version=self.version, loss=float(result.total.detach()),
            channels={k: float(v.detach()) for k, v in result.parts.items()}, metrics=metrics,
        )

    def close(self) -> None:
        """Finish DiLoCo's pending store writes (no-op without DiLoCo)."""
        if self.diloco is not None:
            self.diloco.close()
            self.diloco = None

    def save_checkpoint(self, directory: Path) -> Path:
        """Weights as safetensors + the tokenizer, loadable with `from_pretrained` (no pickles)."""
        assert self.model is not None
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)
        (directory / "trainer_state.json").write_text(f'{{"step": {self.step}, "weight_version": {self.version}}}\n')
        return directory

