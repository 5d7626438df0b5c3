"""Small fakes of the role protocols of `composer_mesh.orchestration.ports`: plain Python, no Monarch, no meshes.

Each keeps a log of what it was asked, so a test replays a component and checks what it did."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RewardResult,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TeacherRequest,
    TeacherSignals,
    TeacherTrace,
    TokenDistribution,
    TrainBatch,
    TrainMetrics,
)
from composer_mesh.errors import UserInputError
from composer_mesh.orchestration.schedule import StepTimes


def prompts(first: int, n: int) -> list[Prompt]:
    return [Prompt(f"p{first + i}", f"q{first + i}", []) for i in range(n)]


class FakeGenerators:
    """`ports.Generators`: each sample is one token; rollouts carry the version the generators hold."""

    def __init__(self, n: int = 1, version: int = 1, fail: BaseException | None = None) -> None:
        self.n = n
        self.version = version
        self.fail = fail  # raised by `generate`
        self.requests: list[tuple[int, GenerationRequest]] = []
        self.manifests: list[Any] = []
        self.sync_gate: dict[int, asyncio.Event] = {}  # version -> released (update_weights waits on it)

    def __len__(self) -> int:
        return self.n

    async def generate(self, index: int, request: GenerationRequest) -> list[RolloutGroup]:
        self.requests.append((index, request))
        if self.fail is not None:
            raise self.fail
        return [RolloutGroup(p, [Rollout(p.prompt_id, [1], [2], [-0.1], self.version, generator=f"generator{index}")
                                 for _ in range(request.samples_per_prompt)]) for p in request.prompts]

    async def generate_versioned(self, index: int, request: GenerationRequest) -> tuple[int, list[RolloutGroup]]:
        return self.version, await self.generate(index, request)

    async def update_weights(self, manifest: Any) -> None:
        self.manifests.append(manifest)
        if manifest.version in self.sync_gate:
            await self.sync_gate[manifest.version].wait()
        self.version = manifest.version

    async def load_weights(self, manifest: Any) -> None:
        await self.update_weights(manifest)


class FakeRewarder:
    """`ports.Rewarder`: `score_of(prompt_id, sample)` gives each reward (default: the sample's index)."""

    def __init__(self, score_of: Callable[[str, int], float] = lambda pid, i: float(i)) -> None:
        self.score_of = score_of
        self.calls: list[list[str]] = []  # prompt ids of each call

    async def score(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        self.calls.append([g.prompt.prompt_id for g in groups])
        return [ScoredGroup(g, [RewardResult(self.score_of(g.prompt.prompt_id, i)) for i in range(len(g.rollouts))])
                for g in groups]


class FakeTeachers:
    """`ports.Teachers` of two pool procs: proc 0 gives a distribution per rollout, proc 1 a trace per prompt."""

    def __init__(self) -> None:
        self.requests: list[TeacherRequest] = []

    async def signals(self, request: TeacherRequest) -> list[TeacherSignals]:
        self.requests.append(request)
        dists = [TokenDistribution(teacher=f"t-{r.prompt_id}", logits=torch.zeros(1, 2)) for r in request.rollouts]
        traces = [TeacherTrace("t", p.prompt_id, f"trace {p.prompt_id}", [7, 8]) for p in request.prompts]
        return [TeacherSignals(distributions=list(dists), usage={"t/calls": 1.0}),
                TeacherSignals(distributions=[None] * len(dists), traces=traces, usage={"t/tokens": 2.0})]


class FakeTrainers:
    """`ports.Trainers` of `replicas` replicas. Step s publishes version `first + s`; a step's answer waits for
    `release(step)` when `hold` is set; replica 0 refuses step `refuse` (a `UserInputError`, as a trainer refuses
    a non-finite loss). `save_state` answers at once; `flush_states` reports every URL saved."""

    def __init__(self, replicas: int = 1, first: int = 1, hold: bool = False, wrong_version: bool = False,
                 refuse: int | None = None) -> None:
        self.replicas = replicas
        self.first = first
        self.hold = hold
        self.wrong_version = wrong_version
        self.refuse = refuse
        self.log: list[tuple[str, int]] = []  # ("train" | "save", step) in the order sent
        self.batches: dict[int, list[TrainBatch]] = {}
        self.released: dict[int, asyncio.Event] = {}
        self.saved: list[str] = []
        self.reported_urls: list[str] = []

    def __len__(self) -> int:
        return self.replicas

    def release(self, step: int) -> None:
        self.released.setdefault(step, asyncio.Event()).set()

    def train(self, step: int, batches: list[TrainBatch]) -> list[Any]:
        self.log.append(("train", step))
        self.batches[step] = batches
        return [self._answer(step, i) for i in range(len(batches))]

    async def _answer(self, step: int, replica: int) -> tuple[TrainMetrics, Any]:
        if self.hold:
            await self.released.setdefault(step, asyncio.Event()).wait()
        if step == self.refuse and replica == 0:
            raise UserInputError(f"trainer step {step}: non-finite loss (nan)")
        version = self.first + step + (1 if self.wrong_version else 0)
        metrics = TrainMetrics(step, version, loss=0.0, metrics={"reward_mean": float(replica)})
        metrics.states_written = [f"r{replica}/before-step-{step}"]  # what a trainer reports with its answer
        return metrics, SimpleNamespace(version=version)

    def save_state(self, step: int, urls: list[str]) -> list[Any]:
        self.log.append(("save", step))
        self.saved.extend(urls)
        return [self._saved(url) for url in urls]

    async def _saved(self, url: str) -> str:
        return url

    def reported(self, urls: list[str]) -> None:
        self.reported_urls.extend(urls)

    async def each(self, endpoint: str, *args: Any) -> list[Any]:
        assert endpoint == "flush_states", endpoint
        done, self.saved = list(self.saved), []
        return [done] + [[] for _ in range(self.replicas - 1)]


class FakeWriter:
    """The part of `MetricsWriter` components write to: events, and the trackers' run ids."""

    def __init__(self) -> None:
        self.tracker_ids: dict[str, str] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []

    def write_event(self, kind: str, **values: Any) -> None:
        self.events.append((kind, values))


class FakeChunks:
    """`rollout.base.ChunkSource` over a fixed list of chunks: `finished` keeps what the driver handed back."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = list(chunks)
        self.total = len(chunks)
        self.finished: dict[int, list[Any]] = {}  # chunk.first -> results
        self.step_times: dict[int, StepTimes] = {}
        self.done = asyncio.Event()
        self.idle_s = 0.0  # generator idle seconds the driver reported
        self.uncounted = 0  # next_chunk calls whose wait was not a generator's

    async def next_chunk(self, counts_idle: bool = True) -> Any:
        self.uncounted += not counts_idle
        if not self.chunks:
            await asyncio.Event().wait()  # nothing more: the driver waits until cancelled
        return self.chunks.pop(0)

    async def finish(self, chunk: Any, results: list[Any]) -> None:
        self.finished[chunk.first] = results
        if len(self.finished) == self.total:
            self.done.set()

    def times(self, step: int) -> StepTimes:
        return self.step_times.setdefault(step, StepTimes())

    def add_idle(self, seconds: float) -> None:
        self.idle_s += seconds
