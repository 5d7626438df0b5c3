"""Scheduling of the built-in loop: generation keeps going while a slow teacher answers.

The mesh here is plain Python objects with the shape of the launched handles (endpoints with `call_one`/
`call`), because the property under test is the controller's scheduling, not Monarch's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from composer_mesh.actors.messages import (
    GenerationRequest,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherSignals,
    TrainMetrics,
)
from composer_mesh.app.runner import apply_overrides
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


class Endpoint:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def call_one(self, *args: Any) -> Any:
        return await self.fn(*args)

    async def call(self, *args: Any) -> Any:
        return _Values([await self.fn(*args)])


class _Values:
    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def values(self) -> list[Any]:
        return self._items


class Handle(SimpleNamespace):
    """One actor mesh of one proc: the whole mesh and its only proc are the same handle."""


class FakeRoleMesh(SimpleNamespace):
    """The part of `RoleMesh` the loop uses: role handles, `has` and `procs`."""

    def has(self, role: str) -> bool:
        return getattr(self, role, None) is not None

    def procs(self, role: str) -> list[Handle]:
        return [getattr(self, role)]


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []


def fake_mesh(log: Log, teacher_delay: float) -> FakeRoleMesh:
    version = {"v": 1}

    async def generate(req: GenerationRequest) -> list[RolloutGroup]:
        log.events.append("generate")
        await asyncio.sleep(0.01)
        return [RolloutGroup(p, [Rollout(p.prompt_id, [1], [2], [-0.1], version["v"])] * req.samples_per_prompt)
                for p in req.prompts]

    async def score(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        return [ScoredGroup(g, [RewardResult(1.0)] * len(g.rollouts)) for g in groups]

    async def signals(_req: Any) -> TeacherSignals:
        log.events.append("teacher-start")
        await asyncio.sleep(teacher_delay)
        log.events.append("teacher-end")
        return TeacherSignals()

    async def train_step(_batch: Any) -> tuple[TrainMetrics, Any]:
        version["v"] += 1
        log.events.append("train")
        return TrainMetrics(step=0, weight_version=version["v"], loss=0.0, metrics={"reward_mean": 1.0}), \
            SimpleNamespace(version=version["v"])

    async def noop(*_: Any) -> Any:
        return None

    async def setup() -> Any:
        return SimpleNamespace(version=1)

    async def stats() -> dict[str, float]:
        return {}

    gens = Handle(generate=Endpoint(generate), update_weights=Endpoint(noop), setup=Endpoint(noop),
                  version=Endpoint(noop))
    return FakeRoleMesh(
        generators=gens,
        trainer=Handle(setup=Endpoint(setup), train_step=Endpoint(train_step), close=Endpoint(noop),
                       save_checkpoint=Endpoint(noop)),
        rewarder=Handle(score=Endpoint(score), stats=Endpoint(stats)),
        teachers=Handle(signals=Endpoint(signals), setup=Endpoint(noop)),
    )


async def test_generation_continues_while_a_slow_teacher_answers(tmp_path):
    topo = apply_overrides(load_topology(ROOT / "topologies" / "local.yaml"), 4, tmp_path / "run")
    topo = topo.model_copy(update={"run": topo.run.model_copy(update={"eval_prompts": 0, "max_policy_lag": 2})})
    log = Log()
    loop = RLLoop(fake_mesh(log, teacher_delay=0.3), topo.run, topo.loss)  # type: ignore[arg-type]
    summary = await loop.run()
    assert summary.steps == 4 and summary.dropped_batches == 0
    first_end = log.events.index("teacher-end")
    # While the first teacher call was in flight, the generator produced every step the lag bound admits
    # (steps 1..3 at lag 2), and no more: step 4 waits for the weights of step 1.
    assert log.events[:first_end].count("generate") == 3
