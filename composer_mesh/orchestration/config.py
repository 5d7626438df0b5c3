"""The topology's `run:` section: steps, batch shape, sampling and the policy-lag bound of a run.

Import-cheap (pydantic only): topology validation imports it without torch or Monarch.
"""

from __future__ import annotations

import importlib.util
import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer_mesh.actors.teacher_topk import DEFAULT_TOP_K, DENSE_VOCAB_LIMIT
from composer_mesh.envs.config import EnvironmentConfig
from composer_mesh.errors import FieldError
from composer_mesh.tasks.data import DataConfig

Logger = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
# The module each tracker needs and the pip extra that installs it (`composer-mesh[<extra>]`).
TRACKER_MODULES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def tracker_missing(name: str) -> str:
    """The error for a tracker whose library is not installed, naming the extra that installs it."""
    return f"run.loggers names {name!r} but {TRACKER_MODULES[name]} is not installed: pip install 'composer-mesh[{name}]'"


class TrackersConfig(BaseModel):
    """Settings of the experiment trackers `run.loggers` names (TensorBoard needs none)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, description="The run's name in every tracker; null: the name of "
                             "`run_dir`. A resumed run keeps its tracker runs (their ids are in the checkpoint).")
    wandb_project: str = Field("composer-mesh", min_length=1, description="W&B project.")
    wandb_entity: str | None = Field(None, min_length=1, description="W&B entity (user or team); null: the default "
                                     "of the logged-in account.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: W&B writes under <run_dir>/wandb only (`wandb sync` uploads it later); "
        "online: it streams to the W&B server (needs `wandb login` or WANDB_API_KEY)."
    )
    mlflow_tracking_uri: str | None = Field(
        None, min_length=1, description="MLflow tracking store: a path (a local file store), sqlite:///..., or a "
        "server's http(s):// URL. null: <run_dir>/mlruns."
    )
    mlflow_experiment: str = Field("composer-mesh", min_length=1, description="MLflow experiment the run is in.")


class ProgressConfig(BaseModel):
    """How often `run` writes a progress line when its output is not a terminal, whichever comes first.

    A Slurm log, nohup or `> log` gets timestamped lines; a terminal gets a live line redrawn at every step."""

    model_config = ConfigDict(extra="forbid")

    every_steps: int = Field(10, ge=1, description="A line at least every this many steps (and for the first "
                             "and the last step).")
    every_s: float = Field(30.0, gt=0, description="A line at the first step after this many seconds without one "
                           "(a step slower than this gets a line of its own).")


class HintsConfig(BaseModel):
    """Targeted feedback (`run.rollout.hints`, docs/agentic.md "Targeted feedback"): at the first policy turn of an
    episode that went wrong, a hint is inserted into the conversation before that turn; the current policy
    conditioned on it (on a generator, with its current weights) scores the student's own tokens from that turn
    on, and channel 2 distils toward it on those policy tokens only."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["none", "environment", "rule", "teacher"] = Field(
        "none", description="Where hints come from. none: no targeted feedback. environment: the feedback the "
        "environment gave on the first turn it saw a mistake in (StepResult.feedback: a tool error, a failing "
        "visible test, a wrong answer), through `template`. rule: the Python function `rule` names decides. "
        "teacher: at that same turn, the teacher `teacher` (a member with channel hint: hf, vllm or openrouter) "
        "reads the episode so far with the feedback and writes the hint.")
    teacher: str | None = Field(
        None, description="source teacher: the name of the teachers member (channels: [hint]) that writes hints.")
    max_tokens: int = Field(64, ge=1, le=4096, description="source teacher: the longest hint it may write, in its "
                            "own tokens.")
    transcript_chars: int = Field(
        6000, ge=100, description="source teacher: the transcript the hint writer reads is cut to its last this "
        "many characters (the mistake and its feedback are at its end), so a long episode fits its context.")
    instruction: str = Field(
        "The conversation below is an attempt at a task that went wrong at its last assistant turn; the "
        "environment's feedback follows it. Write one short hint (one or two sentences) that would have helped the "
        "assistant avoid the mistake, without giving away the final answer.", min_length=1,
        description="source teacher: the system message the hint writer is given before the transcript.")
    rule: str | None = Field(
        None, description="source rule: 'pkg.mod:fn', called as fn(prompt, steps) with the episode's prompt and its "
        "steps (one per policy turn: the messages before it, its text, the environment's reward, feedback and "
        "counters); returns a Hint(turn, text) (composer_mesh.orchestration.rollout.hints) or None.")
    template: str = Field(
        "Hint: {feedback}", min_length=1, description="source environment: the hint's text; {feedback} is the "
        "environment's feedback.")
    role: Literal["user", "system"] = Field(
        "user", description="The chat role of the inserted hint message.")

    @model_validator(mode="after")
    def _rule_given(self) -> HintsConfig:
        if (self.source == "rule") != (self.rule is not None):
            raise FieldError("rule" if self.rule is not None else "source", "run.rollout.hints.rule names the rule function exactly when source is rule "
                             f"(source {self.source!r}, rule {self.rule!r})")
        if (self.source == "teacher") != (self.teacher is not None):
            raise FieldError("teacher" if self.teacher is not None else "source", "run.rollout.hints.teacher names the hint-writing teacher exactly when source "
                             f"is teacher (source {self.source!r}, teacher {self.teacher!r})")
        if self.rule is not None and (self.rule.count(":") != 1 or not all(self.rule.split(":"))):
            raise FieldError("rule", f"run.rollout.hints.rule {self.rule!r} is not an import path 'pkg.mod:fn'")
        if "{feedback}" not in self.template:
            raise FieldError("template", f"run.rollout.hints.template {self.template!r} has no {{feedback}} "
                             "placeholder")
        return self


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class HarnessConfig(BaseModel):
    """Where the OpenAI-compatible endpoint of a harness run listens and who may call it
    (`run.rollout.harness`, `run.rollout.kind: harness`; docs/agentic.md "Your agent harness as the rollout")."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", min_length=1, description="harness: the address the Chat Completions endpoint "
                      "binds on the controller's host. Anything but a loopback address needs token_env.")
    port: int = Field(0, ge=0, le=65535, description="harness: its port; 0 picks a free one (logged, and in each "
                      "task's base_url).")
    token_env: str | None = Field(
        None, min_length=1, description="harness: the environment variable holding the bearer token every caller "
        "must send (`Authorization: Bearer <token>`, the openai client's api_key); required when host is not a "
        "loopback address. The token itself never appears in the topology, logs or metrics.")
    agent: str | None = Field(
        None, min_length=1, description="harness: 'pkg.mod:fn', an `async def fn(task: HarnessTask) -> float | None` "
        "that plays one episode against task.base_url and returns its reward (None: the rewarder scores the last "
        "answer). null: tasks wait for an outside agent at GET /v1/episodes/next.")
    model_name: str = Field("policy", min_length=1, description="harness: the model id the endpoint lists and "
                            "answers with (a request may name any model: it is always the policy).")

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> HarnessConfig:
        if self.token_env is None and not is_loopback(self.host):
            raise FieldError("host", f"run.rollout.harness.token_env is required: host {self.host!r} is not a "
                             "loopback address, and the endpoint must refuse unauthenticated callers there")
        return self


class RolloutConfig(BaseModel):
    """How a prompt becomes training data (`run.rollout`): one completion (`single_turn`), or an episode of
    turns played against `run.environment` (`multi_turn`: the policy calls tools, the environment answers, until
    it is done or a limit ends it). See docs/agentic.md."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["single_turn", "multi_turn", "harness"] = Field(
        "single_turn", description="single_turn: one completion per sample, scored by the rewarder. multi_turn: "
        "one episode per sample, played against run.environment (which must be one that plays episodes) and "
        "scored by it; run.max_new_tokens caps each policy turn. harness: one episode per sample played by your "
        "own agent through an OpenAI-compatible endpoint (run.rollout.harness), rewarded by it or the rewarder.")
    max_turns: int = Field(8, ge=1, description="multi_turn: policy turns per episode; an episode still going "
                           "after them ends with status truncated_turns.")
    max_context: int | None = Field(
        None, ge=8, description="multi_turn: longest episode in tokens (prompt + every turn); a turn that would not "
        "fit with run.max_new_tokens more ends it (truncated_context). null: the model's context length.")
    step_timeout_s: float = Field(60.0, gt=0, description="multi_turn: seconds for the environment to answer one "
                                  "turn (tools included); past it the episode ends with status error_timeout.")
    episode_timeout_s: float | None = Field(
        None, gt=0, description="multi_turn: wall-clock seconds of one episode (generation included); past it the "
        "episode ends with status truncated_time. null: no limit.")
    environment_retries: int = Field(
        0, ge=0, description="multi_turn: an episode whose environment failed (an exception, a dead server) is "
        "played again from its start with the same seed up to this many times; after that it is trained on "
        "with status error_environment and reward 0 (not scored: `RewardResult.ok` false).")
    max_episodes: int = Field(256, ge=1, description="multi_turn: episodes in flight at once over all generators.")
    hints: HintsConfig = Field(
        default_factory=HintsConfig, description="multi_turn: targeted feedback as self-distillation "
        "(`HintsConfig`): a hint at an episode's first mistake makes the current policy its own channel-2 teacher "
        "on the tokens after it.")
    turn_linger_s: float = Field(
        0.05, ge=0, description="multi_turn: a free generator waits up to this long for the turns of every playing "
        "episode (those not already being sampled) to arrive, so one request samples them all instead of the first "
        "alone (the episodes' tool results come back a few at a time); a replay teacher's request of its episodes' "
        "turns does the same. 0: take whatever is waiting.")
    harness: HarnessConfig = Field(default_factory=HarnessConfig, description="harness: the endpoint your agent "
                                   "calls (`HarnessConfig`).")


