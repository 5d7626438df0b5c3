"""Generator scaling: samples/s of the built-in loop with 1, 2, 4 generators, until the trainer is the bottleneck.

The loop splits each step's groups into one chunk per generator, and a free generator takes the next chunk of
the oldest admitted step (admission by `max_policy_lag`), so one step is sampled by all free generators at
once. A 2-core machine cannot show that with real generators (they would share the same cores), so the
generators here are the fixed-latency stand-in (`composer_mesh.actors.backends.generation.fixed_latency:
FixedLatencyGenerator`): real hf sampling of the tiny model (real tokens and log-probs, so training is real),
padded with a sleep to `--seconds-per-group` x the prompts of each request, like an engine of known
throughput. `--binding hf` runs the real hf generator instead (every process runs on CPU: it measures core
contention, not scaling).

For each N in `--generators`: a topology written into the output folder (tiny model, task addition, no warm
start; trainer `hf` lr 1e-3; N stand-in generators on one local proc mesh `procs_per_host: N`; rewarder
`python` exact_match; no teachers; GRPO only; `eval_prompts: 0`; `max_policy_lag: 1`), run as a subprocess
`composer-mesh run`. From its metrics.jsonl:

- samples/s = sum of the step lines' `rollouts` / (last step's `elapsed_s` - the `train_start` event's
  `elapsed_s`): startup (mesh launch, imports, model load) is excluded; step 1's generation is included.
- per-step means of the `timing` fields (generate_s sums a step's requests: generator-seconds per step),
  and of `metrics["sampling/generators"]` (distinct generators whose rollouts the step trained on).
- trainer idle = mean `trainer_idle_s` / mean `step_s` (the trainer waiting for the step's groups).
- ideal speed-up = min(N, limit), limit = G / T: G = generator-seconds per step of the 1-generator run
  (its mean generate_s, at least prompts x seconds_per_group), T = the row's trainer time per step
  (mean train_s + sync_s). Past N = limit the trainer is the bottleneck.

    .venv/bin/python benchmarks/bench_generator_scaling.py --quick   # CI size (tests/test_benchmarks.py): N 1, 2
    .venv/bin/python benchmarks/bench_generator_scaling.py           # N 1, 2, 4 x 24 steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAND_IN = "composer_mesh.actors.backends.generation.fixed_latency:FixedLatencyGenerator"
REWARD_PATH = "composer_mesh.tasks.arithmetic:exact_match"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import (  # noqa: E402
    child_env,
    cli_settings,
    cpu_model,
    package_versions,
    total_memory_gib,
    write_results,
)

TIMING_KEYS = ("generate_s", "score_s", "train_s", "sync_s", "trainer_idle_s", "generator_idle_s")


def topology_yaml(args: argparse.Namespace, generators: int, run_dir: Path) -> str:
    """GRPO-only topology: hf trainer + N generators on one mesh + python rewarder, no teachers."""
    if args.binding == "stand-in":
        binding, settings = STAND_IN, f"{{seconds_per_group: {args.seconds_per_group}, torch_threads: 1}}"
    else:
        binding, settings = "hf", "{torch_threads: 1}"
    return f"""\
# Written by benchmarks/bench_generator_scaling.py: {generators} generator(s) sharing each step.
name: generator-scaling-{generators}

model: {{source: tiny, task: addition, seed: 0}}

meshes:
  trainer:    {{backend: local, procs_per_host: 1}}
  generators: {{backend: local, procs_per_host: {generators}}}
  rewarder:   {{backend: local, procs_per_host: 1}}

roles:
  trainer:
    mesh: trainer
    binding: hf
    settings: {{lr: {args.lr}, torch_threads: 1}}
  generators:
    mesh: generators
    binding: "{binding}"
    settings: {settings}
  rewarder:
    mesh: rewarder
    binding: python
    settings:
      functions:
        - {{path: "{REWARD_PATH}"}}

loss: {{alpha_sdpo: 0.0, beta_replay: 0.0}}   # GRPO only: no teachers

