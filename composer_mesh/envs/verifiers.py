"""verifiers (https://github.com/PrimeIntellect-ai/verifiers, PyPI `verifiers` 0.4) environments as a run's prompts
and rewards.

verifiers 0.4 composes an environment (`vf.Env`) from a taskset (`vf.Taskset`: typed `vf.Task`s, each holding its
`TaskData` and its `@vf.reward` functions) and the agents that play it (a `vf.Harness` per seat). A taskset is an
installed package, named by its id (`verifiers.v1.tasksets.<id>`, or a top-level module exporting one `Taskset`
subclass in `__all__`); a dotted module path (e.g. the shipped `composer_mesh.envs.addition_taskset`) is imported
here and handed to verifiers under a top-level alias (`verifiers_id`). The environment is loaded with
`vf.load_environment` and its taskset's tasks become the prompts; our generators play the agent, so a completion
is scored the way `vf-replay` re-scores a saved trace: a `vf.Trace` of the prompt and the completion,
`await task.score(trace)`, the weighted sum `trace.reward`.
Rewards that need a runtime (the sandbox an agent ran in) cannot run on a completion alone: a task with only
those is an error, a task with some is scored by the others (logged once).

Train and eval: by default the eval set is a tenth of the distinct prompts (at most 64), held out by a hash of
each prompt as `run.data` does; or the same taskset with other config fields (`eval_taskset_config`, e.g. a test
split). Either way a train task whose prompt is an eval prompt is left out. The train stream walks the train
tasks in an order shuffled per epoch. A row's `extra["verifiers"]` carries the environment's config and the
task's data (JSON), so the reward function (`composer_mesh.envs.verifiers:score`, run by the `python` rewarder's
worker processes) rebuilds the very task, with no state of its own: a plain function path, no binding.

This module stays import-cheap (pydantic only): `verifiers` is imported when an environment is loaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import random
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from composer_mesh.envs.base import StreamPosition
from composer_mesh.envs.config import VerifiersConfig
from composer_mesh.tasks.data import DataRow, default_eval_size, held_out_score

if TYPE_CHECKING:
    import verifiers.v1 as vf

log = logging.getLogger("composer_mesh.envs.verifiers")

EXTRA_KEY = "verifiers"  # Prompt.extra[EXTRA_KEY]: {"env": environment config, "task": task data}
T = TypeVar("T")


def library_version() -> str:
    return importlib.metadata.version("verifiers")


def verifiers_id(taskset: str) -> str:
    """The id verifiers 0.4 resolves for `taskset`. It imports an id as a top-level module (or one of its own
    `verifiers.v1.tasksets`), so a dotted module path, a taskset inside a package, is imported here and
    registered under a top-level alias (its dots as underscores): the same in every process that loads it."""
    if "." not in taskset or "/" in taskset or "@" in taskset:  # an id (a hub id may be `owner/name@1.0`)
        return taskset
    module = importlib.import_module(taskset)
    alias = taskset.replace(".", "_").lower()  # verifiers lowercases ids
    if sys.modules.setdefault(alias, module) is not module:
        raise ValueError(f"taskset {taskset!r}: a module {alias!r} (its alias for verifiers) is already imported")
    return alias


@functools.lru_cache(maxsize=16)
def _environment(config_json: str) -> vf.Env:
    """The environment of a config (JSON with sorted keys), loaded once per process."""
    import verifiers.v1 as vf

    config = json.loads(config_json)
    config["taskset"]["id"] = verifiers_id(config["taskset"]["id"])
    return vf.load_environment(vf.resolve_env_config(config))


def load(config: dict[str, Any]) -> vf.Env:
    """`vf.load_environment` of `config`; errors name the taskset and say what failed."""
    try:
        return _environment(json.dumps(config, sort_keys=True))
    except (ImportError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"verifiers cannot load the environment {config}: {type(e).__name__}: {e}") from e


def prompt_messages(data: Any) -> list[dict[str, Any]]:
    """A task's chat prompt: its system prompt, then its prompt (a text, or verifiers messages), in the form chat
    templates take (transformers': an assistant's `tool_calls` with their arguments as a dict, a tool result with
    the called tool's `name` and `tool_call_id`). Refused, naming the task: non-text parts, a call whose
    arguments are not a JSON object, a tool result answering no earlier call."""
    from verifiers.v1.types import content_text

    out: list[dict[str, Any]] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if data.prompt is None:
        raise ValueError(f"verifiers task {data.idx} has no prompt (the user opens the conversation): a run "
                         "needs the task's opening")
    if isinstance(data.prompt, str):
        return [*out, {"role": "user", "content": data.prompt}]
    names: dict[str, str] = {}  # tool call id -> the called tool
    for message in data.prompt:
        content = message.content
        if not (content is None or isinstance(content, str)) and any(p.type != "text" for p in content):
            raise ValueError(f"verifiers task {data.idx}: a {message.role} message with non-text parts "
                             f"({', '.join(sorted({p.type for p in content}))}); only text prompts are supported")
        out.append(_template_message(message, content_text(content), names, data.idx))
    return out


def _template_message(message: Any, text: str, names: dict[str, str], idx: int | None) -> dict[str, Any]:
    """One verifiers message as a chat template takes it; `names` collects the calls made so far."""
    if message.role == "tool":
        if message.tool_call_id not in names:
            raise ValueError(f"verifiers task {idx}: a tool message answers call {message.tool_call_id!r}, which no "
                             "earlier assistant message made")
        return {"role": "tool", "name": names[message.tool_call_id], "content": text,
                "tool_call_id": message.tool_call_id}
    if message.role != "assistant" or not message.tool_calls:
        return {"role": message.role, "content": text}
    calls = []
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"verifiers task {idx}: tool call {call.id!r} ({call.name}) has arguments that are not "
                             f"a JSON object: {call.arguments[:60]!r}")
        names[call.id] = call.name
        calls.append({"type": "function", "id": call.id, "function": {"name": call.name, "arguments": arguments}})
    return {"role": "assistant", "content": text, "tool_calls": calls}


def task_row(task: Any, config: dict[str, Any], chat: bool = True) -> DataRow:
    """A prompt row for a task of the environment `config`; `extra["verifiers"]` rebuilds it for scoring.
    `chat=False`: the prompt's text alone (refused for a task with a system prompt or several messages)."""
    messages = prompt_messages(task.data)
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not chat and len(messages) > 1:
        raise ValueError(f"verifiers task {task.data.idx} of {config['taskset']['id']!r} has {len(messages)} prompt "
                         "messages (a system prompt, or several turns): set run.environment.chat: true")
    answer = getattr(task.data, "answer", None)
    return DataRow(text=users[-1] if users else messages[-1]["content"],
                   answer=None if answer is None else str(answer), messages=messages if chat else None,
                   extra={EXTRA_KEY: {"env": config, "task": task.data.model_dump(mode="json")}},
                   where=f"verifiers {config['taskset']['id']}, task {task.data.idx}")


def taskset_rows(config: dict[str, Any], limit: int | None, chat: bool = True) -> list[DataRow]:
    """Every task of the environment `config` (the first `limit`) as a row."""
    taskset = load(config).taskset
    if limit is not None:
        taskset = taskset.take(limit)
    if not taskset.bounded:
        raise ValueError(f"verifiers taskset {config['taskset']['id']!r} is infinite: set run.environment.limit")
    rows = [task_row(task, config, chat) for task in taskset]
    if not rows:
        raise ValueError(f"verifiers taskset {config['taskset']['id']!r} has no tasks")
    return rows


def _distinct(rows: list[DataRow]) -> list[DataRow]:
    seen: dict[str, DataRow] = {}
    for row in rows:
        seen.setdefault(row.key, row)
    return list(seen.values())


class VerifiersEnvironment(StreamPosition):
    """A verifiers environment's tasks as a train stream and a disjoint, fixed eval set
    (`composer_mesh.envs.Environment`). Loads every task here, so a bad taskset fails the run before any work."""

    changed = "run.environment, the seed, the taskset or verifiers changed"

    def __init__(self, cfg: VerifiersConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, cfg.seed if cfg.seed is not None else seed
        self.name = f"verifiers/{cfg.taskset}"
        rows = taskset_rows(cfg.env_config("train"), cfg.limit, cfg.chat)
        if cfg.eval_taskset_config is not None:
            self.eval = _distinct(taskset_rows(cfg.env_config("eval"), cfg.limit, cfg.chat))
        else:
            distinct = _distinct(rows)
            size = cfg.eval_size if cfg.eval_size is not None else default_eval_size(len(distinct))
            self.eval = sorted(distinct, key=lambda r: held_out_score(r.key))[:size]
        keys = {r.key for r in self.eval}
        self.train = [r for r in rows if r.key not in keys]
        if not self.train:
            raise ValueError(f"run.environment: no train tasks left in {self.name} ({len(rows)} tasks, every one "
                             "asks an eval prompt)")
        # Train tasks left out because their prompt is an eval prompt (beyond the held-out tasks themselves).
        self.dropped = len(rows) - len(self.train) - (len(self.eval) if cfg.eval_taskset_config is None else 0)
        if self.dropped:
            log.warning("run.environment: %d task(s) of %s left out of training: their prompt is in the eval set",
                        self.dropped, self.name)
        self.position = 0
        self.digest = self._digest()
        self._epoch = -1
        self._order: list[int] = []  # the current epoch's order of the train tasks

    def epoch_order(self, epoch: int) -> list[int]:
        """The train tasks' order in `epoch`: a permutation seeded by the seed and the epoch."""
        order = list(range(len(self.train)))
        random.Random(f"composer-mesh/verifiers/{self.seed}/{epoch}").shuffle(order)
        return order

    def train_rows(self, n: int) -> list[DataRow]:
        out = []
        for _ in range(n):
            epoch, at = divmod(self.position, len(self.train))
            if epoch != self._epoch:
                self._epoch, self._order = epoch, self.epoch_order(epoch)
            out.append(self.train[self._order[at]])
            self.position += 1
        return out

    def eval_rows(self, n: int) -> list[DataRow]:
        return self.eval[:n]

    def _digest(self) -> str:
        ident = {"library": library_version(), "env": self.cfg.env_config("train"), "seed": self.seed,
                 "chat": self.cfg.chat, "eval_env": self.cfg.env_config("eval"), "train": [r.key for r in self.train],
                 "eval": [r.key for r in self.eval]}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


    def close(self) -> None:
        """Nothing to release: the tasksets run in this process."""


# ---------------------------------------------------------------------------------------------- reward
def score(prompt: str, completion: str, answer: str | None, extra: dict[str, Any] | None = None) -> float:
    """Reward function for the `python` rewarder (`composer_mesh.envs.verifiers:score`): the task the prompt was
    made from (rebuilt from `extra["verifiers"]`) scores a trace of its prompt and the completion with its own
    rewards (`Task.score`); the result is their weighted sum."""
    where = (extra or {}).get(EXTRA_KEY)
    if not isinstance(where, dict):
        raise ValueError("the prompt has no extra['verifiers'] (only prompts of a verifiers run.environment can be "
                         "scored with composer_mesh.envs.verifiers:score)")
    task = rebuild_task(where["env"], where["task"])
    trace = completion_trace(task, completion)
    _run_sync(task.score(trace))
    if not trace.rewards:
        raise ValueError(f"verifiers task {type(task).__name__} recorded no reward for the completion: its rewards "
                         f"{_runtime_rewards(task) or '(none)'} need a runtime (the sandbox an agent ran in)")
    return float(trace.reward)


def rebuild_task(config: dict[str, Any], data: dict[str, Any]) -> vf.Task:
    """The environment's task for `data` (a task's data as JSON), with the taskset's task config."""
    taskset = load(config).taskset
    task_cls = type(taskset).task_type()
    task = task_cls(task_cls.data_type().model_validate(data), taskset.config.task)
    skipped = _runtime_rewards(task)
    if skipped:
        _warn_once(type(task).__name__, tuple(skipped))
    return task


def completion_trace(task: vf.Task, completion: str) -> vf.Trace:
    """A trace of one turn: the task's prompt messages, then the completion as the model's (sampled) answer."""
    import verifiers.v1 as vf

    return task_trace(task, [*opening_messages(task.data), (vf.AssistantMessage(content=completion), True)])


def opening_messages(data: Any) -> list[tuple[vf.Message, bool]]:
    """The task's opening conversation as verifiers messages (none sampled): its system prompt, then its prompt.
    Checked as `prompt_messages` checks it."""
    import verifiers.v1 as vf

    prompt_messages(data)
    system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    prompt = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
    return [(m, False) for m in [*system, *prompt]]


def task_trace(task: vf.Task, messages: list[tuple[vf.Message, bool]]) -> vf.Trace:
    """A finished trace of one conversation: each message with whether the policy sampled it, in order (one
    branch), as verifiers records a rollout for `Task.score`."""
    import verifiers.v1 as vf

    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m, sampled=sampled)
             for i, (m, sampled) in enumerate(messages)]
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True)


def _runtime_rewards(task: vf.Task) -> list[str]:
    """The task's rewards that need a runtime (a `runtime` parameter without a default): skipped offline."""
    def needs(fn: Any) -> bool:
        param = inspect.signature(fn).parameters.get("runtime")
        return param is not None and param.default is inspect.Parameter.empty

    return sorted(fn.__name__ for fn in task.hooks("reward") if needs(fn))


@functools.cache
def _warn_once(task: str, rewards: tuple[str, ...]) -> None:
    log.warning("verifiers task %s: rewards %s need a runtime and are left out (scored offline)", task, list(rewards))


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on a private event loop (in a helper thread when this thread already runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verifiers-score") as pool:
        return pool.submit(asyncio.run, coro).result()
