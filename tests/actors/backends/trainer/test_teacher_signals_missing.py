"""A TrainBatch that carries no teacher distributions at all, sent to a trainer whose loss weights distillation
(`alpha_sdpo > 0`), trains GRPO only: the trainer says so (`TeacherSignalsMissing`) instead of doing it
silently; the built-in loop's batches (one entry per rollout, None where a teacher skipped) are not warned about."""

from __future__ import annotations

import warnings

import pytest

from composer_mesh.actors.backends.trainer.train_batch import TeacherSignalsMissing, TrainRows
from composer_mesh.actors.messages import Prompt, RewardResult, Rollout, RolloutGroup, ScoredGroup, TrainBatch
from composer_mesh.loss.config import LossConfig


def _batch(distributions: list[None] | None = None) -> TrainBatch:
    rollouts = [Rollout("p0", [1, 2], [3, 4], [-1.0, -1.0], weight_version=1) for _ in range(2)]
    group = ScoredGroup(RolloutGroup(Prompt("p0", "1+1="), rollouts), [RewardResult(1.0), RewardResult(0.0)])
    return TrainBatch([group]) if distributions is None else TrainBatch([group], distributions=distributions)


def test_no_distributions_with_alpha_sdpo_warns_naming_the_fix() -> None:
    with pytest.warns(TeacherSignalsMissing, match=r"loss.alpha_sdpo=1.0: this step trains without distillation"):
        TrainRows.of(_batch(), LossConfig(alpha_sdpo=1.0))


@pytest.mark.parametrize(("alpha", "distributions"), [(0.0, None), (1.0, [None, None])])
def test_grpo_only_loss_or_a_skipped_teacher_is_not_warned_about(alpha: float, distributions: list[None] | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", TeacherSignalsMissing)
        rows = TrainRows.of(_batch(distributions), LossConfig(alpha_sdpo=alpha))
    assert rows.distributions == [None, None]


def test_it_can_be_made_an_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", TeacherSignalsMissing)
        with pytest.raises(TeacherSignalsMissing):
            TrainRows.of(_batch(), LossConfig(alpha_sdpo=0.5))
