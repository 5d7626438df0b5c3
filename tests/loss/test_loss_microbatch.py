"""Micro-batches and the hidden-state student give the whole batch's loss and gradients (float64, to 1e-10)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from composer_mesh.loss.chunks import chunk_tokens
from composer_mesh.loss.compose import (
    BatchTotals,
    HiddenStates,
    LossAccumulator,
    LossBatch,
    ReplayPairs,
    compose_loss,
    new_loss_state,
)
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.grpo import group_advantages

B, T, V, H, P = 6, 5, 13, 7, 4
F64 = torch.float64


def _leaves(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(B, T, H, generator=g, dtype=F64).requires_grad_(),
        "weight": torch.randn(V, H, generator=g, dtype=F64).requires_grad_(),
        "bias": (0.1 * torch.randn(V, generator=g, dtype=F64)).requires_grad_(),
        "chosen": torch.randn(P, 6, V, generator=g, dtype=F64).requires_grad_(),
    }


def _batch(leaves: dict[str, torch.Tensor], teacher: str | None, replay: bool, hidden: bool) -> LossBatch:
    """A float64 batch with ragged rows; the student is either logits or the same model's hidden states."""
    g = torch.Generator().manual_seed(1)
    states = HiddenStates(leaves["hidden"], leaves["weight"], leaves["bias"], scale=1 / 0.7, chunk_elements=3 * V)
    logits = states.logits()
    student = states if hidden else logits
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None] < torch.tensor([5, 2, 4, 5, 1, 3])[:, None]
    with torch.no_grad():
        cur = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    kwargs: dict = {"ref_logprobs": cur + 0.2 * torch.randn(B, T, generator=g, dtype=F64)}
    if teacher == "dense":
        kwargs["teacher_logits"] = torch.randn(B, T, V, generator=g, dtype=F64)
        kwargs["distill_mask"] = torch.rand(B, T, generator=g) > 0.2
    elif teacher == "topk":
        kwargs["teacher_topk_ids"] = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(B * T)]).view(B, T, 4)
        kwargs["teacher_topk_logprobs"] = torch.log_softmax(torch.randn(B, T, 4, generator=g, dtype=F64), -1)
    if replay:
        chosen_mask = torch.arange(6)[None] < torch.tensor([6, 3, 4, 1])[:, None]
        rows = torch.tensor([0, 2, 3, 5])
        rejected = torch.log_softmax(logits[rows], -1).gather(-1, ids[rows][..., None])[..., 0]
        kwargs["replay"] = ReplayPairs(
            chosen_logps=torch.log_softmax(leaves["chosen"], -1)[..., 0], chosen_mask=chosen_mask,
            rejected_logps=rejected, rejected_mask=mask[rows],
            ref_chosen_logps=-torch.rand(P, generator=g, dtype=F64) * 3,
            ref_rejected_logps=-torch.rand(P, generator=g, dtype=F64) * 3, teachers=["a", "b", "a", "b"],
        )
    return LossBatch(
        logits=student, token_ids=ids, mask=mask, old_logprobs=cur + 0.3 * torch.randn(B, T, generator=g, dtype=F64),
        rewards=torch.rand(B, generator=g, dtype=F64), group_ids=torch.arange(B) // 3, **kwargs,
    )


def _piece(batch: LossBatch, rows: slice, pairs: slice) -> LossBatch:
    """Rows `rows` (and replay pairs `pairs`) of `batch`, sharing its autograd graph."""
    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[rows]

    student = batch.logits
    if isinstance(student, HiddenStates):
        student = dataclasses.replace(student, hidden=student.hidden[rows])
    else:
        student = student[rows]
    replay = batch.replay
    if replay is not None:
        replay = ReplayPairs(
            replay.chosen_logps[pairs], replay.chosen_mask[pairs], replay.rejected_logps[pairs],
            replay.rejected_mask[pairs], replay.ref_chosen_logps[pairs], replay.ref_rejected_logps[pairs],
            replay.teachers[pairs],
        )
    return dataclasses.replace(
        batch, logits=student, token_ids=batch.token_ids[rows], mask=batch.mask[rows],
        old_logprobs=batch.old_logprobs[rows], rewards=batch.rewards[rows], group_ids=batch.group_ids[rows],
        ref_logprobs=cut(batch.ref_logprobs), teacher_logits=cut(batch.teacher_logits),
        teacher_topk_ids=cut(batch.teacher_topk_ids), teacher_topk_logprobs=cut(batch.teacher_topk_logprobs),
        distill_mask=cut(batch.distill_mask), replay=replay, advantages=cut(batch.advantages),
    )


