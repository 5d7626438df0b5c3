"""A fixed-latency stand-in generator: the `hf` generator, padded to a known cost per prompt.

Why it exists: a 2-core machine cannot show that more generators give more throughput (the real generators
just share the same cores), yet the orchestration (how a step's groups are spread over free generators, how
the policy-lag bound paces them, where the trainer becomes the bottleneck) should be testable and measurable
anywhere. This binding samples for real with the hf generator (real tokens and log-probs, so training is
real) and then sleeps until the request has taken `seconds_per_group` x its prompts: an engine of known
throughput. The sleep holds no CPU, so N stand-ins behave like N independent engines.

Referenced from a topology by import path:

    generators: {mesh: gen, binding: "composer_mesh.actors.backends.generation.fixed_latency:FixedLatencyGenerator",
                 settings: {seconds_per_group: 0.1}}
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from pydantic import BaseModel

from composer_mesh.actors.backends.generation.config import FixedLatencyGeneratorSettings
from composer_mesh.actors.backends.generation.hf_generator import HFGenerator
from composer_mesh.actors.messages import GenerationRequest, RolloutGroup


class FixedLatencyGenerator(HFGenerator):
    """The hf generator whose every request lasts at least `seconds_per_group` x its prompts (real sampling,
    then a sleep for the remainder; `generate` runs in a worker thread of the generator actor)."""

    Settings: ClassVar[type[BaseModel]] = FixedLatencyGeneratorSettings
    settings: FixedLatencyGeneratorSettings

    def __init__(self, settings: FixedLatencyGeneratorSettings | None = None) -> None:
        if settings is None:
            raise ValueError("FixedLatencyGenerator needs settings with seconds_per_group")
        super().__init__(settings)

    def request_seconds(self, request: GenerationRequest) -> float:
        """The least time a request takes: seconds_per_group x its prompts."""
        return self.settings.seconds_per_group * len(request.prompts)

    def generate(
        self, request: GenerationRequest, weight_version: int, refresh: Callable[[], int] | None = None
    ) -> list[RolloutGroup]:
        """The hf generator's rollouts, returned no sooner than `request_seconds(request)` after the call."""
        t0 = time.perf_counter()
        groups = super().generate(request, weight_version, refresh)
        remaining = self.request_seconds(request) - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return groups
