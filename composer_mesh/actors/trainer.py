"""TrainerActor: hosts `compose_loss` through its binding and publishes weights on the weight plane.

`TrainerService` (plain Python) does the work: binding (e.g. `HFTrainer`) + `WeightPublisher` + version.
The weight version is the publisher's: version 1 is the initial policy, each `train_step` publishes the next.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from monarch.actor import Actor, endpoint

from composer_mesh.actors.digest import weights_digest
from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.actors.position import actor_position
from composer_mesh.mesh.launch import RoleConfig
from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.plane import WeightManifest, WeightPublisher


class TrainerService:
    """A trainer binding plus its weight publisher."""

    def __init__(self, backend: Any, weights: WeightPlaneConfig) -> None:
        self.backend = backend
        self.weights_config = weights
        self.publisher: WeightPublisher | None = None
        self.last_publish_s = 0.0

    def start(self, model: Any, loss: Any, temperature: float, diloco: Any = None, replica_id: int = 0) -> None:
        self.backend.start(model, loss, temperature=temperature, diloco=diloco, replica_id=replica_id)

    def publish(self) -> WeightManifest:
        """Copy the current weights into the next slot of the plane (registered once, on first use)."""
        t0 = time.perf_counter()
        named = self.backend.named_weights()
        if self.publisher is None:
            self.publisher = WeightPublisher(named, self.weights_config)
        manifest = self.publisher.publish(named)
        self.last_publish_s = time.perf_counter() - t0
        return manifest

    @property
    def version(self) -> int:
        return self.publisher.version if self.publisher is not None else 0

    def train_step(self, batch: TrainBatch) -> tuple[TrainMetrics, WeightManifest]:
        metrics = self.backend.train_step(batch)
        manifest = self.publish()
        metrics.weight_version = manifest.version
        metrics.metrics["publish_s"] = self.last_publish_s
        return metrics, manifest

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        if self.publisher is not None:
            self.publisher.close()


class TrainerActor(Actor):
    """The policy trainer (one per proc of the trainer mesh; replicas > 1 sync through DiLoCo)."""

    def __init__(self, config: RoleConfig) -> None:
        self.topology = config.topology
        self.service: TrainerService | None = None

    def _svc(self) -> TrainerService:
        if self.service is None:
            raise RuntimeError("TrainerActor.setup() was not called")
        return self.service

    @endpoint
    async def ready(self) -> bool:
        """Answered once `__init__` succeeded: the launcher waits for it on every actor."""
        return True

    @endpoint
    async def setup(self) -> WeightManifest:
        """Build model, optimizer and loss; publish the initial policy as version 1."""
        topo = self.topology
        service = TrainerService(topo.trainer.build(), topo.weights)
        await asyncio.to_thread(
            service.start, topo.model, topo.loss, topo.run.temperature, topo.diloco, self.replica_id()
        )
        self.service = service
        return service.publish()

    def replica_id(self) -> int:
        """This proc's DiLoCo replica: one trainer proc per replica (the binding trains on one proc)."""
        rank, procs = actor_position()
        replicas = self.topology.trainer.replicas
        if procs != replicas:
            raise ValueError(
                f"trainer mesh {self.topology.trainer.mesh!r} has {procs} procs for {replicas} replica(s); "
                f"binding {self.topology.trainer.binding!r} trains one replica per proc: set the mesh's "
                f"hosts x procs_per_host to roles.trainer.replicas"
            )
        return rank

    @endpoint
    async def train_step(self, batch: TrainBatch) -> tuple[TrainMetrics, WeightManifest]:
        """One optimizer step on `batch`; returns metrics and the manifest of the new version."""
        return await asyncio.to_thread(self._svc().train_step, batch)

    @endpoint
    async def version(self) -> int:
        return self._svc().version

    @endpoint
    async def save_checkpoint(self, directory: str) -> str:
        path = await asyncio.to_thread(self._svc().backend.save_checkpoint, Path(directory))
        return str(path)

    @endpoint
    async def close(self) -> None:
        """Flush DiLoCo's store writes and release the weight plane's buffers."""
        if self.service is not None:
            await asyncio.to_thread(self.service.close)

    @endpoint
    async def weights_digest(self) -> tuple[int, str]:
        """(version, digest) of the current weights: compare with `GeneratorActor.weights_digest`."""
        svc = self._svc()
        return svc.version, weights_digest(svc.backend.named_weights())
