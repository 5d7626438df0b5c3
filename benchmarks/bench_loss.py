"""Channel-2 benchmark: chunked generalized JSD vs the naive full-materialisation reference, side by side.

Each case (vocab x implementation) runs in a fresh subprocess so its peak memory is its own: the child
allocates the student logits (requires_grad) and the dense teacher logits, records its peak RSS
(`ru_maxrss`, which sees torch's CPU allocations, unlike tracemalloc), then runs forward+backward
`--iters` times (the first is a warm-up, not timed) and reports the median time and the new peak RSS.
"overhead" = peak RSS - RSS after the inputs exist, i.e. what the loss itself (including the logits'
gradient, which both implementations must produce) adds on top of the logits.

    .venv/bin/python benchmarks/bench_loss.py                 # 2,048 tokens, vocab 151,936 and 32,000
    .venv/bin/python benchmarks/bench_loss.py --tokens 256    # quick look

Target (issue 2): chunked peak memory <= 0.5x the reference, time no worse.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024**3

sys.path.insert(0, ROOT)
from machine import available_memory_gib, cpu_model, maxrss_bytes, total_memory_gib  # noqa: E402

from composer_mesh.loss.config import LossConfig  # noqa: E402  (cheap: no torch import)


def run_case(
    impl: str, vocab: int, tokens: int, iters: int, beta: float, chunk: int | None, threads: int
) -> dict[str, float]:
    """Runs inside the child process."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)

    from composer_mesh.loss.distill import DistillParams, distill_loss_chunked, distill_loss_naive

    torch.manual_seed(0)
    student = torch.randn(1, tokens, vocab).mul_(2.0).requires_grad_()
    teacher = torch.randn(1, tokens, vocab).mul_(2.0)
    mask = torch.ones(1, tokens, dtype=torch.bool)
    params = DistillParams(beta=beta, chunk_tokens=chunk)
    fn = distill_loss_chunked if impl == "chunked" else distill_loss_naive
    base = maxrss_bytes()
    times = []
    loss_value = 0.0
    grad_norm = 0.0
    for i in range(iters):
        student.grad = None
        t0 = time.perf_counter()
        out = fn(student, teacher, mask, params)
        out.loss.backward()
        dt = time.perf_counter() - t0
        if i > 0 or iters == 1:
            times.append(dt)
        loss_value = float(out.loss.detach())
        assert student.grad is not None
        grad_norm = float(student.grad.norm())
        del out
    peak = maxrss_bytes()
    return {
        "time_s": statistics.median(times),
        "peak_bytes": float(peak),
        "base_bytes": float(base),
        "overhead_bytes": float(peak - base),
        "loss": loss_value,
        "grad_norm": grad_norm,
    }


def _spawn(impl: str, vocab: int, args: argparse.Namespace) -> dict[str, float] | str:
    # rough need of the naive reference: inputs (2) + grad (1) + ~12 full float32 intermediates
    need = (15 if impl == "naive" else 5) * args.tokens * vocab * 4
    avail = available_memory_gib() * GIB
    if need > avail:
        return f"skipped: needs ~{need / GIB:.1f} GiB, {avail / GIB:.1f} GiB available"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        impl,
        "--vocab",
        str(vocab),
        "--tokens",
        str(args.tokens),
        "--iters",
        str(args.iters),
        "--beta",
        str(args.beta),
        *(["--chunk", str(args.chunk)] if args.chunk is not None else []),
        "--threads",
        str(args.threads),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151_936, 32_000])
    parser.add_argument(
        "--iters", type=int, default=3, help="forward+backward runs per case; the first is warm-up"
    )
    parser.add_argument("--beta", type=float, default=0.5, help="sdpo_jsd_beta (0.5 = the general JSD path)")
    parser.add_argument(
        "--chunk",
        type=int,
        default=LossConfig.model_fields["sdpo_chunk_tokens"].default,
        help="sdpo_chunk_tokens of the chunked implementation (default: LossConfig's, i.e. none: "
        "loss_chunk_elements // vocab tokens per chunk)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in each case (0 = torch default). Default 1: on a shared, oversubscribed "
        "box OpenMP spin-waiting makes multi-threaded timings meaningless; both implementations get the same.",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = run_case(
            args.child, args.vocab[0], args.tokens, args.iters, args.beta, args.chunk, args.threads
        )
        print(json.dumps(result))
        return

    import torch

    print(f"hardware: {cpu_model()}, {os.cpu_count()} logical CPUs, {total_memory_gib():.1f} GiB RAM")
    print(
        f"versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"torch threads per case {args.threads or torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    print(
        f"case: channel 2 generalized JSD beta={args.beta}, {args.tokens} tokens, float32 student+teacher logits, "
        f"forward+backward, median of {max(args.iters - 1, 1)} timed runs after 1 warm-up; "
        f"chunk={args.chunk or 'loss_chunk_elements // vocab'} tokens"
    )
    print("naive = same formula with plain autograd over the full [tokens, vocab] tensors (TRL GKD style)\n")
    header = (
        f"{'vocab':>8} | {'impl':>7} | {'fwd+bwd s':>9} | {'peak RSS GiB':>12} | {'overhead GiB':>12} | "
        f"{'inputs GiB':>10} | {'loss':>10}"
    )
    print(header)
    print("-" * len(header))
    summary = []
    for vocab in args.vocab:
        results: dict[str, dict[str, float] | str] = {}
        for impl in ("naive", "chunked"):
            res = _spawn(impl, vocab, args)
            results[impl] = res
            if isinstance(res, str):
                print(f"{vocab:>8} | {impl:>7} | {res}")
                continue
            inputs = 2 * args.tokens * vocab * 4 / GIB
            print(
                f"{vocab:>8} | {impl:>7} | {res['time_s']:>9.2f} | {res['peak_bytes'] / GIB:>12.2f} | "
                f"{res['overhead_bytes'] / GIB:>12.2f} | {inputs:>10.2f} | {res['loss']:>10.6f}"
            )
        naive, chunked = results["naive"], results["chunked"]
        if isinstance(naive, dict) and isinstance(chunked, dict):
            summary.append(
                (
                    vocab,
                    chunked["time_s"] / naive["time_s"],
                    chunked["peak_bytes"] / naive["peak_bytes"],
                    chunked["overhead_bytes"] / naive["overhead_bytes"],
                    abs(chunked["loss"] - naive["loss"]),
                )
            )
    print("\nratios chunked / naive (lower is better; target: peak <= 0.50, time <= 1.00)")
    print(f"{'vocab':>8} | {'time':>6} | {'peak RSS':>8} | {'overhead':>8} | {'|loss diff|':>11}")
    for vocab, t, p, o, d in summary:
        print(f"{vocab:>8} | {t:>6.2f} | {p:>8.2f} | {o:>8.2f} | {d:>11.2e}")


if __name__ == "__main__":
    main()
