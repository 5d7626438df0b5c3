"""The main job's learning numbers over seeds: `composer-mesh run topologies/local.yaml` once per seed.

Each seed is a copy of the topology with `model.seed` (the student's initial weights) and `run.seed` (the
prompt stream, sampling and the order of the held-out problems) set to it, run by the CLI in a fresh process
exactly as a user runs it. Reported per seed: the held-out greedy accuracy and pass@k before training, at every
`run.eval_every` step and after, and the wall time of the whole command (launch, model builds on a cold cache,
training, checkpoints); then the median and range of the final numbers. The README's first paragraph and
docs/benchmarks.md quote this script's output. Numbers are read by people, never asserted in tests
(tests/e2e/test_learning.py checks a margin at lag 0 instead).

    .venv/bin/python benchmarks/bench_local_seeds.py                 # seeds 0 1 2 3, the table in the README
    .venv/bin/python benchmarks/bench_local_seeds.py --seeds 0 --lag 0 --steps 40
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

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import child_env, cpu_model, package_versions

ROOT = Path(__file__).resolve().parents[1]


def seeded_copy(topology: Path, seed: int, out: Path, lag: int | None, steps: int | None) -> Path:
    """`topology` with the student's and the run's seed set to `seed` (and `lag` / `steps` if given), written
    into `out`."""
    data = yaml.safe_load(topology.read_text())
    data["model"]["seed"] = seed
    data["run"]["seed"] = seed
    if lag is not None:
        data["run"]["max_policy_lag"] = lag
    if steps is not None:
        data["run"]["steps"] = steps
    path = out / f"seed{seed}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_seed(topology: Path, seed: int, out: Path, lag: int | None, steps: int | None) -> dict[str, Any]:
    """Run one seed with the CLI; its eval events and wall time."""
    copy = seeded_copy(topology, seed, out, lag, steps)
    run_dir = out / f"seed{seed}"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "composer_mesh.cli", "run", str(copy), "--run-dir", str(run_dir)],
                          cwd=ROOT, env=child_env(str(ROOT), 1), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    (out / f"seed{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"seed": seed, "status": f"exit {proc.returncode} (see {out / f'seed{seed}.log'})", "wall_s": wall}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [{"when": e["when"], "step": e["step"], "greedy": e["reward"], "pass_at_k": e["pass_at_k"], "k": e["k"]}
             for e in lines if e.get("event") == "eval"]
    return {"seed": seed, "status": "ok", "wall_s": wall, "evals": evals}


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}, range {min(values):.2f}-{max(values):.2f}"


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Print one line per seed and the median/range of the final numbers; the summary as a dict."""
    for row in rows:
        if row["status"] != "ok":
            print(f"seed {row['seed']}: {row['status']}")
            continue
        curve = "  ".join(f"{e['step']}:{e['greedy']:.2f}/{e['pass_at_k']:.2f}" for e in row["evals"])
        print(f"seed {row['seed']}  {row['wall_s']:5.0f} s  held-out greedy/pass@k by step: {curve}")
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return {}
    first = [r["evals"][0] for r in ok]
    last = [r["evals"][-1] for r in ok]
    summary = {
        "seeds": [r["seed"] for r in ok],
        "greedy_before": [e["greedy"] for e in first], "greedy_after": [e["greedy"] for e in last],
        "pass_before": [e["pass_at_k"] for e in first], "pass_after": [e["pass_at_k"] for e in last],
        "k": last[0]["k"], "wall_s": [r["wall_s"] for r in ok],
    }
    k = summary["k"]
    print(f"greedy before: {spread(summary['greedy_before'])}; after: {spread(summary['greedy_after'])}")
    print(f"pass@{k} before: {spread(summary['pass_before'])}; after: {spread(summary['pass_after'])}")
    print(f"wall s: median {statistics.median(summary['wall_s']):.0f}, range "
          f"{min(summary['wall_s']):.0f}-{max(summary['wall_s']):.0f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, default=ROOT / "topologies" / "local.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--lag", type=int, default=None, help="run.max_policy_lag (default: the topology's)")
    parser.add_argument("--steps", type=int, default=None, help="run.steps (default: the topology's)")
    parser.add_argument("--quick", action="store_true", help="CI size: seed 0, 20 steps")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_local_seeds")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps = [0], 20
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"hardware: {cpu_model()}, {os.cpu_count()} cores, {platform.platform()}")
    print(f"versions: {package_versions('torch', 'transformers', 'torchmonarch')}")
    rows = [one_seed(args.topology, s, args.out, args.lag, args.steps) for s in args.seeds]
    summary = report(rows)
    result = {"hardware": cpu_model(), "cores": os.cpu_count(), "topology": str(args.topology), "lag": args.lag,
              "steps": args.steps, "rows": rows, "summary": summary}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
