"""Weight-sync benchmark: every weight-plane transport side by side, plus a state dict through an endpoint
and an in-process copy.

One trainer proc and up to 4 generator procs (separate proc meshes, one host). For each model size and
generator count, every generator pulls one published version; the time is the wall time, seen by the
controller, until all of them hold it. MB/s is aggregate (generators x model size / time). The methods
alternate within each repetition, so their ratios are comparable even on a shared, noisy machine:

* rdma      one-sided RDMABuffer reads (ibverbs, else Monarch's TCP fallback);
* shm       (--device cpu) memcpy from the trainer's slots in POSIX shared memory;
* cuda_ipc  (--device cuda) device copy from the trainer's slots opened through CUDA IPC handles;
* endpoint  the plane's endpoint transport (safetensors bytes from an actor in the trainer's process);
* state_dict the trainer's endpoint returns its tensors (Monarch pickling), each generator copies them in.

rdma and the same-host transport read the same publisher (`transport: auto` serves both); each generator
forces one per subscriber.

    python benchmarks/bench_weight_sync.py                         # CPU: 16/128/512 MiB x 1/2/4 generators
    python benchmarks/bench_weight_sync.py --sizes 512             # the 512 MiB rows only
    python benchmarks/bench_weight_sync.py --device cuda           # CUDA weights: rdma vs cuda_ipc vs ...
    python benchmarks/bench_weight_sync.py --quick --json out.json # CI size: 16 MiB x 1/2 generators, 2 reps
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
os.environ.setdefault("MONARCH_FILE_LOG", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import monarch
import monarch.actor
import torch
from machine import available_memory_gib, cpu_model, total_memory_gib
from monarch.actor import Actor, endpoint, this_host
from rich.console import Console
from rich.table import Table

from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.plane import WeightPublisher, WeightSubscriber

MIB = 1 << 20
LOCAL = {"cpu": "shm", "cuda": "cuda_ipc"}  # the same-host transport for each device
SEQLOCK = ("rdma", "shm", "cuda_ipc")  # methods served by the `auto` publisher


def model_params(size_mb: int, device: str) -> dict[str, torch.Tensor]:
    """A transformer-like state dict of about `size_mb` MiB: per layer a 2 MiB fp32 matrix, a 1 MiB bf16
    matrix, and small fp32/int64 vectors."""
    params: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    for i in range(size_mb // 3):
        params[f"layers.{i}.mlp.weight"] = torch.randn(512, 1024, generator=g)
        params[f"layers.{i}.attn.weight"] = torch.randn(512, 1024, generator=g).bfloat16()
        params[f"layers.{i}.norm.weight"] = torch.randn(1024, generator=g)
        params[f"layers.{i}.positions"] = torch.arange(64)
    if size_mb % 3:
        params["embed.weight"] = torch.randn(size_mb % 3 * 256, 1024, generator=g)
    return {n: t.to(device) for n, t in params.items()}


def quiet() -> None:
    import warnings

    from monarch.rdma import RDMATcpFallbackWarning

    warnings.filterwarnings("ignore", category=RDMATcpFallbackWarning)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class BenchTrainer(Actor):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.pub: WeightPublisher | None = None
        self.copy_dest: dict[str, torch.Tensor] = {}
        self.device = "cpu"

    @endpoint
    async def setup(self, size_mb: int, config: dict[str, Any], device: str, copy: bool) -> int:
        if self.pub is not None:
            self.pub.close()
        self.pub = None
        self.copy_dest = {}  # only the seqlock block measures the in-process copy; keep peak memory low
        gc.collect()
        if sum(t.nbytes for t in self.params.values()) != size_mb * MIB or self.device != device:
            self.params = model_params(size_mb, device)
        self.device = device
        if copy:
            self.copy_dest = {n: torch.empty_like(t) for n, t in self.params.items()}
        self.pub = WeightPublisher(self.params, WeightPlaneConfig(**config))
        return self.pub.nbytes

    @endpoint
    async def publish(self) -> tuple[Any, float]:
        assert self.pub is not None
        with torch.no_grad():
            for t in self.params.values():  # "an optimizer step"
                t.add_(1)
        _sync(self.device)
        t0 = time.perf_counter()
        manifest = self.pub.publish(self.params)
        return manifest, time.perf_counter() - t0

    @endpoint
    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The naive baseline: return the tensors from an endpoint (Monarch pickles them)."""
        return self.params

    @endpoint
    async def local_copy(self) -> float:
        """Seconds of one in-process copy of the state dict into preallocated tensors."""
        _sync(self.device)
        t0 = time.perf_counter()
        for n, t in self.params.items():
            self.copy_dest[n].copy_(t)
        _sync(self.device)
        return time.perf_counter() - t0


