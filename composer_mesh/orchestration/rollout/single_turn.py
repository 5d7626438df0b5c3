"""The built-in rollout driver: one completion per sample.

Each chunk is one generation request on the driver's generator (re-issued on a replacement if its proc dies);
the generator then takes its next chunk while the chunk is completed in a task of its own: scored and sent to
the teachers concurrently, then the teachers' traces scored. With dynamic sampling the teachers are asked only
about groups whose rewards differ (the others are set aside by the scheduler), so scoring comes first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from composer_mesh.actors.messages import (
    GenerationRequest,
    Prompt,
    RolloutGroup,
    ScoredGroup,
    TeacherSignals,
    TokenDistribution,
    TrainBatch,
)
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.ports import RestartsExhausted
from composer_mesh.orchestration.rollout.base import ChunkSource, RolloutFactory, RolloutServices
from composer_mesh.orchestration.schedule import Chunk, GroupResult, row_seed


@dataclass(frozen=True)
class SingleTurnConfig:
    """The sampling settings of the run (`run:`) a single-turn request carries."""

    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    seed: int
    dynamic_sampling: bool = False

    @classmethod
    def of(cls, run: RunConfig) -> SingleTurnConfig:
        return cls(samples_per_prompt=run.samples_per_prompt, max_new_tokens=run.max_new_tokens,
                   temperature=run.temperature, seed=run.seed, dynamic_sampling=run.dynamic_sampling)


def generation_request(cfg: SingleTurnConfig, prompts: list[Prompt], first: int) -> GenerationRequest:
    """Sampling request for `prompts`, the first of which is prompt `first` of the stream."""
    return GenerationRequest(
        prompts=prompts, samples_per_prompt=cfg.samples_per_prompt, max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature, seed=row_seed(cfg.seed, first, cfg.samples_per_prompt),
    )


class SingleTurnRollout:
    """`RolloutDriver`: generate a chunk, score it, fetch its teacher signals, score the teachers' traces."""

    def __init__(self, cfg: SingleTurnConfig, services: RolloutServices) -> None:
        self.cfg = cfg
        self.generators = services.generators
        self.scoring = services.scoring
        self.spawn = services.spawn
        self.stop = services.stop

    async def drive(self, index: int, chunks: ChunkSource) -> None:
        """Generator `index`'s loop: the next admitted chunk, generated, then completed in a task of its own."""
        try:
            while True:
                chunk = await chunks.next_chunk()
                request = generation_request(self.cfg, chunk.prompts, chunk.first)
                t0 = time.perf_counter()
                groups = await self.generators.generate(index, request)
                chunks.times(chunk.step).generate_s += time.perf_counter() - t0
                self.spawn(self._complete_chunk(chunk, groups, chunks))
        except RestartsExhausted as e:
            self.stop(str(e))

    async def evaluate(self, prompts: list[Prompt], samples: int, temperature: float,
                       seed: int) -> tuple[int, list[ScoredGroup]]:
        """`samples` completions of each prompt on generator 0, scored by the rewarder."""
        request = GenerationRequest(prompts=prompts, samples_per_prompt=samples, max_new_tokens=self.cfg.max_new_tokens,
                                    temperature=temperature, seed=seed)
        version, groups = await self.generators.generate_versioned(0, request)
        return version, await self.scoring.score(groups)

    def counters(self) -> dict[str, float]:
        return {}

    async def _complete_chunk(self, chunk: Chunk, groups: list[RolloutGroup], chunks: ChunkSource) -> None:
        try:
            await chunks.finish(chunk, await self.complete(chunk, groups, chunks))
        except RestartsExhausted as e:
            self.stop(str(e))

    async def complete(self, chunk: Chunk, groups: list[RolloutGroup], chunks: ChunkSource) -> list[GroupResult]:
        """`chunk`'s generated groups, scored and with their teacher signals, one result per prompt."""
        times = chunks.times(chunk.step)
        if not self.cfg.dynamic_sampling:
            return group_results(chunk, await self.scoring.complete(groups, chunk.first, times))
        scored = await self.scoring.score(groups, times)
        informative = [i for i, g in enumerate(scored) if len({r.score for r in g.rewards}) > 1]
        signals = await self.scoring.signals([groups[i] for i in informative], chunk.first, times)
        await self.scoring.score_traces(signals.traces, groups, times)
        return group_results(chunk, TrainBatch(scored, spread(scored, informative, signals), signals.traces))


def spread(scored: list[ScoredGroup], informative: list[int], signals: TeacherSignals) -> list[TokenDistribution | None]:
    """Teacher distributions asked for the informative groups only, spread back over all groups' rollouts."""
    out: list[TokenDistribution | None] = []
    asked = iter(signals.distributions)
    for i, g in enumerate(scored):
        n = len(g.rewards)
        out.extend([next(asked, None) for _ in range(n)] if i in informative else [None] * n)
    return out


def group_results(chunk: Chunk, batch: TrainBatch) -> list[GroupResult]:
    """A completed chunk as one `GroupResult` per prompt (distributions and traces split by group)."""
    out, offset = [], 0
    for i, g in enumerate(batch.groups):
        n = len(g.group.rollouts)
        dists = batch.distributions[offset : offset + n] if batch.distributions else [None] * n
        pid = g.group.prompt.prompt_id
        out.append(GroupResult(chunk.first + i, g, list(dists), [t for t in batch.traces if t.prompt_id == pid]))
        offset += n
    return out


def factory(run: RunConfig) -> RolloutFactory:
    """The built-in driver for `run` (`RLLoop`'s default `rollout`)."""
    return lambda services: SingleTurnRollout(SingleTurnConfig.of(run), services)