def _grads(leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.grad.clone() for k, v in leaves.items() if v.grad is not None}
    for v in leaves.values():
        v.grad = None
    return out


CASES = [
    pytest.param({"normalization": "token"}, None, False, id="grpo-token"),
    pytest.param({"normalization": "sequence", "kl_beta": 0.1}, None, False, id="grpo-sequence-kl"),
    pytest.param({"dppo_mask": True}, None, False, id="grpo-dppo"),
    pytest.param({"off_policy_correction": "tis", "tis_cap": 1.2}, None, False, id="grpo-tis"),
    pytest.param(
        {"off_policy_correction": "tis", "tis_cap": 1.1, "normalization": "sequence", "kl_beta": 0.1,
         "dppo_mask": True},
        "dense", True, id="all-tis-sequence-dppo",
    ),
    pytest.param({"sdpo_jsd_beta": 0.3}, "dense", False, id="sdpo-dense-jsd"),
    pytest.param({"sdpo_wrapper": "entropy_opd", "sdpo_jsd_beta": 1.0}, "dense", False, id="sdpo-dense-eopd"),
    pytest.param({"sdpo_wrapper": "taid", "taid_total_steps": 10}, "dense", False, id="sdpo-dense-taid"),
    pytest.param({"sdpo_token_clip": 0.4}, "dense", False, id="sdpo-dense-clip"),
    pytest.param({"sdpo_jsd_beta": 0.0}, "topk", False, id="sdpo-topk"),
    pytest.param({"dpo_variant": "dpo"}, None, True, id="replay-dpo"),
    pytest.param({"dpo_variant": "simpo", "normalization": "sequence"}, "topk", True, id="all-simpo-sequence"),
]


@pytest.mark.parametrize(("knobs", "teacher", "replay"), CASES)
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_micro_batches_sum_to_the_whole_batch(knobs: dict, teacher: str | None, replay: bool, hidden: bool) -> None:
    config = LossConfig(**knobs)
    leaves = _leaves()
    whole_batch = _batch(leaves, teacher, replay, hidden)
    whole = compose_loss(whole_batch, config, step=3, state=new_loss_state(config))
    whole.total.backward()
    expected = _grads(leaves)

    batch = _batch(leaves, teacher, replay, hidden)
    batch.advantages = group_advantages(batch.rewards, batch.group_ids, config.scale_std, config.advantage_eps)
    accumulator = LossAccumulator(config, BatchTotals.of(batch), step=3, state=new_loss_state(config))
    for rows, pairs in ((slice(0, 1), slice(0, 1)), (slice(1, 4), slice(1, 1)), (slice(4, 6), slice(1, 4))):
        accumulator.add(_piece(batch, rows, pairs)).total.backward(retain_graph=True)  # pieces share one graph
    result = accumulator.finish()

    assert set(result.parts) == set(whole.parts)
    torch.testing.assert_close(result.total, whole.total.detach(), rtol=0, atol=1e-12)
    got = _grads(leaves)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-10, msg=name)
    assert result.metrics.keys() == whole.metrics.keys()
    for key, value in whole.metrics.items():
        assert result.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    if config.off_policy_correction == "tis":  # the cap binds on some tokens, so the weights are not all 1
        assert 0 < result.metrics["grpo/tis_truncated_frac"] < 1


