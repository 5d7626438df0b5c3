"""PRIME-RL adapter: our channel 1 as a PRIME-RL custom loss.

PRIME-RL (PrimeIntellect-ai/prime-rl @ 559b447, `src/prime_rl/trainer/rl/loss.py`) loads a custom loss with

    [trainer.loss]
    type = "custom"
    import_path = "composer_mesh.loss.prime_rl.composer_loss"
    [trainer.loss.kwargs]          # any LossConfig field, plus mismatch_kl_tau
    eps_high = 0.28

and calls it once per SAMPLE as `composer_loss(inputs, **kwargs)` with 1-D tensors over the whole packed
sequence. It must return `LossOutputs(loss, metrics)` where `loss` is the token SUM over `loss_mask`; the
PRIME-RL trainer divides by the global token count itself (token-level normalisation over the step batch).
The contract is re-declared here (prime-rl is not pip-installable); field names, order and meaning mirror it.

What maps: the clipped surrogate with eps_low/eps_high, the TIS off-policy correction
(off_policy_correction/tis_cap, with `inference_logprobs` as the sampler), the DPPO mask, the k3 KL to
`ref_logprobs` (kl_beta), PRIME-RL's squared-log-ratio mismatch term (mismatch_kl_tau, its `kl_tau`), `loss_weights`.
Advantages come precomputed from PRIME-RL's orchestrator, so scale_std/advantage_eps do not apply and a
per-turn `credit` is refused. What does not: channel 2 needs full-vocabulary (or top-k) logits and channel 3 needs trace pairs; LossInputs
carries only sampled-token log-probs, so asking for them raises NotImplementedError. "sequence" normalisation
cannot be written as a token sum either.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.grpo import policy_terms


@dataclass
class LossInputs:
    """Inputs for computing loss on a single sample (mirror of PRIME-RL's `LossInputs`).

    ``loss_mask`` already selects the tokens that belong to the receiving component.
    ``loss_weights`` is the component's per-token weight stream (None means 1.0 everywhere).
    """

    trainer_logprobs: Tensor  # [seq] log pi_theta (carries grad)
    inference_logprobs: Tensor  # [seq] sampler log-probs
    ref_logprobs: Tensor | None  # [seq] reference / teacher log-probs of the sampled tokens
    advantages: Tensor  # [seq]
    loss_mask: Tensor  # [seq] bool
    loss_weights: Tensor | None = field(default=None)  # [seq]


@dataclass
class LossOutputs:
    """Outputs from computing loss on a single sample (mirror of PRIME-RL's `LossOutputs`)."""

    loss: Tensor  # 0-d, token sum
    metrics: dict[str, Tensor]


LossFn = Callable[..., LossOutputs]


class PrimeRLLossKwargs(LossConfig):
    """`[trainer.loss.kwargs]` of the custom loss: LossConfig's channel-1 knobs plus PRIME-RL's mismatch term.

    The channel weights default to 0 here: channels 2 and 3 cannot run inside PRIME-RL (see module doc).
    """

    alpha_sdpo: float = Field(
        0.0,
        description="Must stay 0: channel 2 needs full-vocabulary logits, which PRIME-RL's LossInputs lacks.",
    )
    beta_replay: float = Field(
        0.0, description="Must stay 0: channel 3 needs trace pairs, which PRIME-RL's LossInputs lacks."
    )
    mismatch_kl_tau: float = Field(
        0.0,
        ge=0,
        description="PRIME-RL's kl_tau: adds mismatch_kl_tau * (log pi_theta - log pi_old)^2 on every loss_mask "
        "token (PRIME-RL's default uses 1e-3).",
    )


@lru_cache(maxsize=64)
def _parse_kwargs(frozen: str) -> PrimeRLLossKwargs:
    cfg = PrimeRLLossKwargs(**json.loads(frozen))
    if cfg.alpha_sdpo > 0:
        raise NotImplementedError(
            "alpha_sdpo > 0: channel 2 (self-distillation) needs full-vocabulary or top-k teacher logits; "
            "PRIME-RL's LossInputs carries only sampled-token log-probs. Use composer_mesh.loss.compose_loss "
            "in a composer-mesh trainer, or PRIME-RL's opd/opsd algorithm for sampled-token reverse KL."
        )
    if cfg.beta_replay > 0:
        raise NotImplementedError(
            "beta_replay > 0: channel 3 (trace replay) needs chosen/rejected trace pairs, which PRIME-RL's "
            "LossInputs does not carry."
        )
    if cfg.credit != "episode":
        raise NotImplementedError(
            f"credit={cfg.credit!r}: per-turn advantages are computed from a TrainBatch's turns by a composer-mesh "
            "trainer; inside PRIME-RL the advantages come precomputed (LossInputs.advantages). Leave credit out."
        )
    if cfg.normalization != "token":
        raise NotImplementedError(
            "normalization='sequence' cannot be expressed as the per-sample token sum PRIME-RL normalises by "
            "its global token count; use normalization='token'."
        )
    return cfg


def _check_inputs(inputs: LossInputs) -> None:
    n = inputs.trainer_logprobs.shape
    if inputs.trainer_logprobs.dim() != 1:
        raise ValueError(f"LossInputs.trainer_logprobs must be 1-D [seq], got shape {tuple(n)}")
    for name in ("inference_logprobs", "ref_logprobs", "advantages", "loss_mask", "loss_weights"):
        value = getattr(inputs, name)
        if value is not None and value.shape != n:
            raise ValueError(
                f"LossInputs.{name} shape {tuple(value.shape)} != trainer_logprobs shape {tuple(n)}"
            )


def composer_loss(inputs: LossInputs, **kwargs: Any) -> LossOutputs:
    """Channel-1 loss of one PRIME-RL sample: sum over loss_mask tokens of the per-token loss (x loss_weights)."""
    config = _parse_kwargs(json.dumps(kwargs, sort_keys=True))
    _check_inputs(inputs)
    mask = inputs.loss_mask.bool()
    logprobs = inputs.trainer_logprobs
    ref = inputs.ref_logprobs if config.kl_beta > 0 else None
    if config.kl_beta > 0 and ref is None:
        raise ValueError("kl_beta > 0 needs LossInputs.ref_logprobs (set by PRIME-RL's opd/opsd algorithms)")
    terms = policy_terms(logprobs, inputs.inference_logprobs, inputs.advantages.detach(), mask, config, ref)
    per_token = terms.per_token
    if config.mismatch_kl_tau > 0:
        log_ratio = torch.where(
            mask, logprobs - inputs.inference_logprobs.detach(), torch.zeros_like(logprobs)
        )
        per_token = per_token + config.mismatch_kl_tau * log_ratio**2
    if inputs.loss_weights is not None:
        per_token = per_token * inputs.loss_weights.detach()
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()

    n = mask.sum().clamp_min(1)

    def frac(x: Tensor) -> Tensor:
        return (x & mask).sum().float() / n

    metrics: dict[str, Tensor] = {
        "clip_frac_low": frac(terms.clipped_low),
        "clip_frac_high": frac(terms.clipped_high),
        "is_masked": frac(terms.dppo_masked),
        "is_masked_low": frac(terms.dppo_masked_low),
        "is_masked_high": frac(terms.dppo_masked_high),
        "mismatch_kl": (terms.mismatch_kl * mask).sum() / n,
    }
    if terms.kl_ref is not None:
        metrics["kl_ref"] = (terms.kl_ref * mask).sum() / n
    if terms.tis_weight is not None and terms.tis_truncated is not None:
        metrics["tis_weight_mean"] = (terms.tis_weight * mask).sum() / n
        metrics["tis_truncated_frac"] = frac(terms.tis_truncated)
    return LossOutputs(loss=loss, metrics=metrics)


def full_vocab_loss(inputs: LossInputs, **kwargs: Any) -> LossOutputs:
    """Import target for channel 2 under PRIME-RL: always raises, with the reason (never silently 0)."""
    raise NotImplementedError(
        "composer-mesh channel 2 (generalized JSD / TAID / entropy-aware OPD) needs full-vocabulary logits; "
        "PRIME-RL's LossInputs carries only sampled-token log-probs (trainer/inference/ref), so it cannot be "
        "computed inside PRIME-RL's custom-loss hook."
    )
