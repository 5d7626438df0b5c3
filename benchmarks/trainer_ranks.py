"""`bench_trainer.py --ranks 1 2 4`: one trainer replica sharded over N real Monarch procs (FSDP2), the same
global batch at every N.

Each N gets its own proc mesh on this host and one `RankBench` actor per proc, which builds the `hf` trainer as a
sharded replica (`ShardGroup` rank r of N, gloo on CPU / NCCL on CUDA), takes one warm-up step and then `steps`
timed steps on the same `TrainBatch` (every rank gets the whole batch and trains its share, as in a run).
Measured per rank:

- parameter + AdamW-state bytes it holds (its shards: `DTensor.to_local()`), counted exactly after the warm-up
  step, and the ratio to one proc's (goal: ≤ 1/N + 10%);
- step time (median), and the time inside the collectives FSDP2 and the loss merge issue (`all_gather_single`,
  `reduce_scatter_single`, `all_reduce`, `all_gather`, wrapped with a timer: on gloo they return when done, so the
  time is the communication plus waiting for the slowest rank; on CUDA they are asynchronous and this share is not
  measured), and how many of them a step issues;
- tokens/s = the global batch's tokens / the slowest rank's median step;
- publishing the weights after a step as the trainer service does (rank 0 copies them into a real weight-plane
  slot over shared memory, the other ranks join the gathers): its seconds, and the most whole-tensor bytes a rank
  holds at once besides the slot (the largest tensor: they are gathered one at a time), against the model's.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from typing import Any

from monarch.actor import Actor, current_rank, endpoint

COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather")


class RankBench(Actor):
    """One rank of the replica under test."""

    @endpoint
    async def run(self, address: str, world: int, spec: dict[str, Any]) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from bench_trainer import _model_config, make_batch

        from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
        from composer_mesh.actors.backends.trainer.sharding import ShardGroup
        from composer_mesh.loss.config import LossConfig

        torch.set_num_threads(spec["threads"])
        settings = HFTrainerSettings(lr=1e-5, device=spec["device"], precision=spec["precision"],
                                     micro_batch_tokens=spec["micro_batch_tokens"], lm_head=spec["lm_head"],
                                     torch_threads=spec["threads"], reference_model=False)
        trainer = HFTrainer(settings)
        trainer.start(_model_config(spec), LossConfig(alpha_sdpo=0.0, beta_replay=0.0),
                      shard=ShardGroup(current_rank().rank, world, address))
        batch = make_batch(spec["rollouts"], spec["prompt"], spec["completion"], spec["vocab"], spec["group_size"])
        comm = _time_collectives(dist)
        trainer.train_step(batch)  # warm-up: AdamW's state exists after it
        held = _held_bytes(trainer)
        comm.clear()
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            trainer.train_step(batch)
            times.append(time.perf_counter() - t0)
        return {"rank": current_rank().rank, "world": world, "step_s": statistics.median(times),
                "comm_s": sum(comm) / len(times), "comm_calls": len(comm) / len(times), **held,
                **_publish(trainer, current_rank().rank)}


def _time_collectives(dist: Any) -> list[float]:
    """Wrap the step's collectives (FSDP2's and the loss merge's) with a timer; the seconds spent in them,
    appended per call."""
    spent: list[float] = []
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)

        setattr(dist, name, timed)
    return spent


def _publish(trainer: Any, rank: int) -> dict[str, float]:
    """Seconds to publish the weights once (after a first publish that allocated the slot), as the trainer service
    does: rank 0 into a shared-memory weight plane, the others only joining the gathers; and the whole-tensor
    bytes held at once (the largest tensor) against the whole model's, both in the publish dtype."""
    from composer_mesh.mesh.weights.config import WeightPlaneConfig
    from composer_mesh.mesh.weights.plane import WeightPublisher

    def once(publisher: Any) -> None:
        named = trainer.named_weights()
        if publisher is not None:
            publisher.publish(named)
        else:
            for name in named:
                named[name]

    publisher = WeightPublisher(trainer.named_weights(), WeightPlaneConfig(transport="shm")) if rank == 0 else None
    once(publisher)
    t0 = time.perf_counter()
    once(publisher)
    seconds = time.perf_counter() - t0
    shapes = trainer.named_weights().shapes()
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values()]
    if publisher is not None:
        publisher.close()
    return {"publish_s": seconds, "publish_peak_bytes": max(sizes), "model_bytes": sum(sizes)}


def _held_bytes(trainer: Any) -> dict[str, int]:
    """Bytes of this rank's parameter shards and of its AdamW state."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    params = sum(local(p).numel() * p.element_size() for p in trainer.model.parameters())
    state = sum(local(v).numel() * v.element_size() for s in trainer.optimizer.state.values() for v in s.values()
                if hasattr(v, "numel") and v.dim() > 0)
    return {"param_bytes": params, "optimizer_bytes": state}


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_ranks(spec: dict[str, Any], ranks: list[int]) -> list[dict[str, Any]]:
    """Every N of `ranks` on a fresh proc mesh of N procs; one row per N (its ranks' worst and mean)."""
    from monarch.actor import this_host

    rows = []
    for world in ranks:
        procs = this_host().spawn_procs(per_host={"procs": world}, name=f"bench_ranks{world}")
        try:
            answers = procs.spawn(f"rank_bench{world}", RankBench).run.call(free_address(), world, spec).get()
        finally:
            procs.stop().get()
        per_rank = [a for _, a in answers.items()]
        held = max(a["param_bytes"] + a["optimizer_bytes"] for a in per_rank)
        step = max(a["step_s"] for a in per_rank)
        rows.append({"ranks": world, "step_s": step, "comm_s": max(a["comm_s"] for a in per_rank),
                     "comm_calls": max(a["comm_calls"] for a in per_rank),
                     "held_bytes": held, "tokens_per_s": spec["tokens"] / step, "per_rank": per_rank,
                     "publish_s": max(a["publish_s"] for a in per_rank),
                     "publish_peak_bytes": max(a["publish_peak_bytes"] for a in per_rank),
                     "model_bytes": per_rank[0]["model_bytes"]})
    one = next((r for r in rows if r["ranks"] == 1), None)
    for row in rows:
        row["held_vs_one"] = row["held_bytes"] / one["held_bytes"] if one else None
        row["goal_held"] = 1 / row["ranks"] + 0.10
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["ranks", "tokens/s", "step s (slowest rank)", "in collectives", "collectives per step",
            "params + AdamW per rank", "vs one proc", "goal ≤ 1/N + 10%", "publish s", "whole tensors held publishing"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        ratio = "-" if r["held_vs_one"] is None else f"{r['held_vs_one']:.3f}"
        ok = "-" if r["held_vs_one"] is None else ("PASS" if r["held_vs_one"] <= r["goal_held"] else "MISS")
        share = f"{r['comm_s']:.3f} s ({r['comm_s'] / r['step_s']:.0%})"
        held = f"{r['publish_peak_bytes'] / 2**20:,.1f} of {r['model_bytes'] / 2**20:,.1f} MiB"
        lines.append(f"| {r['ranks']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {share} | {r['comm_calls']:.0f} | "
                     f"{r['held_bytes'] / 2**20:,.1f} MiB | {ratio} | {r['goal_held']:.3f} {ok} | "
                     f"{r['publish_s']:.3f} | {held} |")
    return lines
