"""Scheduling of the built-in loop: generation keeps going while a slow teacher answers.

The mesh here is plain Python objects with the shape of the launched handles (endpoints with `call_one`/
`call`), because the property under test is the controller's scheduling, not Monarch's.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from composer_mesh.actors.messages import (
    GenerationRequest,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherSignals,
    TrainMetrics,
    WeightVersion,
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
    """The part of `RoleMesh` the loop uses: role handles, `has` and `procs`, and where roles run (each on a
    mesh of its own, no spares, nothing failed)."""

    failures: tuple[Any, ...] = ()
    procs_per_replica = 1  # the trainer's: one proc per replica
    launched = SimpleNamespace(specs=defaultdict(lambda: SimpleNamespace(spare=False)), has_spare=lambda mesh: False)

    def has(self, role: str) -> bool:
        return getattr(self, role, None) is not None

    def procs(self, role: str) -> list[Handle]:
        return [getattr(self, role)]

    def mesh_of(self, role: str) -> str:
        return role

    def roles_on(self, mesh: str) -> list[str]:
        return [mesh]


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.teacher_rollouts: list[str] = []  # prompt ids of the rollouts the teachers were asked about
        self.batches: list[Any] = []


def fake_mesh(log: Log, teacher_delay: float, flat: Callable[[str], bool] = lambda _: False) -> FakeRoleMesh:
    """`flat(prompt_id)`: that prompt's group gets equal rewards (no GRPO signal)."""
    version = {"v": 1}

    async def generate(req: GenerationRequest) -> list[RolloutGroup]:
        log.events.append("generate")
        await asyncio.sleep(0.01)
        return [RolloutGroup(p, [Rollout(p.prompt_id, [1], [2], [-0.1], version["v"])] * req.samples_per_prompt)
                for p in req.prompts]

    async def score(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        return [ScoredGroup(g, [RewardResult(1.0 if flat(g.prompt.prompt_id) else float(i))
                                for i in range(len(g.rollouts))]) for g in groups]

    async def signals(req: Any) -> TeacherSignals:
        log.teacher_rollouts.extend(r.prompt_id for r in req.rollouts)
        log.events.append("teacher-start")
        await asyncio.sleep(teacher_delay)
        log.events.append("teacher-end")
        return TeacherSignals()

    async def train_step(batch: Any) -> tuple[TrainMetrics, Any]:
        log.batches.append(batch)
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

    saved: list[str] = []  # full-state checkpoints "written" (nothing is: the loop only needs the report)

    async def save_state(url: str, wait: bool = True) -> str:
        saved.append(url)
        return url

    async def flush_states() -> list[str]:
        done = list(saved)
        saved.clear()
        return done

    async def update_weights(manifest: Any) -> WeightVersion:
        return WeightVersion(manifest.version)

    gens = Handle(generate=Endpoint(generate), update_weights=Endpoint(update_weights), setup=Endpoint(noop),
                  version=Endpoint(noop))
    return FakeRoleMesh(
        generators=gens,
        trainer=Handle(setup=Endpoint(setup), train_step=Endpoint(train_step), close=Endpoint(noop),
                       save_checkpoint=Endpoint(noop), save_state=Endpoint(save_state),
                       flush_states=Endpoint(flush_states)),
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


async def test_dynamic_sampling_trains_on_informative_groups_and_asks_teachers_only_about_them(tmp_path):
    topo = apply_overrides(load_topology(ROOT / "topologies" / "local.yaml"), 3, tmp_path / "run")
    run = topo.run.model_copy(update={"eval_prompts": 0, "max_policy_lag": 0, "prompts_per_step": 4,
                                      "dynamic_sampling": True})
    log = Log()
    every_third_flat = lambda pid: int(pid[1:]) % 3 == 0  # noqa: E731
    summary = await RLLoop(fake_mesh(log, 0.0, every_third_flat), run, topo.loss).run()  # type: ignore[arg-type]
    assert summary.steps == 3 and summary.dropped_batches == 0
    trained = [g.group.prompt.prompt_id for b in log.batches for g in b.groups]
    assert len(trained) == 3 * 4 and not any(every_third_flat(p) for p in trained)
    assert set(log.teacher_rollouts) == set(trained)  # no teacher work on groups that were set aside
    # Each step draws 4, two of them flat (p0 p3 | p6 p9 | p12 p15), and backfills 2: p0..p17 drawn, 6 set aside.
    assert summary.zero_variance_groups == 6 and max(int(p[1:]) for p in trained) == 17


async def test_a_failing_generator_or_rewarder_stops_the_run_with_its_error(tmp_path):
    topo = apply_overrides(load_topology(ROOT / "topologies" / "local.yaml"), 3, tmp_path / "run")
    run = topo.run.model_copy(update={"eval_prompts": 0, "max_policy_lag": 1})

    async def broken(*_: Any) -> Any:
        raise RuntimeError("grader exploded")

    for role, endpoint in (("generators", "generate"), ("rewarder", "score")):
        mesh = fake_mesh(Log(), 0.0)
        setattr(getattr(mesh, role), endpoint, Endpoint(broken))
        with pytest.raises(RuntimeError, match="grader exploded"):
            await asyncio.wait_for(RLLoop(mesh, run, topo.loss).run(), 30)  # type: ignore[arg-type]