run:
  task: addition
  steps: {args.steps}
  prompts_per_step: {args.prompts}
  samples_per_prompt: {args.samples}
  max_new_tokens: {args.max_new_tokens}
  max_policy_lag: {args.lag}
  eval_prompts: 0
  seed: 0
  run_dir: {json.dumps(str(run_dir))}
"""


def _child_env() -> dict[str, str]:
    env = child_env(ROOT, 1, MONARCH_FILE_LOG="error")
    env.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
    return env


def run_one(args: argparse.Namespace, generators: int) -> dict[str, Any]:
    """One `composer-mesh run` with N generators in a subprocess; its summary from metrics.jsonl."""
    run_dir = args.out / f"generators-{generators}"
    run_dir.mkdir(parents=True, exist_ok=True)
    topo = run_dir / "topology.yaml"
    topo.write_text(topology_yaml(args, generators, run_dir))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "composer_mesh.cli", "run", str(topo), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_child_env(),
                                  timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"generators": generators, "status": f"timeout ({args.timeout:.0f} s)", "log": str(log.name)}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (run_dir / "log.txt").read_text().strip().splitlines()[-1:] or [""]
        return {"generators": generators, "status": f"failed (exit {proc.returncode}): {tail[0][:160]}",
                "log": str(run_dir / "log.txt")}
    return summarise(generators, run_dir, wall)


def summarise(generators: int, run_dir: Path, wall_s: float) -> dict[str, Any]:
    """samples/s, per-step timing means and generators per step of one run."""
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines() if s.strip()]
    steps = [o for o in lines if "step" in o and "event" not in o]
    start = next((o for o in lines if o.get("event") == "train_start"), None)
    if not steps or start is None:
        return {"generators": generators, "status": "no step lines or no train_start event in metrics.jsonl",
                "run_dir": str(run_dir)}
    train_s = float(steps[-1]["elapsed_s"]) - float(start["elapsed_s"])
    rollouts = sum(int(o["rollouts"]) for o in steps)
    timing = {k: statistics.fmean(float(o["timing"][k]) for o in steps) for k in TIMING_KEYS}
    step_s = statistics.fmean(float(o["step_s"]) for o in steps)
    return {
        "generators": generators, "status": "ok", "steps": len(steps), "rollouts": rollouts,
        "train_s": train_s, "samples_per_s": rollouts / train_s if train_s > 0 else float("nan"),
        "startup_s": float(start["elapsed_s"]), "wall_s": wall_s, "step_s_mean": step_s,
        "timing_mean_s": timing, "trainer_idle_fraction": timing["trainer_idle_s"] / step_s if step_s > 0 else 0.0,
        "generators_per_step_mean": statistics.fmean(float(o["metrics"]["sampling/generators"]) for o in steps),
        "dropped_batches": int(steps[-1].get("dropped_batches", 0)),
        "policy_lag_max": max(int(o.get("policy_lag", 0)) for o in steps), "run_dir": str(run_dir),
    }


def add_ideal(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Speed-up vs the first row, and the ideal min(N, G / T) (see the module docstring)."""
    ok = [r for r in rows if r["status"] == "ok"]
    base = next((r for r in ok if r["generators"] == 1), ok[0] if ok else None)
    if base is None:
        return
    floor = args.prompts * args.seconds_per_group if args.binding == "stand-in" else 0.0
    gen_s = max(base["timing_mean_s"]["generate_s"], floor)  # generator-seconds per step, one generator
    for r in ok:
        trainer_s = r["timing_mean_s"]["train_s"] + r["timing_mean_s"]["sync_s"]
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"] * base["generators"]
        r["trainer_bound_limit"] = gen_s / trainer_s if trainer_s > 0 else float("inf")
        r["ideal_speedup"] = min(r["generators"], r["trainer_bound_limit"])


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["generators", "samples/s", "speed-up", "ideal", "trainer-bound limit", "trainer idle",
            "generators/step", "generate_s", "train_s", "sync_s", "trainer_idle_s", "generator_idle_s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['generators']} | {r['status']} |" + " |" * (len(head) - 2))
            continue
        t = r["timing_mean_s"]
        out.append("| " + " | ".join([
            str(r["generators"]), f"{r['samples_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['ideal_speedup']:.2f}x",
            f"{r['trainer_bound_limit']:.1f}", f"{r['trainer_idle_fraction']:.0%}", f"{r['generators_per_step_mean']:.2f}",
            *(f"{t[k]:.3f}" for k in ("generate_s", "train_s", "sync_s", "trainer_idle_s", "generator_idle_s")),
        ]) + " |")
    return out


