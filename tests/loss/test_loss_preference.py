"""Channel 3: DPO and SimPO against TRL, invariants, per-teacher metrics."""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from composer_mesh.loss.compose import LossBatch, compose_loss
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.preference import ReplayPairs, dpo_loss, replay_metrics, sequence_logps, simpo_loss

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _pairs(seed: int = 0, p: int = 4, tc: int = 6, tr: int = 5):
    g = torch.Generator().manual_seed(seed)
    chosen = -torch.rand(p, tc, generator=g) * 2
    rejected = -torch.rand(p, tr, generator=g) * 2
    cmask = torch.arange(tc).unsqueeze(0) < torch.randint(1, tc + 1, (p,), generator=g).unsqueeze(1)
    rmask = torch.arange(tr).unsqueeze(0) < torch.randint(1, tr + 1, (p,), generator=g).unsqueeze(1)
    ref_c = -torch.rand(p, generator=g) * 5
    ref_r = -torch.rand(p, generator=g) * 5
    return chosen, cmask, rejected, rmask, ref_c, ref_r


def _trl_dpo_sigmoid(chosen, cmask, rejected, rmask, ref_c, ref_r, beta: float) -> torch.Tensor:
    """Run TRL's own DPOTrainer._compute_loss (loss_type "sigmoid") on given per-token log-probs.

    TRL 1.16 has no standalone DPO loss function; the loss lives in `_compute_loss`. The model is replaced by a
    callable returning the per-token log-probs (zero at non-completion positions, as TRL's fused LM head
    does) and the trainer by a namespace with the attributes that method reads.
    """
    from trl.trainer.dpo_trainer import DPOTrainer

    p = chosen.shape[0]
    length = max(chosen.shape[1], rejected.shape[1])

    def pad(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, length - x.shape[1]))

    token_logps = torch.cat([pad(chosen * cmask), pad(rejected * rmask)])  # [2P, L]
    comp_mask = torch.cat([pad(cmask.long()), pad(rmask.long())])
    completion_mask = F.pad(comp_mask, (1, 0))  # TRL shifts by one: seq_len = L
    accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x
    )
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=accelerator,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )

    def model(**_kwargs):
        zeros = torch.zeros(2 * p, length)
        return SimpleNamespace(log_probs=token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    inputs = {
        "input_ids": torch.zeros(2 * p, length + 1, dtype=torch.long),
        "attention_mask": torch.ones(2 * p, length + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_c,
        "ref_rejected_logps": ref_r,
    }
    return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_trl_sigmoid_loss(beta: float) -> None:
    chosen, cmask, rejected, rmask, ref_c, ref_r = _pairs(seed=int(beta * 10))
    c1, r1 = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    ref = _trl_dpo_sigmoid(c1, cmask, r1, rmask, ref_c, ref_r, beta)
    ref.backward()
    c2, r2 = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    losses, _, _ = dpo_loss(
        sequence_logps(c2, cmask, average=False), sequence_logps(r2, rmask, average=False), ref_c, ref_r, beta
    )
    ours = losses.mean()
    ours.backward()
    assert abs(float(ours.detach()) - float(ref.detach())) < 1e-6
    torch.testing.assert_close(c2.grad, c1.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(r2.grad, r1.grad, rtol=0, atol=1e-6)


def test_simpo_matches_trl_cpo_simpo() -> None:
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    chosen, cmask, rejected, rmask, _, _ = _pairs(seed=3)
    avg_c, avg_r = sequence_logps(chosen, cmask, True), sequence_logps(rejected, rmask, True)
    beta, gamma = 2.0, 0.5
    stub = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=0.0,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    ref_losses, ref_rc, ref_rr = CPOTrainer.cpo_loss(stub, avg_c, avg_r)
    losses, r_c, r_r = simpo_loss(avg_c, avg_r, beta, gamma)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-6)
    torch.testing.assert_close(r_c, ref_rc)
    torch.testing.assert_close(r_r, ref_rr)


def test_dpo_at_reference_is_log2_and_gradient_prefers_chosen() -> None:
    chosen, cmask, rejected, rmask, _, _ = _pairs(seed=4)
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    sc, sr = sequence_logps(c, cmask, False), sequence_logps(r, rmask, False)
    losses, _, _ = dpo_loss(sc, sr, sc.detach(), sr.detach(), beta=0.1)
    torch.testing.assert_close(losses, torch.full_like(losses, math.log(2)))
    losses.mean().backward()
    assert c.grad is not None and r.grad is not None
    assert (c.grad[cmask] < 0).all() and (c.grad[~cmask] == 0).all()  # descent raises log pi(chosen)
    assert (r.grad[rmask] > 0).all() and (r.grad[~rmask] == 0).all()  # ... and lowers log pi(rejected)


def test_simpo_is_differentiable_reference_free_and_softplus_gamma_at_equal_average() -> None:
    chosen, cmask, rejected, rmask, ref_c, ref_r = _pairs(seed=5)
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    losses, _, _ = simpo_loss(sequence_logps(c, cmask, True), sequence_logps(r, rmask, True), 2.0, 0.5)
    losses.mean().backward()
    assert c.grad is not None and r.grad is not None
    assert (c.grad[cmask] < 0).all() and (r.grad[rmask] > 0).all()
    equal, _, _ = simpo_loss(torch.tensor([-1.3]), torch.tensor([-1.3]), 2.0, 0.5)
    assert float(equal) == pytest.approx(math.log1p(math.exp(0.5)))
    # reference-free: the compose path ignores reference log-probs under "simpo"
    cfg = LossConfig(dpo_variant="simpo", alpha_sdpo=0.0)
    a = ReplayPairs(chosen, cmask, rejected, rmask, ref_c, ref_r, ["t"] * 4)
    b = ReplayPairs(chosen, cmask, rejected, rmask, None, None, ["t"] * 4)
    base = dict(
        logits=torch.zeros(1, 1, 3),
        token_ids=torch.zeros(1, 1, dtype=torch.long),
        mask=torch.ones(1, 1, dtype=torch.bool),
        old_logprobs=torch.zeros(1, 1),
        rewards=torch.zeros(1),
        group_ids=torch.zeros(1, dtype=torch.long),
    )
    ra = compose_loss(LossBatch(**base, replay=a), cfg).parts["replay"]
    rb = compose_loss(LossBatch(**base, replay=b), cfg).parts["replay"]
    assert torch.equal(ra, rb)


def test_replay_metrics_per_teacher() -> None:
    r_c = torch.tensor([1.0, 0.0, 2.0, -1.0])
    r_r = torch.tensor([0.0, 1.0, 1.0, 0.0])
    m = replay_metrics(r_c, r_r, torch.tensor([0.1, 0.2, 0.3, 0.4]), ["a", "b", "a", "b"])
    assert m["replay/a/accuracy"] == 1.0 and m["replay/b/accuracy"] == 0.0
    assert m["replay/a/margin"] == 1.0 and m["replay/b/margin"] == -1.0
    assert m["replay/a/pairs"] == 2.0 and m["replay/accuracy"] == 0.5
    assert m["replay/b/loss"] == pytest.approx(0.3)
