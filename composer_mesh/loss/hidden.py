"""The student as hidden states + its output head: log-probs and channel 2 without a [tokens x vocab] tensor.

A causal LM's logits are `hidden @ head.T (+ bias)`. At vocab 151,936 and 1,024 completion tokens the float32
logits of ONE rollout are 622 MB, and autograd keeps them (and their softmax) for backward. `HiddenStates` stands
in for `LossBatch.logits`: every loss quantity is computed chunk by chunk from the hidden states, so at most one
(chunk x vocab) block exists at a time:

- token log-probs (`hidden_token_logprobs`): forward keeps only the log-sum-exp per token; backward recomputes
  each chunk's logits and writes the gradients of the hidden states and of the head (Cut Cross-Entropy,
  arXiv:2411.09009, does the same on GPU kernels).
- channel 2 dense (`hidden_distill_dense`): each chunk's divergence gradient w.r.t. its logits comes from the
  same analytic kernel as the logits path (`distill._chunk_loss_and_grad`) and is pushed through the head
  during forward; backward only scales the result.
- channel 2 top-k (`hidden_topk_logits`): only the k head rows a token needs, under activation checkpointing.

Only the rows where the mask is True are ever computed (padding costs nothing).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from composer_mesh.loss.chunks import DEFAULT_CHUNK_ELEMENTS, chunk_tokens, compute_dtype, flat_chunks
from composer_mesh.loss.distill import (
    DistillOutput,
    DistillParams,
    _chunk_loss_and_grad,
    checked_topk_ids,
    distill_topk_selected,
)


@dataclass
class HiddenStates:
    """Stands in for logits [B, T, V]: logits[b, t] = (hidden[b, t] @ weight.T + bias) * scale.

    The head's matmuls run in `hidden`'s dtype (give bf16 hidden states for bf16 compute, as autocast would
    run the head); log-sum-exps, divergences and their gradients are float32 (float64 for float64 inputs)."""

    hidden: Tensor  # [B, T, H] last hidden state that scores completion token t (grad flows)
    weight: Tensor  # [V, H] the output head (grad flows unless frozen; tied embeddings are fine)
    bias: Tensor | None = None  # [V]
    scale: float = 1.0  # 1 / sampling temperature
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        if self.hidden.dim() != 3:
            raise ValueError(f"HiddenStates.hidden must be [B, T, H], got shape {tuple(self.hidden.shape)}")
        if self.weight.dim() != 2 or self.weight.shape[1] != self.hidden.shape[-1]:
            raise ValueError(
                f"HiddenStates.weight must be [V, H={self.hidden.shape[-1]}], got shape {tuple(self.weight.shape)}"
            )
        if self.bias is not None and tuple(self.bias.shape) != (self.weight.shape[0],):
            raise ValueError(f"HiddenStates.bias must be [V={self.weight.shape[0]}], got {tuple(self.bias.shape)}")

    @property
    def shape(self) -> torch.Size:
        """[B, T, V]: the shape of the logits this stands in for."""
        return torch.Size((*self.hidden.shape[:2], self.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def tokens_per_chunk(self) -> int:
        return chunk_tokens(self.weight.shape[0], self.chunk_elements)

    def logits(self) -> Tensor:
        """The full [B, T, V] logits (with grad): for tests and small vocabularies only."""
        out = self.hidden @ self.weight.to(self.hidden.dtype).T
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out * self.scale


def _head_logits(h: Tensor, w: Tensor, bias: Tensor | None, scale: float, dt: torch.dtype) -> Tensor:
    """[c, V] logits of hidden rows `h` in dtype `dt` (the matmul runs in h's dtype, like the model's head)."""
    z = (h @ w.T).to(dt)
    if bias is not None:
        z.add_(bias.to(dt))
    return z.mul_(scale) if scale != 1.0 else z


def _no_autocast(device: torch.device) -> Any:
    """Inside the custom functions dtypes are chosen explicitly; autocast must not re-cast the matmuls."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else nullcontext()


