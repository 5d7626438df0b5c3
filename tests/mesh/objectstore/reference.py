"""Hand-computed DiLoCo (float64 outer step) for the worker's model and data, to check the real thing."""

from __future__ import annotations

import copy

import torch

from mesh.objectstore.worker import build_model, inner_step


def reference_diloco(theta0: dict[str, torch.Tensor], replicas: int, sync_every: int, rounds: int,
                     lr: float, momentum: float, nesterov: bool, inner_lr: float) -> dict[str, torch.Tensor]:
    """Plain DiLoCo: Δ = mean_r(θ_global − θ_local,r); buf = Δ, then μ·buf + Δ; θ ← θ − lr·(Δ + μ·buf | buf)."""
    template = build_model(0)
    theta = {k: v.double() for k, v in theta0.items()}
    buf: dict[str, torch.Tensor] = {}
    for t in range(rounds):
        locals_ = []
        for r in range(replicas):
            m = copy.deepcopy(template)
            m.load_state_dict({k: v.float() for k, v in theta.items()})
            opt = torch.optim.SGD(m.parameters(), lr=inner_lr)
            for i in range(sync_every):
                inner_step(m, opt, r, t * sync_every + i)
            locals_.append({k: v.detach().double() for k, v in m.state_dict().items()})
        for k in theta:
            delta = sum(theta[k] - loc[k] for loc in locals_) / replicas
            if momentum:
                buf[k] = delta.clone() if t == 0 else momentum * buf[k] + delta
                update = delta + momentum * buf[k] if nesterov else buf[k]
            else:
                update = delta
            if t == 0:  # sign check of the reference itself: the outer step moves toward the replicas' mean
                mean_local = sum(loc[k] for loc in locals_) / replicas
                cos = torch.nn.functional.cosine_similarity(
                    (-lr * update).flatten(), (mean_local - theta[k]).flatten(), dim=0)
                assert cos > 0.999, f"reference outer step for {k} does not point to the local mean (cos={cos})"
            theta[k] = theta[k] - lr * update
    return theta
