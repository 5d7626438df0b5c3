"""GeneratorActor: samples rollouts and swaps in new weights without draining.

The actor is thin: `GeneratorService` (plain Python) owns the backend, the weight subscriber and the
version bookkeeping; endpoints only await it. Generation runs in a worker thread so a weight pull can
proceed while a request is in flight. The pulled version is applied before the next request starts, or,
when the backend takes weights mid-request (`in_flight_updates`, e.g. the hf binding's
`in_flight_weight_updates`), between two decode steps of the request in flight: the service hands the
backend a `refresh` callable that loads a pending version and returns the active one, the rollouts carry
per-token versions and are stamped with their oldest token's version.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from composer_mesh.actors.backends.generation.base import GeneratorBackend
from composer_mesh.actors.configs import GeneratorConfig
from composer_mesh.actors.digest import weights_digest
from composer_mesh.actors.messages import (
    GenerationRequest,
    RolloutGroup,
    SelfTeacherRequest,
    TokenDistribution,
    WeightVersion,
)
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
        self._lock = threading.Lock()  # guards _pending and version (a swap loads the weights under it)
        self._serving = threading.Lock()  # held by a request from swap to last token: its stamps stay exact
        self._pull_lock: asyncio.Lock | None = None  # created on the actor's event loop
        self.last_sync_s = 0.0
        self.requests = 0
        self.forwards = 0  # forward passes of in-flight-update requests (each asks `refresh` first)

    def start(self, model: Any, adapter: Any = None) -> None:
        """Start the backend on `model`; with `adapter` (a LoraConfig: the trainer publishes adapters only) the
        backend applies it and takes adapter tensors as its weights (capability `adapters`)."""
        if adapter is None:
            self.backend.start(model)
        else:
            self.backend.start(model, adapter=adapter)

    def _swap_if_pending(self) -> int:
        """Load a pulled version, if any, into the backend; returns the active version. Under `_lock`, so a
        pull finishing meanwhile waits and `version`/`_pending` never disagree."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                version, tensors = pending
                self.backend.load_weights(tensors)
                self.version = version
            return self.version

    @property
    def in_flight_updates(self) -> bool:
        """Whether the backend takes a new version between decode steps of a request (`refresh`)."""
        return bool(getattr(self.backend, "in_flight_updates", False))

    def generate(self, request: GenerationRequest) -> list[RolloutGroup]:
        """Apply any pulled version first, then sample stamped with that version; with an in-flight backend,
        versions pulled meanwhile are applied between decode steps (rollouts stamped per token)."""
        with self._serving:
            version = self._swap_if_pending()
            self.requests += 1
            if self.in_flight_updates:
                groups = self.backend.generate(request, version, refresh=self._refresh)
            else:
                groups = self.backend.generate(request, version)
        for g in groups:
            for r in g.rollouts:
                r.generator = self.name
        return groups

    def _refresh(self) -> int:
        """Before each forward of an in-flight request: apply a pulled version; the active one."""
        self.forwards += 1
        return self._swap_if_pending()

    def distributions(self, request: SelfTeacherRequest) -> tuple[int, list[TokenDistribution | None]]:
        """The policy as its own teacher: the active weights' distributions over each continuation (pulled weights
        applied first; None for one that does not fit the model's context), and that weight version. A backend
        without the `self_teacher` capability refuses."""
        score = getattr(self.backend, "distributions", None)
        if score is None:
            raise NotImplementedError(f"{type(self.backend).__name__} cannot score continuations (the self_teacher "
                                      "capability: run.rollout.hints needs an hf or vllm generator)")
        with self._serving:
            version = self._swap_if_pending()
            return version, score(request)

    async def update(self, manifest: WeightManifest) -> WeightVersion:
        """Pull `manifest` into private staging tensors; it becomes active at the next request (or at the next
        decode step of the request in flight, with an in-flight backend).

        Pulls are serialised (one staging buffer); a manifest not newer than what is held is a no-op."""
        if self._pull_lock is None:
            self._pull_lock = asyncio.Lock()
        async with self._pull_lock:
            return await self._update(manifest)

    async def _update(self, manifest: WeightManifest) -> WeightVersion:
        with self._lock:  # one read of (version, pending): a refresh may pop `_pending` meanwhile
            pending = self._pending
            held = max(self.version, pending[0] if pending is not None else -1)
        if manifest.version <= held:
            return self._answer(self.version)
        if self._subscriber is None:
            # Meta tensors describe the expected names/shapes/dtypes without allocating anything.
            expected = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in self.backend.weight_specs().items()}
            self._subscriber = WeightSubscriber(self.weights_config, expected=expected, name=self.name)
        t0 = time.perf_counter()
        pulled = await self._subscriber.pull(manifest)  # a transport weights.require refuses raises here
        tensors = {k: v.clone() for k, v in pulled.tensors.items()}  # staging views are reused by the next pull
        with self._lock:
            self._pending = (pulled.version, tensors)
        self.last_sync_s = time.perf_counter() - t0
        return self._answer(pulled.version, len(tensors), pulled.nbytes)

    def _answer(self, version: int, num_params: int = 0, num_bytes: int = 0) -> WeightVersion:
        """`update`'s answer: the version, and the transport the weights arrive by (the controller reports it)."""
        choice = self._subscriber.choice if self._subscriber is not None else None
        if choice is None:
            return WeightVersion(version, num_params, num_bytes, generator=self.name)
        return WeightVersion(version, num_params, num_bytes, generator=self.name, transport=choice.used,
                             reason=choice.reason, fallback=choice.fallback)

    def apply_pending_now(self) -> int:
        """Swap now, or as soon as the request in flight finishes (an in-flight backend may already have)."""
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
        await asyncio.to_thread(service.start, self.config.model, self.config.adapter)
        self._service = service
        return name

    @concurrent_endpoint
    async def generate(self, request: GenerationRequest) -> list[RolloutGroup]:
        return await asyncio.to_thread(self.service.generate, request)

    @concurrent_endpoint
    async def distributions(self, request: SelfTeacherRequest) -> tuple[int, list[TokenDistribution | None]]:
        return await asyncio.to_thread(self.service.distributions, request)

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
        backend = getattr(svc.backend, "stats", None)  # a binding's own counters (the hf prefix cache)
        return {"version": float(svc.version), "requests": float(svc.requests), "forwards": float(svc.forwards),
                "last_sync_s": svc.last_sync_s,
                **{k: float(v) for k, v in (backend() if callable(backend) else {}).items()}}
