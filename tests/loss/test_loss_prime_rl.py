"""PRIME-RL adapter: loadable by import path, token-sum contract, DPPO parity, clear refusals."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import pytest
import torch
from pydantic import ValidationError

from composer_mesh.loss.compose import LossBatch, compose_loss, token_logprobs
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.prime_rl import LossInputs, LossOutputs, PrimeRLLossKwargs, composer_loss


def import_object(path: str):
    """What PRIME-RL's `import_object` does with CustomLossConfig.import_path ("pkg.module.attr")."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _sample(seed: int = 0, n: int = 9, on_policy: bool = False):
    g = torch.Generator().manual_seed(seed)
    trainer = (-torch.rand(n, generator=g) * 2).requires_grad_()
    inference = (
        trainer.detach().clone() if on_policy else trainer.detach() + 0.4 * torch.randn(n, generator=g)
    )
    adv = torch.randn(n, generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    mask[:2] = False  # prompt tokens
    return trainer, inference, adv, mask


def _prime_default_loss(inputs: LossInputs, dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3):
    """PRIME-RL's default loss (loss.py L109-161 @ 559b447, as transcribed in the shared note)."""
    lp, ilp = inputs.trainer_logprobs, inputs.inference_logprobs
    log_ratio = lp - ilp
    ratio = torch.exp(log_ratio)
    delta_p = torch.exp(lp) - torch.exp(ilp)
    adv = inputs.advantages
    invalid = torch.where(adv > 0, delta_p > dppo_mask_high, delta_p < -dppo_mask_low)
    keep = inputs.loss_mask & ~invalid
    per_token = -(keep * (adv_tau * adv) * ratio) + kl_tau * inputs.loss_mask * log_ratio**2
    if inputs.loss_weights is not None:
        per_token = per_token * inputs.loss_weights
    return per_token.sum()


def test_loadable_by_import_path_and_returns_loss_outputs() -> None:
    fn = import_object("composer_mesh.loss.prime_rl.composer_loss")
    trainer, inference, adv, mask = _sample()
    out = fn(LossInputs(trainer, inference, None, adv, mask), eps_high=0.28)
    assert isinstance(out, LossOutputs)
    assert out.loss.dim() == 0 and out.loss.requires_grad
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.metrics.values())


def test_on_policy_gradient_is_reinforce_token_sum() -> None:
    trainer, inference, adv, mask = _sample(on_policy=True)
    out = composer_loss(LossInputs(trainer, inference, None, adv, mask))
    out.loss.backward()
    torch.testing.assert_close(trainer.grad, -adv * mask)  # a SUM over tokens: no 1/N
    torch.testing.assert_close(out.loss.detach(), -(adv * mask).sum())


