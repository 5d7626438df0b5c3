"""`compose_loss`: total = GRPO + alpha_sdpo * self-distillation + beta_replay * trace replay.

A channel is skipped (absent from `parts`, nothing added to the total) when its weight is 0 or when the batch
carries none of its inputs, so `alpha_sdpo=0, beta_replay=0` reproduces the GRPO-only loss bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.distill import (
    DistillOutput,
    DistillParams,
    TAIDState,
    distill_loss_chunked,
    distill_loss_topk,
    taid_current_t,
    taid_update,
)
from composer_mesh.loss.grpo import (
    group_advantages,
    policy_metrics,
    policy_terms,
    reduce_tokens,
    token_logprobs,
)
from composer_mesh.loss.preference import ReplayPairs, dpo_loss, replay_metrics, sequence_logps, simpo_loss

__all__ = [
    "LossBatch",
    "LossResult",
    "ReplayPairs",
    "TAIDState",
    "compose_loss",
    "new_loss_state",
    "token_logprobs",
]


@dataclass
class LossBatch:
    """One training batch as the loss sees it. logits[b, t] scores completion token t (already aligned)."""

    logits: Tensor  # [B, T, V] student logits (grad flows here)
    token_ids: Tensor  # [B, T] long completion tokens
    mask: Tensor  # [B, T] bool, False = padding
    old_logprobs: Tensor  # [B, T] sampling-policy (generator) log-probs
    rewards: Tensor  # [B]
    group_ids: Tensor  # [B] long, GRPO groups
    ref_logprobs: Tensor | None = None  # [B, T] reference policy (for kl_beta > 0)
    teacher_logits: Tensor | None = None  # [B, T, V] dense teacher (channel 2)
    teacher_topk_ids: Tensor | None = None  # [B, T, k] sparse teacher support (channel 2)
    teacher_topk_logprobs: Tensor | None = None  # [B, T, k] teacher log-probs on that support
    distill_mask: Tensor | None = None  # [B, T] bool, tokens that have a teacher distribution
    replay: ReplayPairs | None = None  # channel 3 pairs
    advantages: Tensor | None = None  # [B] or [B, T]: overrides the group advantages computed from rewards

    def validate(self) -> None:
        """Check shapes and dtypes; every error names the offending field."""
        if self.logits.dim() != 3:
            raise ValueError(f"logits must be [B, T, V], got shape {tuple(self.logits.shape)}")
        b, t, v = self.logits.shape
        if self.token_ids.dtype.is_floating_point or self.token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be an integer tensor, got {self.token_ids.dtype}")
        for name in ("token_ids", "mask", "old_logprobs", "ref_logprobs", "distill_mask"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t):
                raise ValueError(f"{name} must be [B={b}, T={t}] like logits, got shape {tuple(value.shape)}")
        for name in ("rewards", "group_ids"):
            value = getattr(self, name)
            if tuple(value.shape) != (b,):
                raise ValueError(f"{name} must be [B={b}], got shape {tuple(value.shape)}")
        if self.advantages is not None and tuple(self.advantages.shape) not in ((b,), (b, t)):
            raise ValueError(
                f"advantages must be [B={b}] or [B={b}, T={t}], got shape {tuple(self.advantages.shape)}"
            )
        if self.teacher_logits is not None and tuple(self.teacher_logits.shape) != (b, t, v):
            raise ValueError(
                f"teacher_logits must be [B={b}, T={t}, V={v}] like logits, got shape {tuple(self.teacher_logits.shape)}"
            )
        ids, lps = self.teacher_topk_ids, self.teacher_topk_logprobs
        if (ids is None) != (lps is None):
            raise ValueError("teacher_topk_ids and teacher_topk_logprobs must be given together")
        if ids is not None and lps is not None:
            if ids.dim() != 3 or tuple(ids.shape[:2]) != (b, t):
                raise ValueError(f"teacher_topk_ids must be [B={b}, T={t}, k], got shape {tuple(ids.shape)}")
            if lps.shape != ids.shape:
                raise ValueError(
                    f"teacher_topk_logprobs shape {tuple(lps.shape)} != teacher_topk_ids shape {tuple(ids.shape)}"
                )
            if self.teacher_logits is not None:
                raise ValueError(
                    "give either teacher_logits (dense) or teacher_topk_* (sparse) for channel 2, not both"
                )
        if self.replay is not None:
            self.replay.validate()

    @property
    def has_teacher(self) -> bool:
        return self.teacher_logits is not None or self.teacher_topk_ids is not None


@dataclass
class LossResult:
    """The total (scalar with grad), each active channel's unweighted part, and float metrics."""

    total: Tensor
    parts: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def new_loss_state(config: LossConfig) -> TAIDState | None:
    """The cross-step state compose_loss needs for this config (a TAIDState for adaptive TAID), else None."""
    if config.sdpo_wrapper == "taid" and config.taid_t is None and config.taid_adaptive:
        return TAIDState()
    return None


