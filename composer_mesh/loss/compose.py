"""`compose_loss`: total = GRPO + alpha_sdpo * self-distillation + beta_replay * trace replay.

A channel is skipped (absent from `parts`, nothing added to the total) when its weight is 0 or when the batch
carries none of its inputs, so `alpha_sdpo=0, beta_replay=0` reproduces the GRPO-only loss bit for bit.

Micro-batches: `LossAccumulator` takes a batch in pieces. Each channel divides by the WHOLE batch's count
(`BatchTotals`: tokens, rows, distilled tokens, replay pairs), so the pieces' losses (and gradients) sum to the
whole batch's; metrics are computed once from every piece's per-token values, and TAID steps once.
`compose_loss` is the accumulator with one piece.

The student is `LossBatch.logits`: a [B, T, V] tensor, or `HiddenStates` (hidden states + output head), from
which every channel computes its logits chunk by chunk (`loss/hidden.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    PolicyTerms,
    group_advantages,
    policy_metrics,
    policy_terms,
    reduce_tokens,
    token_logprobs,
)
from composer_mesh.loss.hidden import (
    HiddenStates,
    hidden_distill_dense,
    hidden_distill_topk,
    hidden_token_logprobs,
)
from composer_mesh.loss.preference import ReplayPairs, dpo_loss, replay_metrics, sequence_logps, simpo_loss
from composer_mesh.loss.ranks import Local, Ranks, merge

__all__ = [
    "BatchTotals",
    "HiddenStates",
    "LossAccumulator",
    "LossBatch",
    "LossResult",
    "ReplayPairs",
    "TAIDState",
    "compose_loss",
    "new_loss_state",
    "student_logprobs",
    "token_logprobs",
]


@dataclass
class LossBatch:
    """One training batch as the loss sees it. logits[b, t] scores completion token t (already aligned)."""

    logits: Tensor | HiddenStates  # [B, T, V] student logits, or hidden states + head (grad flows here)
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
        if len(self.logits.shape) != 3:
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


@dataclass(frozen=True)
class BatchTotals:
    """The whole batch's denominators: unpadded tokens, rows, distilled tokens and replay pairs.

    A micro-batch's channel losses divide by these instead of its own counts, which makes it its exact share."""

    tokens: int = 0
    sequences: int = 0
    distill_tokens: int = 0
    replay_pairs: int = 0

    @classmethod
    def of(cls, batch: LossBatch) -> BatchTotals:
        mask = batch.mask.bool()
        distill = mask & batch.distill_mask.bool() if batch.distill_mask is not None else mask
        return cls(
            tokens=int(mask.sum()),
            sequences=int(mask.shape[0]),
            distill_tokens=int(distill.sum()) if batch.has_teacher else 0,
            replay_pairs=batch.replay.num_pairs if batch.replay is not None else 0,
        )

    def __add__(self, other: BatchTotals) -> BatchTotals:
        return BatchTotals(
            self.tokens + other.tokens, self.sequences + other.sequences,
            self.distill_tokens + other.distill_tokens, self.replay_pairs + other.replay_pairs,
        )


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


def student_logprobs(student: Tensor | HiddenStates, token_ids: Tensor, mask: Tensor, chunk_elements: int) -> Tensor:
    """[B, T] log-probs of `token_ids` under the student (logits or hidden states), chunked either way."""
    if isinstance(student, HiddenStates):
        return hidden_token_logprobs(student, token_ids, mask)
    return token_logprobs(student, token_ids, chunk_elements)


@dataclass
class _Diagnostics:
    """Detached per-token / per-pair values of every piece, so metrics are those of the whole batch."""

    policy: list[PolicyTerms] = field(default_factory=list)
    advantages: list[Tensor] = field(default_factory=list)
    distill: list[DistillOutput] = field(default_factory=list)
    replay: list[tuple[Tensor, Tensor, Tensor, list[str]]] = field(default_factory=list)


def _flat_terms(terms: PolicyTerms, mask: Tensor) -> PolicyTerms:
    """The unpadded tokens' values, flattened and detached."""
    def pick(x: Tensor | None) -> Tensor | None:
        return x[mask] if x is not None else None

    return PolicyTerms(
        terms.per_token.detach()[mask], terms.ratio[mask], terms.clipped_low[mask], terms.clipped_high[mask],
        terms.dppo_masked[mask], terms.dppo_masked_low[mask], terms.dppo_masked_high[mask], pick(terms.kl_ref),
        terms.mismatch_kl[mask], pick(terms.tis_weight), pick(terms.tis_truncated),
    )


