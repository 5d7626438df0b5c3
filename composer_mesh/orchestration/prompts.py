"""Where a run's prompts come from: a train stream and a fixed eval set, disjoint by construction.

Three sources: `TaskPrompts` samples a procedural `Task` (its "train" and "eval" splits), `DataPrompts` walks the
rows of a data set (`run.data`, read by `composer_mesh.tasks.data`) in a shuffled order per epoch, and
`EnvironmentPrompts` draws an environment's stream (`run.environment`, `composer_mesh.envs`). The train
stream's position is part of a run checkpoint (`state()` / `restore()`, JSON), so a resumed run draws exactly the
prompts the uninterrupted one would have. `close()` (called by the run when it ends) releases what a source
started, such as an environment's server. Train prompts are `p<N>` (N: index in the stream, across epochs), eval
prompts `eval<N>`. Token ids are left empty: the generators' tokenizer fills them in.
"""

from __future__ import annotations

import inspect
import logging
import random
from abc import ABC, abstractmethod
from typing import Any

from composer_mesh.actors.messages import Prompt
from composer_mesh.envs import Environment, EnvironmentStateError, load_environment
from composer_mesh.envs.session import EpisodeEnvironment
from composer_mesh.errors import UserInputError
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.tasks import Task, get_task
from composer_mesh.tasks.data import DataRow, PromptData, load_prompt_data

log = logging.getLogger("composer_mesh.prompts")

EVAL_SEED_OFFSET = 10_000  # a task's eval set is sampled with seed + this (the same prompts every evaluation)


class PromptSourceError(UserInputError, ValueError):
    """A prompt source that cannot give what is asked: no eval split, or a checkpoint of another stream."""


