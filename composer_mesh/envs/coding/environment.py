"""The coding tasks as the run's prompts (`composer_mesh.envs.Environment`) whose rows are played as episodes
(`EpisodeEnvironment.session`): `run.environment: {kind: coding}`.

Why a shuffled stream of a handful of tasks: the catalog is small (six train tasks), so the train stream goes
over it again and again; each pass (epoch) visits every train task once, in an order drawn from (`seed`,
epoch), so consecutive steps do not always see the same tasks side by side, and the order is a function of the
position alone: the position is the stream's whole state. The eval set is the held-out tasks
(`catalog.EVAL_IDS`), never in the train stream.
"""

from __future__ import annotations

import hashlib
import json
import random

from composer_mesh.envs.base import StreamPosition
from composer_mesh.envs.coding.catalog import TASKS, split_ids
from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.envs.coding.session import CodingSession, opening
from composer_mesh.envs.session import EpisodePrompt
from composer_mesh.errors import UserInputError
from composer_mesh.sandbox.pool import SandboxPool
from composer_mesh.sandbox.run import check_available
from composer_mesh.tasks.data import DataRow


class UnknownCodingTask(UserInputError):
    """A prompt row names a coding task that is not shipped."""


def task_row(task_id: str, where: str) -> DataRow:
    """The prompt row of a task: its opening message (the statement and how to work), the task id as extra.
    The tools are declared by the session's reset (`Observation.tools`), not the row."""
    text = opening(TASKS[task_id])
    return DataRow(text=text, answer=None, messages=[{"role": "user", "content": text}],
                   extra={"task_id": task_id}, where=where)


def epoch_order(seed: int, epoch: int) -> list[str]:
    """The train task ids in the order epoch `epoch` of `seed`'s stream visits them."""
    ids = split_ids("train")
    random.Random(f"composer-mesh/coding/train/{seed}/{epoch}").shuffle(ids)
    return ids


def train_task(seed: int, index: int) -> str:
    """The task id at position `index` of `seed`'s train stream."""
    size = len(split_ids("train"))
    return epoch_order(seed, index // size)[index % size]


def sample_rows(seed: int, n: int) -> list[DataRow]:
    """The first `n` rows of the train stream, without a sandbox: for the check before launch."""
    return [task_row(task_id, f"coding task {task_id}") for task_id in (train_task(seed, i) for i in range(n))]


class CodingEnvironment(StreamPosition):
    """The coding tasks as a train stream and a disjoint eval set, and one `CodingSession` per episode, all
    sharing one sandbox pool (its concurrency bounds the commands running at once)."""

    def __init__(self, config: CodingConfig, seed: int) -> None:
        self.config, self.seed = config, seed
        self.name = "coding"
        self.position = 0
        self.skipped = 0  # nothing is skipped: the splits are disjoint by construction
        ident = {"train": split_ids("train"), "eval": split_ids("eval"), "seed": seed}
        self.digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        self.pool = SandboxPool(config.sandbox)

    def check(self) -> None:
        """Refuse early (`SandboxUnavailable`, one line) when the configured sandbox cannot run here."""
        check_available(self.config.sandbox)

    def train_rows(self, n: int) -> list[DataRow]:
        rows = [train_task(self.seed, self.position + i) for i in range(n)]
        self.position += n
        return [task_row(task_id, f"coding task {task_id}") for task_id in rows]

    def eval_rows(self, n: int) -> list[DataRow]:
        return [task_row(task_id, f"coding task {task_id}") for task_id in split_ids("eval")[:n]]

    def session(self, prompt: EpisodePrompt, seed: int) -> CodingSession:
        """A new episode of the prompt's task (`extra["task_id"]`; the tasks draw nothing: `seed` changes
        nothing)."""
        task_id = prompt.extra.get("task_id", prompt.prompt_id.removeprefix("coding/"))
        if task_id not in TASKS:
            raise UnknownCodingTask(f"prompt {prompt.prompt_id!r}: unknown coding task {task_id!r}; shipped: "
                                    f"{', '.join(TASKS)}")
        return CodingSession(TASKS[task_id], self.pool, self.config)

    def close(self) -> None:
        """Nothing to release: each session removes its own work dir when it closes."""