def _cat_terms(parts: list[PolicyTerms]) -> PolicyTerms:
    def cat(name: str) -> Tensor:
        return torch.cat([getattr(p, name) for p in parts])

    def cat_optional(name: str) -> Tensor | None:
        return cat(name) if all(getattr(p, name) is not None for p in parts) else None

    return PolicyTerms(
        cat("per_token"), cat("ratio"), cat("clipped_low"), cat("clipped_high"), cat("dppo_masked"),
        cat("dppo_masked_low"), cat("dppo_masked_high"), cat_optional("kl_ref"), cat("mismatch_kl"),
        cat_optional("tis_weight"), cat_optional("tis_truncated"),
    )


def _cat_distill(parts: list[DistillOutput], loss: Tensor) -> DistillOutput:
    return DistillOutput(
        loss, torch.cat([p.per_token for p in parts]), torch.cat([p.teacher_entropy for p in parts]),
        torch.cat([p.gate for p in parts]), torch.cat([p.clipped for p in parts]),
        has_entropy=all(p.has_entropy for p in parts),
    )


class LossAccumulator:
    """`compose_loss` over a batch given in micro-batches (see module doc).

    `add(piece)` returns the piece's share (total and parts with grad; backward it before the next piece to free
    its activations); `finish()` returns the whole batch's parts and metrics (detached) and steps adaptive TAID.
    """

    def __init__(
        self, config: LossConfig, totals: BatchTotals, *, step: int = 0, state: TAIDState | None = None
    ) -> None:
        self.config, self.totals, self.step, self.state = config, totals, step, state
        self.taid_t: float | None = None
        if config.alpha_sdpo > 0 and config.sdpo_wrapper == "taid":
            self.taid_t = taid_current_t(config, step, state)  # raises ValueError when there is no schedule
        self._sums: dict[str, Tensor] = {}
        self._diag = _Diagnostics()
        self._saw = {"teacher": False, "replay": False}

    def add(self, batch: LossBatch) -> LossResult:
        """The piece's share of the whole batch's loss (no metrics: see `finish`)."""
        batch.validate()
        config = self.config
        parts: dict[str, Tensor] = {"grpo": self._grpo(batch)}
        total = parts["grpo"]
        if config.alpha_sdpo > 0 and batch.has_teacher:
            self._saw["teacher"] = True
            sdpo = self._sdpo(batch)
            if sdpo is not None:
                parts["sdpo"] = sdpo
                total = total + config.alpha_sdpo * sdpo
        if config.beta_replay > 0 and batch.replay is not None:
            self._saw["replay"] = True
            replay = self._replay(batch.replay)
            if replay is not None:
                parts["replay"] = replay
                total = total + config.beta_replay * replay
        for name, value in parts.items():
            self._sums[name] = self._sums[name] + value.detach() if name in self._sums else value.detach()
        return LossResult(total=total, parts=parts)

    def finish(self, ranks: Ranks | None = None, teachers: Sequence[str] = ()) -> LossResult:
        """The whole batch's total and parts (detached) and its metrics; updates the adaptive TAID state once.

        With `ranks` (a sharded replica, each rank holding its own pieces of the batch), every rank's sums and
        diagnostics are merged first (`loss/ranks.py`), so every rank returns the whole batch's; `teachers`
        lists every replay teacher name of the batch (names cross ranks as indices into it)."""
        if ranks is not None:
            self._merge(ranks, teachers)
        config, diag, parts = self.config, self._diag, dict(self._sums)
        metrics: dict[str, float] = {}
        if self.taid_t is not None:
            metrics["sdpo/taid_t"] = self.taid_t
        if not diag.policy:
            raise ValueError("LossAccumulator.finish() before any add(): no micro-batch was given")
        terms = _cat_terms(diag.policy)
        every_token = torch.ones(terms.ratio.shape, dtype=torch.bool, device=terms.ratio.device)
        metrics.update(policy_metrics(terms, every_token, torch.cat(diag.advantages)))
        if "sdpo" in parts:
            metrics.update(_cat_distill(diag.distill, parts["sdpo"]).metrics())
            self._step_taid(parts["sdpo"], metrics)
        elif self._saw["teacher"]:
            metrics["sdpo/tokens"] = 0.0
        if "replay" in parts:
            chosen, rejected, losses = (torch.cat([d[i] for d in diag.replay]) for i in range(3))
            metrics.update(replay_metrics(chosen, rejected, losses, [t for d in diag.replay for t in d[3]]))
        elif self._saw["replay"]:
            metrics["replay/pairs"] = 0.0
        total = parts["grpo"]
        if "sdpo" in parts:
            total = total + config.alpha_sdpo * parts["sdpo"]
        if "replay" in parts:
            total = total + config.beta_replay * parts["replay"]
        for name, value in parts.items():
            metrics[f"loss/{name}"] = float(value)
        metrics["loss/total"] = float(total)
        return LossResult(total=total, parts=parts, metrics=metrics)

    def _merge(self, ranks: Ranks, teachers: Sequence[str]) -> None:
        d = self._diag
        whole = merge(ranks, Local(self._sums, self._saw, d.policy, d.advantages, d.distill, d.replay), teachers)
        self._sums, self._saw = whole.sums, whole.saw
        self._diag = _Diagnostics(whole.policy, whole.advantages, whole.distill, whole.replay)

    def _step_taid(self, sdpo: Tensor, metrics: dict[str, float]) -> None:
        config, state, t = self.config, self.state, self.taid_t
        if t is not None and state is not None and config.taid_t is None and config.taid_adaptive:
            taid_update(config, self.step, state, t, float(sdpo))
            metrics["sdpo/taid_t_next"] = float(state.t) if state.t is not None else t

    def _grpo(self, batch: LossBatch) -> Tensor:
        config, mask = self.config, batch.mask.bool()
        if config.kl_beta > 0 and batch.ref_logprobs is None:
            raise ValueError("ref_logprobs is required when kl_beta > 0 (KL to the reference policy)")
        logprobs = student_logprobs(batch.logits, batch.token_ids, mask, config.loss_chunk_elements)
        if batch.advantages is not None:
            adv = batch.advantages.detach().to(logprobs.dtype)
        else:
            adv = group_advantages(batch.rewards, batch.group_ids, config.scale_std, config.advantage_eps)
        adv_tok = adv if adv.dim() == 2 else adv.unsqueeze(-1)
        terms = policy_terms(logprobs, batch.old_logprobs, adv_tok, mask, config, batch.ref_logprobs)
        count = self.totals.tokens if config.normalization == "token" else self.totals.sequences
        self._diag.policy.append(_flat_terms(terms, mask))
        # per sequence ([B]) or per trained token ([B, T]: padding and environment tokens would dilute the mean)
        self._diag.advantages.append(adv.detach()[mask] if adv.dim() == 2 else adv.detach())
        return reduce_tokens(terms.per_token, mask, config.normalization, count)

    def _sdpo(self, batch: LossBatch) -> Tensor | None:
        sel = batch.mask.bool()
        if batch.distill_mask is not None:
            sel = sel & batch.distill_mask.bool()
        if not bool(sel.any()):
            return None
        params = DistillParams.from_config(self.config, self.taid_t)
        student, n = batch.logits, self.totals.distill_tokens
        hidden = isinstance(student, HiddenStates)
        if batch.teacher_logits is not None:
            dense = hidden_distill_dense if hidden else distill_loss_chunked
            out = dense(student, batch.teacher_logits, sel, params, n)
        else:
            assert batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
            topk = hidden_distill_topk if hidden else distill_loss_topk
            out = topk(student, batch.teacher_topk_ids, batch.teacher_topk_logprobs, sel, params, n)
        self._diag.distill.append(out)
        return out.loss

    def _replay(self, replay: ReplayPairs) -> Tensor | None:
        config = self.config
        if replay.num_pairs == 0:
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
                chosen, rejected, replay.ref_chosen_logps.to(chosen.dtype), replay.ref_rejected_logps.to(chosen.dtype),
                config.replay_dpo_beta,
            )
        else:
            chosen = sequence_logps(replay.chosen_logps, replay.chosen_mask, average=True)
            rejected = sequence_logps(replay.rejected_logps, replay.rejected_mask, average=True)
            losses, r_c, r_r = simpo_loss(chosen, rejected, config.simpo_beta, config.simpo_gamma)
        self._diag.replay.append((r_c, r_r, losses.detach(), list(replay.teachers)))
        return losses.sum() / max(self.totals.replay_pairs, 1)


def compose_loss(
    batch: LossBatch, config: LossConfig, *, step: int = 0, state: TAIDState | None = None
) -> LossResult:
    """GRPO + alpha_sdpo * channel 2 + beta_replay * channel 3 for one batch (see module doc).

    `step` drives the TAID schedule; `state` is the TAIDState the trainer keeps for adaptive TAID
    (`new_loss_state(config)`), updated in place after the loss is computed.
    """
    batch.validate()
    accumulator = LossAccumulator(config, BatchTotals.of(batch), step=step, state=state)
    share = accumulator.add(batch)
    whole = accumulator.finish()
    return LossResult(total=share.total, parts=share.parts, metrics=whole.metrics)
