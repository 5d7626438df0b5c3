"""Trainer benchmark: our `hf` trainer's `train_step` vs the bare transformers fwd+bwd+AdamW on the same tokens.

The model is a Qwen2-shaped causal LM with random weights, built offline and saved with `save_pretrained` (plus a
character-level tokenizer) into a temporary directory; both sides load it the same way (`load_pretrained` of a
`ModelConfig(source=<dir>)`), in the same precision and attention implementation. A step is R rollouts of
prompt P + completion C random tokens, groups of `--group-size` rollouts per prompt, random rewards; GRPO only.

- ours: `HFTrainer.train_step` (`lm_head` chunked by default: only completion positions reach the LM head),
  with `micro_batch_tokens` gradient accumulation.
- bare: one forward of the [R, P+C] batch with full logits for every position, a token-level policy-gradient
  loss over the completion positions (log_softmax in float32, gathered, times the group advantage), backward,
  the same gradient clipping, one AdamW step.

Each case runs in a fresh subprocess, so its peak memory is its own: CUDA `max_memory_allocated` (everything:
weights, gradients, AdamW state, activations), or on CPU `ru_maxrss` after the steps minus `ru_maxrss` once
the model, optimizer and batch exist (what the step adds). tokens/s = R x (P+C) / median step time (after one
warm-up step); MFU (CUDA) = 6 x params x tokens/s / peak FLOP/s. A CUDA out-of-memory in a case is "OOM".

    .venv/bin/python benchmarks/bench_trainer.py --quick                       # CI-sized, CPU, < 1 min
    .venv/bin/python benchmarks/bench_trainer.py --device cpu                  # the CPU tables in docs/trainer.md
    python3 benchmarks/bench_trainer.py --device cuda --model qwen0.5b --precision bf16-mixed

Goals (docs/trainer.md): >= 1.0x the bare step's tokens/s at the largest R the bare step fits, and a
256 x 1,024-token step of a 0.5B model on one 80 GB GPU.
"""

from __future__ import annotations

import argparse
import json
import math
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
GIB = 1024**3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import available_memory_gib, cpu_model, maxrss_bytes, package_versions, total_memory_gib  # noqa: E402

# Qwen2Config shapes. qwen0.5b is Qwen2.5-0.5B's shape (494M parameters, tied embeddings).
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=8192),
    "tiny-cpu": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=32_000),
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151_936, rope_theta=1_000_000.0),
}
Key = tuple[str, int, int | None]  # a case: (implementation, rollouts per step, micro_batch_tokens)
# Peak dense FLOP/s by GPU name fragment: (bf16, fp32 via TF32). H200 has the H100 SXM's compute.
PEAK_FLOPS = {"H100 PCIe": (756e12, 378e12), "H100": (989e12, 494.7e12), "H200": (989e12, 494.7e12)}


# ---- the model and the batch -----------------------------------------------------------------------------------


def build_model_dir(shape: dict[str, Any], out: Path, save_dtype: str, seed: int = 0) -> int:
    """A random-weight Qwen2 of `shape` + a character-level tokenizer saved into `out`; returns the parameters."""
    import string

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from composer_mesh.models.tokenizer import build_tokenizer

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = Qwen2Config(
        **shape, tie_word_embeddings=True, max_position_embeddings=32_768, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config).to(getattr(torch, save_dtype))
    model.save_pretrained(str(out))
    # The tokenizer only has to load (the batch is random ids); a model's embedding may exceed its tokenizer.
    build_tokenizer(string.ascii_letters + string.digits + string.punctuation + " ").save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def make_batch(rollouts: int, prompt: int, completion: int, vocab: int, group_size: int, seed: int = 0) -> Any:
    """A `TrainBatch` of random token ids, groups of `group_size` rollouts, random rewards, and old log-probs
    near a random-weight model's (-ln vocab), so the PPO ratio is about 1."""
    import torch

    from composer_mesh.actors.messages import (
        Prompt,
        RewardResult,
        Rollout,
        RolloutGroup,
        ScoredGroup,
        TrainBatch,
    )

    g = torch.Generator().manual_seed(seed)
    groups = []
    for start in range(0, rollouts, group_size):
        n = min(group_size, rollouts - start)
        pid = f"p{start // group_size}"
        prompt_ids = torch.randint(1, vocab, (prompt,), generator=g).tolist()
        outs = []
        for _ in range(n):
            ids = torch.randint(1, vocab, (completion,), generator=g).tolist()
            old = (-math.log(vocab) + 0.01 * torch.randn(completion, generator=g)).tolist()
            outs.append(Rollout(pid, prompt_ids, ids, old, weight_version=0))
        rewards = [RewardResult(score=float(s)) for s in torch.rand(n, generator=g)]
        groups.append(ScoredGroup(RolloutGroup(Prompt(pid, "", prompt_ids), outs), rewards))
    return TrainBatch(groups=groups)


