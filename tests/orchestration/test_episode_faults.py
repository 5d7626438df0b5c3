"""A generator proc killed (SIGKILL) in the middle of an episode run (`run.rollout.kind: multi_turn`) on real local
Monarch meshes, with real generators and the real calculator environment: the mesh is replaced, the request in
flight (later turns of unfinished episodes: each the exact ids of its conversation so far, with its turn's seed)
is re-issued on the replacement, every episode completes, and at `max_policy_lag: 0` the episodes trained on are
token for token those of the same run never killed (and so are the trained weights).

The kill point is deterministic: the test's `Generators` wrapper kills the proc of the generator a request goes
to, once, on the first request that carries a later turn (so at least one turn of some episode was generated and
those episodes are not finished). A dead environment is the driver's business alone: test_multi_turn.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from composer_mesh.actors.messages import GenerationRequest, Prompt, RolloutGroup
from composer_mesh.app.launch import launch, run_config
from composer_mesh.app.runner import apply_overrides, checkpoint_policy
from composer_mesh.orchestration.loop import RLLoop
from composer_mesh.orchestration.metrics import RunSummary
from composer_mesh.orchestration.prompts import prompt_source
from composer_mesh.orchestration.rollout import multi_turn
from composer_mesh.orchestration.rollout.base import (
    ChunkSource,
    RolloutDriver,
    RolloutFactory,
    RolloutServices,
)
from composer_mesh.orchestration.rollout.episode import TURN_SEED_STRIDE
from composer_mesh.orchestration.schedule import Chunk, GroupResult, row_seed
from composer_mesh.topology import Topology, load_topology

TOPOLOGY = Path(__file__).with_name("tiny_agentic.yaml")
STEPS = 2

Episodes = dict[tuple[int, int], dict[str, Any]]  # (stream index, sample) -> the trained episode's tokens


def topology(run_dir: Path) -> Topology:
    topo = apply_overrides(load_topology(TOPOLOGY), None, run_dir)
    return topo.model_copy(update={"run": topo.run.model_copy(update={
        "steps": STEPS, "max_policy_lag": 0, "eval_prompts": 0})})


class KillingGenerators:
    """`ports.Generators` passed through, except that the first request carrying a later turn of an episode has
    the proc of its generator killed while it is in flight (when `kill`)."""

    def __init__(self, inner: Any, mesh: Any, kill: bool) -> None:
        self.inner, self.mesh, self.kill = inner, mesh, kill
        self.killed: list[GenerationRequest] = []  # the request in flight when its generator's proc was killed
        self.answered = 0  # requests answered before the kill

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, index: int, request: GenerationRequest) -> list[RolloutGroup]:
        if not self.kill or self.killed or all(p.bridge_messages is None for p in request.prompts):
            out = await self.inner.generate(index, request)
            self.answered += not self.killed
            return out
        # noted before the first await: two generators sample a round's later turns at once, and only one dies
        self.killed.append(request)
        where = await self.mesh.procs("generators")[index].process.call_one()
        call = asyncio.ensure_future(self.inner.generate(index, request))
        await asyncio.sleep(0.05)  # the request is on its way (or being sampled) when the proc dies
        os.kill(int(where["pid"]), signal.SIGKILL)
        return await call


class RecordingChunks:
    """The scheduler, with every finished episode's tokens noted on the way back."""

    def __init__(self, inner: ChunkSource, episodes: Episodes) -> None:
        self.inner, self.episodes = inner, episodes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def finish(self, chunk: Chunk, results: list[GroupResult]) -> None:
        for r in results:
            for j, e in enumerate(r.group.group.rollouts):
                assert (r.index, j) not in self.episodes, f"episode {(r.index, j)} handed back twice"
                self.episodes[r.index, j] = {
                    "prompt_ids": e.prompt_ids, "completion_ids": e.completion_ids, "status": e.status,
                    "turns": [(t.start, t.end, t.policy) for t in e.turns or []]}
        await self.inner.finish(chunk, results)


@dataclasses.dataclass
class Recording:
    """The test's view of one run: its summary, records, trained episodes and what was killed."""

    summary: RunSummary
    records: list[dict[str, Any]]
    episodes: Episodes
    generators: KillingGenerators


