"""Targeted feedback's ablation (issue 28): held-out success of the calculator task trained with GRPO alone vs
GRPO + targeted feedback, the same seeds, every other setting equal. `bench_agentic.py --ablation` runs it.

Both arms are `topologies/agentic.yaml` without its teacher (Composer's setting: the policy is its own teacher):
- `grpo`: channel 1 only (`loss.alpha_sdpo: 0`);
- `grpo+hints`: the same plus `run.rollout.hints: {source: environment}`, channel 2 fed by the policy conditioned
  on a hint before each episode's first mistaken turn (`loss.alpha_sdpo: --alpha`).
At `max_policy_lag: 0` (a seed gives the same run whatever the machine's load), `--ablation-steps` steps, the
held-out set (`eval_size` problems the train stream never draws: `tests/envs/test_calculator.py` proves it) scored
greedily before the first step and after the last, both arms from the same warm start (built once into the model
cache). The warm start (`--warmstart-task`) is by default `HintedCalculatorTask`: agentic.yaml's perfect episodes,
half of them with the environment's hint before the right answer, so that the policy has seen a hint at all;
`CalculatorTask` is agentic.yaml's own (docs/benchmarks.md has both).

    .venv/bin/python benchmarks/bench_agentic.py --ablation              # 3 seeds x 2 arms x 60 steps
    .venv/bin/python benchmarks/bench_agentic.py --ablation --quick      # CI-sized: 1 seed, 2 steps, short warm start
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("grpo", "grpo+hints")


def arm_topology(arm: str, seed: int, cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`topologies/agentic.yaml` as the arm's run: no teacher, channel 2 only from hints (arm `grpo+hints`)."""
    data = yaml.safe_load((ROOT / "topologies" / "agentic.yaml").read_text())
    del data["roles"]["teachers"], data["meshes"]["teachers"]
    data["model"]["warmstart"].update(steps=cfg["warmstart_steps"], task=cfg["warmstart_task"])
    data["roles"]["trainer"]["settings"].update(lr_decay_steps=cfg["steps"], lr_warmup_steps=min(10, cfg["steps"] // 5))
    hints = arm == "grpo+hints"
    data["loss"] = {"alpha_sdpo": cfg["alpha"] if hints else 0.0, "sdpo_jsd_beta": cfg["jsd_beta"], "beta_replay": 0.0}
    run = data["run"]
    run.update(steps=cfg["steps"], seed=seed, max_policy_lag=0, eval_every=cfg["steps"], eval_prompts=cfg["eval"],
               run_dir=str(run_dir), checkpoint_every=0, prompts_per_step=cfg["prompts"])
    run["environment"]["eval_size"] = cfg["eval"]
    run["rollout"]["hints"] = {"source": "environment" if hints else "none"}
    return data


def run_arm(arm: str, seed: int, cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One arm at one seed through `composer-mesh run`: held-out greedy success before and after, and what the
    hints did (from metrics.jsonl)."""
    run_dir = Path(cfg["out"]) / f"{arm.replace('+', '_')}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    topo = run_dir / "topology.yaml"
    topo.write_text(yaml.safe_dump(arm_topology(arm, seed, cfg, run_dir)))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "composer_mesh.cli", "run", str(topo), "--run-dir", str(run_dir)]
    with (run_dir / "log.txt").open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=cfg["timeout"],
                              check=False)
    if proc.returncode != 0:
        tail = (run_dir / "log.txt").read_text().strip().splitlines()[-1:] or [""]
        return {"arm": arm, "seed": seed, "status": f"exit {proc.returncode}: {tail[0][:160]}"}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"arm": arm, "seed": seed, "status": "ok", **summarise(lines)}


def summarise(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out greedy success before/after, the train reward of the last fifth, and the hints' counters."""
    evals = {e["when"]: e for e in lines if e.get("event") == "eval"}
    steps = [o for o in lines if "step" in o and "event" not in o]
    last = steps[-max(1, len(steps) // 5):]
    metrics = steps[-1]["metrics"] if steps else {}
    episodes = metrics.get("hints/episodes", 0.0)
    return {"held_out_before": evals["before"]["reward"], "held_out_after": evals["after"]["reward"],
            "train_reward_last": sum(o["reward"] for o in last) / len(last), "steps": len(steps),
            "hinted_fraction": metrics.get("hints/hinted", 0.0) / episodes if episodes else 0.0,
            "hint_tokens": metrics.get("hints/tokens", 0.0),
            "run_s": steps[-1]["elapsed_s"] if steps else 0.0}


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["seed", "arm", "held-out before", "held-out after", "change", "train reward (last fifth)",
            "episodes hinted", "run s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['seed']} | {r['arm']} | {r['status']} |" + " - |" * (len(head) - 3))
            continue
        change = r["held_out_after"] - r["held_out_before"]
        out.append(f"| {r['seed']} | {r['arm']} | {r['held_out_before']:.3f} | {r['held_out_after']:.3f} | "
                   f"{change:+.3f} | {r['train_reward_last']:.3f} | {r['hinted_fraction']:.0%} | {r['run_s']:.0f} |")
    return out


def mean_change(rows: list[dict[str, Any]], arm: str) -> float | None:
    ok = [r["held_out_after"] - r["held_out_before"] for r in rows if r["arm"] == arm and r["status"] == "ok"]
    return sum(ok) / len(ok) if ok else None


def run(args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    cfg = cfg_of(args)
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            print(f"  ablation: seed {seed}, {arm} ...", file=sys.stderr, flush=True)
            rows.append(run_arm(arm, seed, cfg, env))
    return rows


def cfg_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"steps": args.ablation_steps, "alpha": args.alpha, "jsd_beta": args.jsd_beta, "eval": args.eval_size,
            "prompts": args.prompts_per_step, "warmstart_steps": args.warmstart_steps,
            "warmstart_task": args.warmstart_task, "out": str(args.out / "ablation"), "timeout": args.timeout}


def warm_start_probe(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """`hint_probe.probe` on the arms' warm start (built into the model cache by the runs, or here)."""
    from hint_probe import probe

    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.loading import load_pretrained

    model, tokenizer = load_pretrained(ModelConfig(**arm_topology("grpo", seed, cfg, Path(cfg["out"]))["model"]))
    return probe(model, tokenizer, seed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ablation", action="store_true", help="instead of the throughput sweep: held-out success with "
                   "and without targeted feedback (benchmarks/agentic_ablation.py)")
    p.add_argument("--seeds", type=int, nargs="+", help="ablation: run seeds (default 0 1 2; quick 0)")
    p.add_argument("--ablation-steps", type=int, help="ablation: steps per arm (default 60; quick 2)")
    p.add_argument("--alpha", type=float, default=0.5, help="ablation: loss.alpha_sdpo of the hints arm")
    p.add_argument("--jsd-beta", type=float, default=0.0, help="ablation: loss.sdpo_jsd_beta of the hints arm (0: "
                   "forward KL(teacher||student), agentic.yaml's; 1: reverse KL, on-policy distillation's)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="ablation: which arms run")
    p.add_argument("--eval-size", type=int, help="ablation: held-out problems (default 32; quick 4)")
    p.add_argument("--prompts-per-step", type=int, help="ablation: prompts per step (default 8; quick 2)")
    p.add_argument("--warmstart-steps", type=int, help="ablation: SFT steps of the policy's warm start (default "
                   "1200, agentic.yaml's; quick 30)")
    p.add_argument("--warmstart-task", default="composer_mesh.envs.calculator:HintedCalculatorTask",
                   help="ablation: the warm start's task, for both arms. Default: perfect episodes, half with a hint "
                   "before the answer (a policy that never saw a hint reads one as noise); "
                   "composer_mesh.envs.calculator:CalculatorTask is agentic.yaml's")


ABLATION_DEFAULTS: dict[str, dict[str, Any]] = {
    "quick": dict(seeds=[0], ablation_steps=2, eval_size=4, prompts_per_step=2, warmstart_steps=30),
    "full": dict(seeds=[0, 1, 2], ablation_steps=60, eval_size=32, prompts_per_step=8, warmstart_steps=1200),
}