def describe(args: argparse.Namespace) -> dict[str, str]:
    versions = package_versions("torch", "transformers", "torchmonarch", "composer-mesh")
    gen = (f"fixed-latency stand-in ({STAND_IN}), seconds_per_group {args.seconds_per_group:g}: a request of k "
           f"prompts takes >= k x {args.seconds_per_group:g} s (real hf sampling, then a sleep), so one generator "
           f"needs >= {args.prompts * args.seconds_per_group:.2f} s per step"
           if args.binding == "stand-in" else "real hf generator (CPU: the generators share the cores)")
    return {
        "hardware": f"{cpu_model()}, {os.cpu_count()} logical CPUs, {total_memory_gib():.1f} GiB RAM; load average "
        f"{args.load_at_start:.1f} at start (shared machine: other work makes the seconds noisy)",
        "versions": f"python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v != "?"),
        "generators": gen,
        "run": f"tiny Qwen2 (no warm start), addition; {args.steps} steps x {args.prompts} prompts x {args.samples} "
        f"samples x <= {args.max_new_tokens} new tokens; trainer hf lr {args.lr:g}, GRPO only, no teachers; "
        f"max_policy_lag {args.lag}; every process at 1 torch thread; one subprocess `composer-mesh run` per N",
        "timing": "samples/s = rollouts / (last step elapsed_s - train_start elapsed_s); per-step means of metrics "
        "`timing` (seconds; generate_s = generator-seconds per step); trainer idle = trainer_idle_s / step_s; "
        "ideal = min(N, limit), limit = 1-generator generate_s / (train_s + sync_s)",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-sized: N 1 and 2, 4 steps")
    p.add_argument("--generators", type=int, nargs="+", help="generator counts (default 1 2 4; quick 1 2)")
    p.add_argument("--steps", type=int, help="training steps per run (default 24; quick 4)")
    p.add_argument("--binding", choices=["stand-in", "hf"], default="stand-in",
                   help="generator binding: the fixed-latency stand-in (default) or the real hf generator")
    p.add_argument("--seconds-per-group", type=float, default=0.1, help="the stand-in's seconds per prompt")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (groups)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=8, help="completion length cap")
    p.add_argument("--lag", type=int, default=1, help="max_policy_lag")
    p.add_argument("--lr", type=float, default=1e-3, help="trainer learning rate")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", type=Path, help="run folders (topology, log, metrics) and results.json "
                   "(default runs/bench_generator_scaling)")
    p.add_argument("--json", type=Path, help="also write the results JSON here")
    args = p.parse_args(argv)
    if args.generators is None:
        args.generators = [1, 2] if args.quick else [1, 2, 4]
    if args.steps is None:
        args.steps = 4 if args.quick else 24
    args.out = (args.out or Path(ROOT) / "runs" / "bench_generator_scaling").resolve()
    args.load_at_start = os.getloadavg()[0]
    return args


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.generators:
        print(f"running {n} generator(s) ...", flush=True)
        rows.append(run_one(args, n))
    add_ideal(args, rows)
    info = describe(args)
    print()
    for key, text in info.items():
        print(f"{key}: {text}")
    print("\ngenerator scaling (speed-up vs 1 generator; ideal = min(N, trainer-bound limit); means per step, s)")
    print("\n".join(table(rows)))
    write_results(args.out, {**info, "settings": cli_settings(args), "rows": rows}, args.json)
    if any(r["status"] != "ok" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
