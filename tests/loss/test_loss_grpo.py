"""Channel 1 (GRPO / Dr. GRPO / DAPO / DPPO) invariants."""

from __future__ import annotations

import pytest
import torch

from composer_mesh.loss.compose import compose_loss
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.grpo import (
    episode_advantages,
    group_advantages,
    policy_metrics,
    policy_terms,
    reduce_tokens,
)


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


def test_an_episode_of_two_segments_counts_once_in_its_group() -> None:
    """Group 0 holds episodes A (reward 1, two segments: rows 0 and 2), B (0) and C (0.5); group 1 holds D (1) and
    E (0). By hand, over episodes: group 0 has mean 0.5 and unbiased std 0.5, so A = 0.5 / (0.5 + 1e-4), B = -A,
    C = 0; group 1 has std sqrt(0.5), so D = 0.5 / (sqrt(0.5) + 1e-4), E = -D. Both of A's rows get A's."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    episodes = torch.tensor([5, 2, 5, 8, 1, 3])  # any labels, unique across the batch
    a, d = 0.5 / (0.5 + 1e-4), 0.5 / (0.5**0.5 + 1e-4)
    adv = episode_advantages(rewards, groups, episodes, scale_std=True)
    torch.testing.assert_close(adv, torch.tensor([a, -a, a, 0.0, d, -d]), rtol=0, atol=1e-6)
    assert abs(float(adv[[0, 1, 3]].sum())) < 1e-6  # the group's mean is over its episodes: they sum to 0
    assert abs(float(group_advantages(rewards, groups, True)[0]) - a) > 0.1  # rows as samples: A would weigh 2x
    dr = episode_advantages(rewards, groups, episodes, scale_std=False)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, 0.5, 0.0, 0.5, -0.5]), rtol=0, atol=1e-6)
    singles = torch.arange(6)  # every row its own episode: plain group advantages
    torch.testing.assert_close(episode_advantages(rewards, groups, singles, True), group_advantages(rewards, groups,
                                                                                                    True))
    with pytest.raises(ValueError, match="share its reward and group"):
        episode_advantages(torch.tensor([1.0, 0.0, 0.5]), groups[:3], torch.tensor([0, 1, 0]), True)


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


# ---- off_policy_correction="tis": decoupled PPO with the trainer as proximal policy, truncated IS weight -----------

F64 = torch.float64


@pytest.mark.parametrize(
    "knobs",
    [{}, {"normalization": "sequence", "kl_beta": 0.1}, {"dppo_mask": True, "eps_low": 0.1, "eps_high": 0.1}],
    ids=["token", "sequence-kl", "dppo"],
)
def test_tis_equals_none_when_the_sampler_is_the_trainer(knobs: dict) -> None:
    """pi_sampler == pi_theta: w = 1, so "tis" gives "none"'s loss and gradient."""
    g = torch.Generator().manual_seed(7)
    logp0 = -torch.rand(3, 6, generator=g, dtype=F64) * 3
    mask = torch.arange(6)[None] < torch.tensor([[6], [4], [2]])
    adv = torch.randn(3, 1, generator=g, dtype=F64)
    ref = logp0 + 0.2 * torch.randn(3, 6, generator=g, dtype=F64)
    out = {}
    for mode in ("none", "tis"):
        cfg = LossConfig(off_policy_correction=mode, tis_cap=1.5, **knobs)
        logp = logp0.clone().requires_grad_()
        terms = policy_terms(logp, logp0, adv, mask, cfg, ref_logprobs=ref)
        loss = reduce_tokens(terms.per_token, mask, cfg.normalization)
        loss.backward()
        out[mode] = (loss.detach(), logp.grad, terms)
    torch.testing.assert_close(out["tis"][0], out["none"][0], rtol=0, atol=1e-15)
    torch.testing.assert_close(out["tis"][1], out["none"][1], rtol=0, atol=1e-15)
    tis_terms = out["tis"][2]
    assert tis_terms.tis_weight is not None and torch.equal(tis_terms.tis_weight, torch.ones(3, 6, dtype=F64))
    assert tis_terms.tis_truncated is not None and not tis_terms.tis_truncated.any()
    assert out["none"][2].tis_weight is None and out["none"][2].tis_truncated is None


