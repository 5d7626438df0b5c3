"""Channel 1 (GRPO / Dr. GRPO / DAPO / DPPO) invariants."""

from __future__ import annotations

import pytest
import torch

from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.grpo import group_advantages, policy_terms, reduce_tokens


def test_identical_rewards_give_zero_advantage_and_groups_sum_to_zero() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.2, 0.9])
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 9, 9])
    adv = group_advantages(rewards, groups, scale_std=True)
    assert torch.equal(adv[:3], torch.zeros(3))
    for g in (7, 3, 9):
        assert abs(float(adv[groups == g].sum())) < 1e-6


def test_advantages_match_trl_group_scaling_and_dr_grpo() -> None:
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=g)
    groups = torch.arange(12) // 4  # 3 groups of 4, contiguous as in TRL
    grouped = rewards.view(-1, 4)
    centred = rewards - grouped.mean(1).repeat_interleave(4)
    trl = centred / (grouped.std(1).repeat_interleave(4) + 1e-4)  # TRL grpo_trainer, scale_rewards="group"
    torch.testing.assert_close(group_advantages(rewards, groups, scale_std=True), trl, rtol=0, atol=1e-6)
    torch.testing.assert_close(group_advantages(rewards, groups, scale_std=False), centred, rtol=0, atol=1e-6)


def test_singleton_group_has_zero_advantage_not_nan() -> None:
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1]), scale_std=True)
    assert adv[0] == 0 and torch.isfinite(adv).all()


def _grad_wrt_logprob(ratio: float, adv: float, config: LossConfig) -> tuple[float, float]:
    old = torch.tensor([[-1.0]])
    logp = (old + torch.log(torch.tensor(ratio))).requires_grad_()
    terms = policy_terms(logp, old, torch.tensor([[adv]]), torch.ones(1, 1, dtype=torch.bool), config)
    loss = reduce_tokens(terms.per_token, torch.ones(1, 1, dtype=torch.bool), "token")
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), float(logp.grad)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_clipping_bounds_the_ratio(adv: float) -> None:
    cfg = LossConfig(eps_low=0.2, eps_high=0.28)
    # outside the trust region in the direction the advantage pushes: objective is flat (clipped)
    ratio = 1.5 if adv > 0 else 0.5
    loss, grad = _grad_wrt_logprob(ratio, adv, cfg)
    bound = 1 + 0.28 if adv > 0 else 1 - 0.2
    assert grad == 0.0
    assert loss == pytest.approx(-bound * adv)
    # inside: unclipped, d(-r*A)/dlogp = -r*A
    loss, grad = _grad_wrt_logprob(1.1 if adv > 0 else 0.9, adv, cfg)
    assert grad == pytest.approx(-(1.1 if adv > 0 else 0.9) * adv)


def test_dapo_clip_higher() -> None:
    """Ratio 1.25 with A>0 is clipped at eps_high=0.2 but not at 0.28."""
    _, g_sym = _grad_wrt_logprob(1.25, 1.0, LossConfig(eps_low=0.2, eps_high=0.2))
    _, g_high = _grad_wrt_logprob(1.25, 1.0, LossConfig(eps_low=0.2, eps_high=0.28))
    assert g_sym == 0.0
    assert g_high == pytest.approx(-1.25)


def test_on_policy_gradient_is_reinforce_and_token_vs_sequence_normalisation() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([[2.0], [-1.0]])
    cfg = LossConfig()
    terms = policy_terms(logp, logp.detach(), adv, mask, cfg)
    loss = reduce_tokens(terms.per_token, mask, "token")
    loss.backward()
    expected = torch.tensor([[-2.0, -2.0, -2.0], [1.0, 1.0, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)
    assert float(loss.detach()) == pytest.approx((-2.0 * 3 + 1.0 * 2) / 5)
    seq = reduce_tokens(terms.per_token, mask, "sequence")
    assert float(seq.detach()) == pytest.approx((-2.0 + 1.0) / 2)


def test_dppo_mask_matches_prime_rl_rule() -> None:
    """PRIME-RL default loss: mask A>0 tokens whose prob rose > high, A<=0 tokens whose prob fell > low."""
    old = torch.log(torch.tensor([[0.1, 0.1, 0.8, 0.8, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.5, 0.25, 0.3, 0.7, 0.5, 0.1]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0, 0.0]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    cfg = LossConfig(dppo_mask=True, dppo_mask_low=0.2, dppo_mask_high=0.2, eps_low=0.5, eps_high=100.0)
    terms = policy_terms(new, old, adv, mask, cfg)
    delta_p = new.detach().exp() - old.exp()
    prime = torch.where(adv > 0, delta_p > 0.2, delta_p < -0.2)
    assert torch.equal(terms.dppo_masked, prime)
    assert terms.dppo_masked.tolist() == [[True, False, True, False, False, True]]
    terms.per_token.sum().backward()
    assert new.grad is not None
    assert (new.grad[prime] == 0).all()
    assert not cfg.model_copy(update={"dppo_mask": False}).dppo_mask


def test_k3_kl_to_reference_is_zero_at_reference_and_positive_elsewhere() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, 1)
    cfg = LossConfig(kl_beta=0.5)
    same = policy_terms(logp, logp.detach(), adv, mask, cfg, ref_logprobs=logp.detach())
    assert same.kl_ref is not None and torch.equal(same.kl_ref, torch.zeros(1, 2))
    diff = policy_terms(logp, logp.detach(), adv, mask, cfg, ref_logprobs=logp.detach() - 0.5)
    assert diff.kl_ref is not None and (diff.kl_ref > 0).all()
    assert float(diff.per_token.detach().sum()) == pytest.approx(0.5 * float(diff.kl_ref.sum()))


def test_padding_with_garbage_old_logprobs_is_excluded() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.1, float("nan"), float("inf")]])
    mask = torch.tensor([[True, False, False]])
    terms = policy_terms(logp, old, torch.ones(1, 1), mask, LossConfig())
    loss = reduce_tokens(terms.per_token, mask, "token")
    loss.backward()
    assert torch.isfinite(loss)
    assert logp.grad is not None and logp.grad[0, 1:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_matches_log_softmax_gather(dtype: torch.dtype) -> None:
    from composer_mesh.loss.grpo import token_logprobs

    g = torch.Generator().manual_seed(3)
    full = (torch.randn(3, 150, 19, generator=g) * 3).to(dtype).requires_grad_()
    view = full[:, 1:-1]  # shifted, non-contiguous, spans several internal chunks
    ids = torch.randint(0, 19, (3, 148), generator=g)
    ids[0, 0] = -100  # padding id is read as 0, not an error
    weights = torch.randn(3, 148, generator=g)
    ours = token_logprobs(view, ids)
    ref_full = full.detach().clone().requires_grad_()
    ref = (
        torch.log_softmax(ref_full[:, 1:-1].float(), -1)
        .gather(-1, ids.clamp_min(0).unsqueeze(-1))
        .squeeze(-1)
    )
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    assert full.grad is not None and full.grad.dtype == dtype
    torch.testing.assert_close(full.grad.float(), ref_full.grad.float(), rtol=0.01, atol=2e-6)
