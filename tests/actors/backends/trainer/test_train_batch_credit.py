"""Per-turn credit through the trainer: a TrainBatch of episodes with per-turn rewards gives the hand-computed
per-token advantages in its LossBatch (environment tokens and padding 0), in every micro-batch, packed layout
and sharded rank's share of it, and the `hf` trainer trains on them. Real tiny model, CPU."""

from __future__ import annotations

import math

import pytest
import torch

from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
from composer_mesh.actors.backends.trainer.sharding import rank_pieces
from composer_mesh.actors.backends.trainer.train_batch import (
    StudentPass,
    TrainRows,
    build_loss_batch,
    build_piece,
)
from composer_mesh.actors.messages import (
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TrainBatch,
    Turn,
)
from composer_mesh.loss.compose import LossAccumulator, compose_loss
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.grpo import group_advantages
from composer_mesh.models.config import ModelConfig
from composer_mesh.models.tiny import build_tiny
from tests.loss.test_credit import DISCOUNTED, TURN_GROUP

# Each rollout: its spans as (tokens, policy, reward) and its score. Group p0 is tests/loss/test_credit.py's hand
# group (per-turn rewards [0, 1], [0, 0, 0.5], [1]; scores are their sums). Group p1: a completion (turns None,
# score 1), an episode whose environment gave no per-turn reward but whose score is 1 (the last turn takes it:
# r = [0, 1]), and a completion scoring 0.
P0 = [
    ([(3, True, 0.0), (2, False, None), (2, True, 1.0)], 1.0),
    ([(2, True, 0.0), (1, False, None), (1, True, 0.0), (2, False, None), (2, True, 0.5)], 0.5),
    ([(4, True, 1.0), (1, False, None)], 1.0),
]
P1 = [([(3, True, None)], 1.0), ([(2, True, None), (3, False, None), (2, True, None)], 1.0), ([(5, True, None)], 0.0)]
# p1 with advantage_eps 0: G_0 = (1, 0 + 0.5*1, 0), mean 0.5, unbiased std 0.5 -> turn 0: (1, 0, -1);
# the episode's turn 1 (G_1 = 1): (1 - 0.5)/0.5 = 1 under discounted_return, 0 under turn_group (only it got there).
P1_TURNS = {"discounted_return": [[1.0], [0.0, 1.0], [-1.0]], "turn_group": [[1.0], [0.0, 0.0], [-1.0]]}
P0_TURNS = {"discounted_return": DISCOUNTED, "turn_group": TURN_GROUP}


def rollout(prompt_id: str, spans: list[tuple[int, bool, float | None]], g: torch.Generator) -> Rollout:
    turns, at = [], 0
    for n, policy, reward in spans:
        turns.append(Turn(at, at + n, policy, weight_version=1 if policy else None, reward=reward))
        at += n
    ids = torch.randint(1, 14, (at,), generator=g).tolist()
    logprobs = [-float(torch.rand(1, generator=g)) if t.policy else 0.0 for t in turns for _ in range(t.start, t.end)]
    return Rollout(prompt_id, [1, 2, 3], ids, logprobs, 1, turns=turns if len(spans) > 1 else None)


def credit_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(4)
    groups = []
    for i, rows in enumerate((P0, P1)):
        rollouts = [rollout(f"p{i}", spans, g) for spans, _ in rows]
        groups.append(ScoredGroup(RolloutGroup(Prompt(f"p{i}", "", [1, 2, 3]), rollouts),
                                  [RewardResult(score) for _, score in rows]))
    return TrainBatch(groups=groups)


def expected_tokens(batch: TrainBatch, credit: str) -> torch.Tensor:
    """[N, T] by hand: each policy token its turn's advantage, 0 on environment tokens and padding."""
    per_turn = [*P0_TURNS[credit], *P1_TURNS[credit]]
    rollouts = batch.rollouts()
    out = torch.zeros(len(rollouts), max(len(r.completion_ids) for r in rollouts), dtype=torch.float64)
    for n, r in enumerate(rollouts):
        policy = [t for t in r.turns or [Turn(0, len(r.completion_ids), True)] if t.policy]
        for k, t in enumerate(policy):
            out[n, t.start : t.end] = per_turn[n][k]
    return out


