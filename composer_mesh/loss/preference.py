"""Channel 3: trace replay as preference pairs (chosen = a teacher's trace, rejected = the student's).

- DPO (Rafailov et al., arXiv:2305.18290; TRL `DPOTrainer`, loss_type "sigmoid"):
  loss = -log sigmoid(beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))]),
  log-probs summed over completion tokens. Implicit rewards beta * (log pi - log pi_ref).
- SimPO (Meng et al., arXiv:2405.14734; princeton-nlp/SimPO): no reference,
  loss = -log sigmoid(beta * (avg log pi(y_w) - avg log pi(y_l)) - gamma), avg = mean over completion tokens.
  Rewards beta * avg log pi. (The SimPO code's gamma_beta_ratio is gamma / beta.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ReplayPairs:
    """P preference pairs. Per-token log-probs come from the student (with grad); masks mark real tokens."""

    chosen_logps: Tensor  # [P, Tc] student log-probs of the teacher trace's tokens
    chosen_mask: Tensor  # [P, Tc] bool
    rejected_logps: Tensor  # [P, Tr] student log-probs of the student's own trace
    rejected_mask: Tensor  # [P, Tr] bool
    ref_chosen_logps: Tensor | None = None  # [P] reference policy, summed over tokens (DPO only)
    ref_rejected_logps: Tensor | None = None  # [P]
    teachers: list[str] = field(default_factory=list)  # [P] which teacher produced each chosen trace

    def validate(self) -> None:
        """Shapes and lengths agree; errors name the field."""
        p = self.chosen_logps.shape[0] if self.chosen_logps.dim() == 2 else -1
        if self.chosen_logps.dim() != 2:
            raise ValueError(
                f"replay.chosen_logps must be [P, Tc], got shape {tuple(self.chosen_logps.shape)}"
            )
        if self.rejected_logps.dim() != 2 or self.rejected_logps.shape[0] != p:
            raise ValueError(
                f"replay.rejected_logps must be [P={p}, Tr], got shape {tuple(self.rejected_logps.shape)}"
            )
        if self.chosen_mask.shape != self.chosen_logps.shape:
            raise ValueError(
                f"replay.chosen_mask shape {tuple(self.chosen_mask.shape)} != chosen_logps shape "
                f"{tuple(self.chosen_logps.shape)}"
            )
        if self.rejected_mask.shape != self.rejected_logps.shape:
            raise ValueError(
                f"replay.rejected_mask shape {tuple(self.rejected_mask.shape)} != rejected_logps shape "
                f"{tuple(self.rejected_logps.shape)}"
            )
        for name in ("ref_chosen_logps", "ref_rejected_logps"):
            ref = getattr(self, name)
            if ref is not None and tuple(ref.shape) != (p,):
                raise ValueError(f"replay.{name} must be [P={p}], got shape {tuple(ref.shape)}")
        if len(self.teachers) != p:
            raise ValueError(
                f"replay.teachers must name one teacher per pair ({p}), got {len(self.teachers)}"
            )

    @property
    def num_pairs(self) -> int:
        return int(self.chosen_logps.shape[0])


def sequence_logps(token_logps: Tensor, mask: Tensor, average: bool) -> Tensor:
    """Sum (or mean) of per-token log-probs over real tokens, per row."""
    dt = torch.float64 if token_logps.dtype == torch.float64 else torch.float32
    maskf = mask.to(dt)
    total = (token_logps.to(dt) * maskf).sum(-1)
    if average:
        return total / maskf.sum(-1).clamp_min(1.0)
    return total


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair sigmoid DPO loss and the implicit rewards (chosen, rejected), inputs [P] sequence log-probs."""
    chosen_logratios = chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = rejected_logps - ref_rejected_logps.detach()
    losses = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def simpo_loss(
    chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, beta: float, gamma: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair SimPO loss and rewards, inputs [P] length-averaged log-probs; gamma is the absolute margin."""
    losses = -F.logsigmoid(beta * (chosen_avg_logps - rejected_avg_logps) - gamma)
    return losses, beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach()


def replay_metrics(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    losses: Tensor,
    teachers: list[str],
    prefix: str = "replay/",
) -> dict[str, float]:
    """Overall and per-teacher reward accuracy, margin, loss and pair count."""
    out: dict[str, float] = {f"{prefix}pairs": float(losses.numel())}
    if losses.numel() == 0:
        return out
    margins = (chosen_rewards - rejected_rewards).float()
    correct = (margins > 0).float()
    out[f"{prefix}accuracy"] = float(correct.mean())
    out[f"{prefix}margin"] = float(margins.mean())
    for name in sorted(set(teachers)):
        idx = torch.tensor([i for i, t in enumerate(teachers) if t == name], device=losses.device)
        out[f"{prefix}{name}/pairs"] = float(idx.numel())
        out[f"{prefix}{name}/accuracy"] = float(correct[idx].mean())
        out[f"{prefix}{name}/margin"] = float(margins[idx].mean())
        out[f"{prefix}{name}/loss"] = float(losses.detach()[idx].mean())
    return out
