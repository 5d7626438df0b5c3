"""The controller's part of a run checkpoint, gathered from the components that keep it, and given back to
them on resume: the one place that knows which component holds what.

What is written and how is `checkpoint.py`'s (`ControllerState`, `CheckpointStore`); this module decides what
goes in (versions, the prompt stream, the scheduler, the run's counters) and, on resume, checks the checkpoint
against the run, has every trainer replica load its state and the generators pull its weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from composer_mesh.orchestration.checkpoint import CheckpointPolicy, ControllerState, RunCheckpointError
from composer_mesh.orchestration.metrics import MetricsWriter
from composer_mesh.orchestration.pipeline import LagGate, Versions
from composer_mesh.orchestration.ports import Generators
from composer_mesh.orchestration.prompts import PromptSource, PromptSourceError
from composer_mesh.orchestration.schedule import StepScheduler
from composer_mesh.orchestration.scoring import Scoring


@dataclass
class ResumePoint:
    """A committed checkpoint to continue from (`read_checkpoint(url)`, fingerprint checked)."""

    url: str
    state: ControllerState


class Counters(Protocol):
    """Run-wide counters a component keeps across sessions (e.g. `Recovery`'s restarts)."""

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


class RunState:
    """Captures the controller's state for a checkpoint and restores it from one. `eval_before()`: the greedy
    reward before training (a run-wide counter the summary reports)."""

    def __init__(self, versions: Versions, prompts: PromptSource, scoring: Scoring, gate: LagGate,
                 recovery: Counters, policy: CheckpointPolicy, replicas: int, eval_before: Callable[[], float]) -> None:
        self.versions = versions
        self.prompts = prompts
        self.scoring = scoring
        self.gate = gate
        self.recovery = recovery
        self.policy = policy
        self.replicas = replicas
        self.eval_before = eval_before

    def capture(self, step: int, schedule: StepScheduler, trackers: dict[str, str]) -> ControllerState:
        """The controller's state once step `step` is sent to the trainers (taken before step+1 is)."""
        prompts = self.prompts.state()
        return ControllerState(
            step=step, weight_version=self.versions.after(step), first_version=self.versions.first,
            prompts_count=self.prompts.count, prompts_rng=prompts.get("rng"),
            schedule=schedule.state(trained=step), counters=self._counters(),
            fingerprint=self.policy.fingerprint, replicas=self.replicas, prompts=prompts, trackers=trackers,
        )

    def _counters(self) -> dict[str, Any]:
        scoring = self.scoring.state()
        return {"eval_before": self.eval_before(), "traces_scored": scoring["traces_scored"],
                "teacher_usage": scoring["teacher_usage"], "dropped_batches": self.gate.dropped_batches,
                "dropped_rollouts": self.gate.dropped_rollouts, "recovery": self.recovery.state()}

    def check(self, resume: ResumePoint, steps: int) -> None:
        """The checkpoint fits this run: as many trainer replicas, and a step within `run.steps`."""
        st = resume.state
        if st.replicas != self.replicas:
            raise RunCheckpointError(f"{resume.url} holds {st.replicas} trainer replica(s), this run has "
                                     f"{self.replicas}")
        if st.step > steps:
            raise RunCheckpointError(f"{resume.url} is at step {st.step}, beyond run.steps={steps}: raise "
                                     "run.steps (--steps) to train on from it")

    async def restore(self, resume: ResumePoint, trainers: list[Any], generators: Generators,
                      schedule: StepScheduler, writer: MetricsWriter) -> float:
        """Continue from a checkpoint: every trainer replica (`trainers`: their handles) loads its state (all
        before any trains again), the generators pull its weights, the prompt stream and the scheduler continue
        where they were. Returns the evaluation before training that the checkpoint kept."""
        st = resume.state
        try:
            manifests = await asyncio.gather(*(t.load_state.call_one(f"{resume.url}/trainer/r{i}")
                                               for i, t in enumerate(trainers)))
        except Exception as e:  # the replica's refusal (TrainerStateError) arrives wrapped in Monarch's ActorError
            raise RunCheckpointError(f"a trainer replica could not load its state: {last_line(e)}") from e
        if manifests[0].version != st.weight_version:
            raise RuntimeError(f"{resume.url}: the trainer state is at weight version {manifests[0].version}, the "
                               f"controller state at {st.weight_version}")
        self.versions.restore(st.weight_version, st.first_version)
        await generators.load_weights(manifests[0])
        try:  # checkpoints before `prompts` hold a task stream's count and RNG
            self.prompts.restore(st.prompts or {"kind": "task", "count": st.prompts_count, "rng": st.prompts_rng})
        except PromptSourceError as e:
            raise RunCheckpointError(f"{resume.url}: {e}") from e
        schedule.restore(st.schedule)
        c = st.counters
        self.scoring.restore(c)
        self.gate.restore(c)
        self.recovery.restore(c.get("recovery", {}))
        writer.write_event("resumed", step=st.step, checkpoint=resume.url, weight_version=st.weight_version)
        return float(c["eval_before"])


def last_line(error: BaseException) -> str:
    """The gist of a remote error: Monarch's ActorError carries the remote traceback, whose last line is it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
