"""Object-store DiLoCo sync: reduce-scatter vs naive all-gather vs a raw copy of M bytes, side by side.

For each store (file:// on local disk, s3:// on a moto server subprocess, gs:// on a gcp-storage-emulator
subprocess, both on localhost), model size M and
replica count N, the N replicas run as threads of this process against the same store, and three things
are measured in one run, one after the other, under the same concurrency:

  reduce-scatter : ObjectStoreManager (the real code): publish N slices, average one slice, read all
                   averaged slices; checksummed safetensors, quorum records and all.
  naive          : every replica PUTs its whole checksummed shard, then reads all N shards and averages.
  raw copy       : every replica PUTs M raw bytes, then reads another replica's M bytes (no format, no
                   checksum, no protocol): the floor for moving M bytes through this store.

Bytes are counted by the store wrapper (everything, including the small JSON records); seconds are the
wall time of the whole round (slowest replica), after a barrier. Targets (issue 5): reduce-scatter reads
<= 2.2 x M per replica for every N; its round time <= 1.5 x the raw copy.

    .venv/bin/python benchmarks/bench_objectstore.py            # 64 and 256 MiB, N = 2, 4, 8, file + s3
    .venv/bin/python benchmarks/bench_objectstore.py --quick    # 4 and 16 MiB, N = 2, 4
    .venv/bin/python benchmarks/bench_objectstore.py --stores file s3 gs --sizes-mib 16 --replicas 2 4

The gs:// rows talk to the emulator directly (the tests put a proxy in front of it that enforces create-only
puts; the benchmark's keys are written once each, so it measures the store without that extra hop).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from machine import available_memory_gib, cpu_model, package_versions, total_memory_gib  # noqa: E402

from composer_mesh.mesh.objectstore import DiLoCoConfig  # noqa: E402
from composer_mesh.mesh.objectstore.manager import ObjectStoreManager  # noqa: E402
from composer_mesh.mesh.objectstore.store import Store, decode_shard, encode_shard_parts  # noqa: E402

MIB = 1024 * 1024


# ------------------------------------------------------------------------------------------ stores
class ServerProcess:
    """A local server in its own process (its CPU does not share this process's GIL) on a free port: started by
    `command(port)`, ready once `probe(endpoint)` stops raising OSError (30 s at most), stopped by `stop`."""

    def __init__(self, what: str, command: Callable[[int], list[str]], probe: Callable[[str], None]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(command(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 30
        while True:
            try:
                probe(self.endpoint)
                break
            except OSError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise RuntimeError(f"{what} did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _connects(endpoint: str) -> None:
    host, port = endpoint.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=0.5):
        pass


def _lists_buckets(endpoint: str) -> None:
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b?project=bench", timeout=1):
        pass


class MotoServer(ServerProcess):
    """`moto_server`, with one bucket `bench`."""

    def __init__(self) -> None:
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        super().__init__("moto_server", lambda port: [exe, "-H", "127.0.0.1", "-p", str(port)], _connects)
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket="bench")


class GcsEmulator(ServerProcess):
    """`gcp-storage-emulator --in-memory`, with one bucket `bench`."""

    def __init__(self) -> None:
        # gcsfs 2026.x would ask each bucket's type over gRPC first (the emulator has no gRPC): 60 s per bucket.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        os.environ.setdefault("BENCH_GCS_TOKEN", "anon")
        super().__init__("gcp-storage-emulator", lambda port: [
            sys.executable, "-m", "gcp_storage_emulator", "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
            _lists_buckets)
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=bench", data=b'{"name": "bench"}',
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=10).close()


def store_fields(kind: str, tmp: str, servers: dict[str, Any]) -> dict[str, Any]:
    if kind == "file":
        return {"store_uri": f"file://{tmp}/store"}
    if kind == "gs":
        return {
            "store_uri": "gs://bench/diloco",
            "storage_options": {"endpoint_url": servers["gs"].endpoint, "project": "bench"},
            "credentials_env": {"token": "BENCH_GCS_TOKEN"},
        }
    moto = servers["s3"]
    return {
        "store_uri": "s3://bench/diloco",
        "storage_options": {"endpoint_url": moto.endpoint, "region_name": "us-east-1"},
        "credentials_env": {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY"},
    }


# ------------------------------------------------------------------------------------------ methods
def run_threads(n: int, fn: Callable[[int, threading.Barrier], Any]) -> tuple[float, list[Any]]:
    barrier = threading.Barrier(n + 1)
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            out[r] = fn(r, barrier)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, out


def wait_for(store: Store, prefix: str, count: int, poll: float) -> None:
    while len(store.list(prefix)) < count:
        time.sleep(poll)


PHASES: dict[str, list[float]] = {}  # reduce-scatter seconds per phase, mean over replicas, per timed round


def bench_reduce_scatter(cfg: DiLoCoConfig, vecs: list[torch.Tensor]) -> tuple[float, list[tuple[int, int]]]:
    """The real manager. (Its average lands in `vecs` in place; the later methods only move bytes.)"""
    n = len(vecs)
    managers = [ObjectStoreManager(cfg, r) for r in range(n)]

    def one(r: int, barrier: threading.Barrier) -> tuple[int, int]:
        m = managers[r]
        m.store.exists("warmup")  # connect (S3 client creation) before the clock starts
        barrier.wait()
        m.start_quorum()
        work = m.allreduce(vecs[r])
        work.wait()
        assert m.should_commit(), m.reports[-1].error
        rep = m.reports[-1]
        return rep.bytes_read, rep.bytes_written

    try:
        result = run_threads(n, one)
        for phase in ("publish", "quorum", "reduce", "gather"):
            PHASES.setdefault(phase, []).append(statistics.mean(m.reports[-1].phases.get(phase, 0.0) for m in managers))
        return result
    finally:
        for m in managers:
            m.shutdown()


def bench_naive(cfg: DiLoCoConfig, vecs: list[torch.Tensor]) -> tuple[float, list[tuple[int, int]]]:
    n = len(vecs)
    stores = [Store.from_config(cfg) for _ in range(n)]

    def one(r: int, barrier: threading.Barrier) -> tuple[int, int]:
        s = stores[r]
        s.exists("warmup")  # connect (S3 client creation) before the clock starts
        barrier.wait()
        r0, w0 = s.counters()
        meta = {"run_id": cfg.run_id, "quorum_id": 1, "replica": r, "kind": "naive"}
        s.put(f"naive/r{r:03d}.safetensors", encode_shard_parts({"data": vecs[r]}, meta))
        s.put_json(f"naive_arrived/r{r:03d}.json", {"replica": r})
        wait_for(s, "naive_arrived", n, cfg.poll_interval_s)
        acc = None
        for m in range(n):
            key = f"naive/r{m:03d}.safetensors"
            t = decode_shard(key, s.get(key), expect={**meta, "replica": m})[0]["data"]
            acc = t.clone() if acc is None else acc.add_(t)
            del t
        assert acc is not None
        acc.div_(n)
        r1, w1 = s.counters()
        return r1 - r0, w1 - w0

    return run_threads(n, one)


def bench_raw_copy(cfg: DiLoCoConfig, vecs: list[torch.Tensor]) -> tuple[float, list[tuple[int, int]]]:
    n = len(vecs)
    stores = [Store.from_config(cfg) for _ in range(n)]
    # file:// writes straight from the tensor's memory; S3 needs one bytes body (the copy is outside the clock)
    payloads: list = [memoryview(v.numpy()).cast("B") if cfg.scheme == "file" else v.numpy().tobytes() for v in vecs]

    def one(r: int, barrier: threading.Barrier) -> tuple[int, int]:
        s = stores[r]
        s.exists("warmup")  # connect (S3 client creation) before the clock starts
        barrier.wait()
        r0, w0 = s.counters()
        s.put(f"raw/r{r:03d}.bin", [payloads[r]] if cfg.scheme == "file" else payloads[r])
        peer = f"raw/r{(r + 1) % n:03d}.bin"
        while not s.exists(peer):
            time.sleep(cfg.poll_interval_s)
        data = s.get(peer)
        assert len(data) == memoryview(payloads[r]).nbytes
        r1, w1 = s.counters()
        return r1 - r0, w1 - w0

    return run_threads(n, one)


METHODS = {
    "reduce-scatter": bench_reduce_scatter,
    "naive all-gather": bench_naive,
    "raw copy": bench_raw_copy,
}


# ------------------------------------------------------------------------------------------ report
def environment() -> list[str]:
    import fsspec
    import safetensors
    cpu, mem = cpu_model(), total_memory_gib()
    vers = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fsspec": fsspec.__version__,
        "safetensors": safetensors.__version__,
    }
    vers.update(package_versions("s3fs", "moto", "gcsfs", "gcp-storage-emulator", "torchft"))
    return [
        f"host: {platform.node()} | {platform.platform()} | {cpu} | {os.cpu_count()} cpus | {mem:.1f} GiB RAM"
        f" | load avg {os.getloadavg()[0]:.1f}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
    ]


def needed_gib(kind: str, size_mib: int, n: int) -> float:
    """Rough peak: inputs + per-replica result/accumulator + read buffer, plus the server's copy of the objects."""
    per = size_mib / 1024
    return per * (4 * n + 1) + (per * n * 2.5 if kind != "file" else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 and 16 MiB, N = 2 and 4")
    ap.add_argument("--sizes-mib", type=int, nargs="+", help="model sizes in MiB (default 64 256)")
    ap.add_argument("--replicas", type=int, nargs="+", help="replica counts (default 2 4 8)")
    ap.add_argument("--stores", nargs="+", default=["file", "s3"], choices=["file", "s3", "gs"])
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds per cell (median is reported)")
    args = ap.parse_args()
    sizes = args.sizes_mib or ([4, 16] if args.quick else [64, 256])
    counts = args.replicas or ([2, 4] if args.quick else [2, 4, 8])
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`: stop moto, remove temp files

    print("\n".join(environment()), flush=True)
    print("N replicas are threads of one process; moto and the GCS emulator run as separate processes. "
          "M = model bytes (fp32).")
    servers: dict[str, Any] = {}
    if "s3" in args.stores:
        servers["s3"] = MotoServer()
    if "gs" in args.stores:
        servers["gs"] = GcsEmulator()
    tmp = tempfile.mkdtemp(prefix="bench_objstore_", dir=os.environ.get("BENCH_TMP"))
    rows = []
    try:
        for kind in args.stores:
            for size in sizes:
                numel = size * MIB // 4
                for n in counts:
                    need, have = needed_gib(kind, size, n), available_memory_gib()
                    if need > have - 1.0:
                        print(f"  {kind:4} {size:4d} MiB N={n} SKIPPED: needs ~{need:.1f} GiB, {have:.1f} GiB "
                              "available (shared machine)", flush=True)
                        rows.append((kind, size, n, "SKIPPED (memory)", float("nan"), float("nan"),
                                     float("nan"), float("nan")))
                        continue
                    vecs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
                    cell: dict[str, tuple[float, float, float]] = {}
                    for method, fn in METHODS.items():
                        secs, reads, writes = [], [], []
                        for _ in range(args.rounds):
                            cfg = DiLoCoConfig(
                                run_id=f"b{uuid.uuid4().hex[:8]}",
                                replicas=n,
                                quorum_deadline_s=600,
                                poll_interval_s=0.02,
                                **store_fields(kind, tmp, servers),
                            )
                            wall, counters = fn(cfg, vecs)
                            gc.collect()
                            secs.append(wall)
                            reads.append(statistics.mean(c[0] for c in counters) / (numel * 4))
                            writes.append(statistics.mean(c[1] for c in counters) / (numel * 4))
                            Store.from_config(cfg).rm_prefix("")
                        cell[method] = (
                            statistics.median(secs),
                            statistics.median(reads),
                            statistics.median(writes),
                        )
                    raw = cell["raw copy"][0]
                    phases = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in PHASES.items())
                    PHASES.clear()
                    for method, (sec, rd, wr) in cell.items():
                        rows.append((kind, size, n, method, rd, wr, sec, sec / raw))
                        print(
                            f"  {kind:4} {size:4d} MiB N={n} {method:16} read {rd:5.2f}xM write {wr:5.2f}xM "
                            f"{sec:7.2f} s  {sec / raw:5.2f}x raw   (peak RSS so far "
                            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB)",
                            flush=True,
                        )
                    print(f"      reduce-scatter phases (s, mean over replicas): {phases}", flush=True)
                    del vecs
                    gc.collect()
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(
        "| store | M (MiB) | N | method | read / replica (×M) | written / replica (×M) | s / round | × raw copy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, size, n, method, rd, wr, sec, ratio in rows:
        if method.startswith("SKIPPED"):
            print(f"| {kind} | {size} | {n} | {method} | – | – | – | – |")
            continue
        print(f"| {kind} | {size} | {n} | {method} | {rd:.2f} | {wr:.2f} | {sec:.2f} | {ratio:.2f} |")
    rs = [r for r in rows if r[3] == "reduce-scatter"]
    if not rs:
        return
    worst_read = max(r[4] for r in rs)
    worst_ratio = max(r[7] for r in rs)
    print(
        f"\nreduce-scatter: worst bytes read per replica {worst_read:.2f} x M (target <= 2.2): "
        f"{'PASS' if worst_read <= 2.2 else 'FAIL'}; worst round time {worst_ratio:.2f} x raw copy "
        f"(target <= 1.5): {'PASS' if worst_ratio <= 1.5 else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