def _grpo(batch: LossBatch, config: LossConfig, metrics: dict[str, float]) -> Tensor:
    mask = batch.mask.bool()
    if config.kl_beta > 0 and batch.ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_beta > 0 (KL to the reference policy)")
    logprobs = token_logprobs(batch.logits, batch.token_ids)
    if batch.advantages is not None:
        adv = batch.advantages.detach().to(torch.float32)
    else:
        adv = group_advantages(batch.rewards, batch.group_ids, config.scale_std, config.advantage_eps)
    adv_tok = adv if adv.dim() == 2 else adv.unsqueeze(-1)
    terms = policy_terms(logprobs, batch.old_logprobs, adv_tok, mask, config, batch.ref_logprobs)
    loss = reduce_tokens(terms.per_token, mask, config.normalization)
    metrics.update(policy_metrics(terms, mask, adv))
    return loss


def _sdpo(
    batch: LossBatch, config: LossConfig, taid_t: float | None, metrics: dict[str, float]
) -> Tensor | None:
    sel = batch.mask.bool()
    if batch.distill_mask is not None:
        sel = sel & batch.distill_mask.bool()
    if not bool(sel.any()):
        metrics["sdpo/tokens"] = 0.0
        return None
    params = DistillParams.from_config(config, taid_t)
    out: DistillOutput
    if batch.teacher_logits is not None:
        out = distill_loss_chunked(batch.logits, batch.teacher_logits, sel, params)
    else:
        assert batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
        out = distill_loss_topk(
            batch.logits, batch.teacher_topk_ids, batch.teacher_topk_logprobs, sel, params
        )
    metrics.update(out.metrics())
    return out.loss


def _replay(replay: ReplayPairs, config: LossConfig, metrics: dict[str, float]) -> Tensor | None:
    if replay.num_pairs == 0:
        metrics["replay/pairs"] = 0.0
        return None
    if config.dpo_variant == "dpo":
        if replay.ref_chosen_logps is None or replay.ref_rejected_logps is None:
            raise ValueError(
                "replay.ref_chosen_logps and replay.ref_rejected_logps are required for dpo_variant='dpo' "
                "(use dpo_variant='simpo' for reference-free replay)"
            )
        chosen = sequence_logps(replay.chosen_logps, replay.chosen_mask, average=False)
        rejected = sequence_logps(replay.rejected_logps, replay.rejected_mask, average=False)
        losses, r_c, r_r = dpo_loss(
            chosen,
            rejected,
            replay.ref_chosen_logps.float(),
            replay.ref_rejected_logps.float(),
            config.replay_dpo_beta,
        )
    else:
        chosen = sequence_logps(replay.chosen_logps, replay.chosen_mask, average=True)
        rejected = sequence_logps(replay.rejected_logps, replay.rejected_mask, average=True)
        losses, r_c, r_r = simpo_loss(chosen, rejected, config.simpo_beta, config.simpo_gamma)
    metrics.update(replay_metrics(r_c, r_r, losses, replay.teachers))
    return losses.mean()


def compose_loss(
    batch: LossBatch, config: LossConfig, *, step: int = 0, state: TAIDState | None = None
) -> LossResult:
    """GRPO + alpha_sdpo * channel 2 + beta_replay * channel 3 for one batch (see module doc).

    `step` drives the TAID schedule; `state` is the TAIDState the trainer keeps for adaptive TAID
    (`new_loss_state(config)`), updated in place after the loss is computed.
    """
    batch.validate()
    metrics: dict[str, float] = {}
    sdpo_on = config.alpha_sdpo > 0
    taid_t: float | None = None
    if sdpo_on and config.sdpo_wrapper == "taid":
        taid_t = taid_current_t(config, step, state)  # raises ValueError when there is no schedule
        metrics["sdpo/taid_t"] = taid_t

    grpo = _grpo(batch, config, metrics)
    parts: dict[str, Tensor] = {"grpo": grpo}
    total = grpo

    if sdpo_on and batch.has_teacher:
        sdpo = _sdpo(batch, config, taid_t, metrics)
        if sdpo is not None:
            parts["sdpo"] = sdpo
            total = total + config.alpha_sdpo * sdpo
            if taid_t is not None and state is not None and config.taid_t is None and config.taid_adaptive:
                taid_update(config, step, state, taid_t, float(sdpo.detach()))
                metrics["sdpo/taid_t_next"] = float(state.t) if state.t is not None else taid_t

    if config.beta_replay > 0 and batch.replay is not None:
        replay = _replay(batch.replay, config, metrics)
        if replay is not None:
            parts["replay"] = replay
            total = total + config.beta_replay * replay

    for name, value in parts.items():
        metrics[f"loss/{name}"] = float(value.detach())
    metrics["loss/total"] = float(total.detach())
    return LossResult(total=total, parts=parts, metrics=metrics)
