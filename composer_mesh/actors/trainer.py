"""TrainerActor: hosts `compose_loss` through its binding and publishes weights on the weight plane.

`TrainerService` (plain Python) does the work: binding (a `TrainerBackend`, e.g. `HFTrainer`) + `WeightPublisher`
+ version. The weight version is the publisher's and nobody else's: version 1 is the initial policy, each
`train_step` publishes the next, and metrics and checkpoints are stamped with it.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from monarch.actor import endpoint

from composer_mesh.actors.backends.trainer.base import TrainerBackend
from composer_mesh.actors.configs import TrainerConfig
from composer_mesh.actors.digest import weights_digest
from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.actors.position import actor_position
from composer_mesh.actors.role_actor import RoleActor
from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.plane import WeightManifest, WeightPublisher


class TrainerService:
    """A trainer binding plus its weight publisher."""

    def __init__(self, backend: TrainerBackend, weights: WeightPlaneConfig) -> None:
        self.backend = backend
        self.weights_config = weights
        self.shard: Any = None  # this proc's `ShardGroup` in a sharded replica (set by `start`)
        self._version = 0  # the version count of a rank that does not publish
        self.publisher: WeightPublisher | None = None
        self.last_publish_s = 0.0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="trainer-state-writer")
        self._writes: list[tuple[str, Future[None]]] = []  # full-state writes not yet reported

    def start(self, model: Any, loss: Any, temperature: float, diloco: Any = None, replica_id: int = 0,
              seed: int = 0, shard: Any = None, on_nonfinite: str = "stop") -> None:
        """Start the binding (with `shard`: as one rank of a sharded replica; with `on_nonfinite: skip`, skipping
        non-finite steps), then seed the process's RNGs (torch, Python, NumPy) from the run's seed and the
        replica: what building the model consumed (a cold or a warm model cache) must not change the run."""
        import random

        import numpy as np
        import torch

        self.shard = shard
        # A binding that cannot shard (or skip) never sees the argument it has no use for.
        options = ({} if shard is None else {"shard": shard}) | (
            {"on_nonfinite": on_nonfinite} if on_nonfinite != "stop" else {})
        self.backend.start(model, loss, temperature=temperature, diloco=diloco, replica_id=replica_id, **options)
        rng_seed = seed * 1_000_003 + replica_id
        torch.manual_seed(rng_seed)
        random.seed(rng_seed)
        np.random.seed(rng_seed % 2**32)

    def rejoin(self, model: Any, loss: Any, temperature: float, diloco: Any, replica_id: int, seed: int,
               round_id: int, first_version: int, shard: Any = None) -> tuple[int, WeightManifest | None]:
        """`start` in place of dead DiLoCo replica `replica_id` (with `shard`: as one rank of it), heal at round
        `round_id` (`HFTrainer.rejoin`) and publish the healed weights as the version of the step they end;
        returns that step and the manifest (None on a rank that does not publish)."""
        self.start(model, loss, temperature, diloco, replica_id, seed, shard)
        step = int(self.backend.rejoin(round_id))
        return step, self.publish(version=first_version + step)

    def publish(self, version: int | None = None) -> WeightManifest | None:
        """Copy the current weights into the next slot of the plane (registered once, on first use), as the next
        version or as `version` (a resumed run's). A rank that does not publish gathers with the others and
        returns None."""
        t0 = time.perf_counter()
        named = self.backend.named_weights()
        if not self.publishes:  # join the gathers of a sharded replica's weights, keeping none of them
            for name in named:
                named[name]
            self._version = self._version + 1 if version is None else version
            self.last_publish_s = time.perf_counter() - t0
            return None
        if self.publisher is None:
            self.publisher = WeightPublisher(named, self.weights_config)
        manifest = self.publisher.publish(named, version)
        self.last_publish_s = time.perf_counter() - t0
        return manifest

    @property
    def version(self) -> int:
        return self.publisher.version if self.publisher is not None else self._version

    def train_step(self, batch: TrainBatch) -> tuple[TrainMetrics, WeightManifest | None]:
        """One optimizer step, then publish: the plane's version is the one weight-version counter."""
        t0 = time.perf_counter()
        metrics = self.backend.train_step(batch)
        # collected after the step: a step the backend refuses (e.g. a non-finite loss) leaves the finished writes
        # to `flush_states`, so the checkpoints written before it can still commit
        metrics.states_written = self._collect_writes(wait=False)
        manifest = self.publish()
        metrics.weight_version = self.version
        metrics.metrics["publish_s"] = self.last_publish_s
        metrics.metrics["train_step_s"] = time.perf_counter() - t0  # the trainer's own time (no messaging)
        return metrics, manifest

    def save_state(self, url: str, wait: bool = True) -> str:
        """The binding's full training state (`HFTrainer.snapshot_state`), stamped with the published weight version.

        `wait=False` keeps writing off the training path: the state is copied now and written by a background
        thread; the next `train_step` reports it in `TrainMetrics.states_written` (or raises its failure), and
        `flush_states` waits for it. One write at a time: a new save first waits for the previous write."""
        if self._writes:
            self._writes[-1][1].exception()  # wait; its error is raised when collected
        snapshot = self.backend.snapshot_state(extra={"weight_version": self.version})
        self._writes.append((url, self._writer.submit(self.backend.write_state, url, snapshot)))
        if wait:
            self.flush_states()
        elif self.shard is not None:
            # A sharded replica's ranks each write their own shards: rank 0 reports the state written (in a later
            # step) only once every rank's part is, so every rank finishes its write before it trains on.
            self._writes[-1][1].exception()
        return url

    @property
    def publishes(self) -> bool:
        """Rank 0 of a replica publishes; the other ranks of a sharded replica only join the weights' gathering
        (`named_weights` is a collective there) and count the versions."""
        return self.shard is None or self.shard.rank == 0

    def flush_states(self) -> list[str]:
        """Wait for every background state write; the URLs written since the last report."""
        return self._collect_writes(wait=True)

    def _collect_writes(self, wait: bool) -> list[str]:
        """URLs of finished writes (all of them with `wait`); a failed write raises, naming its URL."""
        done = []
        while self._writes and (wait or self._writes[0][1].done()):
            url, future = self._writes.pop(0)
            error = future.exception()
            if error is not None:
                raise RuntimeError(f"writing the trainer state to {url} failed: {type(error).__name__}: {error}") from error
            done.append(url)
        return done

    def load_state(self, url: str) -> WeightManifest | None:
        """Continue from `save_state`'s state: load it and publish its weights under the version it had."""
        extra = self.backend.load_state(url)
        return self.publish(version=int(extra["weight_version"]))

    def save_checkpoint(self, directory: Path) -> Path:
        """The binding's checkpoint, stamped with the published weight version."""
        return Path(self.backend.save_checkpoint(directory, self.version))

    def close(self) -> None:
        try:
            self.flush_states()
        finally:
            self._writer.shutdown(wait=True)
        self.backend.close()
        if self.publisher is not None:
            self.publisher.close()


class TrainerActor(RoleActor[TrainerService]):
    """The policy trainer (one per proc of the trainer mesh; replicas > 1 sync through DiLoCo)."""

    def __init__(self, config: TrainerConfig) -> None:
        super().__init__()
        self.config = config

    @endpoint
    async def rendezvous(self) -> str:
        """A "host:port" on this proc's host where a sharded replica whose rank 0 this is can meet (the
        controller asks rank 0 and hands the address to every rank's `setup`)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{socket.gethostname()}:{port}"

    @endpoint
    async def setup(self, address: str | None = None) -> WeightManifest | None:
        """Build model, optimizer and loss; publish the initial policy as version 1. A replica of several procs
        (`procs_per_replica`) is sharded: its ranks meet at `address` (its rank 0's `rendezvous`)."""
        cfg = self.config
        shard = self.shard_group(address)
        service = TrainerService(cfg.binding.build(), cfg.weights)
        await asyncio.to_thread(service.start, cfg.model, cfg.loss, cfg.temperature, cfg.diloco, self.replica_id(),
                                cfg.seed, shard, cfg.on_nonfinite)
        self._service = service
        return await asyncio.to_thread(service.publish)

    def shard_group(self, address: str | None) -> Any:
        """This proc's `ShardGroup` in its replica, or None for a replica of one proc."""
        cfg = self.config
        if cfg.procs_per_replica == 1:
            return None
        if address is None:
            raise ValueError(f"trainer replica of {cfg.procs_per_replica} procs: setup needs its rank 0's rendezvous "
                             "address")
        from composer_mesh.actors.backends.trainer.sharding import ShardGroup

        rank, _ = actor_position()
        return ShardGroup(rank % cfg.procs_per_replica, cfg.procs_per_replica, address)

    @endpoint
    async def rejoin(self, replica_id: int, round_id: int, first_version: int, address: str | None = None,
                     shard_rank: int = 0) -> tuple[int, WeightManifest | None]:
        """`setup` on a one-proc mesh in place of DiLoCo replica `replica_id`, whose proc died: the weights are
        the survivors' global parameters of round `round_id` from the store. Returns the step they end (the
        controller replays the replica's later batches) and their manifest. A sharded replica's stand-ins are
        one-proc meshes each, so each is told its rank in the replica (`shard_rank`) and where they meet."""
        cfg = self.config
        shard = None
        if cfg.procs_per_replica > 1:
            from composer_mesh.actors.backends.trainer.sharding import ShardGroup

            if address is None:
                raise ValueError("a sharded replica's stand-in needs its rank 0's rendezvous address")
            shard = ShardGroup(shard_rank, cfg.procs_per_replica, address)
        service = TrainerService(cfg.binding.build(), cfg.weights)
        step, manifest = await asyncio.to_thread(service.rejoin, cfg.model, cfg.loss, cfg.temperature, cfg.diloco,
                                                 replica_id, cfg.seed, round_id, first_version, shard)
        self._service = service
        return step, manifest

    def replica_id(self) -> int:
        """This proc's replica: a replica is `procs_per_replica` consecutive procs of the mesh."""
        rank, procs = actor_position()
        cfg = self.config
        if procs != cfg.replicas * cfg.procs_per_replica:
            raise ValueError(
                f"trainer mesh {cfg.mesh!r} has {procs} procs for {cfg.replicas} replica(s) of "
                f"{cfg.procs_per_replica} proc(s) each (binding {cfg.binding.name!r}): set the mesh's "
                f"hosts x procs_per_host to roles.trainer.replicas x roles.trainer.procs_per_replica"
            )
        return rank // cfg.procs_per_replica

    @endpoint
    async def train_step(self, batch: TrainBatch) -> tuple[TrainMetrics, WeightManifest | None]:
        """One optimizer step on `batch`; returns metrics and the manifest of the new version."""
        return await asyncio.to_thread(self.service.train_step, batch)

    @endpoint
    async def version(self) -> int:
        return self.service.version

    @endpoint
    async def save_state(self, url: str, wait: bool = True) -> str:
        """Write the full training state under `url` (any fsspec URL); `wait=False` copies it now and writes it
        in the background (see `TrainerService.save_state`)."""
        return await asyncio.to_thread(self.service.save_state, url, wait)

    @endpoint
    async def flush_states(self) -> list[str]:
        """Wait for the background state writes; the URLs written since the last report."""
        return await asyncio.to_thread(self.service.flush_states)

    @endpoint
    async def load_state(self, url: str) -> WeightManifest | None:
        """Resume from `save_state`'s state; returns the manifest of its weights (generators pull it)."""
        return await asyncio.to_thread(self.service.load_state, url)

    @endpoint
    async def save_checkpoint(self, directory: str) -> str:
        return str(await asyncio.to_thread(self.service.save_checkpoint, Path(directory)))

    @endpoint
    async def close(self) -> None:
        """Flush DiLoCo's store writes and release the weight plane's buffers."""
        if self._service is not None:
            await asyncio.to_thread(self._service.close)

    @endpoint
    async def weights_digest(self) -> tuple[int, str]:
        """(version, digest) of the current weights: compare with `GeneratorActor.weights_digest`."""
        svc = self.service
        named = await asyncio.to_thread(svc.backend.named_weights)  # a collective on a sharded replica's ranks
        return svc.version, weights_digest(named)
