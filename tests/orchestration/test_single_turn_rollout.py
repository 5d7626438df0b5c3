"""The single-turn rollout driver replayed with fakes of the role protocols: what it generates with which
seeds, what it scores, what it asks the teachers (dynamic sampling: only about informative groups), and that
teacher traces are scored before they are handed on."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestration.fakes import FakeChunks, FakeGenerators, FakeRewarder, FakeTeachers, prompts

from composer_mesh.orchestration.ports import RestartsExhausted
from composer_mesh.orchestration.rollout.base import RolloutServices
from composer_mesh.orchestration.rollout.single_turn import SingleTurnConfig, SingleTurnRollout
from composer_mesh.orchestration.schedule import Chunk, row_seed
from composer_mesh.orchestration.scoring import Scoring, ScoringConfig

SCORING = ScoringConfig(seed=5, max_new_tokens=3, teacher_top_k=0, distributions=True, traces=True)


async def _drive(chunks: list[Chunk], dynamic: bool, generators: FakeGenerators | None = None,
                 rewarder: FakeRewarder | None = None) -> tuple[FakeChunks, dict[str, Any]]:
    gens, rewarder, teachers = generators or FakeGenerators(n=2), rewarder or FakeRewarder(), FakeTeachers()
    scoring = Scoring(SCORING, rewarder, teachers)
    tasks: list[asyncio.Task[Any]] = []
    stops: list[str] = []
    services = RolloutServices(gens, scoring, lambda c: tasks.append(asyncio.create_task(c)) or tasks[-1],
                               stops.append)
    driver = SingleTurnRollout(SingleTurnConfig(samples_per_prompt=3, max_new_tokens=3, temperature=1.0, seed=5,
                                                dynamic_sampling=dynamic), services)
    source = FakeChunks(chunks)
    work = asyncio.create_task(driver.drive(1, source))
    await asyncio.wait([work, asyncio.create_task(source.done.wait())], timeout=5,
                       return_when=asyncio.FIRST_COMPLETED)
    work.cancel()
    await asyncio.gather(work, *tasks, return_exceptions=True)
    return source, {"gens": gens, "rewarder": rewarder, "teachers": teachers, "scoring": scoring, "stops": stops}


async def test_each_chunk_is_generated_with_its_row_seeds_scored_and_given_teacher_signals() -> None:
    chunks = [Chunk(step=1, first=0, prompts=prompts(0, 2)), Chunk(step=2, first=2, prompts=prompts(2, 2))]
    source, seen = await _drive(chunks, dynamic=False)
    requests = seen["gens"].requests
    assert [(i, r.seed) for i, r in requests] == [(1, row_seed(5, 0, 3)), (1, row_seed(5, 2, 3))]
    results = source.finished[2]
    assert [r.index for r in results] == [2, 3] and [r.group.group.prompt.prompt_id for r in results] == ["p2", "p3"]
    # Distributions of proc 0 land on their rollouts, in order; proc 1's traces go to their prompt's group.
    assert [d.teacher for d in results[0].distributions] == ["t-p2"] * 3
    assert [t.prompt_id for t in results[1].traces] == ["p3"]
    # Traces were scored by the rewarder like rollouts (one sample each: score 0.0) before being handed on.
    assert results[1].traces[0].reward == 0.0 and seen["scoring"].traces_scored == 4
    teacher_request = seen["teachers"].requests[1]
    assert teacher_request.seed == row_seed(5, 2, 1) and len(teacher_request.rollouts) == 6
    assert seen["scoring"].teacher_usage == {"t/calls": 1.0, "t/tokens": 2.0}
    assert source.step_times[1].generate_s > 0 and source.step_times[2].score_s > 0


async def test_dynamic_sampling_asks_teachers_only_about_informative_groups() -> None:
    flat = {"p1"}  # p1's rewards are all equal: no GRPO signal
    rewarder = FakeRewarder(lambda pid, i: 1.0 if pid in flat else float(i))
    source, seen = await _drive([Chunk(step=1, first=0, prompts=prompts(0, 3))], dynamic=True, rewarder=rewarder)
    (request,) = seen["teachers"].requests
    assert {r.prompt_id for r in request.rollouts} == {"p0", "p2"}
    assert [p.prompt_id for p in request.prompts] == ["p0", "p2"]
    results = source.finished[0]
    # Scored first (the groups), then the informative groups' traces: two rewarder calls.
    assert rewarder.calls == [["p0", "p1", "p2"], ["p0", "p2"]]
    # Distributions asked for p0 and p2 are spread back; the set-aside group gets none.
    assert [d.teacher if d else None for d in results[0].distributions] == ["t-p0"] * 3
    assert results[1].distributions == [None] * 3 and results[1].traces == []
    assert [d.teacher for d in results[2].distributions] == ["t-p2"] * 3
    assert not results[1].informative and results[0].informative


async def test_restarts_exhausted_on_a_generator_stops_the_run_with_its_reason() -> None:
    gens = FakeGenerators(fail=RestartsExhausted("generators died again after 3 restart(s)"))
    source, seen = await _drive([Chunk(step=1, first=0, prompts=prompts(0, 1))], dynamic=False, generators=gens)
    assert seen["stops"] == ["generators died again after 3 restart(s)"] and source.finished == {}
