"""Channel 2: generalized JSD (vs TRL GKD), TAID, entropy-aware OPD, top-k, chunking."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.distill import (
    DistillParams,
    TAIDState,
    distill_loss_chunked,
    distill_loss_naive,
    distill_loss_topk,
    taid_current_t,
    taid_linear_t,
    taid_update,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _trl_jsd():
    # TRL 1.16 keeps GKD under trl.experimental: trl/experimental/gkd/gkd_trainer.py, GKDTrainer.generalized_jsd_loss
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _inputs(seed: int = 0, b: int = 3, t: int = 7, v: int = 50, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(b, t, v, generator=g) * scale
    te = torch.randn(b, t, v, generator=g) * scale
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, 0] = True
    return s, te, mask


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_matches_trl_gkd(beta: float, temperature: float) -> None:
    s, te, mask = _inputs(seed=int(beta * 10) + 1)
    labels = torch.where(
        mask, torch.zeros_like(mask, dtype=torch.long), torch.full_like(mask, -100, dtype=torch.long)
    )
    s_trl = s.clone().requires_grad_()
    ref = _trl_jsd()(s_trl, te, labels=labels, beta=beta, temperature=temperature)
    ref.backward()
    s_ours = s.clone().requires_grad_()
    params = DistillParams(beta=beta, temperature=temperature, chunk_tokens=4)
    ours = distill_loss_chunked(s_ours, te, mask, params)
    ours.loss.backward()
    assert abs(float(ours.loss.detach()) - float(ref.detach())) < 1e-6
    assert s_ours.grad is not None and s_trl.grad is not None
    torch.testing.assert_close(s_ours.grad, s_trl.grad, rtol=0, atol=1e-6)


def test_jsd_is_zero_for_equal_distributions_and_symmetric_at_half() -> None:
    s, te, mask = _inputs(seed=3)
    for beta in (0.0, 0.3, 0.5, 1.0):
        same = distill_loss_chunked(s, s.clone(), mask, DistillParams(beta=beta))
        assert abs(float(same.loss)) < 1e-6
    half = DistillParams(beta=0.5)
    ab = distill_loss_naive(s, te, mask, half).per_token
    ba = distill_loss_naive(te, s, mask, half).per_token
    torch.testing.assert_close(ab, ba, rtol=0, atol=1e-6)
    assert float(ab.max()) <= math.log(2) + 1e-6


@pytest.mark.parametrize(
    "params",
    [
        DistillParams(beta=0.5, chunk_tokens=3),
        DistillParams(beta=0.0, temperature=0.5, chunk_tokens=5),
        DistillParams(beta=1.0, temperature=2.0, chunk_tokens=2),
        DistillParams(beta=0.3, taid_t=0.4, chunk_tokens=4),
        DistillParams(beta=1.0, entropy_h_max=2.6, chunk_tokens=4),
        DistillParams(beta=0.7, entropy_h_max=2.6, entropy_gate="linear", chunk_tokens=4),
        DistillParams(beta=0.5, token_clip=0.45, chunk_tokens=6),
    ],
    ids=["jsd", "fkl-temp", "rkl-temp", "taid", "eopd-hard", "eopd-linear", "token-clip"],
)
def test_chunked_equals_naive_in_value_and_gradient(params: DistillParams) -> None:
    s, te, mask = _inputs(seed=5)
    a = s.clone().requires_grad_()
    b = s.clone().requires_grad_()
    out_c = distill_loss_chunked(a, te, mask, params)
    out_n = distill_loss_naive(b, te, mask, params)
    (2.5 * out_c.loss).backward()
    (2.5 * out_n.loss).backward()
    assert abs(float(out_c.loss.detach()) - float(out_n.loss.detach())) < 1e-6
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(out_c.per_token, out_n.per_token, rtol=1e-6, atol=1e-6)
    assert a.grad[~mask].abs().sum() == 0  # padding / non-distilled tokens get no gradient
    if params.entropy_h_max is not None and params.entropy_gate == "hard":
        assert 0 < float(out_c.gate.mean()) < 1  # the threshold splits the tokens: both branches exercised
    if params.token_clip is not None:
        assert out_c.clipped.any() and not out_c.clipped.all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_is_accurate_at_qwen_vocab(beta: float) -> None:
    """At vocab 151,936 the chunked loss stays within float32 rounding (1e-6 relative) of a float64 evaluation."""
    g = torch.Generator().manual_seed(12)
    s = torch.randn(1, 6, 151_936, generator=g) * 2
    te = torch.randn(1, 6, 151_936, generator=g) * 2
    mask = torch.ones(1, 6, dtype=torch.bool)
    ls, lt = torch.log_softmax(s.double(), -1), torch.log_softmax(te.double(), -1)
    if beta == 0.0:
        ref = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1.0:
        ref = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))
        ref = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    out = distill_loss_chunked(s, te, mask, DistillParams(beta=beta, chunk_tokens=4))
    assert abs(float(out.loss) - float(ref.mean())) < 1e-6 * max(1.0, float(ref.mean()))


def test_non_contiguous_student_view_is_handled_without_flattening() -> None:
    """A shifted view such as logits[:, 1:-1] (non-contiguous) gives the same value and gradient."""
    g = torch.Generator().manual_seed(13)
    full = torch.randn(3, 9, 40, generator=g).requires_grad_()
    te = torch.randn(3, 7, 40, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.2
    view = full[:, 1:-1]
    assert not view.is_contiguous()
    params = DistillParams(beta=0.3, chunk_tokens=3)
    distill_loss_chunked(view, te, mask, params).loss.backward()
    ref = full.detach().clone().requires_grad_()
    distill_loss_naive(ref[:, 1:-1], te, mask, params).loss.backward()
    torch.testing.assert_close(full.grad, ref.grad, rtol=0, atol=1e-6)
    assert full.grad is not None and full.grad[:, [0, -1]].abs().sum() == 0


def test_bf16_logits_give_bf16_gradient_close_to_float32() -> None:
    s, te, mask = _inputs(seed=6)
    a = s.to(torch.bfloat16).requires_grad_()
    out = distill_loss_chunked(a, te, mask, DistillParams(chunk_tokens=4))
    out.loss.backward()
    b = s.to(torch.bfloat16).float().requires_grad_()
    distill_loss_naive(b, te, mask, DistillParams()).loss.backward()
    assert a.grad is not None and a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.float(), b.grad, rtol=0.02, atol=1e-4)


def test_taid_t0_ignores_teacher_and_t1_is_plain_distillation() -> None:
    s, te, mask = _inputs(seed=7)
    for beta in (0.0, 0.5, 1.0):
        a = s.clone().requires_grad_()
        out0 = distill_loss_chunked(a, te, mask, DistillParams(beta=beta, taid_t=0.0))
        out0.loss.backward()
        assert abs(float(out0.loss.detach())) < 1e-6
        assert a.grad is not None and float(a.grad.abs().max()) < 1e-7
        a1 = s.clone().requires_grad_()
        p1 = s.clone().requires_grad_()
        taid1 = distill_loss_chunked(a1, te, mask, DistillParams(beta=beta, taid_t=1.0))
        plain = distill_loss_chunked(p1, te, mask, DistillParams(beta=beta))
        taid1.loss.backward()
        plain.loss.backward()
        assert torch.equal(taid1.loss.detach(), plain.loss.detach())
        assert torch.equal(a1.grad, p1.grad)


def test_taid_t1_forward_kl_gradient_is_kd_gradient() -> None:
    """TAID's loss at t=1 with beta=0 is KD (cross entropy to the teacher): grad = (q - p) / n per token."""
    s, te, mask = _inputs(seed=8)
    a = s.clone().requires_grad_()
    distill_loss_chunked(a, te, mask, DistillParams(beta=0.0, taid_t=1.0)).loss.backward()
    expected = (torch.softmax(s, -1) - torch.softmax(te, -1)) * mask.unsqueeze(-1) / mask.sum()
    torch.testing.assert_close(a.grad, expected, rtol=0, atol=1e-7)


