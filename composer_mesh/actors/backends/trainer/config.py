"""The trainer bindings' settings (`HFTrainerSettings`) and capabilities: import-cheap, so that validating a
topology imports neither torch nor the binding (`roles.ROLE_TABLE` names the binding by import path and its
settings from here)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field

from composer_mesh.actors.backends.config import TorchSettings
from composer_mesh.models.config import LoraConfig

Beta = Annotated[float, Field(ge=0, lt=1)]  # an AdamW beta: a decay rate

HF_TRAINER_CAPABILITIES: frozenset[str] = frozenset({"sharded"})  # FSDP2 over procs_per_replica procs


Precision = Literal["fp32", "bf16-mixed", "bf16", "fp64"]


class HFTrainerSettings(TorchSettings):
    device: str = Field("cpu", description="torch device of the policy: 'cpu', 'cuda', 'cuda:<index>' or 'mps'.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads in the trainer process.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the inner optimizer.")
    lr_decay_steps: int | None = Field(
        None, ge=1,
        description="Cosine-decay the learning rate from `lr` to `lr * lr_min_ratio` over this many optimizer "
        "steps, then hold it there (e.g. run.steps, so the last steps make small moves and the final weights do not "
        "land on a noisy step). null = constant `lr`. The schedule follows the trainer's step, so --resume continues it.",
    )
    lr_min_ratio: float = Field(
        0.1, ge=0, le=1, description="The decayed learning rate as a fraction of `lr` (with `lr_decay_steps`)."
    )
    lr_warmup_steps: int = Field(
        0, ge=0,
        description="Raise the learning rate linearly from lr / lr_warmup_steps to `lr` over this many first optimizer "
        "steps (then `lr_decay_steps` applies, counted from step 0). Adam's first steps move every weight by about "
        "`lr` whatever its gradient; a policy fresh from a short warm start can lose a skill to them. 0 = none.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.99), description="AdamW betas, each in [0, 1) (torch refuses others "
                                     "when the trainer starts).")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this (None: off).")
    reference_model: bool = Field(
        True,
        description="Keep a frozen copy of the initial policy for the KL term and DPO reference log-probs (with "
        "lora: no copy, the base model with the adapters disabled). Without it those terms are off.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train low-rank adapters (peft LoRA) instead of the whole model: the base weights stay frozen, "
        "AdamW and the trainer state hold only the adapters, and the end-of-run checkpoint holds the merged model "
        "plus the adapter under adapter/. Needs peft (the 'lora' extra); not with DiLoCo. null = full fine-tuning.",
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1,
        description="Token budget of one forward/backward: the step is cut into micro-batches of at most this many "
        "tokens (rows x longest row, or the packed total), gradients accumulate, and every loss normalisation is "
        "the whole batch's. A single sequence longer than the budget still runs alone. null = one pass.",
    )
    packing: bool = Field(
        False,
        description="Padding-free: pack a micro-batch's sequences into one row with per-sequence position ids "
        "(transformers then masks attention per sequence). Saves the padding's compute and memory.",
    )
    precision: Precision = Field(
        "fp32",
        description="'fp32'; 'bf16-mixed': bf16 autocast compute, float32 master weights and AdamW state; "
        "'bf16': weights, gradients and AdamW state in bf16 (half the memory, lossy updates); 'fp64': everything in "
        "float64, for checking exactness (a sharded replica against one process), not for training. "
        "Loss math is float32 in every case.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward (less memory, ~1/3 more compute)."
    )
    attn_implementation: str | None = Field(
        None,
        description="transformers attention kernel of the policy ('sdpa', 'eager', 'flash_attention_2', ...; "
        "null = the model's default). With packing, sdpa and eager build a dense [L, L] block-diagonal mask "
        "per packed row; flash_attention_2 runs packed rows as variable-length sequences.",
    )
    fsdp_reshard_after_forward: bool = Field(
        True,
        description="Sharded replicas (procs_per_replica > 1): free each layer's gathered parameters after its forward "
        "and gather them again in backward (FSDP2's default: least memory). false keeps them from forward to backward "
        "(one all-gather fewer per layer and step, the full layer held meanwhile).",
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description="Sharded replicas: keep the parameter, gradient and AdamW shards in host memory (FSDP2 "
        "CPUOffloadPolicy); each layer's parameters come to the device for its forward and backward.",
    )
    lm_head: Literal["chunked", "full"] = Field(
        "chunked",
        description="'chunked': only completion positions' hidden states reach the LM head, and log-probs and "
        "channel 2 are computed from them chunk by chunk (no [tokens x vocab] tensor). 'full': the model's own "
        "forward computes logits for every position (needed for heads that transform logits, e.g. soft-capping).",
    )


def scheduled_lr(settings: HFTrainerSettings, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): `lr`, cosine-decayed over `lr_decay_steps` to
    `lr * lr_min_ratio` when that is set, times a linear warm-up over the first `lr_warmup_steps`. A pure function
    of the step, so a resumed trainer continues the schedule."""
    warm = min(1.0, (step + 1) / settings.lr_warmup_steps) if settings.lr_warmup_steps else 1.0
    if settings.lr_decay_steps is None:
        return settings.lr * warm
    frac = min(step, settings.lr_decay_steps) / settings.lr_decay_steps
    floor = settings.lr * settings.lr_min_ratio
    return (floor + (settings.lr - floor) * 0.5 * (1 + math.cos(math.pi * frac))) * warm
