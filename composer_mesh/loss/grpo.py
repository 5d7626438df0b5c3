"""Channel 1: GRPO policy gradient (DeepSeekMath arXiv:2402.03300) with the switches of its successors.

- advantages: A_i = (R_i - mean_g R) / (std_g R + eps) per group g (TRL's unbiased std + 1e-4);
  `scale_std=False` gives Dr. GRPO (arXiv:2503.20783), A_i = R_i - mean_g R. The unit i is the episode: the
  segments of one (`episode_advantages`) count once and share its advantage.
- per token: r = exp(log pi_theta - log pi_old); loss_t = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)
  (PPO clip; eps_high > eps_low is DAPO's clip-higher, arXiv:2503.14476).
- optional DPPO mask (PRIME-RL default loss, arXiv:2602.04879): drop the policy term where A>0 and
  p_theta - p_old > dppo_mask_high, or A<=0 and p_theta - p_old < -dppo_mask_low (probability differences).
- optional KL to a reference: kl_beta * k3, k3 = exp(ref - logp) - (ref - logp) - 1 (GRPO, TRL).
- off-policy correction `off_policy_correction="tis"`: decoupled PPO (AReaL, Fu et al. 2025, arXiv:2505.24298,
  eq. 5) whose proximal policy is the trainer's current policy, detached, prox = sg(log pi_theta), and whose
  behaviour importance weight is truncated (TIS, Yao et al. 2025, https://fengyao.notion.site/off-policy-rl):
  r = exp(logp - prox) (value 1, gradient that of logp), w = min(exp(prox - old), tis_cap) (detached),
  loss_t = -w * min(r*A, clip(r, 1-eps_low, 1+eps_high)*A).
  The trainer takes one optimizer step per batch, so r = 1 and the clip is inactive: the gradient is
  -min(pi_theta/pi_sampler, tis_cap) * A * grad log pi_theta. Every token keeps a (truncated) gradient, whereas
  "none" clips pi_theta/pi_sampler and drops a token whose ratio left the clip range, which with asynchronous
  training (policy lag > 0, sampler weights older than the trainer's) can be many tokens. The DPPO mask, the k3
  KL and the reported ratio/mismatch_kl stay relative to the sampler in both modes.
- normalisation: "token" = sum over unpadded tokens / their count (DAPO); "sequence" = per-completion mean,
  then batch mean (GRPO, TRL's "grpo" loss_type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from composer_mesh.loss.chunks import (
    DEFAULT_CHUNK_ELEMENTS,
    chunk_tokens,
    compute_dtype,
    flat_chunks,
    row_chunks,
)
from composer_mesh.loss.config import LossConfig


def group_advantages(rewards: Tensor, group_ids: Tensor, scale_std: bool, eps: float = 1e-4) -> Tensor:
    """Group-normalised advantages [B] from rewards [B] and group ids [B] (any integer labels)."""
    rewards = rewards.detach().to(compute_dtype(rewards))
    mean, std = group_stats(rewards, group_ids, scale_std)
    centred = rewards - mean
    if std is None:
        return centred
    return centred / (std + eps)


def group_stats(values: Tensor, group_ids: Tensor, scale_std: bool) -> tuple[Tensor, Tensor | None]:
    """Each row's group mean [B] and unbiased group std [B] (None without `scale_std`; 0 for a group of one)
    of `values` [B], in their dtype: the baseline and scale of `group_advantages`, shared with `loss/credit.py`
    so that its per-turn modes reduce to it exactly."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, inverse, torch.ones_like(values)
    )
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    mean = (sums / counts)[inverse]
    if not scale_std:
        return mean, None
    sq = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, (values - mean) ** 2)
    var = torch.where(
        counts > 1, sq / (counts - 1).clamp_min(1), torch.zeros_like(sq)
    )  # unbiased, like torch.std
    return mean, var.sqrt()[inverse]