def test_taid_without_schedule_is_refused_before_any_step() -> None:
    with pytest.raises(ValueError, match="taid_t"):
        LossConfig(sdpo_wrapper="taid")


def test_taid_adaptive_schedule_is_monotone_bounded_and_above_linear() -> None:
    cfg = LossConfig(
        sdpo_wrapper="taid", taid_total_steps=20, taid_t_start=0.2, taid_t_end=0.9, taid_alpha=0.3
    )
    state = TAIDState()
    ts = []
    losses = [5.0, 4.0, 4.5, 3.0, 2.9, 3.5, 1.0] * 4
    for step, loss in enumerate(losses):
        t = taid_current_t(cfg, step, state)
        ts.append(t)
        assert taid_linear_t(cfg, step) - 1e-12 <= t <= cfg.taid_t_end
        taid_update(cfg, step, state, t, loss)
    assert all(b >= a for a, b in itertools.pairwise(ts))
    assert ts[0] == pytest.approx(0.2) and ts[-1] == pytest.approx(0.9)
    assert any(t > taid_linear_t(cfg, i) + 1e-6 for i, t in enumerate(ts))  # adaptivity moved ahead of linear
    fresh = TAIDState()
    fresh.load_state_dict(state.state_dict())
    assert fresh == state


def test_taid_linear_schedule_starts_at_schedule_step() -> None:
    cfg = LossConfig(sdpo_wrapper="taid", taid_total_steps=10, taid_schedule_step=5, taid_adaptive=False)
    assert taid_current_t(cfg, 0, None) == pytest.approx(0.4)
    assert taid_current_t(cfg, 10, None) == pytest.approx(0.7)
    assert taid_current_t(cfg, 100, None) == pytest.approx(1.0)


