"""The run's plot: reward and per-channel loss curves as one PNG."""

from __future__ import annotations

from pathlib import Path

from composer_mesh.orchestration.metrics import StepRecord


def plot_run(records: list[StepRecord], path: Path) -> Path:
    """PNG with the reward curve and one curve per loss channel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_r.plot(steps, [r.reward for r in records], marker=".", label="train reward (mean)")
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("reward")
    ax_r.grid(alpha=0.3)
    ax_r.legend()
    channels = sorted({k for r in records for k in r.channels})
    for ch in channels:
        ax_l.plot(steps, [r.channels.get(ch, float("nan")) for r in records], label=ch)
    ax_l.plot(steps, [r.loss for r in records], color="black", linewidth=1, label="total")
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("loss")
    ax_l.grid(alpha=0.3)
    ax_l.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