@pytest.mark.parametrize(("knobs", "teacher", "replay"), CASES)
def test_hidden_states_give_the_logits_loss_and_gradients(knobs: dict, teacher: str | None, replay: bool) -> None:
    config = LossConfig(**knobs)
    leaves = _leaves(seed=4)
    results, grads = [], []
    for hidden in (False, True):
        result = compose_loss(_batch(leaves, teacher, replay, hidden), config, step=3, state=new_loss_state(config))
        result.total.backward()
        results.append(result)
        grads.append(_grads(leaves))
    torch.testing.assert_close(results[1].total, results[0].total, rtol=0, atol=1e-12)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-10, msg=name)
    assert set(grads[1]) == set(grads[0]) >= {"hidden", "weight", "bias"}


def test_adaptive_taid_steps_once_per_batch_however_it_is_split() -> None:
    config = LossConfig(sdpo_wrapper="taid", taid_total_steps=10)
    leaves = _leaves()
    whole_state, split_state = new_loss_state(config), new_loss_state(config)
    for step in range(3):
        compose_loss(_batch(leaves, "dense", False, False), config, step=step, state=whole_state)
        batch = _batch(leaves, "dense", False, False)
        accumulator = LossAccumulator(config, BatchTotals.of(batch), step=step, state=split_state)
        for rows in (slice(0, 2), slice(2, 6)):
            accumulator.add(_piece(batch, rows, slice(0, 0)))
        accumulator.finish()
    assert whole_state is not None and split_state is not None
    assert split_state.t == pytest.approx(whole_state.t, rel=1e-12)
    assert split_state.prev_loss == pytest.approx(whole_state.prev_loss, rel=1e-12)


def test_totals_add_up_over_pieces() -> None:
    batch = _batch(_leaves(), "dense", True, False)
    pieces = [_piece(batch, slice(0, 2), slice(0, 1)), _piece(batch, slice(2, 6), slice(1, 4))]
    assert BatchTotals.of(pieces[0]) + BatchTotals.of(pieces[1]) == BatchTotals.of(batch)
    assert BatchTotals.of(batch).tokens == int(batch.mask.sum())


@pytest.mark.parametrize(("vocab", "elements", "override", "expected"), [
    (151_936, 8 * 2**20, None, 55), (32_000, 8 * 2**20, None, 262), (64, 8 * 2**20, None, 131_072),
    (10**9, 8 * 2**20, None, 1), (32_000, 8 * 2**20, 7, 7),
])
def test_chunk_tokens_follow_the_element_budget(vocab: int, elements: int, override: int | None, expected: int) -> None:
    assert chunk_tokens(vocab, elements, override) == expected


def test_hidden_states_reject_mismatched_head() -> None:
    with pytest.raises(ValueError, match="weight must be"):
        HiddenStates(torch.zeros(2, 3, 4), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="bias must be"):
        HiddenStates(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(4))


@pytest.mark.parametrize("teacher", [None, "dense", "topk"])
def test_bf16_hidden_states_give_float32_gradients_close_to_float32(teacher: str | None) -> None:
    """bf16 hidden states (mixed precision): gradients come back in each input's dtype, near the fp32 ones."""
    leaves = _leaves(seed=2)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        h = leaves["hidden"].detach().float().to(dtype).requires_grad_()
        w = leaves["weight"].detach().float().requires_grad_()
        batch = _batch({**leaves, "hidden": h, "weight": w}, teacher, False, True)
        batch = dataclasses.replace(batch, old_logprobs=batch.old_logprobs.float(), rewards=batch.rewards.float())
        if batch.teacher_logits is not None:
            batch.teacher_logits = batch.teacher_logits.float()
        compose_loss(batch, LossConfig()).total.backward()
        assert h.grad is not None and h.grad.dtype == dtype and w.grad is not None and w.grad.dtype == torch.float32
        grads[dtype] = (h.grad.float(), w.grad)
    for got, ref in zip(grads[torch.bfloat16], grads[torch.float32]):
        assert float((got - ref).abs().max()) <= 0.05 * float(ref.abs().max())
