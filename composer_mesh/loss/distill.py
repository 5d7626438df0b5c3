"""Channel 2: per-token divergence from the student to a teacher distribution, computed in chunks.

Divergence (GKD, Agarwal et al. arXiv:2306.13649 Eq. 1, TRL's `generalized_jsd_loss` convention):
P = teacher, Q = student, both softmax(logits / temperature), M = beta*P + (1-beta)*Q,

    JSD_beta = beta*KL(P||M) + (1-beta)*KL(Q||M);  beta=0 -> KL(P||Q) (forward),  beta=1 -> KL(Q||P) (reverse).

Wrappers:
- TAID (Shing et al., arXiv:2501.16937, SakanaAI/TAID `taid.py`): the target P is replaced by
  softmax((1-t)*sg(student_logits) + t*teacher_logits) (in temperature-scaled logit space). t=0 -> target is the
  detached student (loss and gradient 0); t=1 -> plain distillation.
- Entropy-aware OPD (Jin et al., arXiv:2603.07079): adds gate(H_teacher) * KL(P||Q) to the base divergence,
  gate = 1[H > h_max] ("hard") or clamp(H/h_max, 0, 1) ("linear"). With sdpo_jsd_beta=1 the base is the
  reverse-KL OPD term of the paper.

Memory: the dense path is a custom autograd function. Its forward walks over the distilled tokens
`chunk` at a time, computes each token's divergence and its analytic gradient w.r.t. the student logits, and writes
the gradient rows into ONE buffer shaped like the logits (the gradient autograd would produce anyway). Only a
(chunk x vocab) float32 working set exists besides the logits, the teacher logits and that buffer. Backward just
scales the buffer. `distill_loss_naive` is the straightforward full-materialisation reference (tests, benchmark).

Gradient used (per token, w.r.t. s = logits/temperature, q = softmax(s), p = target, lm = log M):
  d JSD_beta / d q_v = (1-beta) * (log q_v - lm_v)   (0 < beta < 1)
  forward KL: q - p;  reverse KL: q * (log q - log p - KL(Q||P));  softmax chain: g_s = q * (g - sum_v q_v g_v).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from composer_mesh.loss.chunks import DEFAULT_CHUNK_ELEMENTS, chunk_tokens, compute_dtype
from composer_mesh.loss.config import LossConfig


@dataclass(frozen=True)
class DistillParams:
    """The numeric knobs of one channel-2 evaluation (resolved from LossConfig and the TAID state)."""

    beta: float = 0.5
    temperature: float = 1.0
    token_clip: float | None = None
    taid_t: float | None = None  # None = no TAID
    entropy_h_max: float | None = None  # None = no entropy-aware OPD term
    entropy_gate: str = "hard"
    chunk_tokens: int | None = None  # None = chunk_elements // vocab
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS

    @classmethod
    def from_config(cls, config: LossConfig, taid_t: float | None = None) -> DistillParams:
        return cls(
            beta=config.sdpo_jsd_beta,
            temperature=config.sdpo_temperature,
            token_clip=config.sdpo_token_clip,
            taid_t=taid_t if config.sdpo_wrapper == "taid" else None,
            entropy_h_max=config.entropy_opd_h_max if config.sdpo_wrapper == "entropy_opd" else None,
            entropy_gate=config.entropy_opd_gate,
            chunk_tokens=config.sdpo_chunk_tokens,
            chunk_elements=config.loss_chunk_elements,
        )

    def tokens_per_chunk(self, vocab: int) -> int:
        return chunk_tokens(vocab, self.chunk_elements, self.chunk_tokens)


@dataclass
class DistillOutput:
    """Channel-2 loss (mean over distilled tokens) plus per-token diagnostics (detached)."""

    loss: Tensor  # scalar, differentiable w.r.t. the student logits
    per_token: Tensor  # [n] divergence per distilled token (after clipping)
    teacher_entropy: Tensor  # [n] entropy of the (temperature-scaled) teacher per distilled token
    gate: Tensor  # [n] entropy-OPD gate per token (zeros when the wrapper is off)
    clipped: Tensor  # [n] bool, token divergence hit sdpo_token_clip
    has_entropy: bool = True  # False when the dense path skipped the teacher entropy (not entropy-OPD)

    def metrics(self, prefix: str = "sdpo/") -> dict[str, float]:
        n = self.per_token.numel()
        if n == 0:
            return {f"{prefix}tokens": 0.0}
        out = {
            f"{prefix}tokens": float(n),
            f"{prefix}divergence_mean": float(self.per_token.mean()),
            f"{prefix}gate_frac": float(self.gate.mean()),
            f"{prefix}clipped_frac": float(self.clipped.float().mean()),
        }
        if self.has_entropy:
            out[f"{prefix}teacher_entropy"] = float(self.teacher_entropy.mean())
        return out


# --------------------------------------------------------------------------------------------------------------
# reference (differentiable, full materialisation) per-token divergence — used by the sparse top-k path,
# by the naive reference and by the tests
# --------------------------------------------------------------------------------------------------------------


def _entropy_gate(entropy: Tensor, params: DistillParams) -> Tensor:
    assert params.entropy_h_max is not None
    if params.entropy_gate == "hard":
        return (entropy > params.entropy_h_max).to(entropy.dtype)
    return (entropy / params.entropy_h_max).clamp(0.0, 1.0)


def token_divergence(
    student_logits: Tensor, teacher_logits: Tensor, params: DistillParams
) -> tuple[Tensor, ...]:
    """Per-token channel-2 divergence with plain autograd. Inputs [..., V] (teacher logits or log-probs).

    Returns (loss [...], teacher_entropy [...], gate [...], clipped [...]).
    """
    dt = compute_dtype(student_logits)
    s = student_logits.to(dt) / params.temperature
    t_scaled = teacher_logits.to(dt) / params.temperature
    ls = torch.log_softmax(s, dim=-1)
    teacher_lp = torch.log_softmax(t_scaled, dim=-1)
    teacher_entropy = -(teacher_lp.exp() * teacher_lp).sum(-1).detach()
    if params.taid_t is not None:
        target_lp = torch.log_softmax((1.0 - params.taid_t) * s.detach() + params.taid_t * t_scaled, dim=-1)
    else:
        target_lp = teacher_lp
    target_lp = target_lp.detach()
    beta = params.beta
    if beta == 0.0:
        loss = (target_lp.exp() * (target_lp - ls)).sum(-1)
    elif beta == 1.0:
        loss = (ls.exp() * (ls - target_lp)).sum(-1)
    else:
        lm = torch.logaddexp(target_lp + math.log(beta), ls + math.log1p(-beta))
        loss = beta * (target_lp.exp() * (target_lp - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(
            -1
        )
    gate = torch.zeros_like(teacher_entropy)
    if params.entropy_h_max is not None:
        gate = _entropy_gate(teacher_entropy, params)
        fkl = (teacher_lp.exp() * (teacher_lp - ls)).sum(-1)
        loss = loss + gate * fkl
    clipped = torch.zeros_like(loss, dtype=torch.bool)
    if params.token_clip is not None:
        clipped = (loss > params.token_clip).detach()
        loss = torch.where(clipped, loss.detach().clamp(max=params.token_clip), loss)
    return loss, teacher_entropy, gate, clipped


def distill_loss_naive(
    student_logits: Tensor,
    teacher_logits: Tensor,
    weights_mask: Tensor,
    params: DistillParams,
    denominator: int | None = None,
) -> DistillOutput:
    """Reference: full (tokens x vocab) materialisation with autograd. Sum over tokens where weights_mask,
    divided by their count (or by `denominator`, the whole batch's count, for a micro-batch)."""
    loss_tok, entropy, gate, clipped = token_divergence(student_logits, teacher_logits, params)
    sel = weights_mask.bool()
    n = sel.sum().clamp_min(1) if denominator is None else max(denominator, 1)
    loss = (loss_tok * sel).sum() / n
    return DistillOutput(loss, loss_tok[sel].detach(), entropy[sel], gate[sel].detach(), clipped[sel])


# --------------------------------------------------------------------------------------------------------------
# chunked dense path with analytic gradient
# --------------------------------------------------------------------------------------------------------------


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product of two [c, V] tensors.

    (a * b).sum(-1) costs a transient [c, V] product, but torch's cascade summation keeps float32 error at
    rounding level; a batched GEMV (bmm) accumulated ~2e-4 absolute error per token at vocab 151,936.
    """
    return (a * b).sum(-1)


def _log_softmax_rows(x: Tensor, inv_t: float) -> Tensor:
    """log_softmax(x * inv_t) in float32 (float64 for float64 x) as a NEW tensor (x, possibly a view of the
    inputs, is never modified)."""
    x32 = x.to(compute_dtype(x))
    if inv_t != 1.0:
        x32 = x32 * inv_t
    return torch.log_softmax(x32, dim=-1)


@torch.no_grad()
def _chunk_loss_and_grad(
    s: Tensor, t: Tensor, params: DistillParams, grad_out: Tensor | None, row_scale: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk of rows [c, V]: per-token loss, teacher entropy, gate, clipped.

    If `grad_out` ([c, V], any float dtype, may be a view into the gradient buffer) is given, it receives
    row_scale[i] * d loss_i / d s_i (the chain rule through the temperature included). `s` and `t` are read only.
    Working set: ~5 float32 [c, V] buffers.
    """
    inv_t = 1.0 / params.temperature
    ls = _log_softmax_rows(s, inv_t)
    q = ls.exp()
    teacher_lp = _log_softmax_rows(t.to(ls.dtype), inv_t)
    teacher_p = teacher_lp.exp()
    eopd = params.entropy_h_max is not None
    entropy = -_rowdot(teacher_p, teacher_lp) if eopd else torch.zeros(s.shape[0], dtype=ls.dtype, device=s.device)
    gate = _entropy_gate(entropy, params) if eopd else torch.zeros_like(entropy)
    fkl_teacher = None
    if eopd:
        fkl_diff = teacher_lp - ls
        fkl_teacher = _rowdot(teacher_p, fkl_diff)  # KL(teacher || student)
        del fkl_diff
    # target of the divergence
    if params.taid_t is not None and params.taid_t != 1.0:
        # log_softmax((1-t)*s + t*teacher); per-row constants cancel, so log-probs can stand in for logits
        tt = params.taid_t
        if eopd:
            mixed = teacher_lp.mul(tt)
        else:
            mixed = teacher_lp.mul_(tt)
            del teacher_lp, teacher_p  # not needed again: free before the target is built
        target_lp = torch.log_softmax(mixed.add_(ls, alpha=1.0 - tt), dim=-1)
        del mixed
        p = target_lp.exp()
    else:
        target_lp, p = teacher_lp, teacher_p
    direct = grad_out is not None and grad_out.dtype == ls.dtype and grad_out.is_contiguous()
    g: Tensor | None = None
    beta = params.beta
    # Sums are taken over elementwise differences (never as differences of large sums such as sum p log p,
    # which cancel badly in float32 at vocab ~150k).
    if beta == 0.0:  # forward KL(P||Q); d/ds = q - p
        diff = target_lp - ls
        loss = _rowdot(p, diff)
        del diff
        if grad_out is not None:
            g = torch.sub(q, p, out=grad_out) if direct else q - p
    elif beta == 1.0:  # reverse KL(Q||P); d/ds = q * (ls - lp - loss)
        g0 = torch.sub(ls, target_lp, out=grad_out) if direct else ls - target_lp
        loss = _rowdot(q, g0)
        if grad_out is not None:
            g = g0.sub_(loss.unsqueeze(-1)).mul_(q)
    else:
        # M = beta*P + (1-beta)*Q = (1-beta) * M',  M' = Q + beta/(1-beta) * P,  log M = log M' + c
        c = math.log1p(-beta)
        lm = torch.add(q, p, alpha=beta / (1.0 - beta)).clamp_min_(1e-38).log_()  # log M'
        g0 = torch.sub(ls, lm, out=grad_out) if direct else ls - lm  # log q - log M'
        b0 = _rowdot(q, g0)  # KL(Q||M) = b0 - c
        a0 = _rowdot(p, torch.sub(target_lp, lm, out=lm))  # KL(P||M) = a0 - c
        loss = beta * a0 + (1.0 - beta) * b0 - c
        if grad_out is not None:
            # d/ds = (1-beta) * q * (g' - sum q g'),  g' = log q - log M = g0 - c
            g = g0.sub_(b0.unsqueeze(-1)).mul_(q).mul_(1.0 - beta)
    if eopd:
        assert fkl_teacher is not None
        loss = loss + gate * fkl_teacher
        if g is not None and bool((gate > 0).any()):
            g.add_(q.sub_(teacher_p).mul_(gate.unsqueeze(-1)))
    clipped = torch.zeros_like(loss, dtype=torch.bool)
    if params.token_clip is not None:
        clipped = loss > params.token_clip
        loss = loss.clamp(max=params.token_clip)
        if g is not None and bool(clipped.any()):
            g[clipped] = 0.0
    if g is not None and grad_out is not None:
        g.mul_((row_scale * inv_t).unsqueeze(-1))
        if not direct:
            grad_out.copy_(g)
    return loss, entropy, gate, clipped


def _plan_chunks(rows: list[list[int]], step: int) -> list[tuple[int, int]]:
    """Split the (b, t) row list into [start, stop) chunks of <= step rows that never cross a sequence."""
    chunks = []
    start, n = 0, len(rows)
    while start < n:
        b0 = rows[start][0]
        stop = start + 1
        while stop < n and stop - start < step and rows[stop][0] == b0:
            stop += 1
        chunks.append((start, stop))
        start = stop
    return chunks


class _ChunkedDistill(torch.autograd.Function):
    """loss = sum_i w_i * D(student[b_i, t_i], teacher[b_i, t_i]); gradient rows are written during forward.

    Works on the [B, T, V] tensors as given (no flattening), so a non-contiguous student view such as
    `logits[:, prompt_len - 1 : -1]` is never copied: a chunk of consecutive tokens is a view.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, student: Tensor, teacher: Tensor, mask: Tensor, weights: Tensor, params: DistillParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        need_grad = bool(ctx.needs_input_grad[0])
        dev = student.device
        rows = mask.nonzero().tolist()  # row-major (b, t), same order as student[mask]
        n_rows = len(rows)
        grad_buf: Tensor | None = None
        if need_grad:
            full = n_rows == mask.numel()
            alloc = torch.empty if full else torch.zeros
            grad_buf = alloc(student.shape, dtype=student.dtype, device=dev)
        # Outputs are preallocated: small tensors kept alive between the chunks' large temporaries would pin
        # glibc heap pages (measured: +440 MB RSS at 2,048 x 32,000 before this change).
        dt = compute_dtype(student)
        per_token = torch.empty(n_rows, dtype=dt, device=dev)
        entropy = torch.empty(n_rows, dtype=dt, device=dev)
        gate = torch.empty(n_rows, dtype=dt, device=dev)
        clipped = torch.empty(n_rows, dtype=torch.bool, device=dev)
        for start, stop in _plan_chunks(rows, params.tokens_per_chunk(student.shape[-1])):
            b = rows[start][0]
            ts = [r[1] for r in rows[start:stop]]
            w = weights[start:stop]
            t0, t1 = ts[0], ts[-1] + 1
            if t1 - t0 == len(ts):  # consecutive tokens: views, gradient written in place
                g_chunk = grad_buf[b, t0:t1] if grad_buf is not None else None
                out = _chunk_loss_and_grad(student[b, t0:t1], teacher[b, t0:t1], params, g_chunk, w)
            else:
                idx = torch.tensor(ts, device=dev)
                g_tmp = (
                    torch.empty(len(ts), student.shape[-1], dtype=dt, device=dev)
                    if need_grad
                    else None
                )
                out = _chunk_loss_and_grad(student[b, idx], teacher[b, idx], params, g_tmp, w)
                if grad_buf is not None and g_tmp is not None:
                    grad_buf[b, idx] = g_tmp.to(grad_buf.dtype)
                del g_tmp
            per_token[start:stop] = out[0]
            entropy[start:stop] = out[1]
            gate[start:stop] = out[2]
            clipped[start:stop] = out[3]
            del out
        ctx.grad_buf = grad_buf
        total = (per_token * weights).sum()
        ctx.mark_non_differentiable(per_token, entropy, gate, clipped)
        return total, per_token, entropy, gate, clipped

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_total: Tensor, *_unused: Any) -> tuple[Tensor | None, None, None, None, None]:
        grad_buf: Tensor | None = ctx.grad_buf
        ctx.grad_buf = None
        if grad_buf is None:
            return None, None, None, None, None
        if not bool(grad_total == 1):
            grad_buf.mul_(grad_total.to(grad_buf.dtype))
        return grad_buf, None, None, None, None


def distill_loss_chunked(
    student_logits: Tensor,
    teacher_logits: Tensor,
    weights_mask: Tensor,
    params: DistillParams,
    denominator: int | None = None,
) -> DistillOutput:
    """Channel 2 over a dense teacher: mean divergence over tokens where `weights_mask`, chunked (see module doc).
    With `denominator` (the whole batch's distilled-token count, for a micro-batch): sum / denominator.

    student_logits, teacher_logits: [B, T, V] (any strides; the last dim must be contiguous for speed);
    weights_mask: [B, T] bool.
    """
    if student_logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(student_logits.shape)}")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits shape {tuple(teacher_logits.shape)} != logits shape {tuple(student_logits.shape)}"
        )
    if tuple(weights_mask.shape) != tuple(student_logits.shape[:2]):
        raise ValueError(
            f"distill mask shape {tuple(weights_mask.shape)} != logits [B, T] {tuple(student_logits.shape[:2])}"
        )
    mask = weights_mask.bool()
    n_rows = int(mask.sum())
    weights = torch.full(
        (n_rows,), 1.0 / max(n_rows if denominator is None else denominator, 1),
        dtype=compute_dtype(student_logits), device=student_logits.device,
    )
    total, per_token, entropy, gate, clipped = _ChunkedDistill.apply(
        student_logits, teacher_logits.detach(), mask, weights, params
    )
    return DistillOutput(
        total, per_token, entropy, gate, clipped, has_entropy=params.entropy_h_max is not None
    )


def distill_loss_topk(
    student_logits: Tensor,
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    weights_mask: Tensor,
    params: DistillParams,
    denominator: int | None = None,
) -> DistillOutput:
    """Channel 2 over a sparse top-k teacher.

    Both distributions are renormalised on the teacher's k-token support: the teacher's top-k log-probs become
    log_softmax(topk_logprobs / T) and the student's log_softmax(student_logits[ids] / T). The divergence is then
    the same as the dense one over k outcomes; mass the student puts outside the support is not penalised.
    """
    sel = weights_mask.bool()
    ids = checked_topk_ids(topk_ids, topk_logprobs, sel, student_logits.shape[-1])
    student_k = student_logits.gather(-1, ids)[sel]
    return distill_topk_selected(student_k, topk_logprobs.detach()[sel], params, denominator)


def checked_topk_ids(topk_ids: Tensor, topk_logprobs: Tensor, sel: Tensor, vocab: int) -> Tensor:
    """The top-k ids as long, clamped into [0, vocab); raises on ids outside it at distilled positions."""
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"teacher_topk_ids shape {tuple(topk_ids.shape)} != teacher_topk_logprobs shape {tuple(topk_logprobs.shape)}"
        )
    ids = topk_ids.long()
    bad = sel.unsqueeze(-1) & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        raise ValueError(f"teacher_topk_ids has ids outside [0, {vocab}) at distilled positions")
    return ids.clamp(0, vocab - 1)


def distill_topk_selected(
    student_k: Tensor, teacher_k: Tensor, params: DistillParams, denominator: int | None = None
) -> DistillOutput:
    """Channel 2 on the distilled tokens' top-k support: student logits and teacher log-probs, both [n, k]."""
    loss_tok, entropy, gate, clipped = token_divergence(student_k, teacher_k, params)
    n = max(loss_tok.shape[0] if denominator is None else denominator, 1)
    loss = loss_tok.sum() / n
    return DistillOutput(loss, loss_tok.detach(), entropy, gate.detach(), clipped)


# --------------------------------------------------------------------------------------------------------------
# TAID schedule
# --------------------------------------------------------------------------------------------------------------


@dataclass
class TAIDState:
    """What TAID's adaptive schedule carries across steps; the trainer keeps one and passes it every step.

    Mirrors `update_t` of SakanaAI/TAID: t starts at taid_t_start; after each step with loss J_n,
    delta = (J_{n-1} - J_n)/J_{n-1}, m = beta*m + (1-beta)*delta, t <- min(t_end, max(t_lin, t + alpha*sigmoid(m)*(1-t))).
    """

    t: float | None = None
    prev_loss: float | None = None
    momentum: float = 0.0

    def state_dict(self) -> dict[str, float | None]:
        return {"t": self.t, "prev_loss": self.prev_loss, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.t = state["t"]
        self.prev_loss = state["prev_loss"]
        self.momentum = float(state["momentum"] or 0.0)


def taid_linear_t(config: LossConfig, step: int) -> float:
    """t_lin of the linear schedule (t_start before taid_schedule_step, t_end after the last step)."""
    if config.taid_total_steps is None:
        return config.taid_t_start
    frac = (step - config.taid_schedule_step) / config.taid_total_steps
    frac = min(1.0, max(0.0, frac))
    return config.taid_t_start + (config.taid_t_end - config.taid_t_start) * frac


def taid_current_t(config: LossConfig, step: int, state: TAIDState | None) -> float:
    """The t used at `step` (`LossConfig` refuses 'taid' with neither a fixed t nor a schedule)."""
    if config.taid_t is not None:
        return config.taid_t
    t_lin = taid_linear_t(config, step)
    if not config.taid_adaptive:
        return t_lin
    if state is None:
        raise ValueError(
            "state: the adaptive TAID schedule (taid_adaptive=True) needs a TAIDState kept by the trainer "
            "across steps (compose_loss(..., state=TAIDState()))"
        )
    current = config.taid_t_start if state.t is None else state.t
    return min(config.taid_t_end, max(t_lin, current))


def taid_update(config: LossConfig, step: int, state: TAIDState, t_used: float, loss: float) -> None:
    """Advance the adaptive schedule after a step whose channel-2 loss was `loss` (detached)."""
    if not math.isfinite(loss):
        return
    if state.prev_loss is None:
        state.prev_loss = loss
        state.t = t_used
        return
    delta = (state.prev_loss - loss) / (state.prev_loss + 1e-15)
    state.momentum = config.taid_momentum * state.momentum + (1.0 - config.taid_momentum) * delta
    candidate = t_used + config.taid_alpha * (1.0 / (1.0 + math.exp(-state.momentum))) * (1.0 - t_used)
    state.t = min(config.taid_t_end, max(taid_linear_t(config, step + 1), candidate))
    state.prev_loss = loss
