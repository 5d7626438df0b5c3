"""compose_loss: channel switching, bit-exactness, gradients through every channel, masks, argument errors."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from composer_mesh.loss.compose import ReplayPairs, compose_loss, new_loss_state, token_logprobs
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.distill import TAIDState


def _grad(result_part: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(result_part, logits, retain_graph=True)
    return g


@pytest.mark.parametrize("teacher", ["dense", "topk"])
def test_zero_weights_reproduce_grpo_only_bit_exactly(make_batch, teacher: str) -> None:
    full = make_batch(teacher=teacher, replay=True, ref=True)
    bare = dataclasses.replace(
        full, teacher_logits=None, teacher_topk_ids=None, teacher_topk_logprobs=None, replay=None
    )
    cfg = LossConfig(kl_beta=0.05)
    off = compose_loss(full, cfg.model_copy(update={"alpha_sdpo": 0.0, "beta_replay": 0.0}))
    grpo_only = compose_loss(bare, cfg)
    assert set(off.parts) == {"grpo"} and set(grpo_only.parts) == {"grpo"}
    assert torch.equal(off.total, grpo_only.total)
    assert torch.equal(_grad(off.total, full.logits), _grad(grpo_only.total, full.logits))
    on = compose_loss(full, cfg)
    assert set(on.parts) == {"grpo", "sdpo", "replay"}
    assert torch.equal(on.parts["grpo"], grpo_only.total)
    expected = on.parts["grpo"] + cfg.alpha_sdpo * on.parts["sdpo"] + cfg.beta_replay * on.parts["replay"]
    assert torch.equal(on.total, expected)


def test_channels_off_per_batch_when_inputs_absent(make_batch) -> None:
    batch = make_batch()
    result = compose_loss(batch, LossConfig(alpha_sdpo=2.0, beta_replay=3.0))
    assert set(result.parts) == {"grpo"}
    no_distill_tokens = make_batch(teacher="dense")
    no_distill_tokens.distill_mask = torch.zeros_like(no_distill_tokens.mask)
    result = compose_loss(no_distill_tokens, LossConfig())
    assert "sdpo" not in result.parts and result.metrics["sdpo/tokens"] == 0.0


def test_gradients_reach_student_logits_through_every_channel(make_batch) -> None:
    batch = make_batch(teacher="dense")
    # channel 3 log-probs are computed from the same student logits, as the trainer does
    lp = token_logprobs(batch.logits, batch.token_ids)
    batch.replay = ReplayPairs(
        chosen_logps=lp[:2],
        chosen_mask=batch.mask[:2],
        rejected_logps=lp[2:],
        rejected_mask=batch.mask[2:],
        ref_chosen_logps=torch.tensor([-9.0, -8.0]),
        ref_rejected_logps=torch.tensor([-7.0, -9.5]),
        teachers=["a", "b"],
    )
    for variant in ("dpo", "simpo"):
        result = compose_loss(batch, LossConfig(dpo_variant=variant))
        for name, part in result.parts.items():
            g = _grad(part, batch.logits)
            assert torch.isfinite(g).all(), name
            assert float(g[batch.mask].abs().sum()) > 0, name
            assert float(g[~batch.mask].abs().sum()) == 0, name
    topk = make_batch(teacher="topk")
    g = _grad(compose_loss(topk, LossConfig()).parts["sdpo"], topk.logits)
    assert float(g[topk.mask].abs().sum()) > 0 and float(g[~topk.mask].abs().sum()) == 0


def test_padding_values_do_not_change_the_loss(make_batch) -> None:
    batch = make_batch(teacher="dense", ref=True)
    cfg = LossConfig(kl_beta=0.1)
    before = compose_loss(batch, cfg).total.detach()
    pad = ~batch.mask
    noisy = dataclasses.replace(
        batch,
        logits=torch.where(pad.unsqueeze(-1), torch.full_like(batch.logits, 55.0), batch.logits.detach()),
        old_logprobs=torch.where(pad, torch.full_like(batch.old_logprobs, float("nan")), batch.old_logprobs),
        ref_logprobs=torch.where(pad, torch.full_like(batch.old_logprobs, 1e4), batch.ref_logprobs),
        teacher_logits=torch.where(pad.unsqueeze(-1), -batch.teacher_logits * 30, batch.teacher_logits),
        token_ids=torch.where(pad, torch.full_like(batch.token_ids, -100), batch.token_ids),
    )
    after = compose_loss(noisy, cfg).total
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)


def test_distill_mask_limits_channel_two(make_batch) -> None:
    batch = make_batch(teacher="dense")
    dm = torch.zeros_like(batch.mask)
    dm[0, :3] = True
    batch.distill_mask = dm
    result = compose_loss(batch, LossConfig())
    assert result.metrics["sdpo/tokens"] == 3.0
    g = _grad(result.parts["sdpo"], batch.logits)
    assert float(g[~dm].abs().sum()) == 0 and float(g[dm].abs().sum()) > 0


def test_taid_without_schedule_is_refused_by_its_config() -> None:
    """Refused when the topology is read (`composer-mesh validate`), not at the first training step."""
    with pytest.raises(ValueError, match="taid_total_steps"):
        LossConfig(sdpo_wrapper="taid")
    LossConfig(sdpo_wrapper="taid", taid_t=0.5)  # a fixed t is a schedule too


def test_adaptive_taid_needs_state_and_updates_it(make_batch) -> None:
    cfg = LossConfig(sdpo_wrapper="taid", taid_total_steps=100, taid_alpha=0.5)
    batch = make_batch(teacher="dense")
    with pytest.raises(ValueError, match="state"):
        compose_loss(batch, cfg, step=0, state=None)
    state = new_loss_state(cfg)
    assert isinstance(state, TAIDState)
    ts = []
    for step in range(4):
        result = compose_loss(make_batch(teacher="dense", seed=step), cfg, step=step, state=state)
        ts.append(result.metrics["sdpo/taid_t"])
    assert ts[0] == pytest.approx(0.4) and all(b >= a for a, b in itertools.pairwise(ts))
    assert state.t is not None and state.t >= ts[-1]
    assert new_loss_state(LossConfig(sdpo_wrapper="taid", taid_t=0.5)) is None
    fixed = compose_loss(batch, LossConfig(sdpo_wrapper="taid", taid_t=0.25))
    assert fixed.metrics["sdpo/taid_t"] == 0.25


def test_half_precision_logits(make_batch) -> None:
    batch = make_batch(teacher="dense", dtype=torch.bfloat16)
    result = compose_loss(batch, LossConfig())
    result.total.backward()
    assert batch.logits.grad is not None and batch.logits.grad.dtype == torch.bfloat16
    assert torch.isfinite(batch.logits.grad.float()).all()


def test_precomputed_advantages_override_rewards(make_batch) -> None:
    batch = make_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    a = compose_loss(dataclasses.replace(batch, advantages=adv), LossConfig()).total
    b = compose_loss(
        dataclasses.replace(batch, advantages=adv.unsqueeze(-1).expand(4, 6)), LossConfig()
    ).total
    assert torch.equal(a, b)


def test_metrics_are_floats_with_expected_keys(make_batch) -> None:
    result = compose_loss(make_batch(teacher="dense", replay=True), LossConfig(sdpo_wrapper="entropy_opd"))
    assert all(isinstance(v, float) for v in result.metrics.values())
    for key in (
        "grpo/clip_frac",
        "grpo/mismatch_kl",
        "sdpo/teacher_entropy",
        "replay/t0/accuracy",
        "loss/total",
    ):
        assert key in result.metrics, key


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"logits": torch.zeros(4, 6)}, "logits"),
        ({"token_ids": torch.zeros(4, 5, dtype=torch.long)}, "token_ids"),
        ({"token_ids": torch.zeros(4, 6)}, "token_ids"),
        ({"mask": torch.ones(3, 6, dtype=torch.bool)}, "mask"),
        ({"old_logprobs": torch.zeros(4, 7)}, "old_logprobs"),
        ({"rewards": torch.zeros(4, 1)}, "rewards"),
        ({"group_ids": torch.zeros(5, dtype=torch.long)}, "group_ids"),
        ({"teacher_logits": torch.zeros(4, 6, 10)}, "teacher_logits"),
        ({"distill_mask": torch.ones(4, 5, dtype=torch.bool)}, "distill_mask"),
        ({"teacher_topk_ids": torch.zeros(4, 6, 3, dtype=torch.long)}, "teacher_topk_logprobs"),
        (
            {
                "teacher_topk_ids": torch.zeros(4, 6, 3, dtype=torch.long),
                "teacher_topk_logprobs": torch.zeros(4, 6, 2),
            },
            "teacher_topk_logprobs",
        ),
        ({"advantages": torch.zeros(3)}, "advantages"),
    ],
)
def test_shape_errors_name_the_argument(make_batch, change: dict, field: str) -> None:
    batch = dataclasses.replace(make_batch(), **change)
    with pytest.raises(ValueError, match=field):
        compose_loss(batch, LossConfig())


def test_missing_inputs_name_the_argument(make_batch) -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        compose_loss(make_batch(), LossConfig(kl_beta=0.1))
    replay = make_batch(replay=True)
    assert replay.replay is not None
    no_ref = dataclasses.replace(replay, replay=dataclasses.replace(replay.replay, ref_chosen_logps=None))
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        compose_loss(no_ref, LossConfig(dpo_variant="dpo"))
    bad_teachers = dataclasses.replace(replay, replay=dataclasses.replace(replay.replay, teachers=["x"]))
    with pytest.raises(ValueError, match="teachers"):
        compose_loss(bad_teachers, LossConfig())
    bad_mask = dataclasses.replace(
        replay, replay=dataclasses.replace(replay.replay, chosen_mask=torch.ones(3, 2, dtype=torch.bool))
    )
    with pytest.raises(ValueError, match="chosen_mask"):
        compose_loss(bad_mask, LossConfig())
    both = make_batch(teacher="topk")
    both.teacher_logits = torch.zeros_like(both.logits)
    with pytest.raises(ValueError, match="teacher_logits"):
        compose_loss(both, LossConfig())