class PromptSource(ABC):
    """A train stream (`take`, endless, deterministic for a seed) and an eval set (`eval_prompts`, the same each
    time) that share no prompt. `count`: train prompts taken so far (the next one's stream index)."""

    kind: str
    count: int = 0

    @abstractmethod
    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts of the train stream."""

    @abstractmethod
    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first `n` prompts of the eval set (fewer if it is smaller), `eval0`, `eval1`, ..."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """The stream's position, JSON-able, for a run checkpoint."""

    @abstractmethod
    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of the same source (PromptSourceError for another source's)."""

    def close(self) -> None:  # noqa: B027  (a hook: only an environment's source holds anything)
        """Release what the source holds (an environment's server); the run calls it once it ends."""

    def episode_environment(self) -> EpisodeEnvironment | None:
        """The environment that plays this source's prompts as episodes (`run.rollout.kind: multi_turn`), if any."""
        return None

    def _check_kind(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise PromptSourceError(f"the checkpoint's prompt stream is a {state.get('kind')!r} source, this run's "
                                    f"is a {self.kind!r} source (run.task / run.data changed)")


def prompt_source(run: RunConfig) -> PromptSource:
    """The run's prompt source: `run.environment` or `run.data` if set, else `run.task`. Reads and checks data
    now, so a bad row, dataset name or a task without an eval split stops the run before any work."""
    if run.environment is not None:
        env_source = EnvironmentPrompts(load_environment(run.environment, run.seed))
        if run.eval_prompts > 0:
            env_source.check_eval()
        return env_source
    if run.data is not None:
        data = load_prompt_data(run.data)
        if data.dropped:
            log.warning("run.data: %d training row(s) left out: their prompt is in the eval set", data.dropped)
        source = DataPrompts(data, run.data.seed if run.data.seed is not None else run.seed)
        if run.eval_prompts > 0:
            source.check_eval()
        return source
    source = TaskPrompts(run.task, run.seed)
    if run.eval_prompts > 0:
        source.check_eval()
    return source


class TaskPrompts(PromptSource):
    """Prompts sampled from a procedural task: train from its "train" split with one RNG seeded by `seed`, eval
    from its "eval" split with `seed + EVAL_SEED_OFFSET`. A task without splits (`sample(rng)` only) trains as
    before but has no eval set: its samples could repeat training prompts, so evaluation is refused."""

    kind = "task"

    def __init__(self, task: str | Task, seed: int) -> None:
        self.task = get_task(task) if isinstance(task, str) else task
        self.seed = seed
        self.rng = random.Random(seed)
        self.count = 0
        self.has_splits = _has_splits(self.task)

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            text, answer = self.task.sample(self.rng, "train") if self.has_splits else self.task.sample(self.rng)
            out.append(Prompt(prompt_id=f"p{self.count}", text=text, token_ids=[], answer=answer))
            self.count += 1
        return out

    def check_eval(self) -> None:
        """PromptSourceError unless the task has an eval split disjoint from its train split."""
        if not self.has_splits:
            name = getattr(self.task, "name", type(self.task).__name__)
            raise PromptSourceError(
                f"task {name!r} has no eval split, so held-out prompts could repeat training prompts: give it "
                "`splits = ('train', 'eval')` and `sample(rng, split)` drawing disjoint problems per split, or set "
                "run.eval_prompts: 0")

    def eval_prompts(self, n: int) -> list[Prompt]:
        """A task that lists its eval split (`problems("eval")`) gives each problem at most once, in an order
        shuffled by `seed + EVAL_SEED_OFFSET` (all of them when `n` is at least the split's size), so an accuracy
        counts every held-out problem once; other tasks give `n` samples of their eval split."""
        if n == 0:
            return []
        self.check_eval()
        rng = random.Random(self.seed + EVAL_SEED_OFFSET)
        listed = getattr(self.task, "problems", None)
        if callable(listed):
            problems = list(listed("eval"))
            rng.shuffle(problems)
            pairs = problems[:n]
        else:
            pairs = [self.task.sample(rng, "eval") for _ in range(n)]
        return [Prompt(prompt_id=f"eval{i}", text=text, token_ids=[], answer=answer)
                for i, (text, answer) in enumerate(pairs)]

    def state(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"kind": self.kind, "count": self.count, "rng": [version, list(internal), gauss]}

    def restore(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.count = int(state["count"])


class DataPrompts(PromptSource):
    """Prompts from data rows: epoch e walks the train rows in an order shuffled by (`seed`, e), so every row is
    trained on once per epoch, epochs differ, and prompt N is a function of N alone (its position is the whole
    state). The eval set is the data's held-out rows, in their fixed order."""

    kind = "data"

    def __init__(self, data: PromptData, seed: int) -> None:
        self.data = data
        self.seed = seed
        self.count = 0
        self._epoch = -1
        self._order: list[int] = []  # the current epoch's row order

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            out.append(self.row_prompt(f"p{self.count}", self.data.train[self._row(self.count)]))
            self.count += 1
        return out

    def check_eval(self) -> None:
        """PromptSourceError when the data has no eval rows to evaluate on."""
        if not self.data.eval:
            raise PromptSourceError("run.data has no eval rows: set data.eval_path, eval_split, eval_fraction or "
                                    "eval_size, or run.eval_prompts: 0")

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > 0:
            self.check_eval()
        return [self.row_prompt(f"eval{i}", row) for i, row in enumerate(self.data.eval[:n])]

    def epoch_order(self, epoch: int) -> list[int]:
        """The train rows' order in `epoch`: a permutation seeded by the source's seed and the epoch."""
        order = list(range(len(self.data.train)))
        random.Random(f"composer-mesh/data/{self.seed}/{epoch}").shuffle(order)
        return order

    def _row(self, index: int) -> int:
        epoch, at = divmod(index, len(self.data.train))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.epoch_order(epoch)
        return self._order[at]

    @staticmethod
    def row_prompt(prompt_id: str, row: DataRow) -> Prompt:
        """The prompt of a data or environment row, its extra columns included (rewards may read them), and the
        tool schemas of an environment whose episodes call tools."""
        return Prompt(prompt_id=prompt_id, text=row.text, token_ids=[], answer=row.answer,
                      messages=row.messages, extra=dict(row.extra), tools=row.tools)

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": self.count, "seed": self.seed, "digest": self.data.digest}

    def restore(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        if state["digest"] != self.data.digest or state["seed"] != self.seed:
            raise PromptSourceError(f"the checkpoint's prompt data differs from this run's (digest {state['digest']} "
                                    f"seed {state['seed']}, now {self.data.digest} seed {self.seed}): the data files "
                                    "or their column mapping changed since it was written")
        self.count = int(state["count"])


class EnvironmentPrompts(PromptSource):
    """Prompts of an environment (`run.environment`, `composer_mesh.envs`): its train stream in order and its
    fixed eval set, rows made prompts as `run.data`'s are; the environment keeps the stream's position."""

    kind = "environment"

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.count = 0

    def take(self, n: int) -> list[Prompt]:
        out = [DataPrompts.row_prompt(f"p{self.count + i}", row) for i, row in enumerate(self.env.train_rows(n))]
        self.count += len(out)
        return out

    def check_eval(self) -> None:
        """PromptSourceError when the environment has no eval set to evaluate on."""
        if not self.env.eval_rows(1):
            raise PromptSourceError(f"run.environment ({self.env.name}) has no eval set: set its eval_size, or "
                                    "run.eval_prompts: 0")

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > 0:
            self.check_eval()
        return [DataPrompts.row_prompt(f"eval{i}", row) for i, row in enumerate(self.env.eval_rows(n))]

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": self.count, **self.env.state()}

    def restore(self, state: dict[str, Any]) -> None:
        self._check_kind(state)
        try:
            self.env.restore(state)
        except EnvironmentStateError as e:
            raise PromptSourceError(str(e)) from e
        self.count = int(state["count"])

    def close(self) -> None:
        self.env.close()

    def episode_environment(self) -> EpisodeEnvironment | None:
        return self.env if callable(getattr(self.env, "session", None)) else None  # type: ignore[return-value]


def _has_splits(task: Task) -> bool:
    """Whether `task.sample` takes a split ("train" / "eval"): declared by `splits`, or seen in its signature."""
    splits = getattr(task, "splits", None)
    if splits is not None:
        return "eval" in splits
    try:
        return "split" in inspect.signature(task.sample).parameters
    except (TypeError, ValueError):
        return False