def episode_advantages(rewards: Tensor, group_ids: Tensor, episode_ids: Tensor, scale_std: bool,
                       eps: float = 1e-4) -> Tensor:
    """`group_advantages` with the episode as the unit [B]: rows with the same episode id (the segments of an
    episode whose conversation was rewritten, `Rollout.episode_id`; labels unique across the batch) count once in
    their group's mean and std, and every one of them gets its episode's advantage. Why: a 3-segment episode is
    one sample of the policy, and must not weigh 3x in the group's statistics."""
    _, inverse = torch.unique(episode_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    rows = torch.arange(inverse.numel(), device=inverse.device)
    first = torch.full((n,), inverse.numel(), dtype=torch.long, device=inverse.device).scatter_reduce_(
        0, inverse, rows, "amin")  # each episode's first row
    if not torch.equal(rewards[first][inverse], rewards) or not torch.equal(group_ids[first][inverse], group_ids):
        raise ValueError("episode_advantages: rows of one episode must share its reward and group")
    return group_advantages(rewards[first], group_ids[first], scale_std, eps)[inverse]


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits)[token], computed a chunk of about `elements` values at a time.

    Forward keeps only a (chunk x vocab) working set; backward writes g * (onehot - softmax) chunk by chunk
    into ONE buffer shaped like the logits (the gradient itself). Plain autograd (gather + logsumexp) would build
    a full float32 exp() in forward and a full softmax plus a full zero-filled scatter in backward.
    Contiguous logits are walked as flat [B*T, V] rows, so short rows do not mean many tiny chunks.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, ids: Tensor, elements: int) -> Tensor:  # type: ignore[override]
        dt = compute_dtype(logits)
        lse = torch.empty(logits.shape[:2], dtype=dt, device=logits.device)
        ctx.elements = elements
        for z, lse_c in _spans(elements, logits, lse):
            lse_c.copy_(torch.logsumexp(z.to(dt), dim=-1))
        picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(dt)
        ctx.save_for_backward(logits, ids, lse)
        return picked - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        g = grad_out.to(lse.dtype).contiguous()
        for z, gz, lse_c, g_c, ids_c in _spans(ctx.elements, logits, grad, lse, g, ids):
            sm = z.to(lse.dtype).sub(lse_c.unsqueeze(-1)).exp_()  # softmax
            sm.mul_(-g_c.unsqueeze(-1))
            sm.scatter_add_(-1, ids_c.unsqueeze(-1), g_c.unsqueeze(-1))
            gz.copy_(sm)
        return grad, None, None


def _spans(elements: int, x: Tensor, *others: Tensor) -> list[tuple[Tensor, ...]]:
    """Chunk views covering [B, T, V] `x` and `others` ([B, T, V] or [B, T], contiguous): x [c, V], others [c(, V)].

    Flat [B*T] chunks when `x` is contiguous, else row by row (a non-contiguous view is sliced, never copied).
    """
    tokens = chunk_tokens(x.shape[-1], elements)
    if x.is_contiguous():
        flat = [f.view(-1, *f.shape[2:]) for f in (x, *others)]
        return [tuple(f[s:e] for f in flat) for s, e in flat_chunks(flat[0].shape[0], tokens)]
    return [tuple(f[b, t0:t1] for f in (x, *others)) for b, t0, t1 in row_chunks(x, tokens)]