class _HeadGrads:
    """Gradient buffers of (hidden rows, head weight, head bias) filled chunk by chunk from d loss / d logits."""

    def __init__(self, h: Tensor, weight: Tensor, bias: Tensor | None, needs: tuple[bool, ...], dt: torch.dtype):
        self.h, self.dt = h, dt
        self.w = weight.to(h.dtype)
        self.grad_h = torch.zeros_like(h) if needs[0] else None
        self.grad_w = torch.zeros(weight.shape, dtype=dt, device=h.device) if needs[1] else None
        self.grad_b = torch.zeros(weight.shape[0], dtype=dt, device=h.device) if bias is not None and needs[2] else None

    def add(self, start: int, stop: int, gz: Tensor) -> None:
        """gz [c, V]: d loss / d (unscaled logits) of rows start:stop (the head's scale already applied).

        The matmuls run in the hidden states' dtype (bf16 under mixed precision, like autocast's backward of
        the head); the head's gradient accumulates in float32."""
        g = gz.to(self.h.dtype)
        if self.grad_h is not None:
            self.grad_h[start:stop] = g @ self.w
        if self.grad_w is not None:
            if g.dtype == self.dt:
                self.grad_w.addmm_(g.T, self.h[start:stop])
            else:
                self.grad_w.add_(g.T @ self.h[start:stop])
        if self.grad_b is not None:
            self.grad_b.add_(gz.sum(0))

    def result(self, weight: Tensor, bias: Tensor | None, factor: Tensor | None = None) -> tuple[Tensor | None, ...]:
        out = []
        for g, like in ((self.grad_h, self.h), (self.grad_w, weight), (self.grad_b, bias)):
            if g is not None and like is not None:
                g = g if factor is None else g * factor.to(g.dtype)
                g = g.to(like.dtype)
            out.append(g)
        return tuple(out)


class _HeadLogprobs(torch.autograd.Function):
    """log_softmax(head(h))[id] for flat rows h [N, H], ids [N]; forward keeps only the log-sum-exp."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, scale: float, tokens: int
    ) -> Tensor:
        dt = compute_dtype(h)
        w = weight.to(h.dtype)
        out = torch.empty(h.shape[0], dtype=dt, device=h.device)
        lse = torch.empty_like(out)
        with _no_autocast(h.device):
            for s, e in flat_chunks(h.shape[0], tokens):
                z = _head_logits(h[s:e], w, bias, scale, dt)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                out[s:e] = z.gather(-1, ids[s:e, None]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(h, weight, bias, ids, lse)
        ctx.scale, ctx.tokens = scale, tokens
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        h, weight, bias, ids, lse = ctx.saved_tensors
        grads = _HeadGrads(h, weight, bias, ctx.needs_input_grad[:3], lse.dtype)
        g = grad_out.to(lse.dtype)
        with _no_autocast(h.device):
            for s, e in flat_chunks(h.shape[0], ctx.tokens):
                z = _head_logits(h[s:e], grads.w, bias, ctx.scale, lse.dtype)
                gz = z.sub_(lse[s:e, None]).exp_().mul_(-g[s:e, None])  # -g * softmax
                gz.scatter_add_(-1, ids[s:e, None], g[s:e, None]).mul_(ctx.scale)
                grads.add(s, e, gz)
        return (*grads.result(weight, bias), None, None, None)


def _rows(states: HiddenStates, mask: Tensor) -> Tensor:
    """[N, H] hidden rows where mask (row-major, the order of `tensor[mask]`)."""
    return states.hidden[mask]


def _scatter(values: Tensor, mask: Tensor) -> Tensor:
    """[B, T] tensor with `values` [N] at mask and 0 elsewhere (differentiable)."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask, values)


def hidden_token_logprobs(states: HiddenStates, token_ids: Tensor, mask: Tensor) -> Tensor:
    """[B, T] log-probs of `token_ids` under softmax(logits) at mask positions (0 elsewhere), chunked."""
    mask = mask.bool()
    ids = token_ids.long().clamp_min(0)[mask]
    out = _HeadLogprobs.apply(
        _rows(states, mask), states.weight, states.bias, ids, states.scale, states.tokens_per_chunk()
    )
    return _scatter(out, mask)