class RunConfig(BaseModel):
    """Steps, batch shape and policy-lag bound of the built-in async RL loop."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field("addition", description="Built-in task name or import path 'pkg.mod:Task' giving prompts and answers.")
    data: DataConfig | None = Field(
        None, description="Prompts from local data (JSONL, Parquet, a datasets directory, a cached hub dataset) "
        "instead of `task` (then leave `task` unset); see docs/data.md."
    )
    environment: EnvironmentConfig | None = Field(
        None, description="Prompts and scoring from an environment library instead of `task`/`data`: "
        "{kind: reasoning_gym, dataset, config, ...}; score with composer_mesh.envs.reasoning_gym:score. "
        "See docs/reasoning_gym.md. {kind: calculator}: a tool-use task played as episodes (docs/agentic.md)."
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="One completion per sample, or multi-turn episodes against "
        "run.environment (`RolloutConfig`); see docs/agentic.md.")
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
    stop_after_failed_reward_steps: int = Field(
        3, ge=0, description="Stop the run (exit 3, naming the reward function and its last error) once every "
        "rollout's reward failed in this many consecutive steps: a reward that fails everywhere trains on nothing "
        "but `failure_score`. 0: never stop for it."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A step whose loss or gradient is not finite (NaN, inf) never updates the weights. "
        "stop: the run stops with one line naming the step and the quantity (exit 3) and the newest checkpoint, "
        "which is from before it, to `--resume` from. skip: the step's update is skipped (no optimizer step, the "
        "weights unchanged bitwise), counted in the metric `faults/nonfinite_skipped`, and the run goes on; not "
        "with `diloco` (a replica that skips a step would leave its rounds' cadence)."
    )
    eval_prompts: int = Field(
        64, ge=0, description="Held-out prompts (the prompt source's eval set, never trained on) evaluated before "
        "and after training and every `eval_every` steps (0: no evaluation). A task that lists its eval split "
        "(addition: 20 problems) gives each problem at most once, so at most that many.")
    eval_every: int = Field(0, ge=0, description="Also evaluate every this many steps while training (0: only "
                            "before and after). Runs on generator 0 between its chunks; the event says which "
                            "weight version it saw.")
    eval_pass_k: int = Field(4, ge=0, description="pass@k of each evaluation: k completions per held-out prompt "
                             "at `temperature`; a prompt passes when one scores 1 (0: greedy reward only).")
    loggers: list[Logger] = Field(
        default_factory=lambda: ["jsonl"], description="Where step metrics go: `jsonl` (<run_dir>/metrics.jsonl, "
        "always on), `tensorboard` (<run_dir>/tensorboard), `wandb`, `mlflow`; each tracker is a pip extra "
        "(`composer-mesh[wandb]`). See docs/trackers.md."
    )
    trackers: TrackersConfig = Field(
        default_factory=TrackersConfig, description="Settings of the trackers in `loggers` (`TrackersConfig`)."
    )
    progress: ProgressConfig = Field(
        default_factory=ProgressConfig, description="How often progress lines are written when the output is not "
        "a terminal (`ProgressConfig`); see docs/launch.md."
    )

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

    @field_validator("loggers")
    @classmethod
    def _loggers_installed(cls, v: list[str]) -> list[str]:
        """JSONL first and always; each tracker's library checked now, before anything is launched."""
        names = list(dict.fromkeys(["jsonl", *v]))
        missing = [n for n in names[1:] if importlib.util.find_spec(TRACKER_MODULES[n]) is None]
        if missing:
            raise ValueError("; ".join(tracker_missing(n) for n in missing))
        return names

    @model_validator(mode="after")
    def _tracker_settings_used(self) -> RunConfig:
        # Settings off their default for a tracker the run does not use are a mistake (by value, not by
        # `model_fields_set`: a dumped and re-validated config has every field set).
        unused = [k for k, f in TrackersConfig.model_fields.items()
                  if "_" in k and k.split("_")[0] not in self.loggers and getattr(self.trackers, k) != f.default]
        if unused:
            raise FieldError(("trackers", unused[0]), "; ".join(
                f"run.trackers.{k} is set but run.loggers {self.loggers} does not name {k.split('_')[0]!r}"
                for k in unused))
        return self

    @model_validator(mode="after")
    def _one_prompt_source(self) -> RunConfig:
        # `task` keeps its default beside `data` (the field cannot tell "unset" once a config is re-validated)
        if self.data is not None and self.task != "addition":
            raise FieldError("data", f"run.task ({self.task!r}) and run.data are two prompt sources; set one")
        if self.environment is not None and (self.data is not None or self.task != "addition"):
            raise FieldError("environment", "run.environment and run." + ("data" if self.data is not None else "task")
                             + " are two prompt sources; set one")
        if self.rollout.kind == "multi_turn" and not getattr(self.environment, "plays_episodes", False):
            what = f"run.environment kind {self.environment.kind!r}" if self.environment is not None else "no " \
                "run.environment"
            raise FieldError(self._episodes_field(), f"run.rollout.kind multi_turn plays episodes against an "
                             f"environment, and {what} plays none: use kind calculator, coding, verifiers, or openenv "
                             "with episodes: true (docs/agentic.md)")
        if self.rollout.hints.source != "none" and self.rollout.kind != "multi_turn":
            raise FieldError(("rollout", "hints", "source"), "run.rollout.hints gives feedback inside episodes: it "
                             "needs run.rollout.kind multi_turn")
        own = getattr(self.environment, "max_turns", None)
        if self.rollout.kind == "multi_turn" and own is not None and own > self.rollout.max_turns:
            raise FieldError(("environment", "max_turns"), f"run.environment.max_turns ({own}) is more than "
                             f"run.rollout.max_turns ({self.rollout.max_turns}): the driver would cut episodes before "
                             "the environment grades its last turn; raise run.rollout.max_turns or lower the "
                             "environment's")
        return self

    def _episodes_field(self) -> tuple[str, ...]:
        """Where a multi_turn run without an environment that plays episodes is wrong: the environment's
        `episodes` switch when it has one (OpenEnv), its kind when it has none, `rollout.kind` without one."""
        if self.environment is None:
            return ("rollout", "kind")
        return ("environment", "episodes" if "episodes" in type(self.environment).model_fields else "kind")