def test_entropy_opd_is_zero_when_student_equals_teacher() -> None:
    s, _, mask = _inputs(seed=9)
    a = s.clone().requires_grad_()
    out = distill_loss_chunked(a, s.clone(), mask, DistillParams(beta=1.0, entropy_h_max=0.1))
    out.loss.backward()
    assert float(out.gate.min()) == 1.0  # every token gated on, and still zero
    assert abs(float(out.loss.detach())) < 1e-6
    assert a.grad is not None and float(a.grad.abs().max()) < 1e-7


def test_entropy_opd_below_threshold_is_plain_opd_and_above_adds_forward_kl() -> None:
    s, te, mask = _inputs(seed=10)
    opd = distill_loss_naive(s, te, mask, DistillParams(beta=1.0))
    low = distill_loss_naive(s, te, mask, DistillParams(beta=1.0, entropy_h_max=1e6))
    assert torch.equal(low.loss, opd.loss)
    high = distill_loss_naive(s, te, mask, DistillParams(beta=1.0, entropy_h_max=1e-6))
    fkl = distill_loss_naive(s, te, mask, DistillParams(beta=0.0))
    torch.testing.assert_close(high.loss, opd.loss + fkl.loss, rtol=0, atol=1e-6)


def test_topk_teacher_is_renormalised_on_its_support() -> None:
    """Sparse top-k == dense divergence between both distributions restricted and renormalised to the k ids."""
    g = torch.Generator().manual_seed(11)
    b, t, v, k = 2, 5, 30, 6
    s = torch.randn(b, t, v, generator=g)
    ids = torch.stack([torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(t)]) for _ in range(b)])
    t_lp = torch.log_softmax(torch.randn(b, t, v, generator=g), -1).gather(
        -1, ids
    )  # not normalised on support
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False
    params = DistillParams(beta=0.4, temperature=0.8)
    a = s.clone().requires_grad_()
    sparse = distill_loss_topk(a, ids, t_lp, mask, params)
    sparse.loss.backward()
    dense = distill_loss_naive(s.gather(-1, ids), t_lp, mask, params)
    torch.testing.assert_close(sparse.loss.detach(), dense.loss, rtol=0, atol=1e-6)
    assert a.grad is not None
    outside = torch.ones_like(a.grad, dtype=torch.bool).scatter_(-1, ids, False)
    assert a.grad[outside].abs().sum() == 0
    assert a.grad[~mask].abs().sum() == 0
    assert a.grad[mask].abs().sum() > 0


def test_topk_ids_out_of_range_name_the_field() -> None:
    s = torch.randn(1, 2, 5)
    ids = torch.tensor([[[0, 9]], [[1, 2]]]).reshape(1, 2, 2)
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        distill_loss_topk(s, ids, torch.zeros(1, 2, 2), torch.ones(1, 2, dtype=torch.bool), DistillParams())
