"""A trainer-role actor that hosts ObjectStoreDiLoCo, for the launcher test (importable: procs load it).

It stands in for TrainerActor (which does not host DiLoCo yet): constructed by `launch` like any role actor
(`Actor(trainer_config)`), it derives its replica id from its rank the way the topology places replicas (the
trainer mesh's procs split evenly between `roles.trainer.replicas`), then trains the tiny worker model.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from monarch.actor import Actor, current_rank, current_size, endpoint

from composer_mesh.actors.configs import TrainerConfig


class DiLoCoTrainerProbe(Actor):
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        replicas = config.replicas
        size = current_size()
        procs = 1
        for v in size.values():
            procs *= v
        self.replica_id = current_rank().rank // (procs // replicas)

    @endpoint
    def ready(self) -> None:
        return None

    @endpoint
    def train(self, outer_steps: int) -> dict[str, Any]:
        import torch

        from composer_mesh.mesh.objectstore.diloco import ObjectStoreDiLoCo
        from mesh.objectstore.worker import build_model, inner_step

        torch.set_num_threads(1)
        cfg = self.config.diloco
        model = build_model(self.replica_id)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = ObjectStoreDiLoCo(model, opt, cfg, self.replica_id)
        step = 0
        with sync:
            while sync.outer_step < outer_steps:
                inner_step(model, opt, self.replica_id, step)
                step += 1
        sync.close()
        h = hashlib.sha256()
        for name, t in sorted(sync.global_state().items()):
            h.update(name.encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        return {"replica": self.replica_id, "pid": os.getpid(), "outer_step": sync.outer_step,
                "digest": h.hexdigest(), "members": [r.members for r in sync.reports],
                "committed": [r.committed for r in sync.reports]}