def token_logprobs(logits: Tensor, token_ids: Tensor, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> Tensor:
    """log softmax(logits)[token] per position [B, T] (float32; float64 for float64 logits), chunked so no full
    float32 copy of the logits' size exists besides the gradient. Negative ids (e.g. -100 padding) are read as 0;
    mask them.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    ids = token_ids.long().clamp_min(0)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    return _TokenLogprobs.apply(logits, ids, chunk_elements)


@dataclass
class PolicyTerms:
    """Per-token channel-1 loss and the quantities its metrics are built from."""

    per_token: Tensor  # [..., T] loss per token (0 at padding)
    ratio: Tensor  # [..., T] pi_theta / pi_old (detached, 1 at padding)
    clipped_low: Tensor  # [..., T] bool
    clipped_high: Tensor  # [..., T] bool
    dppo_masked: Tensor  # [..., T] bool
    dppo_masked_low: Tensor
    dppo_masked_high: Tensor
    kl_ref: Tensor | None  # [..., T] k3 to reference (detached) or None
    mismatch_kl: Tensor  # [..., T] k3 between sampler and policy (detached)
    tis_weight: Tensor | None = None  # [..., T] min(pi_theta/pi_sampler, tis_cap) (detached; 1 at padding), tis only
    tis_truncated: Tensor | None = None  # [..., T] bool, pi_theta/pi_sampler > tis_cap (tis only)


def policy_terms(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    ref_logprobs: Tensor | None = None,
) -> PolicyTerms:
    """Per-token clipped surrogate (+ TIS off-policy correction, + DPPO mask, + k3 KL). All inputs broadcast to
    logprobs' shape. `ratio` is pi_theta / pi_sampler in both modes; the clip flags are those of the ratio the
    objective clips (pi_theta / pi_sampler, or with "tis" pi_theta / sg(pi_theta), never clipped)."""
    mask = mask.bool()
    adv = advantages.to(logprobs.dtype).expand_as(logprobs)
    old = old_logprobs.detach().to(logprobs.dtype)
    log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
    tis = config.off_policy_correction == "tis"
    if tis:  # decoupled PPO: the clipped ratio is to the proximal policy sg(pi_theta)
        clip_ratio = torch.exp(torch.where(mask, logprobs - logprobs.detach(), torch.zeros_like(logprobs)))
    else:
        clip_ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(clip_ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    surrogate = torch.minimum(clip_ratio * adv, clipped_ratio * adv)
    with torch.no_grad():
        c = clip_ratio.detach()
        r = torch.exp(log_ratio.detach()) if tis else c  # pi_theta / pi_sampler (1 at padding)
    tis_weight = tis_truncated = None
    if tis:  # behaviour weight pi_prox / pi_sampler = r in value, detached and truncated
        tis_truncated = mask & (r > config.tis_cap)
        tis_weight = r.clamp(max=config.tis_cap)
        surrogate = tis_weight * surrogate
    per_token = -surrogate
    with torch.no_grad():
        clipped_low = mask & (adv < 0) & (c < 1.0 - config.eps_low)
        clipped_high = mask & (adv > 0) & (c > 1.0 + config.eps_high)
        prob_diff = torch.where(mask, torch.exp(logprobs.detach()) - torch.exp(old), torch.zeros_like(r))
        masked_high = mask & (adv > 0) & (prob_diff > config.dppo_mask_high)
        masked_low = mask & (adv <= 0) & (prob_diff < -config.dppo_mask_low)
        if not config.dppo_mask:
            masked_high = torch.zeros_like(masked_high)
            masked_low = torch.zeros_like(masked_low)
        dppo_masked = masked_high | masked_low
        mismatch = torch.where(mask, r - log_ratio.detach() - 1.0, torch.zeros_like(r))
    if config.dppo_mask:
        per_token = torch.where(dppo_masked, torch.zeros_like(per_token), per_token)
    kl_ref = None
    if ref_logprobs is not None and config.kl_beta > 0:
        delta = torch.where(
            mask, ref_logprobs.detach().to(logprobs.dtype) - logprobs, torch.zeros_like(logprobs)
        )
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_beta * k3
        kl_ref = k3.detach()
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    return PolicyTerms(
        per_token, r, clipped_low, clipped_high, dppo_masked, masked_low, masked_high, kl_ref, mismatch,
        tis_weight, tis_truncated,
    )


def reduce_tokens(per_token: Tensor, mask: Tensor, normalization: str, count: int | None = None) -> Tensor:
    """'token': sum / #tokens over the batch; 'sequence': per-row mean then mean over rows (TRL 'grpo').

    `count` is the whole batch's #tokens ('token') or #rows ('sequence') when this is one micro-batch of it, so
    the micro-batches' results sum to the whole batch's loss.
    """
    maskf = mask.to(per_token.dtype)
    if normalization == "token":
        denominator = maskf.sum().clamp_min(1.0) if count is None else max(count, 1)
        return (per_token * maskf).sum() / denominator
    if normalization == "sequence":
        per_row = (per_token * maskf).sum(-1) / maskf.sum(-1).clamp_min(1.0)
        return per_row.mean() if count is None else per_row.sum() / max(count, 1)
    raise ValueError(f"normalization={normalization!r} is not one of 'token', 'sequence'")


def policy_metrics(
    terms: PolicyTerms, mask: Tensor, advantages: Tensor, prefix: str = "grpo/"
) -> dict[str, float]:
    """Clip fractions, ratio and KL statistics over unpadded tokens (+ TIS weight statistics when TIS is on)."""
    m = mask.bool()
    n = max(int(m.sum()), 1)

    def frac(x: Tensor) -> float:
        return float((x & m).sum()) / n

    out = {
        f"{prefix}clip_frac_low": frac(terms.clipped_low),
        f"{prefix}clip_frac_high": frac(terms.clipped_high),
        f"{prefix}clip_frac": frac(terms.clipped_low | terms.clipped_high),
        f"{prefix}ratio_mean": float(terms.ratio[m].mean()) if m.any() else 1.0,
        f"{prefix}ratio_max": float(terms.ratio[m].max()) if m.any() else 1.0,
        f"{prefix}mismatch_kl": float(terms.mismatch_kl[m].mean()) if m.any() else 0.0,
        f"{prefix}dppo_masked_frac": frac(terms.dppo_masked),
        f"{prefix}dppo_masked_low_frac": frac(terms.dppo_masked_low),
        f"{prefix}dppo_masked_high_frac": frac(terms.dppo_masked_high),
        f"{prefix}tokens": float(m.sum()),
        f"{prefix}advantage_mean": float(advantages.float().mean()) if advantages.numel() else 0.0,
        f"{prefix}advantage_abs_mean": float(advantages.float().abs().mean()) if advantages.numel() else 0.0,
    }
    if terms.kl_ref is not None:
        out[f"{prefix}kl_ref"] = float(terms.kl_ref[m].mean()) if m.any() else 0.0
    if terms.tis_weight is not None and terms.tis_truncated is not None:  # off_policy_correction="tis"
        out[f"{prefix}tis_weight_mean"] = float(terms.tis_weight[m].mean()) if m.any() else 1.0
        out[f"{prefix}tis_truncated_frac"] = frac(terms.tis_truncated)
    return out
