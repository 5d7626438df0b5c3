"""`run.environment`: prompts and scoring from an environment library (reasoning-gym), in one typed section.

Import-cheap (pydantic only): topology validation imports it without torch, Monarch or the library itself
(only whether the library is installed is checked here; the dataset name and its config are checked when the
run builds its prompt source, which imports the library).

Why one section under `run:`: the prompt source is the run's (`run.task`, `run.data`), and everything the
reward function needs travels with each prompt (`Prompt.extra`), so the rewarder section names only the
function and the dataset's settings are written once.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.errors import FieldError

# reasoning-gym seeds entry i of a dataset with `seed + i`: eval entries use seeds train entries never reach.
EVAL_SEED_OFFSET = 10**9
MAX_SIZE = 10**8  # so `seed + index` of a train entry stays below the eval seeds


def library_missing(module: str, extra: str) -> str:
    """The error for an environment whose library is not installed, naming the extra that installs it."""
    return f"run.environment needs the {module!r} package: pip install 'composer-mesh[{extra}]'"


def _json_values(field: str, value: Any, *, in_model: bool = True) -> None:
    """`value` crosses to the reward workers as JSON: a YAML value that has no JSON form (a date, a set) is an
    error at its field now, not a TypeError in a worker later (`in_model`: raised by a model validator, so the
    error names the field; a field validator's error is at the field already)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise FieldError(field if in_model else (), f"run.environment.{field} must hold JSON values only: {e}") from None


class ReasoningGymConfig(BaseModel):
    """A reasoning-gym dataset as the run's prompts, scored by the library's own `score_answer`.

    reasoning-gym (https://github.com/open-thought/reasoning-gym) generates entries procedurally and offline; the
    reward function is `composer_mesh.envs.reasoning_gym:score`. See docs/reasoning_gym.md."""

    model_config = ConfigDict(extra="forbid")
    plays_episodes: ClassVar[bool] = False  # scored completions only (run.rollout.kind: single_turn)

    kind: Literal["reasoning_gym"] = Field(description="Which environment library: 'reasoning_gym'.")
    dataset: str = Field(min_length=1, description="A reasoning-gym dataset name, e.g. 'basic_arithmetic', "
                         "'leg_counting', 'chain_sum' (`reasoning_gym.factory.DATASETS` lists them).")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The dataset's config fields (its config dataclass, e.g. {min_terms: 2, "
        "max_digits: 1}); `seed` and `size` are set by this section."
    )
    size: int = Field(10_000, ge=1, le=MAX_SIZE, description="Train entries (indices 0..size-1 of the train seed), "
                      "generated when drawn, in index order; the stream starts over after the last.")
    eval_size: int = Field(64, ge=0, description="Distinct held-out questions (from their own seed; train entries "
                           "asking one of them are skipped). run.eval_prompts scores the first ones.")
    seed: int | None = Field(None, ge=0, description="Seed of the train entries (eval: seed + 10^9); null: run.seed.")
    system_prompt: str | None = Field(
        "default", description="A system message before each question: a name of reasoning-gym's SYSTEM_PROMPTS "
        "('default', 'DeepSeekZero', 'simple', 'direct', 'chain_of_draft'; they ask for the final answer in "
        "<answer></answer> tags) or the text itself; null: none (the question alone, e.g. for a tiny model)."
    )

    @field_validator("kind")
    @classmethod
    def _installed(cls, v: str) -> str:
        if importlib.util.find_spec("reasoning_gym") is None:
            raise ValueError(library_missing("reasoning_gym", "reasoning-gym"))
        return v

    @field_validator("config")
    @classmethod
    def _no_seed_or_size(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted({"seed", "size"} & set(v))
        if taken:
            raise FieldError(taken[0], f"set {', '.join(taken)} as run.environment.{taken[0]} (the section's own "
                             "field), not inside run.environment.config")
        _json_values("config", v, in_model=False)  # it travels with every prompt (Prompt.extra) to the reward function
        return v



# ---- OpenEnv (composer_mesh.envs.openenv) ----------------------------------------------------------------
class ClientSettings(BaseModel):
    """How a client talks to the environment server: timeouts and retries (also sent to the reward workers)."""

    model_config = ConfigDict(extra="forbid")

    connect_timeout_s: float = Field(10.0, gt=0, description="Seconds to open the WebSocket session.")
    message_timeout_s: float = Field(30.0, gt=0, description="Seconds for the server to answer one reset or step.")
    max_retries: int = Field(3, ge=0, description="Retries of an episode after the first attempt: for a server that "
                             "is unreachable, at its session limit, dropped the connection or timed out.")
    backoff_s: float = Field(0.5, ge=0, description="First retry delay; doubles each retry, with jitter (×0.5–1).")
    backoff_max_s: float = Field(8.0, ge=0, description="Upper bound of one retry delay in seconds.")


class ServerCommand(BaseModel):
    """A local environment server the run starts before its first prompt and stops after its last step."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(
        min_length=1, description="argv of the server. `{python}` is this interpreter, `{host}` and `{port}` come "
        "from run.environment.url, e.g. [\"{python}\", -m, uvicorn, --factory, "
        "composer_mesh.envs.openenv:addition_app, --host, \"{host}\", --port, \"{port}\"]."
    )
    ready_timeout_s: float = Field(120.0, gt=0, description="Seconds for `GET <url>/health` to answer 200.")
    log: str | None = Field(None, description="File for the server's output (null: a temporary file).")


class OpenEnvConfig(ClientSettings):
    """An OpenEnv environment server as the run's prompts (`run.environment: {kind: openenv, ...}`), scored by
    replaying each episode (`composer_mesh.envs.openenv:score`)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["openenv"] = Field(description="Which environment library: 'openenv'.")
    url: str = Field(description="The environment server, http(s):// or ws(s):// (its WebSocket API is <url>/ws). "
                     "The rewarder's processes connect to it too: on several hosts, name this host, not 127.0.0.1.")
    server: ServerCommand | None = Field(None, description="Start this server for the run (null: it is running).")
    prompt_field: str = Field("prompt", description="The reset observation's field holding the prompt text.")
    messages_field: str | None = Field(None, description="Instead of `prompt_field`: a field with chat messages "
                                       "[{role, content}]; the prompt's text is the last user message.")
    answer_field: str | None = Field(None, description="A reset observation field with the reference answer "
                                     "(shown and passed to rewards; the environment's own reward scores).")
    action_field: str = Field("message", description="The action field the completion is sent in.")
    split_field: str | None = Field("split", description="The reset argument naming the split ('train' or 'eval'; "
                                    "an environment without one ignores it). null: none is sent.")
    reset: dict[str, Any] = Field(default_factory=dict, description="Further reset arguments (JSON values).")
    system_prompt: str | None = Field(None, description="A system message before the prompt (chat prompt).")
    eval_size: int = Field(64, ge=0, description="Distinct held-out prompts (from the eval seeds; train prompts "
                           "that are one of them are skipped). run.eval_prompts scores the first ones.")
    seed: int | None = Field(None, ge=0, lt=EVAL_SEED_OFFSET, description="First train seed; null: run.seed.")
    episodes: bool = Field(False, description="Play each prompt as a multi-step episode (reset, then one step per "
                           "policy turn until the environment says done; `OpenEnvEnvironment.session`) instead of "
                           "scoring one completion with `composer_mesh.envs.openenv:score`.")
    tools: bool = Field(False, description="An MCP environment (episodes only): its tools (ListToolsAction at "
                        "reset) are declared to the chat template, and the policy's <tool_call> blocks are played "
                        "as CallToolActions; a turn without one is answered with a reminder, not sent.")
    feedback_field: str | None = Field(None, description="Episodes without tools: the step observation's field "
                                       "with the text shown to the policy as the next user turn; null: "
                                       "`prompt_field`.")

    @field_validator("kind")
    @classmethod
    def _installed(cls, v: str) -> str:
        if importlib.util.find_spec("openenv") is None:
            raise ValueError(library_missing("openenv", "openenv"))
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://", "ws://", "wss://")) or not urlsplit(v).hostname:
            raise ValueError(f"url must be http(s):// or ws(s):// with a host, got {v!r}")
        return v.rstrip("/")

    @property
    def plays_episodes(self) -> bool:
        """Whether its prompts are played as episodes (run.rollout.kind: multi_turn): only with `episodes: true`."""
        return self.episodes

    @model_validator(mode="after")
    def _consistent(self) -> OpenEnvConfig:
        taken = {"seed", self.split_field} & set(self.reset)
        if taken:
            raise FieldError("reset", f"run.environment.reset sets {sorted(k for k in taken if k)}: the prompt source "
                             "sets the seed and split of each episode")
        if self.tools and not self.episodes:
            raise FieldError("tools", "run.environment.tools needs episodes: true (tool calls are played over several "
                             "steps)")
        _json_values("reset", self.reset)  # crosses to the reward workers as JSON
        if self.server is not None and urlsplit(self.url).port is None:
            raise FieldError("server", "run.environment.server needs a port in run.environment.url (e.g. "
                             "http://127.0.0.1:8765)")
        return self


# ---- verifiers (composer_mesh.envs.verifiers) ------------------------------------------------------------
class VerifiersConfig(BaseModel):
    """A verifiers environment as the run's prompts (`run.environment: {kind: verifiers, taskset: ...}`), scored by
    its tasks' own rewards (`composer_mesh.envs.verifiers:score`)."""

    model_config = ConfigDict(extra="forbid")
    plays_episodes: ClassVar[bool] = True  # completions (single_turn), or episodes with its tools (multi_turn)

    kind: Literal["verifiers"] = Field(description="Which environment library: 'verifiers'.")
    taskset: str = Field(min_length=1, description="The taskset id: an installed taskset package (a top-level module "
                         "exporting one vf.Taskset subclass in __all__), e.g. 'gsm8k-v1'; or such a module's dotted "
                         "path, e.g. 'composer_mesh.envs.addition_taskset' (the shipped example).")
    taskset_config: dict[str, Any] = Field(default_factory=dict, description="Further fields of the taskset's "
                                           "config (its TasksetConfig subclass), e.g. {task: {rewards: ...}}.")
    env: str = Field("", description="An Env id to pair with the taskset (verifiers' `--env.id`); empty: the "
                     "taskset's own Env, else SingleAgentEnv.")
    eval_taskset_config: dict[str, Any] | None = Field(
        None, description="The eval set from the same taskset with these config fields on top of taskset_config "
        "(e.g. {split: test}); null: hold out eval_size prompts by hash."
    )
    eval_size: int | None = Field(None, ge=0, description="Prompts held out by a hash of the prompt (null: a tenth "
                                  "of the distinct prompts, at most 64). Not with eval_taskset_config.")
    chat: bool = Field(True, description="Prompts as chat messages (the task's system prompt and prompt, as a "
                       "verifiers harness sends them); false: the prompt text alone, for a model without a chat "
                       "template (e.g. the tiny one): then a task may have neither a system prompt nor several turns.")
    limit: int | None = Field(None, ge=1, description="Use the first `limit` tasks (of each of the train and eval "
                              "tasksets); needed for an infinite taskset.")
    seed: int | None = Field(None, description="Seed of the per-epoch shuffle; null: run.seed.")

    @field_validator("kind")
    @classmethod
    def _installed(cls, v: str) -> str:
        if importlib.util.find_spec("verifiers") is None:
            raise ValueError(library_missing("verifiers", "verifiers"))
        return v

    @model_validator(mode="after")
    def _consistent(self) -> VerifiersConfig:
        if self.eval_taskset_config is not None and self.eval_size is not None:
            raise FieldError("eval_size", "run.environment: eval_taskset_config and eval_size both choose the eval "
                             "set; set one")
        for name in ("taskset_config", "eval_taskset_config"):
            value = getattr(self, name)
            if value is not None and "id" in value:
                raise FieldError((name, "id"), f"run.environment.{name} sets `id`: name the taskset in "
                                 "run.environment.taskset")
            _json_values(name, value)  # crosses to the reward workers as JSON
        return self

    def env_config(self, split: str = "train") -> dict[str, Any]:
        """The verifiers environment config (`vf.resolve_env_config` input) of the train or eval tasks."""
        fields = dict(self.taskset_config)
        if split == "eval" and self.eval_taskset_config is not None:
            fields.update(self.eval_taskset_config)
        return {"id": self.env, "taskset": {**fields, "id": self.taskset}}


# ---- the calculator tool-use task (composer_mesh.envs.calculator) ---------------------------------------
class CalculatorConfig(BaseModel):
    """A tool-use task played as episodes: multiply two numbers through a `calculator` tool (docs/agentic.md).

    Small enough for the tiny byte-level model to learn on CPU. The prompt is the product alone (e.g. `47*83`);
    reward 1 when the final answer is the product, else 0."""

    model_config = ConfigDict(extra="forbid")
    plays_episodes: ClassVar[bool] = True  # its prompts are played as episodes (run.rollout.kind: multi_turn)

    kind: Literal["calculator"] = Field(description="Which environment: 'calculator' (built in, no library).")
    min_digits: int = Field(2, ge=1, le=9, description="Fewest digits of an operand.")
    max_digits: int = Field(3, ge=1, le=9, description="Most digits of an operand (each operand draws its digit "
                            "count uniformly from min_digits..max_digits, then its value among the numbers of that "
                            "many digits, 1-digit ones being 1..9).")
    eval_size: int = Field(64, ge=0, description="Distinct held-out problems (from their own seed; a train problem "
                           "with the same operands, in either order, is skipped). run.eval_prompts scores the first.")
    seed: int | None = Field(None, ge=0, description="Seed of the train stream (eval: its own); null: run.seed.")
    system_prompt: str | None = Field(None, description="A system message before each problem; null: none (every "
                                      "prompt byte is a token for the tiny model).")
    tool_latency_s: float = Field(0.0, ge=0, le=60, description="For benchmarks: every calculator call first waits "
                                  "this many seconds (an asyncio sleep, so concurrent episodes overlap their waits), "
                                  "standing in for a slow tool such as a sandbox or a search backend.")

    @model_validator(mode="after")
    def _consistent(self) -> CalculatorConfig:
        if self.min_digits > self.max_digits:
            raise FieldError("max_digits", f"run.environment: min_digits {self.min_digits} > max_digits "
                             f"{self.max_digits}")
        if 2 * self.eval_size > self.problems():
            raise FieldError("eval_size", f"run.environment: eval_size {self.eval_size} holds out more than half of "
                             f"the {self.problems()} distinct problems of {self.min_digits}..{self.max_digits} digits")
        return self

    def problems(self) -> int:
        """How many distinct problems (unordered operand pairs) there are."""
        n = 10 ** self.max_digits - 10 ** (self.min_digits - 1)  # operands 10^(min-1) .. 10^max - 1
        return n * (n + 1) // 2


# The `run.environment` section: one model per environment kind, told apart by `kind`.
EnvironmentConfig = Annotated[
    ReasoningGymConfig | OpenEnvConfig | VerifiersConfig | CalculatorConfig | CodingConfig, Field(discriminator="kind")
]
