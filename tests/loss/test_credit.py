"""Per-turn credit (`loss/credit.py`): against a hand-computed group, the "episode" reductions, token spreading,
and the `grpo/advantage_mean` of per-token advantages."""

from __future__ import annotations

import math

import pytest
import torch

from composer_mesh.loss.compose import LossBatch, compose_loss
from composer_mesh.loss.config import LossConfig
from composer_mesh.loss.credit import (
    discounted_returns,
    episode_turn_rewards,
    padded_turns,
    token_advantages,
    turn_advantages,
)
from composer_mesh.loss.grpo import group_advantages

# One group of three episodes; per-turn rewards r_k of their policy turns:
#   A: [0, 1]        B: [0, 0, 0.5]        C: [1]
HAND = [[0.0, 1.0], [0.0, 0.0, 0.5], [1.0]]
GAMMA = 0.5
# Returns G_k = r_k + 0.5 * G_{k+1}:
#   A: G_1 = 1,   G_0 = 0 + 0.5*1 = 0.5
#   B: G_2 = 0.5, G_1 = 0 + 0.5*0.5 = 0.25, G_0 = 0 + 0.5*0.25 = 0.125
#   C: G_0 = 1
RETURNS = [[0.5, 1.0, 0.0], [0.125, 0.25, 0.5], [1.0, 0.0, 0.0]]
# The group's G_0 = (0.5, 0.125, 1): mean 1.625/3 = 13/24; deviations -1/24, -10/24, 11/24;
# unbiased variance (1 + 100 + 121)/576 / 2 = 37/192, std S = sqrt(37/192) = 0.43898557...
S = math.sqrt(37 / 192)
# "discounted_return": A_k = (G_k - 13/24) / S, i.e. (24 G_k - 13) / (24 S):
#   A: (12-13, 24-13)       = (-1, 11)      / (24 S)
#   B: (3-13, 6-13, 12-13)  = (-10, -7, -1) / (24 S)
#   C: (24-13)              = (11)          / (24 S)
DISCOUNTED = [[-1 / (24 * S), 11 / (24 * S), 0.0],
              [-10 / (24 * S), -7 / (24 * S), -1 / (24 * S)],
              [11 / (24 * S), 0.0, 0.0]]
# "turn_group": turn 0 as above (all three reached it);
#   turn 1: A and B reached it, G_1 = (1, 0.25): mean 0.625, deviations +-0.375, unbiased std 0.375*sqrt(2),
#           so A = +1/sqrt(2), B = -1/sqrt(2);
#   turn 2: only B reached it: 0.
TURN_GROUP = [[-1 / (24 * S), 1 / math.sqrt(2), 0.0],
              [-10 / (24 * S), -1 / math.sqrt(2), 0.0],
              [11 / (24 * S), 0.0, 0.0]]


def _hand() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rewards, mask = padded_turns(HAND)
    return rewards.double(), mask, torch.zeros(3, dtype=torch.long)


def test_padded_turns_and_returns_by_hand() -> None:
    rewards, mask, _ = _hand()
    assert mask.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    assert discounted_returns(rewards, mask, GAMMA).tolist() == RETURNS


@pytest.mark.parametrize(("credit", "expected"), [("discounted_return", DISCOUNTED), ("turn_group", TURN_GROUP)])
def test_hand_computed_group(credit: str, expected: list[list[float]]) -> None:
    rewards, mask, groups = _hand()
    got = turn_advantages(rewards, mask, groups, credit, GAMMA, scale_std=True, eps=0.0)  # type: ignore[arg-type]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_hand_computed_group_without_std_scaling() -> None:
    """Dr. GRPO's `scale_std: false`: G_k minus the group's mean of G_0 (13/24); turn 1 of turn_group: +-0.375."""
    rewards, mask, groups = _hand()
    got = turn_advantages(rewards, mask, groups, "discounted_return", GAMMA, scale_std=False, eps=1e-4)
    want = [[0.5 - 13 / 24, 1 - 13 / 24, 0], [0.125 - 13 / 24, 0.25 - 13 / 24, 0.5 - 13 / 24], [1 - 13 / 24, 0, 0]]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    got = turn_advantages(rewards, mask, groups, "turn_group", GAMMA, scale_std=False, eps=1e-4)
    assert got[:, 1].tolist() == [0.375, -0.375, 0.0] and got[1, 2] == 0.0


def test_groups_are_normalised_apart() -> None:
    """The hand group next to a second group: its numbers do not move (group ids are any labels)."""
    rewards, mask = padded_turns([*HAND, [5.0, 2.0], [1.0, 0.0, 0.0, 7.0]])
    groups = torch.tensor([7, 7, 7, -2, -2])
    for credit, expected in (("discounted_return", DISCOUNTED), ("turn_group", TURN_GROUP)):
        got = turn_advantages(rewards.double(), mask, groups, credit, GAMMA, True, 0.0)  # type: ignore[arg-type]
        torch.testing.assert_close(got[:3, :3], torch.tensor(expected, dtype=torch.float64))
        assert got[3:].abs().sum() > 0 and torch.all(got[:3, 3] == 0)


