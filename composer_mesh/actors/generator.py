"""GeneratorActor: samples rollouts and swaps in new weights between requests without draining.

The actor is thin: `GeneratorService` (plain Python) owns the backend, the weight subscriber and the
version bookkeeping; endpoints only await it. Generation runs in a worker thread so a weight pull can
proceed while a request is in flight; the pulled version is applied before the next request starts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from composer_mesh.actors.backends.base import GeneratorBackend
from composer_mesh.actors.configs import GeneratorConfig
from composer_mesh.actors.digest import weights_digest
from composer_mesh.actors.messages import GenerationRequest, RolloutGroup, WeightVersion
from composer_mesh.actors.position import actor_position
from composer_mesh.actors.role_actor import RoleActor
from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.plane import WeightManifest, WeightSubscriber


class GeneratorService:
    """Backend + weight subscriber + versioning. `generate` and `update` may overlap."""

    def __init__(self, backend: GeneratorBackend, weights: WeightPlaneConfig, name: str = "generator") -> None:
        self.backend = backend
        self.name = name
        self.weights_config = weights
        self.version = 0
        self._subscriber: WeightSubscriber | None = None
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()  # guards _pending
        self._serving = threading.Lock()  # held by a request from swap to last token: versions stay exact
        self._pull_lock: asyncio.Lock | None = None  # created on the actor's event loop
        self.last_sync_s = 0.0
        self.requests = 0

    def start(self, model: Any) -> None:
        self.backend.start(model)

    def _swap_if_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            version, tensors = pending
            self.backend.load_weights(tensors)
            self.version = version

    def generate(self, request: GenerationRequest) -> list[RolloutGroup]:
        """Apply any pulled version first (between requests), then sample stamped with that version."""
        with self._serving:
            self._swap_if_pending()
            self.requests += 1
            groups = self.backend.generate(request, self.version)
        for g in groups:
            for r in g.rollouts:
                r.generator = self.name
        return groups

    async def update(self, manifest: WeightManifest) -> WeightVersion:
        """Pull `manifest` into private staging tensors; it becomes active at the next request.

        Pulls are serialised (one staging buffer); a manifest not newer than what is held is a no-op."""
        if self._pull_lock is None:
            self._pull_lock = asyncio.Lock()
        async with self._pull_lock:
            return await self._update(manifest)

    async def _update(self, manifest: WeightManifest) -> WeightVersion:
        if manifest.version <= max(self.version, self._pending[0] if self._pending else -1):
            return WeightVersion(version=self.version)
        if self._subscriber is None:
            # Meta tensors describe the expected names/shapes/dtypes without allocating anything.
            expected = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in self.backend.weight_specs().items()}
            self._subscriber = WeightSubscriber(self.weights_config, expected=expected)
        t0 = time.perf_counter()
        pulled = await self._subscriber.pull(manifest)
        tensors = {k: v.clone() for k, v in pulled.tensors.items()}  # staging views are reused by the next pull
        with self._lock:
            self._pending = (pulled.version, tensors)
        self.last_sync_s = time.perf_counter() - t0
        return WeightVersion(version=pulled.version, num_params=len(tensors), num_bytes=pulled.nbytes)

    def apply_pending_now(self) -> int:
        """Swap now, or as soon as the request in flight finishes."""
        with self._serving:
            self._swap_if_pending()
            return self.version


class GeneratorActor(RoleActor[GeneratorService]):
    """One generator per proc of the generators mesh. `generate` and `update_weights` overlap."""

    def __init__(self, config: GeneratorConfig) -> None:
        super().__init__()
        self.config = config

    @endpoint
    async def setup(self) -> str:
        name = f"generator{actor_position()[0]}"
        service = GeneratorService(self.config.binding.build(), self.config.weights, name=name)
        await asyncio.to_thread(service.start, self.config.model)
        self._service = service
        return name

    @concurrent_endpoint
    async def generate(self, request: GenerationRequest) -> list[RolloutGroup]:
        return await asyncio.to_thread(self.service.generate, request)

    @concurrent_endpoint
    async def update_weights(self, manifest: WeightManifest) -> WeightVersion:
        return await self.service.update(manifest)

    @endpoint
    async def version(self) -> int:
        return self.service.apply_pending_now()

    @endpoint
    async def weights_digest(self) -> tuple[int, str]:
        """(version, digest) of the active weights, after applying any pulled version."""
        svc = self.service
        version = svc.apply_pending_now()
        named = getattr(svc.backend, "named_weights", None)
        if named is None:
            raise NotImplementedError(f"{type(svc.backend).__name__} cannot expose its weights for a digest")
        return version, weights_digest(named())

    @endpoint
    async def stats(self) -> dict[str, float]:
        svc = self.service
        return {"version": float(svc.version), "requests": float(svc.requests), "last_sync_s": svc.last_sync_s}
