"""The topology's `run:` section: steps, batch shape, sampling and the policy-lag bound of a run.

Import-cheap (pydantic only): topology validation imports it without torch or Monarch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from composer_mesh.actors.teacher_topk import DEFAULT_TOP_K, DENSE_VOCAB_LIMIT


class RunConfig(BaseModel):
    """Steps, batch shape and policy-lag bound of the built-in async RL loop."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field("addition", description="Built-in task name or import path 'pkg.mod:Task' giving prompts and answers.")
    steps: int = Field(40, ge=1, description="Optimizer steps (trainer `train_step` calls) in the run.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts in one training batch (GRPO groups per step).")
    samples_per_prompt: int = Field(4, ge=2, description="Completions sampled per prompt (GRPO group size).")
    max_new_tokens: int = Field(4, ge=1, description="Completion length cap for generators and teacher traces.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the generators.")
    max_policy_lag: int = Field(
        1, ge=0, description="How many weight versions a rollout may lag the trainer when trained on. It paces "
        "generation: a step's prompts are sampled only once the generators hold weights within the bound, so nothing "
        "is generated to be dropped. 0 = synchronous on-policy training (reproducible for a seed); k lets "
        "generation run up to k steps ahead of training."
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling (arXiv:2503.14476): a group whose rewards are all equal (no GRPO "
        "signal) is set aside and replaced by a fresh prompt, so a step trains on prompts_per_step informative groups."
    )
    dynamic_sampling_max_draws: int = Field(
        4, ge=1, description="Dynamic sampling draws at most this many times prompts_per_step prompts for one step; "
        "past that the step is filled with set-aside groups (counted as `sampling/short_step`)."
    )
    teacher_top_k: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description=f"Top-k of channel-2 teacher distributions: 'auto' = dense logits when the student's vocabulary "
        f"has at most {DENSE_VOCAB_LIMIT:,} ids, else top-{DEFAULT_TOP_K}; 0 forces dense; k > 0 forces top-k. "
        "Dense costs tokens x vocab x 4 bytes per rollout (~622 MB for 1,024 tokens at 151,936 ids), top-k "
        f"tokens x k x 12 bytes. Top-{DEFAULT_TOP_K} typically holds most of a trained teacher's probability "
        "mass per token at ~1/1,600 of those bytes (local teachers are not capped at the ~20 log-probs "
        "hosted APIs return). Top-k distillation renormalises teacher and student on the teacher's k ids.",
    )
    seed: int = Field(0, description="Seed for prompt sampling and generation.")
    run_dir: Path = Field(Path("runs/local"), description="Where metrics.jsonl, checkpoints and plot.png are written.")
    checkpoint_every: int = Field(
        50, ge=0, description="Save a full checkpoint (trainer state, optimizer, RNGs, prompt stream, rollouts not yet "
        "trained on) every N steps, and at the end; 0: only at the end. If the trainer dies, `--resume` continues "
        "from the last one, so this bounds the steps lost. A stop (SIGTERM, Ctrl-C, a Slurm warning) always "
        "checkpoints. Resume with `composer-mesh run FILE --resume`."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Full checkpoints kept; older ones are deleted after each commit.")
    checkpoint_url: str | None = Field(
        None, description="Where full checkpoints go: a path or any fsspec URL (file://, s3://, gs://) that the "
        "controller and the trainer procs can both reach. null: <run_dir>/checkpoints."
    )
    max_restarts: int = Field(
        3, ge=0, description="How many times the procs of a generators, rewarder or teachers mesh are replaced "
        "after one died (kill -9, OOM) before the run stops with a checkpoint. The trainer is never replaced: its "
        "death stops the run, and `--resume` continues from the last checkpoint."
    )
    eval_prompts: int = Field(
        64, ge=0, description="Held-out prompts (the prompt source's eval set, never trained on) evaluated before "
        "and after training and every `eval_every` steps (0: no evaluation).")
    eval_every: int = Field(0, ge=0, description="Also evaluate every this many steps while training (0: only "
                            "before and after). Runs on generator 0 between its chunks; the event says which "
                            "weight version it saw.")
    eval_pass_k: int = Field(4, ge=0, description="pass@k of each evaluation: k completions per held-out prompt "
                             "at `temperature`; a prompt passes when one scores 1 (0: greedy reward only).")

    @property
    def checkpoints_url(self) -> str:
        """Where full checkpoints go: `checkpoint_url`, else `<run_dir>/checkpoints`."""
        return self.checkpoint_url or str(self.run_dir / "checkpoints")

    @field_validator("task")
    @classmethod
    def _task_named(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("task must name a built-in task (e.g. 'addition') or an import path 'pkg.mod:Task'")
        return v