class BenchGenerator(Actor):
    def __init__(self) -> None:
        self.subs: dict[str, WeightSubscriber] = {}
        self.dest: dict[str, torch.Tensor] = {}
        self.device = "cpu"

    @endpoint
    async def reset(self, config: dict[str, Any], methods: list[str], device: str) -> None:
        for sub in self.subs.values():
            sub.close()
        self.subs, self.dest, self.device = {}, {}, device
        gc.collect()
        for m in methods:
            if m != "state_dict":  # each subscriber forces its transport
                self.subs[m] = WeightSubscriber(
                    WeightPlaneConfig(**{**config, "transport": m}), device=device
                )

    @endpoint
    async def pull(self, manifest: Any, method: str) -> tuple[int, str]:
        pulled = await self.subs[method].pull(manifest)
        return pulled.version, pulled.transport

    @endpoint
    async def fetch_state_dict(self, trainer: Any) -> int:
        sd = await trainer.state_dict.call_one()
        if not self.dest:  # a subscriber's staging tensors if one ran (saves memory), else new ones
            last = next((s.last for s in self.subs.values() if s.last is not None), None)
            self.dest = (
                last.tensors
                if last is not None
                else {n: torch.empty_like(t, device=self.device) for n, t in sd.items()}
            )
        for n, t in sd.items():
            self.dest[n].copy_(t)
        _sync(self.device)
        return len(sd)


def hardware(device: str) -> str:
    cpu, mem = cpu_model(), total_memory_gib()
    from monarch.rdma import get_rdma_backend

    knobs = {
        k: os.environ[k]
        for k in ("MONARCH_RDMA_TCP_FALLBACK_PARALLELISM", "MONARCH_RDMA_MAX_CHUNK_SIZE_MB")
        if k in os.environ
    }
    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if device == "cuda" else ""
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM{gpu}; python {platform.python_version()}, "
        f"torch {torch.__version__}, torchmonarch {getattr(monarch, '__version__', '0.7')}, "
        f"rdma backend {get_rdma_backend()}; env {knobs or 'defaults'}"
    )


async def time_method(method: str, sub: Any, trainer: Any, n: int, publish_s: list[float]) -> float:
    """One timed transfer of `method` to the `n` generators of `sub`."""
    if method == "state_dict":
        t0 = time.perf_counter()
        await sub.fetch_state_dict.call(trainer)
        return time.perf_counter() - t0
    manifest, pub_s = await trainer.publish.call_one()
    t0 = time.perf_counter()
    got = list((await sub.pull.call(manifest, method)).values())
    dt = time.perf_counter() - t0
    assert got == [(manifest.version, method)] * n, got
    publish_s.append(pub_s)
    return dt


async def run_block(
    block: list[str],
    size: int,
    args: argparse.Namespace,
    trainer: Any,
    gens: Any,
    out: dict[str, Any],
    console: Console,
) -> int:
    """Time one block of methods (one publisher) for every generator count; medians go into `out`."""
    seqlock = [m for m in block if m in SEQLOCK]
    base = {"bucket_mb": args.bucket_mb, "max_concurrent_reads": args.concurrency, "read_timeout_s": 3600}
    cfg = {**base, "transport": "endpoint" if block == ["endpoint"] else "auto"}
    nbytes = await trainer.setup.call_one(size, cfg, args.device, bool(seqlock))
    for n in args.generators:
        sub = gens.slice(procs=slice(0, n))
        await gens.reset.call(base, block, args.device)  # frees every generator's staging from the last round
        need, have = (4 + max(3, len(seqlock) + 2) * n) * nbytes / 2**30, available_memory_gib()  # staging + messages
        if args.device == "cpu" and need > have - 1.0:  # shared machine: skip rather than get OOM-killed
            console.log(f"{size} MiB, {n} gen, {block}: SKIPPED, needs ~{need:.1f} GiB, {have:.1f} free")
            out["skipped"].append([size, n, block])
            continue
        times: dict[str, list[float]] = {m: [] for m in block}
        for rep in range(args.reps + 1):  # rep 0 warms up (allocates staging, opens segments)
            for method in block:
                pub: list[float] = []
                dt = await time_method(method, sub, trainer, n, pub)
                if rep:
                    times[method].append(dt)
                    out["publish_s"].extend(pub)
            if rep and seqlock:
                out["copy_s"].append(await trainer.local_copy.call_one())
        for method in block:
            med = statistics.median(times[method])
            out["cells"][(method, n)] = med
            console.log(f"{size} MiB, {n} gen, {method}: {med:.3f} s")
    return nbytes


