"""The generator bindings' settings and capabilities (`hf`, `vllm`, the fixed-latency stand-in) and the vLLM
engine's settings the vllm teacher shares: import-cheap, so that validating a topology imports neither torch,
vllm nor the bindings (`roles.ROLE_TABLE` names each binding by import path and its settings from here)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from composer_mesh.actors.backends.config import LocalModelSettings, TorchSettings

# Both generators take LoRA adapters alone from the weight plane (`lora.sync: adapter`).
# "adapters": takes LoRA adapters alone (lora.sync: adapter); "self_teacher": scores continuations given a prompt
# (`distributions`: the policy as its own teacher for targeted feedback, run.rollout.hints).
HF_GENERATOR_CAPABILITIES: frozenset[str] = frozenset({"adapters", "self_teacher"})
VLLM_GENERATOR_CAPABILITIES: frozenset[str] = frozenset({"adapters", "self_teacher"})
# vLLM's allowed `max_lora_rank` values (its MaxLoRARanks): an adapter of a larger rank cannot be served.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class HFGeneratorSettings(LocalModelSettings, TorchSettings):
    """Settings of the `hf` generator binding."""

    max_batch: int = Field(64, ge=1, description="Maximum sequences sampled together in one batch.")
    seed: int = Field(
        0, description="Base sampling seed for requests without a seed (call i uses seed + i, so runs are reproducible)."
    )
    name: str = Field("hf", description="Label written into Rollout.generator (e.g. to tell generators apart).")
    in_flight_weight_updates: bool = Field(
        False,
        description=(
            "Apply a weight version pulled while a request runs between its decode steps instead of at the next "
            "request. Each rollout then carries token_versions (the version that produced each token) and its "
            "weight_version is its oldest token's, from which its policy lag counts. The KV cache computed by "
            "older weights is kept (no recompute). False: every token of a request comes from one version."
        ),
    )
    prefix_cache_mb: int = Field(
        256,
        ge=0,
        description=(
            "MiB of prompt KV kept so that an episode's next turn (its last prompt + the turn + the environment's "
            "reply) prefills only what it adds, and the samples of one prompt prefill it once. Cleared whenever "
            "the weights change (as the vllm binding's prefix cache); least recently used out first. 0: off."
        ),
    )


EngineDType = Literal["auto", "float32", "bfloat16", "float16"]


class VLLMEngineSettings(BaseModel):
    """Settings of one vLLM engine (`LLM(...)` arguments and the env vars set before importing vllm)."""

    model_config = ConfigDict(extra="forbid")

    dtype: EngineDType = Field(
        "auto",
        description="Engine dtype: 'auto' (the model's ModelConfig dtype), 'float32', 'bfloat16' or 'float16'.",
    )
    max_model_len: int | None = Field(
        None, ge=8, description="Longest prompt + completion in tokens; null = the model's max_position_embeddings."
    )
    max_num_seqs: int = Field(64, ge=1, description="Most sequences the engine schedules at once.")
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=2**20,
        description=(
            "KV-cache size in bytes. null = 256 MiB on CPU (vLLM-CPU would otherwise take most of host RAM, "
            "~12 GiB per engine) and vLLM's gpu_memory_utilization sizing on GPU. The env var "
            "VLLM_CPU_KVCACHE_SPACE (GiB), when set, overrides this on CPU."
        ),
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU only: fraction of GPU memory vLLM may use (weights + KV cache)."
    )
    enforce_eager: bool = Field(
        True, description="Run eagerly (no CUDA graphs / torch.compile): faster start, slower steady state."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV of shared prompt prefixes (it is reset after every weight push)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine shards the model over.")
    seed: int = Field(
        0,
        description="Engine seed, and base sampling seed of requests without one (call i uses seed + i). "
        "The in-process engine also seeds this process' global RNGs with it.",
    )
    in_process: bool = Field(
        True,
        description=(
            "Run the engine core in this process (sets VLLM_ENABLE_V1_MULTIPROCESSING=0): ~3 s start instead of "
            "~25 s and weights pass to the worker by reference. False = vLLM's engine-core subprocess; weights are "
            "then sent as safetensors bytes."
        ),
    )
    logging_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="vLLM's log level (VLLM_LOGGING_LEVEL), applied when vllm is first imported."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further keyword arguments for vllm.LLM(...) (e.g. quantization); they override the above.",
    )

    @field_validator("engine_args")
    @classmethod
    def _no_reserved_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = {"model", "tokenizer", "worker_extension_cls", "logprobs_mode"}
        bad = sorted(reserved & set(v))
        if bad:
            raise ValueError(f"engine_args may not set {bad}: the binding sets them itself")
        return v


class VLLMGeneratorSettings(LocalModelSettings, VLLMEngineSettings):
    """Settings of the `vllm` generator binding (engine settings plus the hf generator's sampling knobs)."""

    name: str = Field("vllm", description="Label written into Rollout.generator (e.g. to tell generators apart).")
    # The largest LoRA rank the binding serves with `lora.sync: adapter` (read by validation, `check_lora`).
    max_adapter_rank: ClassVar[int] = VLLM_LORA_RANKS[-1]


class FixedLatencyGeneratorSettings(HFGeneratorSettings):
    """Settings of the fixed-latency stand-in: the hf generator's, plus its cost model."""

    seconds_per_group: float = Field(
        ...,
        gt=0,
        description=(
            "The stand-in's cost model: each request takes at least seconds_per_group x its prompts, like an "
            "engine whose throughput is known. For capacity planning and orchestration tests on machines that "
            "cannot run the real generator at scale."
        ),
    )
