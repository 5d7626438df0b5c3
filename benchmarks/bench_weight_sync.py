"""Weight-sync benchmark: our weight plane vs the state dict through an endpoint vs an in-process copy.

One trainer proc and up to 4 generator procs (separate proc meshes). For each model size and generator
count, every generator pulls one published version; the time is the wall time, seen by the controller,
until all of them hold it. MB/s is aggregate (generators x model size / time). All three methods run side
by side in one run, so the ratios are comparable even on a shared, noisy machine.

    python benchmarks/bench_weight_sync.py            # 16/128/512 MB x 1/2/4 generators
    python benchmarks/bench_weight_sync.py --quick    # 16 MB x 1/2 generators, 2 reps
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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
from machine import cpu_model, total_memory_gib
from monarch.actor import Actor, endpoint, this_host
from rich.console import Console
from rich.table import Table

from composer_mesh.mesh.weights.config import WeightPlaneConfig
from composer_mesh.mesh.weights.plane import WeightPublisher, WeightSubscriber

MIB = 1 << 20


def model_params(size_mb: int) -> dict[str, torch.Tensor]:
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
    return params


def quiet() -> None:
    import warnings

    from monarch.rdma import RDMATcpFallbackWarning

    warnings.filterwarnings("ignore", category=RDMATcpFallbackWarning)


class BenchTrainer(Actor):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.pub: WeightPublisher | None = None
        self.copy_dest: dict[str, torch.Tensor] = {}

    @endpoint
    async def setup(self, size_mb: int, config: dict[str, Any]) -> int:
        if self.pub is not None:
            self.pub.close()
        self.pub = None
        self.copy_dest = {}  # only the plane block measures the in-process copy; keep peak memory low
        gc.collect()
        if sum(t.nbytes for t in self.params.values()) != size_mb * MIB:
            self.params = model_params(size_mb)
        if config["transport"] == "rdma":
            self.copy_dest = {n: torch.empty_like(t) for n, t in self.params.items()}
        self.pub = WeightPublisher(self.params, WeightPlaneConfig(**config))
        return self.pub.nbytes

    @endpoint
    async def publish(self) -> tuple[Any, float]:
        assert self.pub is not None
        with torch.no_grad():
            for t in self.params.values():  # "an optimizer step"
                t.add_(1)
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
        t0 = time.perf_counter()
        for n, t in self.params.items():
            self.copy_dest[n].copy_(t)
        return time.perf_counter() - t0


class BenchGenerator(Actor):
    def __init__(self) -> None:
        self.sub: WeightSubscriber | None = None
        self.dest: dict[str, torch.Tensor] = {}

    @endpoint
    async def reset(self, config: dict[str, Any]) -> None:
        self.sub, self.dest = None, {}
        gc.collect()
        self.sub = WeightSubscriber(WeightPlaneConfig(**config))

    @endpoint
    async def pull(self, manifest: Any) -> int:
        assert self.sub is not None
        return (await self.sub.pull(manifest)).version

    @endpoint
    async def fetch_state_dict(self, trainer: Any) -> int:
        sd = await trainer.state_dict.call_one()
        if not self.dest:  # the plane's staging tensors if it ran (saves memory), else new ones
            last = self.sub.last if self.sub is not None else None
            self.dest = last.tensors if last is not None else {n: torch.empty_like(t) for n, t in sd.items()}
        for n, t in sd.items():
            self.dest[n].copy_(t)
        return len(sd)


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def hardware() -> str:
    cpu, mem = cpu_model(), total_memory_gib()
    from monarch.rdma import get_rdma_backend

    knobs = {
        k: os.environ[k]
        for k in ("MONARCH_RDMA_TCP_FALLBACK_PARALLELISM", "MONARCH_RDMA_MAX_CHUNK_SIZE_MB")
        if k in os.environ
    }
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM; python {platform.python_version()}, "
        f"torch {torch.__version__}, torchmonarch {getattr(monarch, '__version__', '0.7')}, "
        f"rdma backend {get_rdma_backend()}; env {knobs or 'defaults'}"
    )


async def run_block(
    size: int,
    block: list[str],
    args: argparse.Namespace,
    base: dict[str, Any],
    trainer: Any,
    gens: Any,
    med: dict[tuple[str, int], float],
    skipped: set[tuple[int, int]],
    publish_s: list[float],
    copy_s: list[float],
    console: Console,
) -> int:
    """Time one block of methods for every generator count; medians go into `med`. Returns the bytes."""
    cfg = {**base, "transport": "endpoint" if block == ["endpoint"] else "rdma"}
    nbytes = await trainer.setup.call_one(size, cfg)
    for n in args.generators:
        sub = gens.slice(procs=slice(0, n))
        await gens.reset.call(cfg)  # frees every generator's staging from the last round
        need, have = (4 + 3 * n) * nbytes / 2**30, available_gib()
        if need > have - 1.0:  # shared 24 GiB machine: skip rather than get OOM-killed
            console.log(f"{size} MiB, {n} gen, {block}: SKIPPED, needs ~{need:.1f} GiB, {have:.1f} free")
            skipped.add((size, n))
            continue
        times: dict[str, list[float]] = {m: [] for m in block}
        for rep in range(args.reps + 1):  # rep 0 warms up (allocates staging)
            for method in block:
                if method == "state_dict":
                    t0 = time.perf_counter()
                    await sub.fetch_state_dict.call(trainer)
                    dt = time.perf_counter() - t0
                else:
                    manifest, pub_s = await trainer.publish.call_one()
                    t0 = time.perf_counter()
                    versions = list((await sub.pull.call(manifest)).values())
                    dt = time.perf_counter() - t0
                    assert versions == [manifest.version] * n, versions
                    if rep and method == "plane":
                        publish_s.append(pub_s)
                        copy_s.append(await trainer.local_copy.call_one())
                if rep:
                    times[method].append(dt)
        for method in block:
            med[(method, n)] = statistics.median(times[method])
            console.log(f"{size} MiB, {n} gen, {method}: {med[(method, n)]:.3f} s")
    return nbytes


async def run(args: argparse.Namespace) -> None:
    console = Console(width=170)
    failures: list[Any] = []
    monarch.actor.unhandled_fault_hook = failures.append
    max_gens = max(args.generators)
    base = {"bucket_mb": args.bucket_mb, "max_concurrent_reads": args.concurrency, "read_timeout_s": 3600}
    rows = []
    for size in args.sizes:
        med: dict[tuple[str, int], float] = {}
        skipped: set[tuple[int, int]] = set()
        publish_s: list[float] = []
        copy_s: list[float] = []
        nbytes = 0
        # plane, state_dict and the in-process copy alternate within each rep (robust to load drift);
        # the safetensors endpoint needs a different publisher, so it runs as its own block.
        blocks = [[m for m in args.methods if m != "endpoint"], [m for m in args.methods if m == "endpoint"]]
        for b, block in enumerate(filter(None, blocks)):
            # Fresh procs per block, so memory held by the previous block is really returned.
            tag = f"{size}_{b}"
            t_procs = this_host().spawn_procs(
                per_host={"procs": 1}, name=f"bench_trainer_{tag}", bootstrap=quiet
            )
            g_procs = this_host().spawn_procs(
                per_host={"procs": max_gens}, name=f"bench_gens_{tag}", bootstrap=quiet
            )
            trainer = t_procs.spawn("trainer", BenchTrainer)
            gens = g_procs.spawn("gens", BenchGenerator)
            try:
                nbytes = await run_block(
                    size, block, args, base, trainer, gens, med, skipped, publish_s, copy_s, console
                )
            finally:
                await g_procs.stop()
                await t_procs.stop()
        mb = nbytes / MIB
        nan = float("nan")
        copy = statistics.median(copy_s) if copy_s else nan
        pub = statistics.median(publish_s) if publish_s else nan
        for n in args.generators:
            plane, ep, sd = (med.get((m, n), nan) for m in ("plane", "endpoint", "state_dict"))
            rows.append(
                (
                    f"{mb:.0f}",
                    f"{n} (memory: skipped a block)" if (size, n) in skipped else str(n),
                    f"{plane:.3f}",
                    f"{n * mb / plane:.0f}",
                    f"{n * mb / sd:.0f}",
                    f"{n * mb / ep:.0f}",
                    f"{mb / copy:.0f}",
                    f"{sd / plane:.1f}x",
                    f"{ep / plane:.1f}x",
                    f"{n * copy / plane:.2f}",
                    f"{1000 * pub:.0f}",
                )
            )
    table = Table(title="Weight sync: plane (RDMA) vs state dict through an endpoint vs in-process copy")
    for col in (
        "MiB",
        "gens",
        "plane s",
        "plane MB/s",
        "endpoint\nstate_dict MB/s",
        "endpoint\nsafetensors MB/s",
        "in-process\ncopy MB/s",
        "plane /\nstate_dict",
        "plane /\nsafetensors",
        "plane /\ncopy",
        "publish\nms",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    console.print(hardware())
    console.print(
        f"median of {args.reps} reps after 1 warm-up; bucket {args.bucket_mb} MiB, {args.concurrency} concurrent "
        "reads per generator. MB/s (MiB/s) = generators x size / wall time until all generators hold the "
        "version. 'endpoint state_dict' = the trainer endpoint returns its tensors (Monarch pickling) and "
        "each generator copies them in (the baseline; alternates with the plane in every rep); 'endpoint "
        "safetensors' = the plane's endpoint transport (safetensors bytes from an actor in the trainer process). "
        "'in-process copy' = one copy_ of the state dict inside the trainer, "
        "measured between the plane's reps; 'plane / copy' compares aggregate rates. 'publish ms' = "
        "trainer-side copy into a slot (independent of the number of generators)."
    )
    if failures:
        console.print(f"[red]mesh failures: {failures}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        help="sets MONARCH_RDMA_TCP_FALLBACK_PARALLELISM for the spawned procs",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=["plane", "endpoint", "state_dict"],
        choices=["plane", "endpoint", "state_dict"],
        help="what to run",
    )
    p.add_argument("--quick", action="store_true", help="16 MiB, 1 and 2 generators, 2 reps")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.generators, args.reps = [16], [1, 2], 2
    if args.tcp_parallelism is not None:
        os.environ["MONARCH_RDMA_TCP_FALLBACK_PARALLELISM"] = str(args.tcp_parallelism)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
