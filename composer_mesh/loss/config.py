"""`LossConfig`: the one typed config of the three-channel loss (`loss:` section of a topology).

Every knob lives here with its description; `docs/loss.md` is generated from these fields
(`loss_config_table()`). Defaults follow the papers cited in the descriptions.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from composer_mesh.errors import FieldError

Normalization = Literal["token", "sequence"]
SdpoWrapper = Literal["none", "taid", "entropy_opd"]
DpoVariant = Literal["dpo", "simpo"]
EntropyGate = Literal["hard", "linear"]
OffPolicyCorrection = Literal["none", "tis"]
Credit = Literal["episode", "discounted_return", "turn_group"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "normalization": ("token", "sequence"),
    "sdpo_wrapper": ("none", "taid", "entropy_opd"),
    "dpo_variant": ("dpo", "simpo"),
    "entropy_opd_gate": ("hard", "linear"),
    "off_policy_correction": ("none", "tis"),
    "credit": ("episode", "discounted_return", "turn_group"),
}

# A chunked loss loop holds about this many float32 values per working buffer (see `loss/chunks.py`).
DEFAULT_LOSS_CHUNK_ELEMENTS = 8 * 2**20

_NON_NEGATIVE = (
    "alpha_sdpo",
    "beta_replay",
    "eps_low",
    "eps_high",
    "advantage_eps",
    "kl_beta",
    "dppo_mask_low",
    "dppo_mask_high",
    "taid_alpha",
    "replay_dpo_beta",
    "simpo_beta",
    "simpo_gamma",
)


class LossConfig(BaseModel):
    """Weights and knobs of `compose_loss`: channel 1 (GRPO) + alpha_sdpo * channel 2 + beta_replay * channel 3."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- channel weights -------------------------------------------------------------------------
    alpha_sdpo: float = Field(
        1.0,
        description="Weight of channel 2 (self-distillation divergence to a teacher distribution). "
        "0 switches the channel off globally; it is also off for a batch without teacher inputs (a script's "
        "TrainBatch with no distributions at all gets a TeacherSignalsMissing warning).",
    )
    beta_replay: float = Field(
        1.0,
        description="Weight of channel 3 (multi-teacher trace replay, DPO/SimPO on pairs). "
        "0 switches the channel off globally; it is also off for a batch without replay pairs.",
    )

    # ---- channel 1: GRPO / Dr. GRPO / DAPO / DPPO ------------------------------------------------
    eps_low: float = Field(
        0.2,
        description="PPO clip range below 1: the ratio pi/pi_old is clipped at 1 - eps_low (GRPO, arXiv:2402.03300).",
    )
    eps_high: float = Field(
        0.28,
        description="PPO clip range above 1: clipped at 1 + eps_high. 0.28 = DAPO clip-higher (arXiv:2503.14476); "
        "set equal to eps_low for symmetric PPO clipping.",
    )
    scale_std: bool = Field(
        True,
        description="Divide group-centred rewards by the group std (GRPO). False = Dr. GRPO (arXiv:2503.20783): "
        "advantage = reward - group mean.",
    )
    advantage_eps: float = Field(
        1e-4,
        description="Added to the group std before dividing (TRL's 1e-4), so a zero-variance group gives 0, not NaN.",
    )
    normalization: Normalization = Field(
        "token",
        description="'token': sum of per-token losses / number of unpadded tokens in the batch (DAPO, length-unbiased). "
        "'sequence': mean over tokens of each completion, then mean over completions (original GRPO).",
    )
    kl_beta: float = Field(
        0.0,
        description="Coefficient of the k3 KL estimator to the reference policy (needs ref_logprobs). 0 = off (DAPO).",
    )
    dppo_mask: bool = Field(
        False,
        description="PRIME-RL DPPO masking (arXiv:2602.04879): drop the policy-gradient term of a token whose "
        "probability already moved by more than dppo_mask_high (A>0) or dppo_mask_low (A<=0) from the sampler's.",
    )
    dppo_mask_low: float = Field(
        0.2,
        description="DPPO: mask a token with advantage <= 0 when p_theta - p_old < -dppo_mask_low (a probability difference).",
    )
    dppo_mask_high: float = Field(
        0.2,
        description="DPPO: mask a token with advantage > 0 when p_theta - p_old > dppo_mask_high (a probability difference).",
    )
    off_policy_correction: OffPolicyCorrection = Field(
        "none",
        description="'none': PPO clip of pi_theta/pi_sampler (a token whose ratio left the clip range gives no "
        "gradient). 'tis': decoupled PPO (AReaL, arXiv:2505.24298, eq. 5) with the trainer's current policy, "
        "detached, as the proximal policy and the behaviour weight pi_prox/pi_sampler truncated at tis_cap (TIS, "
        "Yao et al. 2025, https://fengyao.notion.site/off-policy-rl): loss_t = -min(pi_prox/pi_sampler, tis_cap) "
        "* min(r*A, clip(r)*A), r = pi_theta/pi_prox. With one optimizer step per batch r = 1, the clip is "
        "inactive and the gradient is -min(pi_theta/pi_sampler, tis_cap)*A*grad log pi_theta: every token keeps "
        "a truncated gradient, which is what asynchronous training (policy lag > 0) needs. The clip_frac "
        "metrics then count the (inactive) clip of r, not of pi_theta/pi_sampler.",
    )
    tis_cap: float = Field(
        2.0,
        description="TIS truncation C > 0 (off_policy_correction='tis'): the behaviour weight "
        "pi_prox/pi_sampler is capped at C, so a stale token's gradient is at most C*|A|*|grad log pi_theta|.",
    )

    # ---- channel 1: per-turn credit in multi-turn episodes (loss/credit.py) ------------------------
    credit: Credit = Field(
        "episode",
        description="Which advantage each policy token of a multi-turn episode gets (docs/loss.md, 'Per-turn "
        "credit'). The rewards r_k of the episode's policy turns are the environment's per-turn rewards "
        "(Turn.reward, None = 0), with score - sum_k r_k added to the last turn, so they sum to the episode's "
        "score; G_k = sum_{j>=k} credit_gamma^(j-k) r_j is the return from turn k. 'episode': every token gets "
        "the group-normalised episode score (GRPO). 'discounted_return': A_k = (G_k - mean) / (std + "
        "advantage_eps), mean and std those of the group's G_0 (one baseline per group). 'turn_group': G_k "
        "normalised among the group's episodes that have a k-th policy turn (MT-GRPO / GiGPO-style step groups "
        "by turn index); a turn index that only one episode reached gets 0. A rollout without turns is one turn "
        "(r_0 = score): every choice gives it the episode advantage. scale_std and advantage_eps apply to all.",
    )
    credit_gamma: float = Field(
        1.0,
        description="Discount 0 < gamma <= 1 of later turns' rewards in G_k (credit 'discounted_return' and "
        "'turn_group'). With 1 and a reward only at the end, 'discounted_return' equals 'episode'.",
    )

    # ---- channel 2: self-distillation (generalized JSD, TAID, entropy-aware OPD) ------------------
    sdpo_jsd_beta: float = Field(
        0.5,
        description="Generalized JSD interpolation (GKD, arXiv:2306.13649, TRL convention): 0 = forward KL(teacher||student), "
        "1 = reverse KL(student||teacher), in between beta*KL(P||M) + (1-beta)*KL(Q||M), M = beta*P + (1-beta)*Q.",
    )
    sdpo_temperature: float = Field(
        1.0,
        description="Temperature dividing both student and teacher logits before the divergence.",
    )
    sdpo_token_clip: float | None = Field(
        None,
        description="If set, each token's divergence is clamped to at most this value (tokens above it give no "
        "gradient), so a few tokens where teacher and student disagree wildly cannot dominate. None = off.",
    )
    sdpo_wrapper: SdpoWrapper = Field(
        "none",
        description="'none': divergence to the teacher. 'taid': divergence to TAID's interpolated target "
        "softmax((1-t)*sg(student) + t*teacher) (arXiv:2501.16937). 'entropy_opd': divergence plus a forward-KL "
        "term on tokens where the teacher's entropy is high (EOPD, arXiv:2603.07079).",
    )
    loss_chunk_elements: int = Field(
        DEFAULT_LOSS_CHUNK_ELEMENTS,
        description="Working-set size of every chunked loss loop (channel 2, token log-probs, log-probs from hidden "
        "states): a chunk holds about this many float32 values, i.e. loss_chunk_elements // vocab tokens. "
        "The default (8 Mi values, 32 MiB per buffer) is 55 tokens at vocab 151,936 and 262 at 32,000: big enough "
        "that per-chunk overhead does not make chunking slower than the unchunked computation, small enough to "
        "keep its memory far below it.",
    )
    sdpo_chunk_tokens: int | None = Field(
        None,
        description="Override: compute channel 2 over exactly this many tokens at a time instead of "
        "loss_chunk_elements // vocab (null = from loss_chunk_elements).",
    )
    taid_t: float | None = Field(
        None,
        description="TAID: a fixed interpolation t in [0, 1] (0 = target is the detached student, 1 = the teacher). "
        "Overrides the schedule.",
    )
    taid_schedule_step: int = Field(
        0,
        description="TAID: the trainer step at which the linear schedule starts (t = taid_t_start before it).",
    )
    taid_total_steps: int | None = Field(
        None,
        description="TAID: number of steps of the linear schedule t_lin = t_start + (t_end - t_start) * "
        "(step - taid_schedule_step) / taid_total_steps. Required for 'taid' unless taid_t is set.",
    )
    taid_t_start: float = Field(0.4, description="TAID: initial t (paper default 0.4).")
    taid_t_end: float = Field(1.0, description="TAID: final t (paper default 1.0).")
    taid_adaptive: bool = Field(
        True,
        description="TAID: use the paper's adaptive update t <- min(t_end, max(t_lin, t + alpha*sigmoid(m)*(1-t))), "
        "m = momentum of the relative loss improvement. False = the linear schedule only.",
    )
    taid_alpha: float = Field(5e-4, description="TAID adaptive step size alpha (paper default 5e-4).")
    taid_momentum: float = Field(
        0.99,
        description="TAID adaptive momentum beta on the relative loss improvement (paper default 0.99).",
    )
    entropy_opd_h_max: float = Field(
        1.0,
        description="Entropy-aware OPD: teacher-entropy threshold in nats. 'hard' gate adds the forward-KL term "
        "where H_teacher > entropy_opd_h_max; 'linear' gate weighs it by clamp(H_teacher / entropy_opd_h_max, 0, 1).",
    )
    entropy_opd_gate: EntropyGate = Field(
        "hard",
        description="Entropy-aware OPD gate shape: 'hard' (indicator, as the paper's formula) or 'linear' "
        "(clamp(H/h_max), a soft variant).",
    )

    # ---- channel 3: multi-teacher trace replay ------------------------------------------------------
    dpo_variant: DpoVariant = Field(
        "dpo",
        description="'dpo': sigmoid DPO with reference log-probs (arXiv:2305.18290). 'simpo': length-normalised, "
        "reference-free SimPO (arXiv:2405.14734).",
    )
    replay_dpo_beta: float = Field(0.1, description="DPO beta (TRL default 0.1).")
    simpo_beta: float = Field(2.0, description="SimPO beta (paper default 2.0).")
    simpo_gamma: float = Field(
        0.5,
        description="SimPO target margin gamma (absolute, not gamma/beta): loss = -log sigmoid(beta*(avg_w - avg_l) - gamma). "
        "The paper's default gamma/beta = 0.25 with beta = 2 gives 0.5.",
    )

    @field_validator(*_CHOICES, mode="before")
    @classmethod
    def _known_choice(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = _CHOICES[info.field_name]  # type: ignore[index]
        if value not in allowed:
            raise ValueError(f"{info.field_name}={value!r} is not one of {', '.join(map(repr, allowed))}")
        return value

    @field_validator(*_NON_NEGATIVE)
    @classmethod
    def _non_negative(cls, value: float, info: ValidationInfo) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{info.field_name} must be a finite number >= 0, got {value!r}")
        return value

    @field_validator("sdpo_jsd_beta", "taid_t_start", "taid_t_end", "taid_momentum", "dppo_mask_low", "dppo_mask_high")
    @classmethod
    def _unit_interval(cls, value: float, info: ValidationInfo) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{info.field_name} must be in [0, 1], got {value!r}")
        return value

    @field_validator("taid_t")
    @classmethod
    def _taid_t(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"taid_t must be in [0, 1] or null, got {value!r}")
        return value

    @field_validator("sdpo_temperature", "entropy_opd_h_max", "tis_cap")
    @classmethod
    def _positive(cls, value: float, info: ValidationInfo) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{info.field_name} must be a finite number > 0, got {value!r}")
        return value

    @field_validator("sdpo_token_clip")
    @classmethod
    def _token_clip(cls, value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"sdpo_token_clip must be > 0 or null, got {value!r}")
        return value

    @field_validator("sdpo_chunk_tokens", "taid_total_steps", "loss_chunk_elements")
    @classmethod
    def _positive_int(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {value!r}")
        return value

    @field_validator("taid_schedule_step")
    @classmethod
    def _non_negative_int(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"taid_schedule_step must be >= 0, got {value!r}")
        return value

    @field_validator("eps_low")
    @classmethod
    def _eps_low(cls, value: float) -> float:
        if value >= 1.0:
            raise ValueError(f"eps_low must be < 1 (the lower clip bound is 1 - eps_low), got {value!r}")
        return value

    @model_validator(mode="after")
    def _taid_scheduled(self) -> LossConfig:
        """TAID without a fixed t or a schedule has no t to use: refused when the file is read, not at the first
        training step."""
        if self.sdpo_wrapper == "taid" and not self.taid_has_schedule():
            raise FieldError("sdpo_wrapper", "sdpo_wrapper='taid' needs a schedule: set taid_t (fixed) or "
                             "taid_total_steps (linear/adaptive schedule)")
        return self

    @model_validator(mode="after")
    def _taid_order(self) -> LossConfig:
        if self.taid_t_start > self.taid_t_end:
            raise FieldError("taid_t_start", f"taid_t_start ({self.taid_t_start}) must be <= taid_t_end "
                             f"({self.taid_t_end})")
        return self

    @field_validator("credit_gamma")
    @classmethod
    def _gamma(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"credit_gamma must be in (0, 1], got {value!r}")
        return value

    @model_validator(mode="after")
    def _gamma_used(self) -> LossConfig:
        """A discount that nothing reads is a mistake the user should hear about, not a silent no-op."""
        if self.credit == "episode" and self.credit_gamma != 1.0:
            raise FieldError("credit_gamma", f"credit_gamma={self.credit_gamma} has no effect with credit='episode'; "
                             "set credit: discounted_return or turn_group, or leave credit_gamma out")
        return self

    def taid_has_schedule(self) -> bool:
        """True when TAID has a fixed t or a linear/adaptive schedule to follow."""
        return self.taid_t is not None or self.taid_total_steps is not None


def _type_name(annotation: Any) -> str:
    text = str(annotation)
    if text.startswith("typing.Literal"):
        return " \\| ".join(repr(a) for a in annotation.__args__)
    name = getattr(annotation, "__name__", None)
    if name and not text.startswith(("typing.", "types.")) and "|" not in text:
        return str(name)
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")


def config_table(model: type[BaseModel]) -> str:
    """A Markdown table (field | type | default | description) of a pydantic model, for the generated docs."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        default = "required" if field.is_required() else repr(field.default)
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | `{default}` | {description} |")
    return "\n".join(rows)


def loss_config_table() -> str:
    """The knob table of `docs/loss.md` (between the `loss-config-table` markers)."""
    return config_table(LossConfig)


if __name__ == "__main__":
    print(loss_config_table())