def test_tis_gradient_is_truncated_importance_weighted_reinforce() -> None:
    """grad = -min(pi_theta/pi_sampler, C) * A * grad logp on EVERY token (float64, exact), including tokens whose
    ratio left the clip range (no gradient under "none") and tokens whose ratio exceeds the cap C."""
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5, 3.0, 5.0, 0.3, 2.5]], dtype=F64)
    adv = torch.tensor([[-1.0, 2.0, -0.5, 1.0, 1.5, -2.0, 0.7, -1.2]], dtype=F64)
    mask = torch.ones(1, 8, dtype=torch.bool)
    logp0 = torch.tensor([[-0.2, -1.0, -2.5, -0.9, -1.3, -3.0, -0.4, -2.0]], dtype=F64)
    old = logp0 - torch.log(ratios)  # pi_theta / pi_sampler = ratios
    cap, n = 2.0, 8

    def grad(mode: str) -> tuple[torch.Tensor, torch.Tensor, object]:
        cfg = LossConfig(off_policy_correction=mode, tis_cap=cap, eps_low=0.2, eps_high=0.28)
        logp = logp0.clone().requires_grad_()
        terms = policy_terms(logp, old, adv, mask, cfg)
        loss = reduce_tokens(terms.per_token, mask, "token")
        loss.backward()
        assert logp.grad is not None
        return loss.detach(), logp.grad, terms

    loss, g_tis, terms = grad("tis")
    w = ratios.clamp(max=cap)
    torch.testing.assert_close(g_tis, -w * adv / n, rtol=0, atol=1e-15)
    torch.testing.assert_close(loss, (-w * adv).sum() / n, rtol=0, atol=1e-15)
    # "none": the PPO clip of pi_theta/pi_sampler drops the tokens whose ratio left the clip range in the direction
    # of their advantage (0.5 with A<0; 1.5 and 3.0 with A>0); 0.3 with A>0 and 5.0, 2.5 with A<0 keep -r*A.
    # "tis" gives every one of them a gradient.
    _, g_none, _ = grad("none")
    outside = torch.tensor([[True, False, False, True, True, False, False, False]])
    assert (g_none[outside] == 0).all() and (g_tis[outside] != 0).all()
    torch.testing.assert_close(g_none[~outside], (-ratios * adv / n)[~outside], rtol=0, atol=1e-15)
    # the cap binds on 3.0, 5.0 and 2.5: without truncation those would be -r*A
    truncated = ratios > cap
    assert truncated.sum() == 3 and not torch.allclose(g_tis[truncated], (-ratios * adv / n)[truncated])
    # terms: ratio is still pi_theta/pi_sampler; the (inactive) clip of pi_theta/sg(pi_theta) flags nothing
    torch.testing.assert_close(terms.ratio, ratios, rtol=0, atol=1e-14)
    assert not terms.clipped_low.any() and not terms.clipped_high.any()
    assert torch.equal(terms.tis_truncated, truncated)
    metrics = policy_metrics(terms, mask, adv)
    assert metrics["grpo/tis_truncated_frac"] == pytest.approx(3 / 8)
    assert metrics["grpo/tis_weight_mean"] == pytest.approx(float(w.mean()))
    assert metrics["grpo/ratio_max"] == pytest.approx(5.0)
    assert metrics["grpo/clip_frac"] == 0.0


def test_tis_keeps_dppo_mask_relative_to_the_sampler_and_ignores_padding() -> None:
    old = torch.log(torch.tensor([[0.1, 0.8, 0.5, 0.5]], dtype=F64))
    new = torch.log(torch.tensor([[0.5, 0.3, 0.5, 0.5]], dtype=F64))
    old[0, 3] = float("nan")  # padding: garbage sampler log-prob
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, False]])
    cfg = LossConfig(off_policy_correction="tis", dppo_mask=True, dppo_mask_low=0.2, dppo_mask_high=0.2)
    logp = new.clone().requires_grad_()
    terms = policy_terms(logp, old, adv, mask, cfg)
    assert terms.dppo_masked.tolist() == [[True, True, False, False]]
    reduce_tokens(terms.per_token, mask, "token").backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.0 / 3, 0.0])
    assert terms.tis_weight is not None and terms.tis_weight[0, 3] == 1.0


def test_tis_metrics_only_when_tis_is_on(make_batch) -> None:
    batch = make_batch(seed=3)
    on = compose_loss(batch, LossConfig(off_policy_correction="tis", tis_cap=1.1)).metrics
    off = compose_loss(make_batch(seed=3), LossConfig()).metrics
    assert {"grpo/tis_weight_mean", "grpo/tis_truncated_frac"} <= on.keys()
    assert not {"grpo/tis_weight_mean", "grpo/tis_truncated_frac"} & off.keys()
    assert 0 < on["grpo/tis_truncated_frac"] < 1 and on["grpo/tis_weight_mean"] <= 1.1
    assert on["grpo/ratio_mean"] == pytest.approx(off["grpo/ratio_mean"], rel=1e-6)
