"""The teacher bindings' settings and capabilities (`hf`, `vllm`, `openrouter`): import-cheap, so that
validating a topology imports neither torch, vllm, httpx nor the bindings (`roles.ROLE_TABLE` names each
binding by import path and its settings from here)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from composer_mesh.actors.backends.config import LocalModelSettings, TorchSettings
from composer_mesh.actors.backends.generation.config import VLLMEngineSettings
from composer_mesh.errors import FieldError
from composer_mesh.models.config import ModelConfig, WarmStartConfig

# "distill": per-token distributions over the student's tokens (channel 2); "replay": full traces (channel 3).
HF_TEACHER_CAPABILITIES: frozenset[str] = frozenset({"distill", "replay"})
VLLM_TEACHER_CAPABILITIES: frozenset[str] = frozenset({"distill", "replay"})
OPENROUTER_CAPABILITIES: frozenset[str] = frozenset({"replay"})


def default_teacher_model() -> ModelConfig:
    """The default teacher: the tiny model warm-started on its task, so it already solves it."""
    return ModelConfig(warmstart=WarmStartConfig(steps=150))


class LocalTeacherSettings(LocalModelSettings):
    """What the hf and vllm teachers' settings share: the teacher model, trace sampling, and the local-model
    settings in the teacher's words."""

    model: ModelConfig = Field(
        default_factory=default_teacher_model,
        description="The teacher model (same schema as the topology's model:). Default: the tiny model "
        "warm-started for 150 SFT steps on the addition task, so it already solves it.",
    )
    trace_temperature: float = Field(0.0, ge=0, description="Sampling temperature of channel-3 traces (0 = greedy).")
    stop_at_task_eos: bool = Field(
        True, description="Traces also stop at the teacher model task's end marker (e.g. ';'), besides EOS."
    )
    cache_dir: str | None = Field(
        None, description="Where the teacher model is materialized (null = $COMPOSER_MESH_CACHE or ~/.cache/composer_mesh)."
    )
    score_batch_tokens: int = Field(
        8192, ge=1, description="Channel-2 scoring: most padded tokens (rows x longest prompt+completion) per "
        "teacher forward (hf) or engine call (vllm); a longer rollout is scored alone. Bounds the logits of one "
        "forward: 8,192 tokens x 151,936 ids is ~2.5 GB in bfloat16.",
    )


class HFTeacherSettings(LocalTeacherSettings, TorchSettings):
    """Settings of the `hf` teacher binding."""

    device: str = Field("cpu", description="torch device: 'cpu', 'cuda', 'cuda:<index>' or 'mps'.")
    torch_threads: int | None = Field(
        1, ge=1, description="torch CPU threads for this process (null = leave torch's default)."
    )
    max_batch: int = Field(64, ge=1, description="Maximum sequences per teacher forward pass.")
    seed: int = Field(0, description="Base seed of trace sampling (call i uses seed + i) when trace_temperature > 0.")


class VLLMTeacherSettings(LocalTeacherSettings, VLLMEngineSettings):
    """Settings of the `vllm` teacher binding: the hf teacher's knobs plus the engine's."""

    model: ModelConfig = Field(
        default_factory=default_teacher_model,
        description="The teacher model (same schema as the topology's model:). Default: the hf teacher's "
        "default, the tiny model warm-started on the addition task so that it already solves it.",
    )


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class OpenRouterSettings(BaseModel):
    """Settings of the `openrouter` teacher binding (the `settings:` of a teachers member)."""

    # hide_input_in_errors: a key pasted into the wrong field must not be echoed by a validation error.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    base_url: str = Field(
        "https://openrouter.ai/api/v1",
        description="Base URL of the OpenAI-compatible API; `/chat/completions` is appended.",
    )
    models: list[str] = Field(
        ...,
        min_length=1,
        description="Teacher model slugs, in preference order (e.g. `openai/gpt-4o-mini`). With "
        "`model_fallback: openrouter` the list is sent as OpenRouter's `models` routing field; with "
        "`client` each model is tried in turn by this client.",
    )
    model_fallback: Literal["openrouter", "client"] = Field(
        "openrouter",
        description="Who walks the `models` list: `openrouter` (one request, OpenRouter's own fallback "
        "routing) or `client` (this client moves to the next model when one fails after its retries, "
        "or returns no log-probs; needed for servers without OpenRouter's `models` field).",
    )
    logprobs: bool = Field(
        True, description="Request per-token log-probs (`logprobs: true`) and check they come back."
    )
    top_logprobs: int = Field(
        5, ge=0, le=20, description="Alternatives per token (`top_logprobs`, 0–20; OpenRouter's range)."
    )
    partial_traces: bool = Field(
        True,
        description="When some prompts of a batch fail (after retries), return the traces of the others (the "
        "failures are counted and logged) instead of raising; a batch where every request fails always raises.",
    )
    missing_logprobs: Literal["error", "flag"] = Field(
        "error",
        description="When log-probs were requested but the response has none: `error` raises "
        "OpenRouterMissingLogprobs (not retried; with `model_fallback: client` the next model is tried); "
        "`flag` keeps the completion, counts it in usage `missing_logprobs` and marks the result.",
    )
    require_parameters: bool = Field(
        True,
        description="Send `provider: {require_parameters: true}` so OpenRouter only routes to providers "
        "that support every request parameter (otherwise log-probs may be silently dropped).",
    )
    max_concurrency: int = Field(8, ge=1, description="Maximum requests in flight at once (per teacher).")
    request_timeout: float = Field(
        60.0, gt=0, description="Seconds allowed per HTTP attempt (connect, send, whole response); a timeout is retried."
    )
    max_retries: int = Field(
        4, ge=0, description="Retries per request after the first attempt (429, 408, 5xx, timeouts, transport errors)."
    )
    backoff_base: float = Field(
        0.5, ge=0, description="First retry delay in seconds; doubles each retry, with jitter (×0.5–1.0)."
    )
    backoff_max: float = Field(30.0, ge=0, description="Upper bound in seconds of one computed backoff delay.")
    retry_after_max: float = Field(
        60.0, ge=0, description="Upper bound in seconds on a server-sent `Retry-After` (seconds or HTTP-date)."
    )
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature sent to the teacher.")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Cap on teacher completion tokens per request; the smaller of this and the caller's "
        "`max_new_tokens` is sent (None: the caller's value).",
    )
    seed: int | None = Field(None, description="Sampling seed sent to the teacher (providers may ignore it).")
    system_prompt: str | None = Field(None, description="Optional system message sent before each prompt.")
    api_key_env: str = Field(
        "OPENROUTER_API_KEY",
        description="NAME of the environment variable that holds the API key (never the key itself).",
    )
    app_title: str | None = Field(
        None, description="Optional attribution header `X-OpenRouter-Title` (app name shown by OpenRouter)."
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str) -> str:
        if not _ENV_NAME.match(v):
            raise ValueError(
                f"api_key_env must be the NAME of an environment variable (letters, digits, _), got a "
                f"value of length {len(v)}; put the key itself in that variable, never in the topology"
            )
        return v

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str]) -> list[str]:
        bad = [i for i, m in enumerate(v) if not m.strip()]
        if bad:
            raise FieldError((bad[0],), "models must be non-empty model slugs such as 'openai/gpt-4o-mini'")
        return v