# ---- inside a child: one case ---------------------------------------------------------------------------------


def _model_config(spec: dict[str, Any]) -> Any:
    from composer_mesh.models.config import ModelConfig

    return ModelConfig(source=spec["model_dir"], dtype="bfloat16" if spec["precision"] == "bf16" else "float32")


def _ours(spec: dict[str, Any], batch: Any) -> tuple[Callable[[], dict[str, float]], Any]:
    """`HFTrainer.train_step` on `batch`, GRPO only, no reference model."""
    from composer_mesh.actors.backends.trainer.hf_trainer import HFTrainer, HFTrainerSettings
    from composer_mesh.loss.config import LossConfig

    settings = HFTrainerSettings(
        device=spec["device"], torch_threads=spec["threads"], lr=1e-5, grad_clip=spec["grad_clip"],
        reference_model=False, micro_batch_tokens=spec["micro_batch_tokens"], packing=spec["packing"],
        precision=spec["precision"], activation_checkpointing=spec["activation_checkpointing"],
        lm_head=spec["lm_head"],
    )
    trainer = HFTrainer(settings)
    trainer.start(_model_config(spec), LossConfig(alpha_sdpo=0.0, beta_replay=0.0, kl_beta=0.0))

    def step() -> dict[str, float]:
        m = trainer.train_step(batch)
        return {"loss": m.loss, "micro_batches": m.metrics["micro_batches"]}

    return step, trainer.model