class _Recorded:
    """A driver whose chunks are `RecordingChunks`."""

    def __init__(self, inner: RolloutDriver, episodes: Episodes) -> None:
        self.inner, self.episodes = inner, episodes

    async def drive(self, index: int, chunks: ChunkSource) -> None:
        await self.inner.drive(index, RecordingChunks(chunks, self.episodes))

    async def evaluate(self, prompts: list[Prompt], samples: int, temperature: float, seed: int) -> Any:
        return await self.inner.evaluate(prompts, samples, temperature, seed)

    def counters(self) -> dict[str, float]:
        return self.inner.counters()


async def run(run_dir: Path, kill: bool) -> Recording:
    topo = topology(run_dir)
    cfg = run_config(topo)
    prompts = prompt_source(cfg)
    environment = prompts.episode_environment()
    assert environment is not None
    episodes: Episodes = {}
    wrapped: list[KillingGenerators] = []
    async with launch(topo) as mesh:

        def factory(services: RolloutServices) -> RolloutDriver:
            wrapped.append(KillingGenerators(services.generators, mesh, kill))
            driver = multi_turn.factory(cfg, environment)(dataclasses.replace(services, generators=wrapped[0]))
            return _Recorded(driver, episodes)

        rollout: RolloutFactory = factory
        loop = RLLoop(mesh, cfg, topo.loss, checkpoints=checkpoint_policy(topo), prompts=prompts, rollout=rollout)
        summary = await loop.run()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Recording(summary, [r for r in lines if "event" not in r], episodes, wrapped[0])


def trained_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "trainer" / "r0" / "state.safetensors")


@pytest.mark.slow  # two episode runs on real meshes, one replacing its generators: 1-5 min on a busy 2-core VM
async def test_a_generator_killed_mid_episode_has_its_turns_re_issued_from_the_same_prefix_and_seed(tmp_path):
    clean = await run(tmp_path / "clean", kill=False)
    killed = await run(tmp_path / "killed", kill=True)
    topo = topology(tmp_path / "clean")
    spp, seed = topo.run.samples_per_prompt, topo.run.seed
    assert clean.summary.stopped is None and killed.summary.stopped is None
    assert clean.summary.steps == killed.summary.steps == STEPS
    # The kill: once, in the middle of episodes (some turn was sampled before; the request in flight continues
    # episodes whose conversation so far it carries).
    (request,) = killed.generators.killed
    assert killed.generators.answered >= 1 and request.seeds is not None
    later = [(p, s) for p, s in zip(request.prompts, request.seeds, strict=True) if p.bridge_messages is not None]
    assert later and all(s // TURN_SEED_STRIDE >= 1 for _, s in later)
    last = killed.records[-1]["metrics"]
    assert last["faults/restarts/generators"] == 1.0 and last["faults/reissued"] >= 1.0
    assert all(r["metrics"].get("faults/restarts", 0.0) == 0.0 for r in clean.records)
    # Every episode of every step completed and was trained once (RecordingChunks refuses a second hand-back).
    every = {(i, j) for i in range(STEPS * topo.run.prompts_per_step) for j in range(spp)}
    assert set(killed.episodes) == set(clean.episodes) == every
    assert any(len(e["turns"]) > 1 for e in clean.episodes.values())  # episodes of several turns were played
    # The re-issued turns continued their episodes from the exact prefix they carried ...
    by_seed = {row_seed(seed, i, spp) + j: e for (i, j), e in killed.episodes.items()}
    for p, s in later:
        e = by_seed[s % TURN_SEED_STRIDE]
        assert [*e["prompt_ids"], *e["completion_ids"]][: len(p.token_ids)] == list(p.token_ids)
    # ... and with the same seeds: the episodes trained on are the uninterrupted run's, token for token.
    assert killed.episodes == clean.episodes
    a, b = trained_state(tmp_path / "clean"), trained_state(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = ("step", "weight_version", "reward", "loss", "rollouts", "prompts")
    assert [{k: r[k] for k in keys} for r in clean.records] == [{k: r[k] for k in keys} for r in killed.records]