def loss_config(credit: str, **kw) -> LossConfig:
    return LossConfig(credit=credit, credit_gamma=0.5, advantage_eps=0.0, alpha_sdpo=0.0, beta_replay=0.0, **kw)


@pytest.fixture(scope="module")
def model():
    m, _ = build_tiny(ModelConfig(seed=3))
    return m.double()


@pytest.mark.parametrize("credit", ["discounted_return", "turn_group"])
def test_loss_batch_carries_the_hand_computed_per_token_advantages(model, credit):
    batch = credit_batch()
    lb = build_loss_batch(batch, model, loss_config(credit))
    want = expected_tokens(batch, credit)
    assert lb.advantages is not None and lb.advantages.shape == lb.mask.shape == want.shape
    torch.testing.assert_close(lb.advantages.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.all(lb.advantages[~lb.mask] == 0)  # environment tokens and padding
    assert lb.advantages[0, 3:5].tolist() == [0.0, 0.0] and lb.advantages[0, 0] != lb.advantages[0, 5]


@pytest.mark.parametrize("credit", ["discounted_return", "turn_group"])
@pytest.mark.parametrize(("budget", "packed"), [(12, False), (12, True), (None, True)])
def test_micro_batches_packing_and_ranks_slice_the_whole_batch_advantages(model, credit, budget, packed):
    """Each piece's advantages are its rows of the whole batch's, cut to its width; the accumulated loss equals
    the one-piece loss; a sharded replica's ranks' pieces (`rank_pieces`) slice the same way."""
    batch, loss = credit_batch(), loss_config(credit)
    data = TrainRows.of(batch, loss)
    whole_adv = data.advantages(loss)
    run = StudentPass(model, loss, packed=packed)
    whole = compose_loss(build_loss_batch(batch, model, loss, packed=packed), loss).total
    acc = LossAccumulator(loss, data.totals())
    pieces = data.micro_batches(budget, packed)
    assert len(pieces) > 1 if budget else len(pieces) == 1
    for piece in pieces:
        lb = build_piece(data, piece, run, whole_adv)
        assert torch.equal(lb.advantages, whole_adv[piece.rows][:, : lb.mask.shape[1]])
        acc.add(lb)
    assert acc.finish().total.item() == pytest.approx(whole.item(), rel=1e-12)
    for rank in range(2):
        for piece in (p for p in rank_pieces(data, 2, rank, budget, packed) if p is not None):
            lb = build_piece(data, piece, run, whole_adv)
            assert torch.equal(lb.advantages, whole_adv[piece.rows][:, : lb.mask.shape[1]])


def test_episode_credit_is_todays_group_advantage():
    batch = credit_batch()
    data = TrainRows.of(batch, LossConfig(alpha_sdpo=0.0, beta_replay=0.0))
    assert torch.equal(data.advantages(LossConfig()), group_advantages(data.rewards, data.group_ids, True, 1e-4))
    assert data.turn_rewards.tolist()[4] == [0.0, 1.0, 0.0]  # p1's episode: the score on its last turn
    assert data.turn_rewards.sum(1).tolist() == data.rewards.tolist()


def test_hf_trainer_trains_on_per_turn_advantages():
    """`train_step`'s GRPO loss is the LossBatch's with the per-turn advantages, not the episode's."""
    losses = {}
    for credit in ("episode", "turn_group"):
        trainer = HFTrainer(HFTrainerSettings(lr=1e-2, micro_batch_tokens=16))
        loss = LossConfig(credit=credit, alpha_sdpo=0.0, beta_replay=0.0)
        trainer.start(ModelConfig(source="tiny", seed=3), loss)
        batch = credit_batch()
        with torch.no_grad():
            want = compose_loss(build_loss_batch(batch, trainer.model, loss, temperature=trainer.temperature), loss)
        metrics = trainer.train_step(batch)
        assert metrics.channels["grpo"] == pytest.approx(float(want.total), rel=1e-5, abs=1e-7)
        assert metrics.metrics["grpo/advantage_mean"] == pytest.approx(want.metrics["grpo/advantage_mean"], abs=1e-6)
        assert metrics.metrics["micro_batches"] > 1
        losses[credit] = metrics.channels["grpo"]
    assert not math.isclose(losses["episode"], losses["turn_group"], rel_tol=1e-3)
