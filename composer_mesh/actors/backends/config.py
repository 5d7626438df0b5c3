"""The settings every binding that runs a local copy of a model shares (the hf and vllm generators and
teachers, the hf trainer): import-cheap, so that validating a topology imports neither torch nor a binding.

The helpers those bindings share (prompt ids, stop ids, request and weight checks) are `local_model.py`'s.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


def check_device(v: str) -> str:
    """A torch device setting: 'cpu', 'cuda', 'cuda:<index>' or 'mps'."""
    if v == "cpu" or v == "cuda" or v.startswith("cuda:") or v == "mps":
        return v
    raise ValueError(f"device {v!r} is not one of 'cpu', 'cuda', 'cuda:<index>', 'mps'")


class LocalModelSettings(BaseModel):
    """What every binding that runs a local copy of a model takes (the hf and vllm generators and teachers):
    where the model is materialized and whether it also stops at its task's end marker.

    The descriptions are the policy's (generators); the teachers reword them (`LocalTeacherSettings`).
    """

    model_config = ConfigDict(extra="forbid")

    stop_at_task_eos: bool = Field(
        True, description="Also stop at the model task's end marker (e.g. ';' for addition), besides the tokenizer's EOS."
    )
    cache_dir: str | None = Field(
        None, description="Where the policy model is materialized (null = $COMPOSER_MESH_CACHE or ~/.cache/composer_mesh)."
    )


class TorchSettings(BaseModel):
    """The torch device and CPU threads of a binding that runs its model with torch in its own process (the
    hf generator, teacher and trainer; a vLLM engine owns both itself). Descriptions are the hf generator's;
    the others override a field's description (and the trainer its type) where theirs differ."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field("cpu", description="torch device of the policy copy: 'cpu', 'cuda', 'cuda:<index>' or 'mps'.")
    torch_threads: int | None = Field(
        1, ge=1, description="torch CPU threads for this process (null = leave torch's default). "
        "1 is fastest for tiny models when several processes share a few cores."
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)