def _random_group_batch(final_only: bool, seed: int = 0) -> tuple[list[list[float]], list[float], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows, scores, groups = [], [], []
    for group in range(4):
        for _ in range(5):
            turns = int(torch.randint(1, 5, (1,), generator=g))
            score = float(torch.randint(0, 3, (1,), generator=g)) * 0.5
            rows.append([0.0] * (turns - 1) + [score] if final_only else torch.rand(turns, generator=g).tolist())
            scores.append(score if final_only else sum(rows[-1]))
            groups.append(group)
    return rows, scores, torch.tensor(groups)


def test_gamma_one_final_reward_only_is_the_episode_advantage_bitwise() -> None:
    rows, scores, groups = _random_group_batch(final_only=True)
    rewards, mask = padded_turns(rows)
    episode = group_advantages(torch.tensor(scores), groups, True, 1e-4)
    got = turn_advantages(rewards, mask, groups, "discounted_return", 1.0, True, 1e-4)
    assert torch.equal(got, torch.where(mask, episode[:, None], 0.0))
    assert not torch.equal(turn_advantages(rewards, mask, groups, "discounted_return", 0.9, True, 1e-4), got)


@pytest.mark.parametrize("credit", ["discounted_return", "turn_group"])
@pytest.mark.parametrize("scale_std", [True, False])
def test_single_turn_rollouts_get_the_episode_advantage_bitwise(credit: str, scale_std: bool) -> None:
    """Completions (turns None) are one turn holding the score: every credit gives GRPO's advantage."""
    scores = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.2, 0.2, 0.9])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    rewards, mask = padded_turns([[s] for s in scores.tolist()])
    got = turn_advantages(rewards, mask, groups, credit, 0.7, scale_std, 1e-4)  # type: ignore[arg-type]
    assert got.shape == (7, 1) and torch.equal(got[:, 0], group_advantages(scores, groups, scale_std, 1e-4))


def test_turn_reached_by_one_episode_is_zero_even_without_eps() -> None:
    """eps = 0 would make a lone turn 0/0; it is 0 by definition (and a group of one episode is all 0)."""
    rewards, mask = padded_turns([[1.0, 2.0, 3.0], [0.0], [4.0, 1.0]])
    got = turn_advantages(rewards, mask, torch.tensor([0, 0, 1]), "turn_group", 1.0, True, 0.0)
    assert torch.isfinite(got).all()
    assert got[0, 1] == got[0, 2] == 0.0 and got[2].tolist() == [0.0, 0.0, 0.0]
    assert got[0, 0] > 0 > got[1, 0]


def test_episode_turn_rewards_sum_to_the_score() -> None:
    assert episode_turn_rewards([0.25, None, 0.5], 0.75) == [0.25, 0.0, 0.5]  # the environment's sum: as given
    assert episode_turn_rewards([None, None], 1.0) == [0.0, 1.0]  # a reward function scored the whole episode
    assert episode_turn_rewards([1.0, None], 0.0) == [1.0, -1.0]  # a failed episode is scored 0
    assert episode_turn_rewards([], 0.3) == [0.3]  # no policy turn: one turn holding the score


def test_token_advantages_spread_turns_and_zero_the_rest() -> None:
    per_turn = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    token_turns = torch.tensor([[0, 0, -1, -1, 1, -1], [0, 0, 0, -1, -1, -1]])  # -1: environment or padding
    assert token_advantages(per_turn, token_turns).tolist() == [[0.5, 0.5, 0.0, 0.0, -1.0, 0.0],
                                                                [2.0, 2.0, 2.0, 0.0, 0.0, 0.0]]


def test_advantage_mean_of_per_token_advantages_counts_trained_tokens_only() -> None:
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    adv = torch.tensor([[1.0, 1.0, 50.0, -2.0], [3.0, 60.0, 70.0, 80.0]])  # large values where nothing is trained
    batch = LossBatch(logits=torch.randn(2, 4, 5, generator=g), token_ids=torch.randint(0, 5, (2, 4), generator=g),
                      mask=mask, old_logprobs=torch.full((2, 4), -1.6), rewards=torch.zeros(2),
                      group_ids=torch.zeros(2, dtype=torch.long), advantages=adv)
    metrics = compose_loss(batch, LossConfig(alpha_sdpo=0.0, beta_replay=0.0)).metrics
    assert metrics["grpo/advantage_mean"] == pytest.approx(3.0 / 4)
    assert metrics["grpo/advantage_abs_mean"] == pytest.approx(7.0 / 4)