def _bare(spec: dict[str, Any], batch: Any) -> tuple[Callable[[], dict[str, float]], Any]:
    """Plain transformers: full-logits forward, token-level policy-gradient loss, backward, clip, AdamW."""
    import torch

    from composer_mesh.loss.grpo import group_advantages
    from composer_mesh.models.loading import load_pretrained

    torch.set_num_threads(spec["threads"])
    device, precision = spec["device"], spec["precision"]
    model, _ = load_pretrained(_model_config(spec), device=device)
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    if spec["activation_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, betas=(0.9, 0.99))
    rollouts = batch.rollouts()
    ids = torch.tensor([r.prompt_ids + r.completion_ids for r in rollouts], device=device)
    attention = torch.ones_like(ids)
    p = len(rollouts[0].prompt_ids)
    rewards = torch.tensor([rw.score for g in batch.groups for rw in g.rewards])
    groups = torch.tensor([i for i, g in enumerate(batch.groups) for _ in g.group.rollouts])
    adv = group_advantages(rewards, groups, scale_std=True).to(device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def step() -> dict[str, float]:
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        logp = torch.log_softmax(logits[:, p - 1 : -1].float(), dim=-1)
        token_logp = logp.gather(-1, ids[:, p:, None]).squeeze(-1)
        loss = -(token_logp * adv[:, None]).mean()
        loss.backward()
        del logits, logp, token_logp
        if spec["grad_clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        opt.step()
        return {"loss": float(loss.detach()), "micro_batches": 1.0}

    return step, model


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """One implementation at one size: warm-up step, then `steps` timed steps (inside the child process)."""
    import gc

    import torch

    cuda = torch.device(spec["device"]).type == "cuda"
    batch = make_batch(spec["rollouts"], spec["prompt"], spec["completion"], spec["vocab"], spec["group_size"])
    out: dict[str, Any] = {"status": "ok"}
    try:
        step, model = (_ours if spec["impl"] == "ours" else _bare)(spec, batch)
        gc.collect()
        base = torch.cuda.memory_allocated() if cuda else maxrss_bytes()
        times, info = [], {}
        for i in range(spec["steps"] + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            info = step()
            if cuda:
                torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except RuntimeError as e:  # the CPU allocator's out-of-memory
        if "can't allocate memory" in str(e):
            return {"status": "OOM"}
        raise
    peak = torch.cuda.max_memory_allocated() if cuda else maxrss_bytes() - base
    out.update(
        time_s=statistics.median(times), peak_bytes=float(peak), base_bytes=float(base), **info,
        device_name=torch.cuda.get_device_name() if cuda else cpu_model(),
        attn_implementation=str(model.config._attn_implementation),
    )
    return out


def child_main(spec_json: str) -> None:
    """Entry point of a child: run the case, print its result as the last line of stdout."""
    spec = json.loads(spec_json)
    result = run_case(spec)
    print(json.dumps(result))


# ---- the parent: cases, sweep, tables ---------------------------------------------------------------------------


class Cases:
    """Runs each distinct case once, in a fresh child, and remembers sizes that ran out of memory."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, params: int) -> None:
        self.args, self.model_dir, self.params = args, model_dir, params
        self.done: dict[Key, dict[str, Any]] = {}
        self.oom_at: dict[tuple[str, int | None], int] = {}

    def spec(self, impl: str, rollouts: int, budget: int | None) -> dict[str, Any]:
        """Everything a child needs to run one case (JSON-serialisable)."""
        a = self.args
        return dict(
            impl=impl, rollouts=rollouts, micro_batch_tokens=budget, model_dir=str(self.model_dir),
            device=a.device, precision=a.precision, prompt=a.prompt, completion=a.completion, vocab=a.vocab,
            group_size=a.group_size, steps=a.steps, threads=a.threads, grad_clip=a.grad_clip or None,
            packing=a.packing, lm_head=a.lm_head, activation_checkpointing=a.activation_checkpointing,
        )

    def _skip_reason(self, impl: str, rollouts: int, budget: int | None) -> str | None:
        smaller = self.oom_at.get((impl, budget))
        if smaller is not None and smaller <= rollouts:
            return f"OOM (at {smaller})"
        if impl == "bare" and self.args.device == "cpu":
            # full float32 logits, their log_softmax, its gradient and the logits' gradient
            need = 4 * rollouts * (self.args.prompt + self.args.completion) * self.args.vocab * 4
            if need > 0.8 * available_memory_gib() * GIB:
                return f"skipped (needs ~{need / GIB:.0f} GiB)"
        return None

    def run(self, impl: str, rollouts: int, budget: int | None) -> dict[str, Any]:
        """The row of one case (cached; not run when a smaller size already ran out of memory)."""
        key = (impl, rollouts, budget)
        if key in self.done:
            return self.done[key]
        spec = self.spec(impl, rollouts, budget)
        reason = self._skip_reason(impl, rollouts, budget)
        result = {"status": reason} if reason else self._spawn(spec)
        if str(result["status"]).startswith("OOM") and (impl, budget) not in self.oom_at:
            self.oom_at[(impl, budget)] = rollouts
        row = {k: spec[k] for k in ("impl", "rollouts", "micro_batch_tokens", "prompt", "completion")}
        row["tokens"] = rollouts * (spec["prompt"] + spec["completion"])
        row.update(result)
        if result["status"] == "ok":
            row["tokens_per_s"] = row["tokens"] / row["time_s"]
            row["peak_bytes_per_token"] = row["peak_bytes"] / row["tokens"]
            peak = peak_flops(self.args, row.get("device_name", ""))
            row["mfu"] = 6 * self.params * row["tokens_per_s"] / peak if peak else None
        self.done[key] = row
        return row

    def _spawn(self, spec: dict[str, Any]) -> dict[str, Any]:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        env.setdefault("HF_HUB_OFFLINE", "1")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=self.args.timeout,
                                  check=False)
        except subprocess.TimeoutExpired:
            return {"status": f"timeout ({self.args.timeout:.0f} s)"}
        if proc.returncode == -9:
            return {"status": "OOM (killed)"}
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1:] or [""]
            return {"status": f"failed (exit {proc.returncode}): {last[0][:200]}"}
        return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_flops(args: argparse.Namespace, device_name: str) -> float | None:
    """The dense peak FLOP/s MFU is measured against (None on CPU or an unknown GPU without --peak-tflops)."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if args.device == "cpu":
        return None
    for fragment, (bf16, tf32) in PEAK_FLOPS.items():
        if fragment in device_name:
            return tf32 if args.precision == "fp32" else bf16
    return None


def sweep_sizes(args: argparse.Namespace) -> list[int]:
    """--rollouts, or 1, 2, 4, ... up to and including --max-rollouts."""
    if args.rollouts:
        return sorted(set(args.rollouts))
    sizes, r = [], 1
    while r < args.max_rollouts:
        sizes.append(r)
        r *= 2
    return [*sizes, args.max_rollouts]


def sweep_keys(args: argparse.Namespace) -> list[Key]:
    """Table 1's cases in run order: per size, bare then ours at each budget."""
    keys: list[Key] = []
    for r in sweep_sizes(args):
        keys += [("bare", r, None), *(("ours", r, b or None) for b in args.micro_batch_tokens)]
    return keys


def table_keys(args: argparse.Namespace) -> list[Key]:
    """Table 2's cases: bare, then ours at each budget, all at --table-rollouts."""
    r = args.table_rollouts
    return [("bare", r, None), *(("ours", r, b or None) for b in args.table_micro_batch_tokens)]


def planned(args: argparse.Namespace) -> list[Key]:
    """Every distinct case, in run order."""
    return list(dict.fromkeys([*sweep_keys(args), *table_keys(args)]))


def run_all(args: argparse.Namespace, cases: Cases) -> list[dict[str, Any]]:
    """Run the planned cases one after another, with a progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plan = planned(args)
    rows = []
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("cases", total=len(plan))
        for impl, r, budget in plan:
            progress.update(task, description=f"{impl} R={r} micro_batch_tokens={budget or 'whole'}")
            row = cases.run(impl, r, budget)
            rows.append(row)
            rate = f"{row['tokens_per_s']:,.0f} tok/s" if row["status"] == "ok" else row["status"]
            progress.console.print(f"  {impl:>4} R={r:<4} mbt={budget or 'whole'!s:<6} {rate}")
            progress.advance(task)
    return rows


# ---- printing -------------------------------------------------------------------------------------------------


def _rate(row: dict[str, Any]) -> str:
    return f"{row['tokens_per_s']:,.0f}" if row["status"] == "ok" else str(row["status"])


def _num(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    value = row.get(key) if row["status"] == "ok" else None
    return "-" if value is None else format(value / scale, fmt)


def _ratio(ours: dict[str, Any], bare: dict[str, Any], key: str) -> str:
    if ours["status"] != "ok" or bare["status"] != "ok":
        return "-"
    return f"{ours[key] / bare[key]:.2f}x"


def _markdown(head: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


def sweep_table(args: argparse.Namespace, cases: Cases) -> list[str]:
    """Table 1: per size, bare and ours side by side (one line per ours micro-batch budget)."""
    cuda = args.device == "cuda"
    mem = "peak GiB" if cuda else "peak RSS growth GiB"
    head = ["rollouts", "tokens/step", "ours micro_batch_tokens", "micro-batches", "bare tok/s", "ours tok/s",
            "ours/bare tok/s", f"bare {mem}", f"ours {mem}", "ours/bare peak"]
    head += ["bare MFU", "ours MFU"] if cuda else []
    lines = []
    for r in sweep_sizes(args):
        bare = cases.run("bare", r, None)
        for budget in args.micro_batch_tokens:
            ours = cases.run("ours", r, budget or None)
            cells = [str(r), f"{ours['tokens']:,}", f"{budget:,}" if budget else "whole",
                     _num(ours, "micro_batches", ".0f"), _rate(bare), _rate(ours),
                     _ratio(ours, bare, "tokens_per_s"), _num(bare, "peak_bytes", ".2f", GIB),
                     _num(ours, "peak_bytes", ".2f", GIB), _ratio(ours, bare, "peak_bytes")]
            if cuda:
                cells += [_num(bare, "mfu", ".1%"), _num(ours, "mfu", ".1%")]
            lines.append(cells)
    return _markdown(head, lines)


def goal_line(args: argparse.Namespace, cases: Cases) -> str:
    """The issue's first goal, read off table 1: ours/bare tokens/s at the largest size the bare step fits."""
    fits = [r for r in sweep_sizes(args) if cases.run("bare", r, None)["status"] == "ok"]
    if not fits:
        return "the bare step fits at no size"
    r, bare = fits[-1], cases.run("bare", fits[-1], None)
    ratios = ", ".join(
        f"{_ratio(cases.run('ours', r, b or None), bare, 'tokens_per_s')} (micro_batch_tokens {b or 'whole'})"
        for b in args.micro_batch_tokens
    )
    ours_max = [r2 for r2 in sweep_sizes(args) if all(
        cases.run("ours", r2, b or None)["status"] == "ok" for b in args.micro_batch_tokens)]
    return (f"largest size the bare step ran: R={r}; ours/bare tok/s there: {ratios}; "
            f"largest size ours ran: R={ours_max[-1] if ours_max else '-'}")


def micro_batch_table(args: argparse.Namespace, cases: Cases) -> list[str]:
    """Table 2: one size, ours at decreasing micro-batch budgets (and bare for reference): memory per token."""
    mem = "peak" if args.device == "cuda" else "peak RSS growth"
    head = ["implementation", "micro_batch_tokens", "micro-batches", "step s", "tokens/s", f"{mem} GiB",
            f"{mem} KiB/token"]
    lines = []
    r = args.table_rollouts
    for impl, budget in [("bare", None), *(("ours", b or None) for b in args.table_micro_batch_tokens)]:
        row = cases.run(impl, r, budget)
        lines.append([
            "bare (full logits)" if impl == "bare" else "ours", f"{budget:,}" if budget else "whole",
            _num(row, "micro_batches", ".0f"), _num(row, "time_s", ".2f"), _rate(row),
            _num(row, "peak_bytes", ".2f", GIB), _num(row, "peak_bytes_per_token", ".1f", 1024),
        ])
    return _markdown(head, lines)


def describe(args: argparse.Namespace, params: int, rows: list[dict[str, Any]]) -> dict[str, str]:
    """Hardware, versions and the case, as printed above the tables and stored in the JSON."""
    ok = [r for r in rows if r["status"] == "ok"]
    hardware = f"{cpu_model()}, {os.cpu_count()} logical CPUs, {total_memory_gib():.1f} GiB RAM"
    if args.device == "cuda":
        hardware = f"{ok[0]['device_name'] if ok else 'GPU (no case ran)'}; host {hardware}"
    versions = package_versions("torch", "transformers", "composer-mesh")
    peak = peak_flops(args, ok[0]["device_name"] if ok else "")
    shape = args.shape
    return {
        "hardware": hardware,
        "versions": f"python {platform.python_version()}, " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "model": f"{args.model}: Qwen2, {params / 1e6:,.1f}M parameters (hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads / "
        f"{shape['num_key_value_heads']} kv, intermediate {shape['intermediate_size']}, vocab "
        f"{shape['vocab_size']:,}, tied embeddings), random weights",
        "step": f"R rollouts x ({args.prompt} prompt + {args.completion} completion) tokens, groups of "
        f"{args.group_size}, GRPO only; precision {args.precision}, attention "
        f"{ok[0]['attn_implementation'] if ok else '?'}, ours lm_head {args.lm_head}, packing {args.packing}, "
        f"activation checkpointing {args.activation_checkpointing}, grad clip {args.grad_clip or 'off'} "
        f"(both); median of {args.steps} steps after 1 warm-up; torch threads {args.threads}; "
        f"load average {args.load_at_start:.1f} at start",
        "memory": "torch.cuda.max_memory_allocated of the case's process (weights, grads, AdamW state, "
        "activations)" if args.device == "cuda" else "ru_maxrss after the steps minus ru_maxrss once model, "
        "AdamW and batch exist (what the step adds: gradients, AdamW state, activations)",
        "mfu": f"6 x params x tokens/s / {peak / 1e12:,.1f} TFLOP/s dense "
        f"({'TF32' if args.precision == 'fp32' else 'bf16'} peak)" if peak else "n/a",
    }


# ---- command line ---------------------------------------------------------------------------------------------

DEFAULTS: dict[str, dict[str, Any]] = {
    "quick": dict(model="quick", prompt=32, completion=96, rollouts=[2, 8], micro_batch_tokens=[512],
                  table_rollouts=8, table_micro_batch_tokens=[0, 512, 128], steps=2, precision="fp32"),
    "cpu": dict(model="tiny-cpu", prompt=128, completion=384, max_rollouts=16, micro_batch_tokens=[2048],
                table_rollouts=16, table_micro_batch_tokens=[0, 4096, 1024], steps=2, precision="fp32"),
    "cuda": dict(model="qwen0.5b", prompt=128, completion=896, max_rollouts=256, micro_batch_tokens=[16_384],
                 table_rollouts=64, table_micro_batch_tokens=[0, 16_384, 4096], steps=3, precision="bf16-mixed"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags; unset ones take the defaults of --quick, --device cpu or --device cuda."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="CI-sized: tiny model, two sizes (CPU, < 1 min)")
    p.add_argument("--model", choices=sorted(PRESETS), help="shape preset (cpu: tiny-cpu, cuda: qwen0.5b)")
    p.add_argument("--vocab", type=int, help="override the preset's vocab size")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--precision", choices=["fp32", "bf16-mixed", "bf16"], help="cpu: fp32, cuda: bf16-mixed")
    p.add_argument("--prompt", type=int, help="prompt tokens per rollout")
    p.add_argument("--completion", type=int, help="completion tokens per rollout")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (one GRPO group)")
    p.add_argument("--max-rollouts", type=int, help="sweep 1, 2, 4, ... up to this many rollouts per step")
    p.add_argument("--rollouts", type=int, nargs="+", help="sweep exactly these sizes instead")
    p.add_argument("--micro-batch-tokens", type=int, nargs="+",
                   help="ours' token budget in the sweep (0 = whole batch); several = one line each")
    p.add_argument("--table-rollouts", type=int, help="rollouts per step of the micro-batch table")
    p.add_argument("--table-micro-batch-tokens", type=int, nargs="+", help="budgets of that table (0 = whole)")
    p.add_argument("--packing", action="store_true", help="ours: padding-free packed micro-batches")
    p.add_argument("--lm-head", choices=["chunked", "full"], default="chunked", help="ours: LM head mode")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute layers (both sides)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip on both sides (0 = off)")
    p.add_argument("--steps", type=int, help="timed steps per case, after 1 warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per case (trainer default 1)")
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s for MFU (default: by GPU name and precision)")
    p.add_argument("--ranks", type=int, nargs="+",
                   help="instead of the sweep: one replica sharded with FSDP2 over each of these numbers of procs, "
                   "the same global batch (--table-rollouts rollouts) at every N (benchmarks/trainer_ranks.py)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    p.add_argument("--json", type=Path, help="also write hardware, settings and every row here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in DEFAULTS["quick" if args.quick else args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.shape = dict(PRESETS[args.model])
    for flag, key in (("vocab", "vocab_size"), ("hidden", "hidden_size"), ("layers", "num_hidden_layers")):
        if getattr(args, flag) is not None:
            args.shape[key] = getattr(args, flag)
    args.vocab = args.shape["vocab_size"]
    args.load_at_start = os.getloadavg()[0]
    return args


def report(args: argparse.Namespace, cases: Cases, rows: list[dict[str, Any]]) -> None:
    """Print the header and both tables; write the JSON when asked."""
    info = describe(args, cases.params, rows)
    print()
    for key, text in info.items():
        print(f"{key}: {text}")
    print("\nours vs bare, sweep over rollouts per step (goal: ours/bare tok/s >= 1.00x at the largest R bare fits)")
    print("\n".join(sweep_table(args, cases)))
    print(goal_line(args, cases))
    print(f"\nmicro-batch budget at R={args.table_rollouts} ({args.table_rollouts * (args.prompt + args.completion):,}"
          " tokens per step): memory per token falls with the budget")
    print("\n".join(micro_batch_table(args, cases)))
    if args.json:
        payload = {
            **info, "params": cases.params, "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "sweep": [cases.run(*key) for key in sweep_keys(args)],
            "micro_batch_table": [cases.run(*key) for key in table_keys(args)],
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def report_ranks(args: argparse.Namespace, model_dir: Path, params: int) -> None:
    """`--ranks`: the sharded replica at each N, one table (and the JSON when asked)."""
    # Monarch procs import the actor's module (`trainer_ranks`) and this one by name: both on their path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), ROOT,
                                                             os.environ.get("PYTHONPATH")]))
    from trainer_ranks import run_ranks, table

    rollouts, budget = args.table_rollouts, (args.micro_batch_tokens or [None])[0]
    spec = dict(model_dir=str(model_dir), device=args.device, precision=args.precision, prompt=args.prompt,
                completion=args.completion, vocab=args.vocab, group_size=args.group_size, steps=args.steps,
                threads=args.threads, lm_head=args.lm_head, rollouts=rollouts, micro_batch_tokens=budget,
                tokens=rollouts * (args.prompt + args.completion))
    rows = run_ranks(spec, args.ranks)
    info = describe(args, params, [])
    info["memory"] = "each rank's parameter shards and AdamW state (DTensor.to_local), counted after the warm-up step"
    info.pop("mfu", None)
    print()
    for key, text in info.items():
        print(f"{key}: {text}")
    print(f"\none replica sharded over N procs (FSDP2), the same global batch: {rollouts} rollouts x "
          f"{args.prompt + args.completion} tokens, micro_batch_tokens {budget}")
    print("\n".join(table(rows)))
    if args.json:
        args.json.write_text(json.dumps({**info, "params": params, "ranks": rows}, indent=2, default=str) + "\n")


def main() -> None:
    """Build the model once, run every case in its own child, print the tables."""
    args = parse_args()
    if args.child:
        child_main(args.child)
        return
    model_dir = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    try:
        save_dtype = "bfloat16" if args.model == "qwen0.5b" else "float32"
        params = build_model_dir(args.shape, model_dir, save_dtype)
        if args.ranks:
            report_ranks(args, model_dir, params)
            return
        cases = Cases(args, model_dir, params)
        rows = run_all(args, cases)
        report(args, cases, rows)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
