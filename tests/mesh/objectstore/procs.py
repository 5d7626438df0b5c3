"""Run DiLoCo worker replicas as separate OS processes and collect what they wrote.

Processes come from a multiprocessing *forkserver* that preloads torch and torchft once per session: each
replica is still its own fresh OS process (forked from a clean single-threaded server, never from pytest),
but does not pay the ~3-10 s import again. That keeps the tier fast on 2 shared cores.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import time
from typing import Any

from safetensors.torch import load_file

from mesh.objectstore.gcs import GCS_ENV
from mesh.objectstore.worker import WorkerArgs

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torchft.local_sgd", "safetensors.torch", "fsspec", "mesh.objectstore.worker"])


def _entry(args_json: str, log_path: str, env: dict[str, str]) -> None:
    os.environ.update(env)  # the forkserver's environment is frozen at its start
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import logging

    import torch

    from mesh.objectstore.worker import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    run(WorkerArgs(**json.loads(args_json)))


def spawn(args: WorkerArgs) -> mp.process.BaseProcess:
    os.makedirs(args.out_dir, exist_ok=True)
    log = os.path.join(args.out_dir, f"r{args.replica_id}-{time.time_ns()}.log")
    names = [*args.credentials_env.values(), *GCS_ENV]  # gcsfs reads its switch at import, in the worker
    env = {k: os.environ[k] for k in names if k in os.environ}
    p = _CTX.Process(target=_entry, args=(json.dumps(dataclasses.asdict(args)), log, env), daemon=True)
    p.start()
    return p


def wait_all(procs: list[mp.process.BaseProcess], out_dir: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(timeout=max(1.0, end - time.monotonic()))
            if p.exitcode is None:
                raise AssertionError(f"worker pid {p.pid} still running after {timeout}s:\n{logs(out_dir)}")
            if p.exitcode != 0:
                raise AssertionError(f"worker pid {p.pid} exited with {p.exitcode}:\n{logs(out_dir)}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def logs(out_dir: str) -> str:
    parts = []
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".log"):
            with open(os.path.join(out_dir, name)) as f:
                parts.append(f"--- {name}\n{f.read()[-4000:]}")
    return "\n".join(parts)


def results(out_dir: str) -> list[dict[str, Any]]:
    """One dict per finished worker (json summary + its tensors), sorted by replica id."""
    out = []
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                r = json.load(f)
            tag = r["tag"]
            r["final"] = load_file(os.path.join(out_dir, f"{tag}.final.safetensors"))
            r["global"] = load_file(os.path.join(out_dir, f"{tag}.global.safetensors"))
            r["theta0"] = load_file(os.path.join(out_dir, f"{tag}.theta0.safetensors"))
            out.append(r)
    return sorted(out, key=lambda r: r["replica"])
