"""Reward health: stop a run whose reward fails on every rollout, step after step.

A reward function that fails everywhere (a wrong signature, a missing column, a dead grader service) does not
crash a run: each failed rollout scores `failure_score`, so the policy trains on nothing while distillation
keeps moving it, and the run would exit 0. `RewardHealth` reads each step's record (`StepRecord.reward_failures`
and `reward_error`) and raises `RewardsFailing` once every rollout's reward failed in
`run.stop_after_failed_reward_steps` consecutive steps, naming the failing function and its last error.
It needs nothing but the records, so it constructs alone and replays in a unit test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.metrics import StepRecord

MAX_ERROR_CHARS = 300


class RewardsFailing(RuntimeError):
    """Every rollout's reward failed in too many consecutive steps; the message names the last error."""


@dataclass(frozen=True)
class RewardHealthConfig:
    stop_after: int  # consecutive all-failed steps that stop the run; 0: never

    @classmethod
    def of(cls, run: RunConfig) -> RewardHealthConfig:
        return cls(stop_after=run.stop_after_failed_reward_steps)


@dataclass
class RewardHealth:
    """Counts consecutive steps in which every trained rollout's reward failed; `observe` raises
    `RewardsFailing` when the count reaches `stop_after`. A step with one scored rollout resets it."""

    cfg: RewardHealthConfig
    _streak: list[int] = field(default_factory=list, init=False)  # the steps of the current run of failed steps

    def observe(self, record: StepRecord) -> None:
        if record.rollouts == 0 or record.reward_failures < record.rollouts:
            self._streak.clear()
            return
        self._streak.append(record.step)
        if self.cfg.stop_after and len(self._streak) >= self.cfg.stop_after:
            steps = f"steps {self._streak[0]}-{self._streak[-1]}" if len(self._streak) > 1 else f"step {record.step}"
            raise RewardsFailing(
                f"every rollout's reward failed in {len(self._streak)} consecutive steps ({steps}); last error: "
                f"{record.reward_error[:MAX_ERROR_CHARS]} (fix the reward, or set "
                "run.stop_after_failed_reward_steps: 0 to train on)")
