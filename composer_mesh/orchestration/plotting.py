"""The run's plot: reward, per-channel loss, and where each step's time went, as one PNG."""

from __future__ import annotations

from pathlib import Path

from composer_mesh.orchestration.metrics import StepRecord

# The timing panel: the trainer's side of a step (idle + train + sync = the step's wall time) stacked, and the
# work done for the step elsewhere as lines (summed over requests: several generators overlap).
TRAINER_TIMES = ("trainer_idle_s", "train_s", "sync_s")
WORK_TIMES = ("generate_s", "score_s", "teacher_s", "generator_idle_s")


def plot_run(records: list[StepRecord], path: Path) -> Path:
    """PNG with the reward curve, one curve per loss channel, and the per-step time breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (ax_r, ax_l, ax_t) = plt.subplots(1, 3, figsize=(15, 3.8))
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
    if any(r.timing for r in records):
        stacked = [[r.timing.get(k, 0.0) for r in records] for k in TRAINER_TIMES]
        ax_t.stackplot(steps, stacked, labels=[f"trainer: {k[:-2].replace('trainer_', '')}" for k in TRAINER_TIMES],
                       alpha=0.6)
        for k in WORK_TIMES:
            ax_t.plot(steps, [r.timing.get(k, float("nan")) for r in records], linewidth=1, label=k[:-2])
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("seconds")
    ax_t.set_title("where the time goes", fontsize=9)
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
