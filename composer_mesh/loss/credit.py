"""Per-turn credit: an advantage per policy turn of a multi-turn episode (`LossConfig.credit`).

GRPO gives every token of an episode the group-normalised episode score. An environment that rewards turns
(`StepResult.reward` -> `Turn.reward`) knows more: which turn earned what. The two per-turn modes use it:

- rewards: r_k per policy turn k (in order), `episode_turn_rewards`: the turn's reward (None = 0), and the
  episode's score minus their sum added to the last turn (a reward function that scored the whole episode, a
  failed episode scored 0), so sum_k r_k is the score the rest of the system reports;
- returns: G_k = sum_{j>=k} gamma^(j-k) r_j (`discounted_returns`; GiGPO's step return, arXiv:2505.10978 eq. 5);
- "discounted_return": A_k = (G_k - mean) / (std + eps), mean and std those of the group's G_0 (one baseline
  per group, like GRPO: with gamma = 1 and only a final reward it is GRPO exactly);
- "turn_group": at each turn index k, the G_k of the group's episodes that have a k-th policy turn normalised
  among themselves (MT-GRPO's per-turn group normalisation, Wei et al. arXiv:2505.11821, and GiGPO's step groups
  with the turn index standing in for the anchor state); an index only one episode reached gets 0. When the
  policy decides how many turns it takes, the episodes that reach turn k are a selected subset, so this
  baseline depends on the episode's own length (verl issue #7244 discusses the bias this can cause);
  "discounted_return" has one baseline per group and not this issue.

Everything here takes padded tensors (rows = rollouts, columns = policy turns) and knows no `Rollout`: the
trainer builds them (`actors/backends/trainer/train_batch.py`) and spreads the result over tokens with
`token_advantages`. Means and stds are `grpo.group_stats`, so scale_std and advantage_eps mean what they mean
for GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from composer_mesh.loss.chunks import compute_dtype
from composer_mesh.loss.grpo import group_advantages, group_stats

TurnCredit = Literal["discounted_return", "turn_group"]


def episode_turn_rewards(turn_rewards: Sequence[float | None], score: float) -> list[float]:
    """r_k of an episode's policy turns (None = 0), the last one taking `score - sum`: they sum to `score`.
    No policy turn at all (an episode that failed before its first) is one turn holding `score`."""
    rewards = [r or 0.0 for r in turn_rewards]
    if not rewards:
        return [score]
    rest = score - sum(rewards)
    if rest != 0.0:  # only then: the usual sum of the environment's rewards stays as the environment gave it
        rewards[-1] += rest
    return rewards


def padded_turns(rows: Sequence[Sequence[float]]) -> tuple[Tensor, Tensor]:
    """(rewards [N, K] float32, turn mask [N, K] bool) of per-row turn rewards, K = the most turns (>= 1)."""
    width = max(max((len(r) for r in rows), default=0), 1)
    rewards = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for n, row in enumerate(rows):
        rewards[n, : len(row)] = torch.tensor(list(row), dtype=torch.float32)
        mask[n, : len(row)] = True
    return rewards, mask


def discounted_returns(rewards: Tensor, turn_mask: Tensor, gamma: float) -> Tensor:
    """G [N, K]: G_k = r_k + gamma * G_{k+1} along each row's own turns (0 where `turn_mask` is False)."""
    rewards = torch.where(turn_mask, rewards.detach().to(compute_dtype(rewards)), 0.0)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for k in reversed(range(rewards.shape[1])):
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
    return torch.where(turn_mask, returns, 0.0)


def discounted_return_advantages(returns: Tensor, turn_mask: Tensor, group_ids: Tensor, scale_std: bool,
                                 eps: float) -> Tensor:
    """A [N, K] = (G_k - mean) / (std + eps) with the group's mean and std of G_0 (0 off `turn_mask`)."""
    mean, std = group_stats(returns[:, 0], group_ids, scale_std)
    centred = returns - mean[:, None]
    adv = centred if std is None else centred / (std[:, None] + eps)
    return torch.where(turn_mask, adv, 0.0)


def turn_group_advantages(returns: Tensor, turn_mask: Tensor, group_ids: Tensor, scale_std: bool,
                          eps: float) -> Tensor:
    """A [N, K]: each G_k normalised among the G_k of its group's rows that have a turn k; 0 at an index only one
    row of its group reached (also with eps = 0, where the formula would give 0/0) and off `turn_mask`."""
    n, k = returns.shape
    turn_index = torch.arange(k, device=returns.device).expand(n, k)[turn_mask]
    groups = group_ids.to(returns.device)[:, None].expand(n, k)[turn_mask]
    keys, per_key = torch.unique(torch.stack([groups, turn_index]), dim=1, return_inverse=True)
    values = returns[turn_mask]
    reached = torch.bincount(per_key, minlength=keys.shape[1])[per_key]  # rows of the group with a turn k
    adv = torch.where(reached > 1, group_advantages(values, per_key, scale_std, eps), 0.0)
    out = torch.zeros_like(returns)
    out[turn_mask] = adv.to(out.dtype)
    return out


def turn_advantages(rewards: Tensor, turn_mask: Tensor, group_ids: Tensor, credit: TurnCredit, gamma: float,
                    scale_std: bool, eps: float) -> Tensor:
    """Per-turn advantages [N, K] of rows with per-turn rewards [N, K] (`padded_turns`) and group ids [N]."""
    returns = discounted_returns(rewards, turn_mask, gamma)
    if credit == "discounted_return":
        return discounted_return_advantages(returns, turn_mask, group_ids, scale_std, eps)
    if credit == "turn_group":
        return turn_group_advantages(returns, turn_mask, group_ids, scale_std, eps)
    raise ValueError(f"credit={credit!r} is not a per-turn credit ('discounted_return' or 'turn_group')")


def token_advantages(turn_adv: Tensor, token_turns: Tensor) -> Tensor:
    """[N, T] advantages per token from per-turn ones [N, K] and each token's policy turn [N, T] (-1: an
    environment token or padding, which gets 0)."""
    picked = turn_adv.gather(1, token_turns.clamp_min(0).to(turn_adv.device))
    return torch.where(token_turns.to(turn_adv.device) >= 0, picked, 0.0)
