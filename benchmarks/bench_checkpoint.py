"""Checkpoint benchmark: what a full trainer-state checkpoint costs the training step.

One process, one model, measured side by side: the trainer service's `train_step` (forward, backward, AdamW,
weight publish) with no checkpoint, with a full-state checkpoint every k steps written off the training path
(`save_state(url, wait=False)`: copy now, write in a background thread), and with the checkpoint written on
the training path (`wait=True`). The step time of a checkpointing mode includes the copy and, if the previous
write is still running, the wait for it (one write at a time). Reported: mean step time over the steps and its
ratio to no checkpoint, the copy (snapshot) time, the write time and the state's size.

The model is a Qwen2-shaped causal LM with random weights built offline (see bench_trainer.py); the state is
weights + AdamW moments (float32): ~12 bytes per parameter, so a 0.5B policy's state is ~6 GB.

    .venv/bin/python benchmarks/bench_checkpoint.py --quick     # CI-sized, CPU, < 1 min
    .venv/bin/python benchmarks/bench_checkpoint.py             # the CPU table in docs/benchmarks.md
    python3 benchmarks/bench_checkpoint.py --device cuda --model qwen0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_trainer import PRESETS, build_model_dir, make_batch
from machine import cpu_model, package_versions

PRESETS = {**PRESETS, "cpu-100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                       num_attention_heads=12, num_key_value_heads=4, vocab_size=32_000)}
GIB = 1024**3


def service(model_dir: Path, device: str) -> Any:
    from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
    from composer_mesh.actors.trainer import TrainerService
    from composer_mesh.loss.config import LossConfig
    from composer_mesh.mesh.weights.config import WeightPlaneConfig
    from composer_mesh.models.config import ModelConfig

    svc = TrainerService(HFTrainer(HFTrainerSettings(device=device, torch_threads=os.cpu_count() or 1,
                                                     reference_model=False)), WeightPlaneConfig(transport="endpoint"))
    svc.start(ModelConfig(source=str(model_dir)), LossConfig(alpha_sdpo=0.0, beta_replay=0.0), temperature=1.0)
    svc.publish()
    return svc


def run_mode(svc: Any, batch: Any, steps: int, every: int, wait: bool, out: Path) -> dict[str, float]:
    """Mean step time over `steps` steps, checkpointing every `every` steps (0: never)."""
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        svc.train_step(batch)
        if every and step % every == 0:
            svc.save_state(f"{out}/s{step}", wait=wait)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    svc.flush_states()  # the last background write, not counted in any step
    return {"step_s": statistics.mean(times), "drain_s": time.perf_counter() - t0}


def probe(svc: Any, out: Path) -> dict[str, float]:
    """The copy and the write of one checkpoint, timed apart; the state's size."""
    from composer_mesh.actors.backends.trainer.trainer_state import write_trainer_state

    t0 = time.perf_counter()
    snapshot = svc.backend.snapshot_state(extra={"weight_version": svc.version})
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_trainer_state(f"{out}/probe", snapshot)
    return {"copy_s": copy_s, "write_s": time.perf_counter() - t0, "state_gib": snapshot.nbytes / GIB}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (CI smoke test)")
    p.add_argument("--model", default="cpu-100m", choices=sorted(PRESETS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--out", help="checkpoint destination directory (default: a temporary directory)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    args = p.parse_args()
    shape = PRESETS["quick" if args.quick else args.model]
    steps = 4 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model_dir(shape, Path(tmp) / "model", "float32")
        out = Path(args.out or Path(tmp) / "ckpt")
        svc = service(Path(tmp) / "model", args.device)
        batch = make_batch(args.rollouts, 32, 32, shape["vocab_size"], 4)
        svc.train_step(batch)  # warm-up
        sizes = probe(svc, out)
        modes = [("no checkpoint", 0, False), ("every step, background write", 1, False),
                 (f"every {max(2, steps // 2)} steps, background", max(2, steps // 2), False),
                 ("every step, blocking write", 1, True)]
        rows = [(name, run_mode(svc, batch, steps, every, wait, out)) for name, every, wait in modes]
        svc.close()
    base = rows[0][1]["step_s"]
    versions = package_versions("torch", "transformers", "safetensors", "fsspec")
    print(f"# checkpoint cost — {platform.node()} {cpu_model()} device={args.device}; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"# model {'quick' if args.quick else args.model}: {params / 1e6:.1f}M parameters, state "
          f"{sizes['state_gib']:.2f} GiB; one checkpoint: copy {sizes['copy_s']:.2f} s, write {sizes['write_s']:.2f} s "
          f"to {out.parent if args.out is None else out}; {steps} steps of {args.rollouts} rollouts x 64 tokens per mode")
    print("| mode | mean step s | x no checkpoint | last write drained after the run s |")
    print("|---|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | {r['drain_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"params": params, **sizes, "versions": versions, "device": args.device,
                                               "modes": {name: r for name, r in rows}}, indent=1))


if __name__ == "__main__":
    main()