class _HeadDistill(torch.autograd.Function):
    """sum_i w_i * D(head(h_i), teacher_i); the gradients of h, head weight and bias are made during forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None, teacher: Tensor, weights: Tensor,
        params: DistillParams, scale: float,
    ) -> tuple[Tensor, ...]:
        dt = compute_dtype(h)
        n = h.shape[0]
        grads = _HeadGrads(h, weight, bias, ctx.needs_input_grad[:3], dt) if any(ctx.needs_input_grad[:3]) else None
        diag = [torch.empty(n, dtype=dt, device=h.device) for _ in range(3)]
        clipped = torch.empty(n, dtype=torch.bool, device=h.device)
        w = weight.to(h.dtype) if grads is None else grads.w  # cast once, not per chunk
        with _no_autocast(h.device):
            for s, e in flat_chunks(n, params.tokens_per_chunk(weight.shape[0])):
                z = _head_logits(h[s:e], w, bias, scale, dt)
                gz = torch.empty_like(z) if grads is not None else None
                loss, entropy, gate, clip = _chunk_loss_and_grad(z, teacher[s:e], params, gz, weights[s:e])
                diag[0][s:e], diag[1][s:e], diag[2][s:e], clipped[s:e] = loss, entropy, gate, clip
                if grads is not None and gz is not None:
                    grads.add(s, e, gz.mul_(scale))
                del z, gz
        ctx.grads, ctx.weight, ctx.bias = grads, weight, bias
        total = (diag[0] * weights).sum()
        ctx.mark_non_differentiable(*diag, clipped)
        return total, *diag, clipped

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_total: Tensor, *_unused: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads: _HeadGrads | None = ctx.grads
        ctx.grads = None
        if grads is None:
            return (None,) * 7
        return (*grads.result(ctx.weight, ctx.bias, grad_total), None, None, None, None)


def hidden_distill_dense(
    states: HiddenStates, teacher_logits: Tensor, sel: Tensor, params: DistillParams, denominator: int | None = None
) -> DistillOutput:
    """`distill.distill_loss_chunked` for a student given as hidden states: same value and gradients."""
    sel = sel.bool()
    n_rows = int(sel.sum())
    dt = compute_dtype(states.hidden)
    weights = torch.full((n_rows,), 1.0 / max(n_rows if denominator is None else denominator, 1), dtype=dt,
                         device=states.device)
    total, per_token, entropy, gate, clipped = _HeadDistill.apply(
        _rows(states, sel), states.weight, states.bias, teacher_logits.detach()[sel], weights, params, states.scale
    )
    return DistillOutput(total, per_token, entropy, gate, clipped, has_entropy=params.entropy_h_max is not None)


def _gathered_logits(h: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, scale: float) -> Tensor:
    """[c, k] logits of h [c, H] at head rows ids [c, k]."""
    z = torch.einsum("ch,ckh->ck", h, weight.to(h.dtype)[ids])
    if bias is not None:
        z = z + bias.to(z.dtype)[ids]
    return z * scale


def hidden_topk_logits(states: HiddenStates, ids: Tensor, sel: Tensor) -> Tensor:
    """[n, k] student logits at the teacher's top-k ids [B, T, k] of the `sel` tokens, from k head rows each.

    Each chunk runs under activation checkpointing, so its [chunk, k, H] gathered head rows are not kept for
    backward."""
    sel = sel.bool()
    h, ids = _rows(states, sel), ids[sel]
    k = max(ids.shape[-1], 1)
    tokens = max(1, states.chunk_elements // (k * h.shape[-1]))
    parts = [
        checkpoint(_gathered_logits, h[s:e], states.weight, states.bias, ids[s:e], states.scale, use_reentrant=False)
        for s, e in flat_chunks(h.shape[0], tokens)
    ]
    if not parts:
        return torch.zeros(0, ids.shape[-1], dtype=compute_dtype(h), device=h.device)
    return torch.cat(parts).to(compute_dtype(h))


def hidden_distill_topk(
    states: HiddenStates, topk_ids: Tensor, topk_logprobs: Tensor, sel: Tensor, params: DistillParams,
    denominator: int | None = None,
) -> DistillOutput:
    """`distill.distill_loss_topk` for a student given as hidden states: only the k head rows a token needs."""
    sel = sel.bool()
    ids = checked_topk_ids(topk_ids, topk_logprobs, sel, states.shape[-1])
    return distill_topk_selected(hidden_topk_logits(states, ids, sel), topk_logprobs.detach()[sel], params, denominator)
