"""One DiLoCo trainer replica for the multi-process tests: `python -m mesh.objectstore.worker '<json WorkerArgs>'`.

Also importable (threads, reference computation). The model and data are tiny and fully deterministic so a
test can recompute every replica's local trajectory and the outer update by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

IN_DIM, HIDDEN, OUT_DIM, BATCH = 8, 16, 4, 16
_INIT_LOCK = threading.Lock()  # model init uses the global RNG; threads must not interleave


@dataclass
class WorkerArgs:
    store_uri: str
    run_id: str
    replicas: int
    replica_id: int
    out_dir: str
    sync_every: int = 2
    target_outer_steps: int = 2
    require_full_final_round: bool = False  # stop only after a round in which every replica took part
    max_outer_steps: int = 40
    fragments: int = 1
    fragment_sync_delay: int = 0
    quorum_deadline_s: float = 20.0
    compression: str = "none"
    outer: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] = field(default_factory=dict)
    credentials_env: dict[str, str] = field(default_factory=dict)
    bucket_cap_mb: float | None = None
    inner_lr: float = 0.05
    init_seed: int | None = None  # default: replica_id (replicas start apart on purpose)
    step_sleep_s: float = 0.0
    pause_at_outer_step: int | None = None  # sleep pause_s once when this many outer steps are committed
    pause_s: float = 0.0
    poll_interval_s: float = 0.02


def build_model(seed: int) -> nn.Module:
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_DIM))


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica-specific data: replicas must disagree for the average to mean anything."""
    g = torch.Generator().manual_seed(10_000 * (replica + 1) + step)
    x = torch.randn(BATCH, IN_DIM, generator=g)
    w = torch.Generator().manual_seed(7)
    w_true = torch.randn(IN_DIM, OUT_DIM, generator=w)
    return x, torch.tanh(x @ w_true) + 0.1 * (replica + 1)


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, replica: int, step: int) -> None:
    x, y = batch(replica, step)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def make_config(a: WorkerArgs) -> Any:
    from composer_mesh.mesh.objectstore import DiLoCoConfig

    return DiLoCoConfig(
        store_uri=a.store_uri, run_id=a.run_id, replicas=a.replicas, sync_every=a.sync_every,
        fragments=a.fragments, fragment_sync_delay=a.fragment_sync_delay, quorum_deadline_s=a.quorum_deadline_s,
        compression=a.compression, outer_optimizer=a.outer, storage_options=a.storage_options,
        credentials_env=a.credentials_env, bucket_cap_mb=a.bucket_cap_mb, poll_interval_s=a.poll_interval_s,
    )


def run(a: WorkerArgs) -> dict[str, Any]:
    """Train until the stop rule holds; write params, global state and round reports to out_dir."""
    from composer_mesh.mesh.objectstore.diloco import ObjectStoreDiLoCo

    os.makedirs(a.out_dir, exist_ok=True)
    model = build_model(a.replica_id if a.init_seed is None else a.init_seed)
    opt = torch.optim.SGD(model.parameters(), lr=a.inner_lr)
    sync = ObjectStoreDiLoCo(model, opt, make_config(a), a.replica_id)
    tag = f"r{a.replica_id}-{os.getpid()}"
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{a.out_dir}/{tag}.theta0.safetensors")
    start_step = sync.outer_step
    inner = 0
    with sync:
        while True:
            inner_step(model, opt, a.replica_id, inner)
            inner += 1
            if a.step_sleep_s:
                time.sleep(a.step_sleep_s)
            if a.pause_at_outer_step is not None and sync.outer_step == a.pause_at_outer_step and a.pause_s:
                time.sleep(a.pause_s)  # fall rounds behind the others
                a = dataclasses.replace(a, pause_s=0.0)
            rep = sync.last_report
            done = sync.outer_step >= a.target_outer_steps and (
                not a.require_full_final_round or (rep is not None and rep.committed and rep.quorum_id ==
                                                   sync.round_id and len(rep.members) == a.replicas))
            if done and inner % (a.sync_every // a.fragments) == 0:
                break
            if sync.outer_step >= a.max_outer_steps:
                raise RuntimeError(f"replica {a.replica_id}: no full round after {a.max_outer_steps} outer steps")
    sync.close()
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{a.out_dir}/{tag}.final.safetensors")
    save_file(sync.global_state(), f"{a.out_dir}/{tag}.global.safetensors")
    result = {
        "replica": a.replica_id, "pid": os.getpid(), "tag": tag, "start_mode": sync.start_mode,
        "start_step": start_step, "outer_step": sync.outer_step, "round_id": sync.round_id, "inner_steps": inner,
        "reports": [dataclasses.asdict(r) for r in sync.reports],
    }
    with open(f"{a.out_dir}/{tag}.json", "w") as f:
        json.dump(result, f)
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(WorkerArgs(**json.loads(sys.argv[1])))
