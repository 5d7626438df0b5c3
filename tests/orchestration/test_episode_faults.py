"""A generator proc killed (SIGKILL) in the middle of an episode run (`run.rollout.kind: multi_turn`) on real local
Monarch meshes, with real generators and the real calculator environment: the mesh is replaced, the request in
flight (later turns of unfinished episodes: each the exact ids of its conversation so far, with its turn's seed)
is re-issued on the replacement, every episode completes, and at `max_policy_lag: 0` the episodes trained on are
token for token those of the same run never killed (and so are the trained weights). At `max_policy_lag: 1`
there is no such twin (timing decides which weights sample which turn), so the test checks what must hold
anyway: every episode handed back once, the re-issued turns continuing their prefixes, episodes spanning the
weight update and every trained episode within the lag bound counted from its oldest turn.

The kill point is deterministic: the test's `Generators` wrapper kills the proc of the generator a request goes
to, once, on the first request that carries a later turn (so at least one turn of some episode was generated and
those episodes are not finished); at lag 1, on the first such request after step 1's weights reached the
generators, while step 2's episodes (admitted with step 1's and held at their first environment step until
then) are in flight. A dead environment is the driver's business: test_multi_turn.py, and with real servers
tests/envs/test_openenv_session.py."""

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

from composer_mesh.actors.messages import GenerationRequest, Prompt, Rollout, RolloutGroup
from composer_mesh.app.launch import launch, run_config
from composer_mesh.app.runner import apply_overrides, checkpoint_policy
from composer_mesh.envs.session import EnvSession, EpisodeEnvironment, EpisodePrompt, Observation, StepResult
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


def topology(run_dir: Path, lag: int = 0) -> Topology:
    """The test's run: `STEPS` steps at `max_policy_lag: lag`. The step timeout is long because at lag 1 step 2's
    episodes wait at their first environment step for step 1's training (`Held`)."""
    topo = apply_overrides(load_topology(TOPOLOGY), None, run_dir)
    rollout = topo.run.rollout.model_copy(update={"step_timeout_s": 600.0})
    return topo.model_copy(update={"run": topo.run.model_copy(update={
        "steps": STEPS, "max_policy_lag": lag, "eval_prompts": 0, "rollout": rollout})})


class KillingGenerators:
    """`ports.Generators` passed through (to the driver and to the train pipeline), except that the first request
    carrying a later turn of an episode has the proc of its generator killed while it is in flight (when `kill`;
    with `after_update`, the first one sent once the weights of step 1 reached the generators). `updated` is set
    then."""

    def __init__(self, inner: Any, mesh: Any, kill: bool, after_update: bool = False) -> None:
        self.inner, self.mesh, self.kill, self.after_update = inner, mesh, kill, after_update
        self.killed: list[GenerationRequest] = []  # the request in flight when its generator's proc was killed
        self.answers: list[RolloutGroup] = []  # what that request was answered with (by the replacement)
        self.answered = 0  # requests answered before the kill
        self.updated = asyncio.Event()

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def update_weights(self, manifest: Any) -> None:
        await self.inner.update_weights(manifest)
        self.updated.set()

    def _kills(self, request: GenerationRequest) -> bool:
        later = any(p.bridge_messages is not None for p in request.prompts)
        return self.kill and not self.killed and later and (self.updated.is_set() or not self.after_update)

    async def generate(self, index: int, request: GenerationRequest) -> list[RolloutGroup]:
        if not self._kills(request):
            out = await self.inner.generate(index, request)
            self.answered += not self.killed
            return out
        # noted before the first await: two generators sample a round's later turns at once, and only one dies
        self.killed.append(request)
        where = await self.mesh.procs("generators")[index].process.call_one()
        call = asyncio.ensure_future(self.inner.generate(index, request))
        await asyncio.sleep(0.05)  # the request is on its way (or being sampled) when the proc dies
        os.kill(int(where["pid"]), signal.SIGKILL)
        self.answers = await call
        return self.answers