def test_matches_prime_rl_default_loss_with_dppo_mask() -> None:
    trainer, inference, adv, mask = _sample(seed=2)
    weights = torch.rand(trainer.shape[0], generator=torch.Generator().manual_seed(9))
    a = trainer.detach().clone().requires_grad_()
    b = trainer.detach().clone().requires_grad_()
    kwargs = dict(dppo_mask=True, eps_low=0.99, eps_high=1e6, mismatch_kl_tau=1e-3)  # no PPO clip: pure DPPO
    ours = composer_loss(LossInputs(a, inference, None, adv, mask, weights), **kwargs)
    ref = _prime_default_loss(LossInputs(b, inference, None, adv, mask, weights))
    ours.loss.backward()
    ref.backward()
    torch.testing.assert_close(ours.loss.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
    assert 0 < float(ours.metrics["is_masked"]) < 1


def test_sum_over_samples_divided_by_tokens_equals_compose_loss_channel_one() -> None:
    """Per-sample token sums / global token count == compose_loss's token-normalised GRPO part."""
    g = torch.Generator().manual_seed(4)
    b, t, v = 3, 5, 13
    logits = torch.randn(b, t, v, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.arange(t).unsqueeze(0) < torch.tensor([[5], [3], [4]])
    old = token_logprobs(logits, ids) + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    cfg = LossConfig(alpha_sdpo=0.0, beta_replay=0.0, dppo_mask=True)
    batch = LossBatch(logits, ids, mask, old, torch.zeros(b), torch.arange(b), advantages=adv)
    expected = compose_loss(batch, cfg).total
    lp = token_logprobs(logits, ids)
    sums = [
        composer_loss(LossInputs(lp[i], old[i], None, adv[i].expand(t), mask[i]), dppo_mask=True).loss
        for i in range(b)
    ]
    torch.testing.assert_close(torch.stack(sums).sum() / mask.sum(), expected, rtol=1e-6, atol=1e-6)


def test_kl_to_ref_uses_ref_logprobs_and_requires_them() -> None:
    trainer, inference, adv, mask = _sample(seed=5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        composer_loss(LossInputs(trainer, inference, None, adv, mask), kl_beta=0.1)
    out = composer_loss(LossInputs(trainer, inference, trainer.detach() - 0.3, adv, mask), kl_beta=0.1)
    assert float(out.metrics["kl_ref"]) > 0


def test_tis_maps_with_inference_logprobs_as_the_sampler() -> None:
    """off_policy_correction="tis": grad = -min(exp(trainer - inference), C) * A on loss_mask tokens (a sum)."""
    trainer, inference, adv, mask = _sample(seed=7)
    inference = inference - 0.5  # several ratios above the cap
    out = composer_loss(LossInputs(trainer, inference, None, adv, mask), off_policy_correction="tis", tis_cap=1.5)
    out.loss.backward()
    w = torch.exp(trainer.detach() - inference).clamp(max=1.5)
    torch.testing.assert_close(trainer.grad, -w * adv * mask)
    truncated = (torch.exp(trainer.detach() - inference) > 1.5) & mask
    assert 0 < int(truncated.sum()) < int(mask.sum())
    torch.testing.assert_close(out.metrics["tis_truncated_frac"], truncated.sum() / mask.sum())
    torch.testing.assert_close(out.metrics["tis_weight_mean"], (w * mask).sum() / mask.sum())
    assert "tis_weight_mean" not in composer_loss(LossInputs(trainer, inference, None, adv, mask)).metrics


def test_duck_typed_prime_rl_dataclass_is_accepted() -> None:
    @dataclass
    class PrimeLossInputs:  # shaped like prime_rl.trainer.rl.loss.LossInputs
        trainer_logprobs: torch.Tensor
        inference_logprobs: torch.Tensor
        ref_logprobs: torch.Tensor | None
        advantages: torch.Tensor
        loss_mask: torch.Tensor
        loss_weights: torch.Tensor | None = field(default=None)

    trainer, inference, adv, mask = _sample(seed=6)
    a = composer_loss(PrimeLossInputs(trainer, inference, None, adv, mask))  # type: ignore[arg-type]
    b = composer_loss(LossInputs(trainer, inference, None, adv, mask))
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"alpha_sdpo": 1.0}, "alpha_sdpo"),
        ({"beta_replay": 0.5}, "beta_replay"),
        ({"normalization": "sequence"}, "sequence"),
        ({"credit": "turn_group"}, "credit"),
    ],
)
def test_channels_needing_full_vocab_or_pairs_refuse(kwargs: dict, needle: str) -> None:
    trainer, inference, adv, mask = _sample()
    with pytest.raises(NotImplementedError, match=needle):
        composer_loss(LossInputs(trainer, inference, None, adv, mask), **kwargs)
    full_vocab = import_object("composer_mesh.loss.prime_rl.full_vocab_loss")
    with pytest.raises(NotImplementedError, match="full-vocabulary"):
        full_vocab(LossInputs(trainer, inference, None, adv, mask))


def test_bad_kwargs_and_shapes_name_the_argument() -> None:
    trainer, inference, adv, mask = _sample()
    with pytest.raises(ValidationError, match="kl_tau"):
        composer_loss(LossInputs(trainer, inference, None, adv, mask), kl_tau=1e-3)
    with pytest.raises(ValidationError, match="eps_high"):
        composer_loss(LossInputs(trainer, inference, None, adv, mask), eps_high=-1)
    with pytest.raises(ValueError, match="advantages"):
        composer_loss(LossInputs(trainer, inference, None, adv[:3], mask))
    with pytest.raises(ValueError, match="trainer_logprobs"):
        composer_loss(LossInputs(trainer.detach().reshape(1, -1), inference, None, adv, mask))
    assert "mismatch_kl_tau" in PrimeRLLossKwargs.model_fields
