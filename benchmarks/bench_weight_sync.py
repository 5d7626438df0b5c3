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
from monarch.actor import Actor, endpoint, this_host
from rich.console import Console
from rich.table import Table

from composer_mesh.mesh.weights import WeightPlaneConfig, WeightPublisher, WeightSubscriber

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

    @endpoint
    async def setup(self, size_mb: int, config: dict[str, Any]) -> int:
        if self.pub is not None:
            self.pub.close()
        self.pub = None
        self.params = model_params(size_mb)
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
    async def local_copy(self, reps: int) -> float:
        """Median seconds of an in-process copy of the state dict into preallocated tensors."""
        dest = {n: torch.empty_like(t) for n, t in self.params.items()}
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for n, t in self.params.items():
                dest[n].copy_(t)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


class BenchGenerator(Actor):
    def __init__(self) -> None:
        self.sub: WeightSubscriber | None = None

    @endpoint
    async def reset(self, config: dict[str, Any]) -> None:
        self.sub = WeightSubscriber(WeightPlaneConfig(**config))

    @endpoint
    async def pull(self, manifest: Any) -> tuple[int, float, int]:
        assert self.sub is not None
        pulled = await self.sub.pull(manifest)
        return pulled.version, pulled.seconds, pulled.retries


def hardware() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
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


async def run(args: argparse.Namespace) -> None:
    console = Console(width=150)
    failures: list[Any] = []
    monarch.actor.unhandled_fault_hook = failures.append
    max_gens = max(args.generators)
    t_procs = this_host().spawn_procs(per_host={"procs": 1}, name="bench_trainer", bootstrap=quiet)
    g_procs = this_host().spawn_procs(per_host={"procs": max_gens}, name="bench_gens", bootstrap=quiet)
    trainer = t_procs.spawn("trainer", BenchTrainer)
    gens = g_procs.spawn("gens", BenchGenerator)
    base = {"bucket_mb": args.bucket_mb, "max_concurrent_reads": args.concurrency, "read_timeout_s": 3600}
    rows = []
    try:
        for size in args.sizes:
            results: dict[tuple[str, int], float] = {}
            publish_s: list[float] = []
            retries = 0
            for transport in args.transports:
                cfg = {**base, "transport": transport}
                nbytes = await trainer.setup.call_one(size, cfg)
                for n in args.generators:
                    sub = gens.slice(procs=slice(0, n))
                    await gens.reset.call(cfg)  # frees every generator's staging from the last round
                    times = []
                    for rep in range(args.reps + 1):  # rep 0 warms up (allocates staging)
                        manifest, pub_s = await trainer.publish.call_one()
                        t0 = time.perf_counter()
                        out = list((await sub.pull.call(manifest)).values())
                        dt = time.perf_counter() - t0
                        assert all(v == manifest.version for v, _, _ in out), out
                        retries += sum(r for _, _, r in out)
                        if rep:
                            times.append(dt)
                            if transport == "rdma":
                                publish_s.append(pub_s)
                    results[(transport, n)] = statistics.median(times)
                    console.log(f"{size} MB, {n} gen, {transport}: {statistics.median(times):.3f} s")
            copy_s = await trainer.local_copy.call_one(args.reps)
            mb = nbytes / MIB
            for n in args.generators:
                plane, ep = results.get(("rdma", n), float("nan")), results.get(("endpoint", n), float("nan"))
                rows.append(
                    (
                        f"{mb:.0f}",
                        str(n),
                        f"{plane:.3f}",
                        f"{n * mb / plane:.0f}",
                        f"{ep:.3f}",
                        f"{n * mb / ep:.0f}",
                        f"{mb / copy_s:.0f}",
                        f"{ep / plane:.2f}x",
                        f"{copy_s * n / plane:.2f}",
                        f"{1000 * statistics.median(publish_s):.0f}",
                        str(retries),
                    )
                )
    finally:
        await g_procs.stop()
        await t_procs.stop()
    table = Table(title="Weight sync: plane (RDMA) vs endpoint (safetensors bytes) vs in-process copy")
    for col in (
        "MiB",
        "gens",
        "plane s",
        "plane MB/s",
        "endpoint s",
        "endpoint MB/s",
        "copy MB/s",
        "plane / endpoint",
        "plane / copy",
        "publish ms",
        "retries",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    console.print(hardware())
    console.print(
        f"median of {args.reps} reps after 1 warm-up; bucket {args.bucket_mb} MiB, {args.concurrency} concurrent "
        "reads per generator; MB/s = generators x size / wall time until all hold the version (MiB/s); "
        "'copy MB/s' = one in-process copy_ of the state dict; 'publish ms' = trainer-side copy into a slot."
    )
    if failures:
        console.print(f"[red]mesh failures: {failures}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 512], help="model sizes in MiB")
    p.add_argument("--generators", type=int, nargs="+", default=[1, 2, 4], help="generator counts")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per cell (after 1 warm-up)")
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
        "--transports", nargs="+", default=["rdma", "endpoint"], choices=["rdma", "endpoint"], help="what to run"
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
