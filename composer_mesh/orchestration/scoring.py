"""Scoring and teacher signals: what turns generated groups into a train batch's rewards, teacher
distributions (channel 2) and scored teacher traces (channel 3).

Rollout drivers call it; it talks to the rewarder and the teachers through `ports.Rewarder` / `ports.Teachers`
and keeps the run's counters of that work (traces scored, the teachers' latest usage).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from composer_mesh.actors.messages import (
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherRequest,
    TeacherSignals,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
)
from composer_mesh.errors import UserInputError
from composer_mesh.loss.config import LossConfig
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.ports import Rewarder, Teachers
from composer_mesh.orchestration.schedule import StepTimes, row_seed


@dataclass(frozen=True)
class ScoringConfig:
    """What scoring needs of the run and the loss: which teacher signals to ask for (none for a channel
    weighted 0), their top-k, the traces' length and the run's seed (the traces' sampling seed)."""

    seed: int
    max_new_tokens: int
    teacher_top_k: int | str  # a number or "auto" (`RunConfig.teacher_top_k`)
    distributions: bool  # channel 2 (loss.alpha_sdpo > 0)
    traces: bool  # channel 3 (loss.beta_replay > 0)

    @classmethod
    def of(cls, run: RunConfig, loss: LossConfig) -> ScoringConfig:
        return cls(seed=run.seed, max_new_tokens=run.max_new_tokens, teacher_top_k=run.teacher_top_k,
                   distributions=loss.alpha_sdpo > 0, traces=loss.beta_replay > 0)


def merge_signals(parts: list[TeacherSignals], num_rollouts: int) -> TeacherSignals:
    """Combine the answers of the teacher-pool procs (each hosts some members)."""
    dists: list[TokenDistribution | None] = [None] * num_rollouts
    traces, usage = [], {}
    for part in parts:
        for i, d in enumerate(part.distributions):
            if d is not None and dists[i] is None:
                dists[i] = d
        traces.extend(part.traces)
        usage.update(part.usage)
    return TeacherSignals(distributions=dists, traces=traces, usage=usage)


class NoRewarder(UserInputError, RuntimeError):
    """Completions to score in a run without a rewarder role (validation refuses a single-turn run without one;
    this is the same refusal for a run put together in code)."""


class Scoring:
    """Rewards, teacher signals and trace scores for generated groups. `rewarder` None: no rewarder role (a
    multi-turn run, whose environment scores its episodes and never calls `score`); `teachers` None: no teachers
    role."""

    def __init__(self, cfg: ScoringConfig, rewarder: Rewarder | None, teachers: Teachers | None) -> None:
        self.cfg = cfg
        self.rewarder = rewarder
        self.teachers = teachers
        self.traces_scored = 0
        self.teacher_usage: dict[str, float] = {}  # the teachers' latest usage report

    async def score(self, groups: list[RolloutGroup], times: StepTimes | None = None) -> list[ScoredGroup]:
        if self.rewarder is None:
            raise NoRewarder("there are completions to score but the topology has no roles.rewarder: single_turn "
                             "runs need one (only multi_turn runs are scored by run.environment)")
        t0 = time.perf_counter()
        scored = await self.rewarder.score(groups)
        if times is not None:
            times.score_s += time.perf_counter() - t0
        return scored

    async def signals(self, groups: list[RolloutGroup], first: int, times: StepTimes | None = None,
                      traces: bool = True) -> TeacherSignals:
        """Channel-2 distributions and channel-3 traces for `groups` (prompts from stream index `first` on: the
        traces' sampling seed, so they do not depend on which request reaches the teachers first). `traces`
        False: distributions only (episodes get their replay traces by a teacher playing the task)."""
        rollouts = [r for g in groups for r in g.rollouts]
        if self.teachers is None or not groups:
            return TeacherSignals(distributions=[None] * len(rollouts))
        cfg = self.cfg
        request = TeacherRequest(
            rollouts=rollouts if cfg.distributions else [],
            prompts=[g.prompt for g in groups] if cfg.traces and traces else [],
            top_k=cfg.teacher_top_k,
            max_new_tokens=cfg.max_new_tokens,
            seed=row_seed(cfg.seed, first, 1),
        )
        if not request.rollouts and not request.prompts:
            return TeacherSignals(distributions=[None] * len(rollouts))
        t0 = time.perf_counter()
        answers = await self.teachers.signals(request)
        if times is not None:
            times.teacher_s += time.perf_counter() - t0
        signals = merge_signals(answers, len(rollouts))
        self.teacher_usage = signals.usage
        return signals

    async def score_traces(self, traces: list[TeacherTrace], groups: list[RolloutGroup],
                           times: StepTimes | None = None) -> None:
        """Score teacher traces with the rewarder like rollouts (sets `trace.reward`): a replay pair is formed
        only when its trace scores above the student rollout it is preferred to."""
        if not traces:
            return
        prompt_of = {g.prompt.prompt_id: g.prompt for g in groups}
        as_groups = [
            RolloutGroup(prompt_of[t.prompt_id], [Rollout(
                prompt_id=t.prompt_id, prompt_ids=[], completion_ids=list(t.completion_ids),
                logprobs=[0.0] * len(t.completion_ids), weight_version=0, text=t.text, generator=t.teacher,
            )])
            for t in traces
        ]
        for trace, s in zip(traces, await self.score(as_groups, times)):
            trace.reward = s.rewards[0].score
        self.traces_scored += len(traces)

    async def complete(self, groups: list[RolloutGroup], first: int, times: StepTimes | None = None) -> TrainBatch:
        """Score `groups` (prompts from stream index `first` on) and ask the teachers, concurrently; then score
        the teachers' traces."""
        scored, signals = await asyncio.gather(self.score(groups, times), self.signals(groups, first, times))
        await self.score_traces(signals.traces, groups, times)
        return TrainBatch(groups=scored, distributions=signals.distributions, traces=signals.traces)

    def state(self) -> dict[str, Any]:
        """The counters a checkpoint keeps."""
        return {"traces_scored": self.traces_scored, "teacher_usage": dict(self.teacher_usage)}

    def restore(self, counters: dict[str, Any]) -> None:
        self.traces_scored, self.teacher_usage = int(counters["traces_scored"]), dict(counters["teacher_usage"])
