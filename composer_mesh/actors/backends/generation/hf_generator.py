"""The `hf` generator binding: batched sampling with a transformers causal LM on CPU (or one GPU).

Log-prob convention (shared with `composer_mesh.models.sampling` and the vLLM binding): at temperature
T > 0 each completion token is drawn from `softmax(logits / T)` and `Rollout.logprobs[t]` is
`log_softmax(logits / T)[token_t]`, the log-prob under the distribution actually sampled from. At T == 0
decoding is greedy and the log-probs are those of the untempered model, `log_softmax(logits)`.
A completion ends after a stop token (`models.chat.model_stop_ids`: the tokenizer's EOS, the task's end marker,
e.g. ';', the generation config's EOS ids, the chat template's end-of-turn token; the stop token is included in
`completion_ids`, finish_reason "stop") or after `max_new_tokens` ("length"). Prompt ids: `local_model.prompt_ids`
(a chat prompt's messages go through the chat template).
Sampling is seeded per row, like the vLLM binding: rollout j of prompt i (row r = i * samples_per_prompt + j)
samples with seed `s + r` (s the request seed) from its own stream, so the same request seed and weights give
the same rollouts whatever `max_batch` is (up to float rounding of a differently padded batch). A request with
`seeds` (one per prompt, one sample each: an episode's turns) samples prompt i with `seeds[i]`, whatever else
is in the request.
By default weights change only between requests: `load_weights` waits for the request in flight (one lock),
so every token of a request comes from the weights its `weight_version` names. With the setting
`in_flight_weight_updates` the caller passes `generate` a `refresh` callable, run before every forward
(`sampling.sample`): a version pulled while the request runs is loaded between decode steps, each rollout's
`token_versions[t]` names the version that produced token t, and its `weight_version` is the oldest of them
(its policy lag counts from there). The KV cache of tokens decoded under older weights is kept.
Prefix cache (`prefix_cache_mb`, `models.prefix_cache`): the KV of each request's prompts is kept, so an
episode's next turn, which extends its last prompt (`Prompt.prefix_lengths`), prefills only the tokens it adds,
in the chunks a miss would run; loading weights clears it, so every hit was computed by the active weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel

from composer_mesh.actors.backends.generation.config import HF_GENERATOR_CAPABILITIES, HFGeneratorSettings
from composer_mesh.actors.backends.local_model import (
    as_model_config,
    check_generation_request,
    check_weights,
    context_of,
    fitting_prompt_ids,
    prompt_ids,
    stop_ids_for,
    to_distribution,
)
from composer_mesh.actors.messages import (
    GenerationRequest,
    Rollout,
    RolloutGroup,
    SelfTeacherRequest,
    TokenDistribution,
)
from composer_mesh.actors.teacher_topk import resolve_top_k
from composer_mesh.models.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from composer_mesh.models.config import LoraConfig


class HFGenerator:
    """Samples rollouts with a transformers model; `load_weights` swaps weights between requests, or between
    decode steps through `generate`'s `refresh` when `in_flight_weight_updates` is set."""

    Settings: ClassVar[type[BaseModel]] = HFGeneratorSettings
    capabilities: ClassVar[frozenset[str]] = HF_GENERATOR_CAPABILITIES  # takes LoRA adapters alone (lora.sync)

    def __init__(self, settings: HFGeneratorSettings | None = None) -> None:
        self.settings = settings or HFGeneratorSettings()
        self.model: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.stop_ids: list[int] = []
        self._calls = 0
        self.prefix_cache = PrefixCache(self.settings.prefix_cache_mb << 20) if self.settings.prefix_cache_mb else None
        # One generate or load_weights at a time. Re-entrant: a `refresh` run inside generate (same thread)
        # loads the new version through load_weights.
        self._lock = threading.RLock()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, model: Any, adapter: LoraConfig | None = None) -> None:
        """Load `model`; with `adapter`, apply that LoRA (as the trainer does, same initial adapters) and take
        the adapter tensors as this generator's weights: the policy it samples is base + adapters, the
        merged policy, and each update carries the adapters alone."""
        from composer_mesh.models.loading import load_pretrained, named_weights

        cfg = as_model_config(model)
        if self.settings.torch_threads is not None:
            torch.set_num_threads(self.settings.torch_threads)
        self.model, self.tokenizer = load_pretrained(cfg, self.settings.cache_dir, self.settings.device)
        self.model.requires_grad_(False)
        self.stop_ids = stop_ids_for(
            self.tokenizer, cfg, self.settings.stop_at_task_eos, self.model.generation_config
        )
        self._pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0])
        self._vocab = int(self.model.get_output_embeddings().weight.shape[0])
        if adapter is not None:
            from composer_mesh.models.lora import adapter_weights, apply_lora

            apply_lora(self.model, adapter).requires_grad_(False)
        # Views that share storage with the parameters: the adapters alone with `adapter`, else every weight.
        self._targets = adapter_weights(self.model) if adapter is not None else named_weights(self.model)
        self._context = context_of(self.model.config)

    def _require_started(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if self.model is None or self.tokenizer is None:
            raise RuntimeError("HFGenerator: call start(model_config) first")
        return self.model, self.tokenizer

    @property
    def in_flight_updates(self) -> bool:
        """Whether `generate` takes weights mid-request through its `refresh` argument (the setting)."""
        return self.settings.in_flight_weight_updates

    # -- generation --------------------------------------------------------------------------------------
    def generate(
        self, request: GenerationRequest, weight_version: int, refresh: Callable[[], int] | None = None
    ) -> list[RolloutGroup]:
        """Rollouts stamped with `weight_version`; with `in_flight_updates` and a `refresh` (called before every
        forward, returns the active version, may call `load_weights` first) stamped per token instead."""
        from composer_mesh.models.sampling import sample

        model, tokenizer = self._require_started()
        check_generation_request(request)
        ids = [prompt_ids(p, tokenizer, self._vocab, "hf generator", request.max_new_tokens, self._context)
               for p in request.prompts]
        flat = [(i, ids[i]) for i in range(len(ids)) for _ in range(request.samples_per_prompt)]
        seed = request.seed if request.seed is not None else self.settings.seed + self._calls
        self._calls += 1
        row_seeds = list(request.seeds) if request.seeds is not None else list(range(seed, seed + len(flat)))
        if not self.in_flight_updates:
            refresh = None
        outs = []
        with self._lock:
            for start in range(0, len(flat), self.settings.max_batch):
                batch = flat[start : start + self.settings.max_batch]
                outs += sample(
                    model,
                    [p for _, p in batch],
                    max_new_tokens=request.max_new_tokens,
                    temperature=request.temperature,
                    stop_ids=self.stop_ids,
                    pad_id=self._pad_id,
                    seeds=row_seeds[start : start + len(batch)],
                    refresh=refresh,
                    prefix_cache=self.prefix_cache,
                    prefix_lengths=[request.prompts[i].prefix_lengths or [] for i, _ in batch],
                )
        groups = [RolloutGroup(prompt=p, rollouts=[]) for p in request.prompts]
        for (i, p_ids), out in zip(flat, outs):
            versions = out.token_versions  # None unless refresh ran
            groups[i].rollouts.append(
                Rollout(
                    prompt_id=request.prompts[i].prompt_id,
                    prompt_ids=list(p_ids),
                    completion_ids=out.token_ids,
                    logprobs=out.logprobs,
                    weight_version=min(versions or [weight_version]),  # the oldest token's version
                    token_versions=versions,
                    text=tokenizer.decode(out.token_ids, skip_special_tokens=True),
                    finish_reason=out.finish_reason,
                    generator=self.settings.name,
                )
            )
        return groups

    # -- the policy as its own teacher ---------------------------------------------------------------------
    def distributions(self, request: SelfTeacherRequest) -> list[TokenDistribution | None]:
        """The active weights' distributions over each continuation given its prompt (teacher-forced, one
        forward per `max_batch` rows), dense or top-k by `request.top_k` against this model's vocabulary; None
        for one that does not fit the model's context."""
        from composer_mesh.models.sampling import teacher_forced_map

        model, tokenizer = self._require_started()
        k = resolve_top_k(request.top_k, self._vocab)
        ids = fitting_prompt_ids(request.prompts, request.continuations, tokenizer, self._vocab, "hf generator",
                                 self._context)
        rows = [i for i, p in enumerate(ids) if p is not None]
        out: list[TokenDistribution | None] = [None] * len(ids)
        with self._lock:
            for start in range(0, len(rows), self.settings.max_batch):
                batch = rows[start : start + self.settings.max_batch]
                got = teacher_forced_map(model, [ids[i] for i in batch], [request.continuations[i] for i in batch],
                                         pad_id=self._pad_id, fn=lambda r: to_distribution("self", r, k))
                for i, d in zip(batch, got):
                    out[i] = d
        return out

    # -- weights -----------------------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the set the trainer publishes: the LoRA adapters (started with `adapter`),
        else `named_weights(model)`: parameters (tied ones once) + persistent buffers, by state-dict name."""
        self._require_started()
        return {name: (tuple(t.shape), t.dtype) for name, t in self._targets.items()}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The active weights (views of the model's own storage), under the trainer's names."""
        self._require_started()
        return dict(self._targets)

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Copy exactly the `weight_specs()` tensors into the model in place (tied aliases follow).
        Any name, shape or dtype mismatch raises before anything is copied."""
        check_weights(named, self.weight_specs(), "hf generator")
        with self._lock, torch.no_grad():
            for name, t in named.items():
                self._targets[name].copy_(t)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def stats(self) -> dict[str, float]:
        """The prefix cache's counters (`GeneratorActor.stats` adds them to its own)."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else {}
