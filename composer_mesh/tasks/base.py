"""A task = a prompt sampler with reference answers + a reward function importable by path."""

from __future__ import annotations

import random
from typing import Protocol

from composer_mesh.bindings import BindingError, import_object


class Task(Protocol):
    name: str
    alphabet: str  # every character a prompt or answer can contain (tiny tokenizers are built from it)

    def sample(self, rng: random.Random, split: str = "train") -> tuple[str, str]:
        """One (prompt text, reference answer) of `split`. A task with a held-out split lists its names in an
        optional `splits` attribute ("train", "eval"); the two must be disjoint by construction. A task whose
        eval split is a finite list may also have `problems(split) -> list[(prompt, answer)]`: the held-out
        evaluation then scores each of those problems once instead of sampling."""

    def reward(self, prompt: str, completion: str, answer: str | None) -> float:
        """Score in [0, 1] for a completion."""


BUILTIN_TASKS = {
    "addition": "composer_mesh.tasks.arithmetic:AdditionTask",
}


def get_task(name: str) -> Task:
    """Resolve a built-in task name or an import path `package.module:TaskClass`."""
    path = BUILTIN_TASKS.get(name, name)
    if path == name and ":" not in name:
        raise BindingError(f"unknown task {name!r}; built-ins are {', '.join(sorted(BUILTIN_TASKS))} or 'pkg.mod:Task'")
    obj = import_object(path)
    task = obj() if isinstance(obj, type) else obj
    for attr in ("sample", "reward", "alphabet", "name"):
        if not hasattr(task, attr):
            raise BindingError(f"task {name!r} ({path}) has no {attr!r}")
    return task