class HeldSession:
    """`inner`, whose steps wait until `ready` is set."""

    def __init__(self, inner: EnvSession, ready: asyncio.Event) -> None:
        self.inner, self.ready = inner, ready

    async def reset(self) -> Observation:
        return await self.inner.reset()

    async def step(self, action: str) -> StepResult:
        await self.ready.wait()
        return await self.inner.step(action)

    async def close(self) -> None:
        await self.inner.close()


class Held:
    """The run's environment, with the sessions of the episodes seeded `seeds` held at their first step until
    `ready`. Why: at lag 1 step 2's episodes are admitted with step 1's and sample their first turns with the
    first weights; held until step 1's weights reached the generators, they sample their later turns with the
    next ones, so they span the update whatever the timing."""

    def __init__(self, inner: EpisodeEnvironment, seeds: set[int], ready: asyncio.Event) -> None:
        self.inner, self.seeds, self.ready = inner, seeds, ready
        self.name = inner.name

    def session(self, prompt: EpisodePrompt, seed: int) -> EnvSession:
        session = self.inner.session(prompt, seed)
        return HeldSession(session, self.ready) if seed in self.seeds else session


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
                    "step": chunk.step, "prompt_ids": e.prompt_ids, "completion_ids": e.completion_ids,
                    "status": e.status, "weight_version": e.weight_version,
                    "turns": [(t.start, t.end, t.policy, t.weight_version) for t in e.turns or []]}
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


def step_seeds(topo: Topology, step: int) -> set[int]:
    """The seeds of step `step`'s episodes (its prompts are the stream's `prompts_per_step` after the last step's)."""
    r = topo.run
    rows = range((step - 1) * r.prompts_per_step, step * r.prompts_per_step)
    return {row_seed(r.seed, i, r.samples_per_prompt) + j for i in rows for j in range(r.samples_per_prompt)}


async def run(run_dir: Path, kill: bool, lag: int = 0) -> Recording:
    """One run at `lag`, killed (`kill`) as the module docstring says; at lag 1 step 2's episodes are `Held`."""
    topo = topology(run_dir, lag)
    cfg = run_config(topo)
    prompts = prompt_source(cfg)
    environment = prompts.episode_environment()
    assert environment is not None
    episodes: Episodes = {}
    wrapped: list[KillingGenerators] = []
    async with launch(topo) as mesh:

        def factory(services: RolloutServices) -> RolloutDriver:
            wrapped.append(KillingGenerators(services.generators, mesh, kill, after_update=lag > 0))
            env = Held(environment, step_seeds(topo, 2), wrapped[0].updated) if lag > 0 else environment
            driver = multi_turn.factory(cfg, env)(dataclasses.replace(services, generators=wrapped[0]))
            return _Recorded(driver, episodes)

        rollout: RolloutFactory = factory
        loop = RLLoop(mesh, cfg, topo.loss, checkpoints=checkpoint_policy(topo), prompts=prompts, rollout=rollout)
        loop.pipeline.generators = wrapped[0]  # weight updates pass the wrapper too: it tells `updated`
        summary = await loop.run()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Recording(summary, [r for r in lines if "event" not in r], episodes, wrapped[0])


def trained_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "trainer" / "r0" / "state.safetensors")


Reissued = list[tuple[Prompt, int, Rollout]]  # a later turn of the killed request: its prompt, seed and answer


