"""Test actors for the weight plane (an importable module: Monarch children import actor classes by name).

Content is a pure function of (name, shape, dtype, version), so any process can check what it pulled
bitwise without shipping the trainer's tensors back.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from monarch.actor import Actor, endpoint

from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.plane import WeightPublisher, WeightSubscriber
from composer_mesh.mesh.weights.shm import segment_names

Spec = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype name)


def model_spec(layers: int = 6, width: int = 96) -> Spec:
    """Many tensors of mixed dtypes and odd sizes, incl. a scalar and an empty buffer (~2.2 MB)."""
    spec: Spec = {
        "embed.weight": ((500, width), "float32"),
        "pos.weight": ((64, width), "bfloat16"),
        "step": ((), "int64"),
        "empty_buffer": ((0,), "float32"),
    }
    for i in range(layers):
        p = f"layers.{i}."
        spec[p + "attn.qkv.weight"] = ((3 * width, width), "bfloat16")
        spec[p + "attn.qkv.bias"] = ((3 * width,), "float16")
        spec[p + "attn.out.weight"] = ((width, width), "float32")
        spec[p + "mlp.up.weight"] = ((4 * width, width), "float32")
        spec[p + "mlp.down.weight"] = ((width, 4 * width), "float16")
        spec[p + "norm.weight"] = ((width,), "float64")
        spec[p + "rope.positions"] = ((33,), "int64")
        spec[p + "mask"] = ((7, 5), "bool")
        spec[p + "token_ids"] = ((17,), "int32")
        spec[p + "bytes"] = ((13,), "uint8")
    spec["lm_head.weight"] = ((500, width), "float32")  # published from a transposed (non-contiguous) view
    return spec


def expected_tensor(name: str, shape: tuple[int, ...], dtype: str, version: int) -> torch.Tensor:
    """Deterministic content of `name` at `version`; floats include NaN, -0.0 and inf (bitwise checks)."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 10_007 + version)
    if dt.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
        flat = t.view(-1)
        for i, v in enumerate((float("nan"), -0.0, float("inf"))):
            if flat.numel() > i:
                flat[i] = v
        return t
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low, high = (0, 256) if dt == torch.uint8 else (-(2**31), 2**31 - 1)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dt)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def mismatches(tensors: Mapping[str, torch.Tensor], spec: Spec, version: int) -> list[str]:
    """Names whose content is not exactly `expected_tensor(..., version)`."""
    return [
        n
        for n, (shape, dt) in spec.items()
        if not bitwise_equal(tensors[n], expected_tensor(n, shape, dt, version))
    ]


def fill(params: dict[str, torch.Tensor], spec: Spec, version: int) -> None:
    with torch.no_grad():
        for n, (shape, dt) in spec.items():
            params[n].copy_(expected_tensor(n, shape, dt, version))


