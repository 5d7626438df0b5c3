"""Held-out evaluation: greedy reward and pass@k on the prompt source's eval set, before and after training and
every `run.eval_every` steps (on generator 0, between its chunks)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from composer_mesh.actors.messages import Prompt, ScoredGroup
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.metrics import MetricsWriter

# (prompts, samples per prompt, temperature, seed) -> (weight version, scored groups): the rollout driver's
# `evaluate` (single completions, or episodes), on generator 0.
SampleScored = Callable[[list[Prompt], int, float, int], Awaitable[tuple[int, list[ScoredGroup]]]]


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation: greedy mean reward, pass@k (None when `run.eval_pass_k` is 0) and the weight
    version generator 0 evaluated (at lag > 0 it can trail the trainer's by the lag)."""

    greedy: float
    pass_at_k: float | None
    k: int
    weight_version: int
    prompts: int = 0  # how many held-out prompts were scored: fewer than asked when the eval set is smaller


@dataclass(frozen=True)
class EvalConfig:
    prompts: int  # held-out prompts per evaluation (0: none)
    seed: int
    pass_k: int  # completions per prompt for pass@k (0: greedy only)
    temperature: float
    every: int  # also evaluate every this many steps while training (0: before and after only)
    steps: int  # the run's last step (evaluated "after", not "during")

    @classmethod
    def of(cls, run: RunConfig) -> EvalConfig:
        return cls(prompts=run.eval_prompts, seed=run.seed, pass_k=run.eval_pass_k,
                   temperature=run.temperature, every=run.eval_every, steps=run.steps)


class Evaluator:
    """Runs evaluations on generator 0 and writes them as `eval` events. `sample`: the rollout driver's
    `evaluate` (samples and scores); `eval_prompts(n)`: the prompt source's eval set; `version()`: the trainer's
    version (reported when nothing is evaluated); `spawn`: the run's background tasks (evaluations during
    training)."""

    def __init__(self, cfg: EvalConfig, sample: SampleScored, eval_prompts: Callable[[int], list[Prompt]],
                 version: Callable[[], int], spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]) -> None:
        self.cfg = cfg
        self.sample = sample
        self.eval_prompts = eval_prompts
        self.version = version
        self.spawn = spawn
        self.before: float = float("nan")  # the greedy reward before training (kept by checkpoints)

    async def evaluate(self, n: int, seed: int) -> Evaluation:
        """Greedy mean reward and pass@k (`eval_pass_k` completions at the run's temperature) on `n` held-out
        prompts: the prompt source's eval set, disjoint from every prompt the run trains on, the same each time."""
        if n == 0:
            return Evaluation(float("nan"), None, 0, self.version())
        cfg, prompts = self.cfg, self.eval_prompts(n)
        version, greedy_groups = await self.sample(prompts, 1, 0.0, seed)
        scored = [greedy_groups]
        if cfg.pass_k:
            scored.append((await self.sample(prompts, cfg.pass_k, cfg.temperature, seed + 1))[1])
        greedy = [rw.score for g in scored[0] for rw in g.rewards]
        passed = [any(rw.score >= 1.0 for rw in g.rewards) for g in scored[1]] if cfg.pass_k else []
        return Evaluation(sum(greedy) / len(greedy), sum(passed) / len(passed) if passed else None,
                          cfg.pass_k, version, len(prompts))

    async def run(self, writer: MetricsWriter, when: str, step: int) -> Evaluation:
        """Evaluate the run's held-out prompts and write the `eval` event (`when`: before, during, after)."""
        result = await self.evaluate(self.cfg.prompts, self.cfg.seed)
        writer.write_event("eval", when=when, step=step, reward=result.greedy, pass_at_k=result.pass_at_k,
                           k=result.k, weight_version=result.weight_version, prompts=result.prompts)
        if when == "before":
            self.before = result.greedy
        return result

    def restore(self, before: float) -> None:
        """A resumed run's evaluation before training (from its checkpoint)."""
        self.before = before

    def synced(self, step: int, writer: MetricsWriter) -> None:
        """Step `step`'s weights reached the generators: evaluate them meanwhile if `eval_every` says so."""
        if self.cfg.every and step % self.cfg.every == 0 and step < self.cfg.steps:
            self.spawn(self.run(writer, "during", step))
