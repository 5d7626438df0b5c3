"""Recovery benchmark: kill -9 a proc of each role in the middle of a real run; how long until the role works again?

For each of generators, rewarder, teachers: the CPU main job's topology (`topologies/local.yaml`, smaller steps),
launched for real; once step `--kill-at` is recorded, one proc of the role is sent SIGKILL. For `trainer`:
`topologies/local_diloco.yaml` (two DiLoCo replicas, a sync every 4 steps here) and replica 0 is killed; its
stand-in rejoins from the object store while replica 1 goes on. The loop's `Recovery`
notes when the death surfaced, when the replacement was set up (new procs, model built, weights pulled) and
when the first call re-issued to it answered. Reported per role: seconds from the kill to each of those,
steps lost (steps the run did not finish, or trained twice) and prompts trained twice or never.

    .venv/bin/python benchmarks/bench_recovery.py --quick     # CI-sized
    .venv/bin/python benchmarks/bench_recovery.py             # the table in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model, package_versions

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")  # before Monarch is imported


async def one_role(role: str, steps: int, kill_at: int, run_dir: Path, spare: bool) -> dict[str, Any]:
    from composer_mesh.app.launch import launch
    from composer_mesh.app.runner import apply_overrides, checkpoint_policy
    from composer_mesh.orchestration.loop import RLLoop
    from composer_mesh.orchestration.metrics import StepRecord
    from composer_mesh.topology import load_topology

    source = "local_diloco.yaml" if role == "trainer" else "local.yaml"
    topo = apply_overrides(load_topology(ROOT / "topologies" / source), steps, run_dir)
    topo = topo.model_copy(update={"run": topo.run.model_copy(update={"eval_prompts": 0, "prompts_per_step": 8})})
    if topo.diloco is not None:
        diloco = topo.diloco.model_copy(update={"store_uri": f"file://{run_dir}/store", "sync_every": 4})
        topo = topo.model_copy(update={"diloco": diloco})
    if spare:  # the killed role's mesh keeps a warm spare
        meshes = dict(topo.meshes)
        name = getattr(topo.roles, role).mesh
        meshes[name] = meshes[name].model_copy(update={"spare": True})
        topo = topo.model_copy(update={"meshes": meshes})
    killed: dict[str, float] = {}
    async with launch(topo) as mesh:

        async def kill() -> None:
            if role == "trainer":  # DiLoCo replica 0 (its weights feed the generators)
                pid = int((await loop.trainers.handles[0].process.call_one())["pid"])
            else:
                where = await getattr(mesh, role).process.call()
                pid = int(sorted(w["pid"] for w in where.values())[0])
            killed["at"] = time.perf_counter()
            os.kill(pid, signal.SIGKILL)

        tasks: list[asyncio.Task[None]] = []

        def progress(record: StepRecord) -> None:
            ready = not spare or mesh.launched.spares.get(mesh.mesh_of(role))  # type: ignore[arg-type]
            if record.step >= kill_at and ready and not tasks:
                tasks.append(asyncio.get_running_loop().create_task(kill()))

        loop = RLLoop(mesh, topo.run, topo.loss, progress=progress, checkpoints=checkpoint_policy(topo),
                      diloco=topo.diloco)
        summary = await loop.run()
        await asyncio.gather(*tasks)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [p for r in rows if "event" not in r for p in r["prompts"]]
    expected = {f"p{i}" for i in range(steps * topo.run.prompts_per_step * topo.roles.trainer.replicas)}
    event = loop.recovery.events[0] if loop.recovery.events else {}
    since = lambda key: event[key] - killed["at"] if key in event else float("nan")  # noqa: E731
    return {
        "role": role + (" (warm spare)" if spare else ""), "detect_s": since("failed_s"), "respawned_s": since("respawned_s"),
        "replaced_s": since("replaced_s"),
        "first_result_s": since("first_result_s"), "steps_lost": steps - summary.steps,
        "prompts_twice": len(trained) - len(set(trained)), "prompts_lost": len(expected - set(trained)),
        "reissued": loop.recovery.reissued, "restarts": sum(loop.recovery.restarts.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps (CI smoke test)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=4)
    p.add_argument("--roles", nargs="+", default=["generators", "rewarder", "teachers", "trainer"])
    p.add_argument("--spare", action="store_true", help="also measure each role with a warm spare on its mesh")
    p.add_argument("--json", help="also write the results as JSON to this file")
    args = p.parse_args()
    steps, kill_at = (5, 2) if args.quick else (args.steps, args.kill_at)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for spare in (False, True) if args.spare else (False,):
            for role in [r for r in args.roles if not (spare and r == "trainer")]:  # no spares for trainers
                # with a spare, the kill waits for it to be ready: a longer run
                n = steps * 3 if spare else steps
                results.append(asyncio.run(one_role(role, n, kill_at, Path(tmp) / f"{role}{spare}", spare)))
    versions = package_versions("torchmonarch", "torch", "transformers")
    print(f"# recovery — {platform.node()} {cpu_model()} ({os.cpu_count()} cores); "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"# topologies/local.yaml, {steps} steps of 8 prompts x 4 samples, one proc SIGKILLed after step {kill_at}; "
          "seconds since the kill")
    print("| role | death surfaced s | new procs + actors s | set up (models, weights) s | first result s | "
          "steps lost | prompts twice / lost | calls re-issued |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['role']} | {r['detect_s']:.2f} | {r['respawned_s']:.2f} | {r['replaced_s']:.2f} | "
              f"{r['first_result_s']:.2f} | "
              f"{r['steps_lost']} | {r['prompts_twice']} / {r['prompts_lost']} | {r['reissued']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": versions, "results": results}, indent=1))


if __name__ == "__main__":
    main()