class SlowPublisher(WeightPublisher):
    """Writes half the tensors, then waits for `release` before writing the rest: a publish frozen midway."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slow = False
        self.half_done = threading.Event()
        self.release = threading.Event()

    def _write_slot(self, slot: int, params: Mapping[str, torch.Tensor]) -> None:
        if not self.slow:
            return super()._write_slot(slot, params)
        names = list(params)
        super()._write_slot(slot, {n: params[n] for n in names[: len(names) // 2]})
        self.half_done.set()
        self.release.wait(timeout=60)
        super()._write_slot(slot, {n: params[n] for n in names[len(names) // 2 :]})


class PlaneTrainer(Actor):
    """Holds parameters filled per version and a publisher over them."""

    def __init__(self, spec: Spec, config: dict[str, Any], device: str = "cpu") -> None:
        self.spec = spec
        self.params: dict[str, torch.Tensor] = {}
        for n, (shape, dt) in spec.items():
            if n == "lm_head.weight":  # non-contiguous source tensor
                self.params[n] = torch.zeros(shape[::-1], dtype=getattr(torch, dt), device=device).t()
            else:
                self.params[n] = torch.zeros(shape, dtype=getattr(torch, dt), device=device)
        self.pub = SlowPublisher(self.params, WeightPlaneConfig(**config))
        self._slow_task: asyncio.Task[Any] | None = None

    @endpoint
    async def info(self) -> dict[str, Any]:
        """Where the publisher lives and which shared-memory segments it holds (leak checks)."""
        return {"pid": os.getpid(), "id": self.pub.id, "offers": self.pub.offers, "segments": segment_names(self.pub.id)}

    @endpoint
    async def close(self) -> list[str]:
        """Close the publisher; returns its shared-memory segments still present (expected: none)."""
        self.pub.close()
        return segment_names(self.pub.id)

    def _publish_next(self) -> Any:
        fill(self.params, self.spec, self.pub.version + 1)
        return self.pub.publish(self.params)

    @endpoint
    async def publish(self) -> Any:
        return self._publish_next()

    @endpoint
    async def publish_many(self, n: int, pause_s: float) -> list[int]:
        """Publish n versions back to back (yielding between them); returns the versions."""
        out = []
        for _ in range(n):
            out.append(self._publish_next().version)
            await asyncio.sleep(pause_s)
        return out

    @endpoint
    async def begin_slow_publish(self) -> int:
        """Start publishing the next version and return once half its tensors are written."""
        self.pub.slow = True
        self.pub.half_done.clear()
        self.pub.release.clear()
        fill(self.params, self.spec, self.pub.version + 1)
        self._slow_task = asyncio.ensure_future(asyncio.to_thread(self.pub.publish, self.params))
        await asyncio.to_thread(self.pub.half_done.wait, 60)
        return self.pub.version + 1

    @endpoint
    async def finish_slow_publish(self) -> Any:
        assert self._slow_task is not None
        self.pub.release.set()
        manifest = await self._slow_task
        self.pub.slow = False
        return manifest

    @endpoint
    async def bad_publish(self) -> str:
        """Publish tensors whose shape differs from the registered layout; returns the error text."""
        params = dict(self.params)
        params["embed.weight"] = torch.zeros(3, 3)
        try:
            self.pub.publish(params)
        except ValueError as e:
            return str(e)
        return "no error"


class PlaneGenerator(Actor):
    """A generator stand-in: model tensors, a subscriber, and a request loop that swaps weights between
    requests while pulls run concurrently."""

    def __init__(self, spec: Spec, config: dict[str, Any], device: str = "cpu") -> None:
        self.spec = spec
        self.device = device
        self.config = WeightPlaneConfig(**config)
        self.model = {n: torch.zeros(s, dtype=getattr(torch, d), device=device) for n, (s, d) in spec.items()}
        self.sub = WeightSubscriber(self.config, expected=self.model, device=device)
        self.pulling: WeightSubscriber | None = None  # `start_pull`'s subscriber while it pulls
        self.pull_task: asyncio.Task[dict[str, Any]] | None = None

    @endpoint
    async def sync(self, manifest: Any, latest: bool = False) -> dict[str, Any]:
        """Pull, check the staged copy and then the applied model bitwise against the pulled version."""
        pulled = await self.sub.pull(manifest, latest=latest)
        bad_staged = mismatches(pulled.tensors, self.spec, pulled.version)
        applied = self.sub.apply_to(self.model)
        return {
            "version": pulled.version,
            "retries": pulled.retries,
            "transport": pulled.transport,
            "reason": self.sub.transport_reason,
            "used": self.sub.choice.used if self.sub.choice else None,
            "fallback": self.sub.choice.fallback if self.sub.choice else None,
            "bad_staged": bad_staged,
            "bad_model": mismatches(self.model, self.spec, applied),
        }

    @endpoint
    async def pull_with(self, manifest: Any, overrides: dict[str, Any]) -> dict[str, Any]:
        """Pull with a fresh subscriber using config overrides (e.g. allow_newer=False)."""
        return await self._pull_report(manifest, overrides)

    async def _pull_report(self, manifest: Any, overrides: dict[str, Any]) -> dict[str, Any]:
        sub = WeightSubscriber(self.config.model_copy(update=overrides), expected=self.model, device=self.device)
        self.pulling = sub
        try:
            pulled = await sub.pull(manifest)
            return {
                "version": pulled.version,
                "retries": pulled.retries,
                "transport": pulled.transport,
                "reason": sub.transport_reason,
                "used": sub.choice.used if sub.choice else None,
                "fallback": sub.choice.fallback if sub.choice else None,
                "bad_staged": mismatches(pulled.tensors, self.spec, pulled.version),
            }
        finally:
            sub.close()

    @endpoint
    async def start_pull(self, manifest: Any) -> None:
        """`pull_with(manifest, {})` started in the actor's background and answered at once: an actor serves one
        call at a time, so only then can `torn_reads` be asked while the pull runs; `pulled` awaits its report."""
        self.pulling = None
        self.pull_task = asyncio.create_task(self._pull_report(manifest, {}))

    @endpoint
    async def torn_reads(self) -> int:
        """Reads of the running `start_pull` that overlapped a publish so far (0 before it reads)."""
        return self.pulling.torn_reads if self.pulling is not None else 0

    @endpoint
    async def pulled(self) -> dict[str, Any]:
        return await self.pull_task

    @endpoint
    async def expect_other_spec(self, manifest: Any, spec: Spec) -> str:
        """Pull into a subscriber that expects `spec`; returns the error text."""
        expected = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in spec.items()}
        try:
            await WeightSubscriber(self.config, expected=expected, device=self.device).pull(manifest)
        except ValueError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    @endpoint
    async def serve_while_syncing(self, manifest: Any, n_requests: int, step_s: float) -> dict[str, Any]:
        """Run `n_requests` fake generation requests (each a few awaited steps over the model) while a
        background task keeps pulling the newest version. Weights change only between requests."""
        done = False
        pulls: list[tuple[int, float, float, list[str]]] = []

        async def puller() -> None:
            while not done:
                t0 = time.monotonic()
                pulled = await self.sub.pull(manifest, latest=True)
                pulls.append(
                    (
                        pulled.version,
                        t0,
                        time.monotonic(),
                        mismatches(pulled.tensors, self.spec, pulled.version),
                    )
                )
                # One staging buffer: wait until the request loop has swapped this version in.
                while not done and self.sub.version != self.sub.staged_version:
                    await asyncio.sleep(step_s / 2)

        task = asyncio.ensure_future(puller())
        requests = []
        try:
            for _ in range(n_requests):
                self.sub.maybe_apply(self.model)  # request boundary: swap in the staged version, if newer
                version = self.sub.version
                t0 = time.monotonic()
                for _ in range(3):  # "decode steps"
                    await asyncio.sleep(step_s)
                bad = mismatches(self.model, self.spec, version) if version is not None else []
                requests.append((version, t0, time.monotonic(), bad))
        finally:
            done = True
            await task
        return {"requests": requests, "pulls": pulls}