def check_killed_once(killed: Recording, topo: Topology) -> tuple[Reissued, dict[int, dict[str, Any]]]:
    """What a killed run must show at any lag: it finished every step; the kill came once, in the middle of
    episodes (the request in flight continued episodes whose conversation so far it carried); the generators
    were replaced once and the request re-issued; every episode of every step was handed back once; and each
    re-issued turn is the turn of its seed (episode and turn number) in the trained episode, continuing the exact
    prefix it carried. Returns those turns and the trained episodes by seed."""
    spp, seed = topo.run.samples_per_prompt, topo.run.seed
    assert killed.summary.stopped is None and killed.summary.steps == STEPS
    (request,) = killed.generators.killed
    assert killed.generators.answered >= 1 and request.seeds is not None
    answers = [g.rollouts[0] for g in killed.generators.answers]
    later = [(p, s, a) for p, s, a in zip(request.prompts, request.seeds, answers, strict=True)
             if p.bridge_messages is not None]
    assert later and all(s // TURN_SEED_STRIDE >= 1 for _, s, _ in later)
    last = killed.records[-1]["metrics"]
    assert last["faults/restarts/generators"] == 1.0 and last["faults/reissued"] >= 1.0
    # Every episode of every step completed and was trained once (RecordingChunks refuses a second hand-back).
    every = {(i, j) for i in range(STEPS * topo.run.prompts_per_step) for j in range(spp)}
    assert set(killed.episodes) == every
    assert {e["step"] for e in killed.episodes.values()} == set(range(1, STEPS + 1))
    by_seed = {row_seed(seed, i, spp) + j: e for (i, j), e in killed.episodes.items()}
    for p, s, answer in later:
        e = by_seed[s % TURN_SEED_STRIDE]
        ids = [*e["prompt_ids"], *e["completion_ids"]]
        assert ids[: len(p.token_ids)] == list(p.token_ids) == answer.prompt_ids[: len(p.token_ids)]
        start = len(answer.prompt_ids) - len(e["prompt_ids"])  # the policy turn starts after its bridge
        policy = [t for t in e["turns"] if t[2]]
        turn = (start, start + len(answer.completion_ids), True, answer.weight_version)
        assert policy[s // TURN_SEED_STRIDE] == turn
        assert ids[len(answer.prompt_ids): turn[1] + len(e["prompt_ids"])] == answer.completion_ids
    return later, by_seed


@pytest.mark.slow  # two episode runs on real meshes, one replacing its generators: 1-5 min on a busy 2-core VM
async def test_a_generator_killed_mid_episode_has_its_turns_re_issued_from_the_same_prefix_and_seed(tmp_path):
    clean = await run(tmp_path / "clean", kill=False)
    killed = await run(tmp_path / "killed", kill=True)
    check_killed_once(killed, topology(tmp_path / "clean"))
    assert clean.summary.stopped is None and clean.summary.steps == STEPS
    assert all(r["metrics"].get("faults/restarts", 0.0) == 0.0 for r in clean.records)
    assert any(len(e["turns"]) > 1 for e in clean.episodes.values())  # episodes of several turns were played
    # The re-issued turns continued their prefixes with the same seeds: the episodes trained on are the
    # uninterrupted run's, token for token (and weight version for weight version).
    assert killed.episodes == clean.episodes
    a, b = trained_state(tmp_path / "clean"), trained_state(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = ("step", "weight_version", "reward", "loss", "rollouts", "prompts")
    assert [{k: r[k] for k in keys} for r in clean.records] == [{k: r[k] for k in keys} for r in killed.records]


@pytest.mark.slow  # one episode run on real meshes, replacing its generators: about a minute on a busy 2-core VM
async def test_at_lag_1_a_generator_killed_mid_episode_costs_no_episode_and_keeps_the_lag_bound(tmp_path):
    topo = topology(tmp_path, lag=1)
    killed = await run(tmp_path, kill=True, lag=1)
    reissued, by_seed = check_killed_once(killed, topo)
    trained_from = {r["step"]: r["weight_version"] - 1 for r in killed.records}  # a record has the published one
    first = trained_from[1]
    assert trained_from == {1: first, 2: first + 1}
    # The kill came while step 2's episodes were in flight on step 1's weights, which the replacement pulled:
    # each re-issued turn was sampled with them, one version past the first turn of its episode.
    for _, s, answer in reissued:
        e = by_seed[s % TURN_SEED_STRIDE]
        assert e["step"] == 2 and answer.weight_version == first + 1 and e["weight_version"] == first
    # Every episode's version is its oldest policy turn's, and the lag from it to the version the step trained
    # from is within the bound; step 2's episodes spanned the weight update, so its lag is the bound.
    spanning = set()
    for e in killed.episodes.values():
        versions = [t[3] for t in e["turns"] if t[2]]
        assert e["weight_version"] == min(versions) and 0 <= trained_from[e["step"]] - min(versions) <= 1
        if len(set(versions)) > 1:
            spanning.add(e["step"])
    assert spanning == {2}
    assert [r["policy_lag"] for r in killed.records] == [0, 1]
