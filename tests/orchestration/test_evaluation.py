"""Evaluation replayed with fake generators and a fake rewarder: greedy reward, pass@k, the weight version
generator 0 sampled with, the events it writes and when it runs during training."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestration.fakes import FakeGenerators, FakeRewarder, FakeWriter, prompts

from composer_mesh.orchestration.evaluation import EvalConfig, Evaluator
from composer_mesh.orchestration.rollout.base import RolloutServices
from composer_mesh.orchestration.rollout.single_turn import SingleTurnConfig, SingleTurnRollout
from composer_mesh.orchestration.scoring import Scoring, ScoringConfig


def evaluator(gens: FakeGenerators, every: int = 0, pass_k: int = 4,
              spawned: list[Any] | None = None) -> Evaluator:
    cfg = EvalConfig(prompts=3, seed=7, pass_k=pass_k, temperature=0.9, every=every, steps=10)
    # Greedy: p0 and p2 score 1, p1 scores 0. Sampled: only sample 3 of p1 passes.
    rewarder = FakeRewarder(lambda pid, i: float(pid in ("p0", "p2") or i == 3))
    spawn = (spawned.append if spawned is not None else asyncio.create_task)
    scoring = Scoring(ScoringConfig(seed=7, max_new_tokens=2, teacher_top_k="auto", distributions=False, traces=False),
                      rewarder, None)  # type: ignore[arg-type]
    driver = SingleTurnRollout(SingleTurnConfig(samples_per_prompt=2, max_new_tokens=2, temperature=0.9, seed=7),
                               RolloutServices(gens, scoring, spawn, lambda reason: None))  # type: ignore[arg-type]
    return Evaluator(cfg, driver.evaluate, lambda n: prompts(0, n), lambda: 42, spawn)  # type: ignore[arg-type]


async def test_greedy_reward_pass_at_k_and_the_version_generator_0_evaluated() -> None:
    gens = FakeGenerators(n=2, version=5)
    result = await evaluator(gens).evaluate(3, seed=7)
    assert (result.greedy, result.pass_at_k, result.k, result.weight_version) == (2 / 3, 1.0, 4, 5)
    (i0, greedy), (i1, sampled) = gens.requests
    assert (i0, i1) == (0, 0)  # generator 0 evaluates
    assert (greedy.samples_per_prompt, greedy.temperature, greedy.seed) == (1, 0.0, 7)
    assert (sampled.samples_per_prompt, sampled.temperature, sampled.seed) == (4, 0.9, 8)


async def test_nothing_to_evaluate_reports_the_trainers_version() -> None:
    gens = FakeGenerators()
    result = await evaluator(gens, pass_k=0).evaluate(0, seed=7)
    assert result.greedy != result.greedy and result.pass_at_k is None and result.weight_version == 42
    assert gens.requests == []


async def test_the_before_event_is_written_and_kept_for_the_checkpoint() -> None:
    writer, ev = FakeWriter(), evaluator(FakeGenerators(version=3), pass_k=0)
    await ev.run(writer, "before", 0)  # type: ignore[arg-type]
    assert writer.events == [("eval", {"when": "before", "step": 0, "reward": 2 / 3, "pass_at_k": None, "k": 0,
                                       "weight_version": 3, "prompts": 3})]
    assert ev.before == 2 / 3


async def test_an_eval_set_smaller_than_asked_reports_how_many_prompts_it_scored() -> None:
    """addition holds out 20 problems and scores each once even when `run.eval_prompts` asks for 64: the event
    and the summary say 20, not 64."""
    ev = evaluator(FakeGenerators(), pass_k=0)
    ev.eval_prompts = lambda n: prompts(0, min(n, 2))
    result = await ev.evaluate(3, seed=7)
    assert result.prompts == 2 and result.greedy == 0.5  # p0 scores 1, p1 scores 0


async def test_evaluations_during_training_run_every_eval_every_steps_but_not_at_the_last() -> None:
    spawned: list[Any] = []
    ev = evaluator(FakeGenerators(), every=5, spawned=spawned)
    for step in range(1, 11):
        ev.synced(step, FakeWriter())  # type: ignore[arg-type]
    assert len(spawned) == 1  # step 5 (step 10 is the run's last: evaluated "after" instead)
    spawned[0].close()