def rows_for(size_mib: float, args: argparse.Namespace, out: dict[str, Any]) -> list[dict[str, Any]]:
    """One result row per generator count (aggregate MB/s per method, ratios against the local transport)."""
    nan = float("nan")
    local = LOCAL[args.device]
    copy = statistics.median(out["copy_s"]) if out["copy_s"] else nan
    pub = statistics.median(out["publish_s"]) if out["publish_s"] else nan
    rows = []
    for n in args.generators:
        secs = {m: out["cells"].get((m, n), nan) for m in args.methods}
        rows.append(
            {
                "mib": size_mib,
                "generators": n,
                "seconds": secs,
                "mb_per_s": {m: n * size_mib / s for m, s in secs.items()},
                "copy_mb_per_s": size_mib / copy,
                "publish_ms": 1000 * pub,
                "local_vs": {m: secs[m] / secs.get(local, nan) for m in args.methods if m != local},
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, console: Console) -> None:
    local = LOCAL[args.device]
    others = [m for m in args.methods if m != local]
    table = Table(title=f"Weight sync ({args.device} weights): aggregate MB/s per transport, side by side")
    cols = ["MiB", "gens", *(f"{m}\nMB/s" for m in args.methods), "in-process\ncopy MB/s"]
    cols += [f"{local} /\n{m}" for m in others if local in args.methods] + [f"{local} s", "publish\nms"]
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        cells = [f"{r['mib']:.0f}", str(r["generators"]), *(f"{r['mb_per_s'][m]:.0f}" for m in args.methods)]
        cells.append(f"{r['copy_mb_per_s']:.0f}")
        if local in args.methods:
            cells += [f"{r['local_vs'][m]:.1f}x" for m in others]
        cells += [f"{r['seconds'].get(local, float('nan')):.3f}", f"{r['publish_ms']:.0f}"]
        table.add_row(*cells)
    console.print(table)
    console.print(hardware(args.device))
    console.print(
        f"median of {args.reps} reps after 1 warm-up; bucket {args.bucket_mb} MiB, {args.concurrency} concurrent "
        "RDMA reads per generator. MB/s (MiB/s) = generators x size / wall time until all generators hold the "
        f"version. rdma and {local} read the same `auto` publisher (each generator forces one); 'endpoint' = "
        "safetensors bytes from an actor in the trainer process; 'state_dict' = the trainer endpoint returns "
        "its tensors and each generator copies them in. 'in-process copy' = one copy_ of the state dict inside "
        f"the trainer. '{local} / X' = X's time / {local}'s time. 'publish ms' = trainer-side copy into a slot."
    )


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    console = Console(width=190)
    failures: list[Any] = []
    monarch.actor.unhandled_fault_hook = failures.append
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        out: dict[str, Any] = {"cells": {}, "publish_s": [], "copy_s": [], "skipped": []}
        nbytes = 0
        # The seqlock transports and state_dict share one `auto` publisher; endpoint needs its own.
        blocks = [[m for m in args.methods if m != "endpoint"], [m for m in args.methods if m == "endpoint"]]
        for b, block in enumerate(filter(None, blocks)):
            # Fresh procs per block, so memory held by the previous block is really returned.
            tag = f"{size}_{b}"
            t_procs = this_host().spawn_procs(
                per_host={"procs": 1}, name=f"bench_trainer_{tag}", bootstrap=quiet
            )
            g_procs = this_host().spawn_procs(
                per_host={"procs": max(args.generators)}, name=f"bench_gens_{tag}", bootstrap=quiet
            )
            trainer = t_procs.spawn("trainer", BenchTrainer)
            gens = g_procs.spawn("gens", BenchGenerator)
            try:
                nbytes = await run_block(block, size, args, trainer, gens, out, console)
            finally:
                await g_procs.stop()
                await t_procs.stop()
        rows += rows_for(nbytes / MIB, args, out)
    print_table(rows, args, console)
    if failures:
        console.print(f"[red]mesh failures: {failures}")
        raise SystemExit(1)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the weights live")
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 512], help="model sizes in MiB")
    p.add_argument("--generators", type=int, nargs="+", default=[1, 2, 4], help="generator counts")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell (after 1 warm-up)")
    p.add_argument("--bucket-mb", type=int, default=WeightPlaneConfig().bucket_mb, help="RDMA chunk size")
    p.add_argument(
        "--concurrency", type=int, default=WeightPlaneConfig().max_concurrent_reads, help="reads in flight"
    )
    p.add_argument(
        "--tcp-parallelism",
        type=int,
        default=None,
        help="sets MONARCH_RDMA_TCP_FALLBACK_PARALLELISM for the procs",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=["rdma", "shm", "cuda_ipc", "endpoint", "state_dict"],
        help="what to run (default: rdma, the device's same-host transport, endpoint, state_dict)",
    )
    p.add_argument("--quick", action="store_true", help="16 MiB, 1 and 2 generators, 2 reps")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.generators, args.reps = [16], [1, 2], 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    args.methods = args.methods or ["rdma", LOCAL[args.device], "endpoint", "state_dict"]
    wrong = {"cpu": "cuda_ipc", "cuda": "shm"}[args.device]
    if wrong in args.methods:
        p.error(f"{wrong} does not apply to --device {args.device}")
    if args.tcp_parallelism is not None:
        os.environ["MONARCH_RDMA_TCP_FALLBACK_PARALLELISM"] = str(args.tcp_parallelism)
    rows = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "hardware": hardware(args.device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
