"""LoRA benchmark: what LoRA changes for the trainer, against full fine-tuning of the same model, side by side.

One process, one model directory, two trainer services (`hf` binding, GRPO + k3 KL to the reference so the
reference pass is included): full fine-tuning (a deep-copied reference) and LoRA (`trainer.settings.lora`,
`all-linear`; the reference is the same model with its adapters off). Reported per mode: mean `train_step`
time (forward, backward, AdamW and the weight publish the generators get), trainable parameters, the
trainer-state size a checkpoint writes (weights or adapters + AdamW moments), the bytes one publish carries
(merged full weights, or the adapters alone with `sync: adapter`), the time to build them, and on CUDA the
peak memory of a step.

    .venv/bin/python benchmarks/bench_lora.py --quick     # CI-sized, CPU, < 1 min
    .venv/bin/python benchmarks/bench_lora.py             # the CPU table in docs/models.md
    python3 benchmarks/bench_lora.py --device cuda --model qwen0.5b
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
from bench_checkpoint import PRESETS
from bench_trainer import build_model_dir, make_batch
from machine import cpu_model, package_versions

MIB = 1024**2


def service(model_dir: Path, device: str, lora: dict[str, Any] | None) -> Any:
    from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
    from composer_mesh.actors.trainer import TrainerService
    from composer_mesh.loss.config import LossConfig
    from composer_mesh.mesh.weights.config import WeightPlaneConfig
    from composer_mesh.models.config import ModelConfig

    settings = HFTrainerSettings(device=device, torch_threads=os.cpu_count() or 1, lora=lora)
    svc = TrainerService(HFTrainer(settings), WeightPlaneConfig(transport="endpoint"))
    svc.start(ModelConfig(source=str(model_dir)), LossConfig(alpha_sdpo=0.0, beta_replay=0.0, kl_beta=0.01),
              temperature=1.0)
    svc.publish()
    return svc


def measure(svc: Any, batch: Any, steps: int, device: str) -> dict[str, float]:
    import torch

    backend = svc.backend
    svc.train_step(batch)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        svc.train_step(batch)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    published = backend.named_weights()
    publish_s = time.perf_counter() - t0
    snapshot = backend.snapshot_state(extra={"weight_version": svc.version})
    out = {
        "step_s": statistics.mean(times),
        "trainable": float(sum(p.numel() for p in backend.model.parameters() if p.requires_grad)),
        "state_mib": snapshot.nbytes / MIB,
        "publish_mib": sum(t.numel() * t.element_size() for t in published.values()) / MIB,
        "publish_s": publish_s,
    }
    if device.startswith("cuda"):
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 1024**3
    return out


def adapter_publish(svc: Any) -> dict[str, float]:
    """What `sync: adapter` would carry for the same adapters (the adapter tensors alone)."""
    from composer_mesh.models.lora import adapter_weights

    t0 = time.perf_counter()
    named = {n: t.float() for n, t in adapter_weights(svc.backend.model).items()}
    return {"publish_mib": sum(t.numel() * t.element_size() for t in named.values()) / MIB,
            "publish_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (CI smoke test)")
    p.add_argument("--model", default="cpu-100m", choices=sorted(PRESETS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--json", help="also write the results as JSON to this file")
    args = p.parse_args()
    name = "quick" if args.quick else args.model
    shape = PRESETS[name]
    steps = 2 if args.quick else args.steps
    lora = {"r": args.rank, "alpha": 2 * args.rank, "target_modules": "all-linear"}
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model_dir(shape, Path(tmp) / "model", "float32")
        batch = make_batch(args.rollouts, 32, 32, shape["vocab_size"], 4)
        for mode, cfg in (("full fine-tuning", None), (f"LoRA r={args.rank}, sync merged", lora)):
            svc = service(Path(tmp) / "model", args.device, cfg)
            rows[mode] = measure(svc, batch, steps, args.device)
            if cfg is not None:
                rows[f"LoRA r={args.rank}, sync adapter"] = {**rows[mode], **adapter_publish(svc)}
            svc.close()
            del svc
    base = rows["full fine-tuning"]
    versions = package_versions("torch", "transformers", "peft")
    print(f"# LoRA vs full fine-tuning — {platform.node()} {cpu_model()} device={args.device}; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"# model {name}: {params / 1e6:.1f}M parameters; {steps} steps of {args.rollouts} rollouts x 64 tokens, "
          "GRPO + KL to the reference; ratios are to full fine-tuning")
    peak = "peak_gib" in base
    print("| mode | step s | x step | trainable | x trainable | state MiB | x state | publish MiB | x publish "
          f"| publish build s |{' peak GiB |' if peak else ''}")
    print(f"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|{'---:|' if peak else ''}")
    for mode, r in rows.items():
        print(f"| {mode} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | {r['trainable'] / 1e6:.2f}M "
              f"| {r['trainable'] / base['trainable']:.4f} | {r['state_mib']:.1f} | {r['state_mib'] / base['state_mib']:.3f} "
              f"| {r['publish_mib']:.1f} | {r['publish_mib'] / base['publish_mib']:.3f} | {r['publish_s']:.3f} |"
              + (f" {r['peak_gib']:.2f} |" if peak else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"params": params, "versions": versions, "device": args.device,
                                               "hardware": cpu_model(), "modes": rows}, indent=1))


if __name__ == "__main__":
    main()
