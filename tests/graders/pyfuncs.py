"""Reward callables referenced by import path in tests. The rewarder runs them in its worker processes."""

import os
import signal
import time
from pathlib import Path


def length_bonus(prompt: str, completion: str, answer: str | None) -> float:
    return min(len(completion), 4) / 4


def broken(prompt: str, completion: str, answer: str | None) -> float:
    raise KeyError("no such field")


def not_finite(prompt: str, completion: str, answer: str | None) -> float:
    return float("nan")


def not_a_number(prompt: str, completion: str, answer: str | None) -> float:
    return {"score": 1.0}  # type: ignore[return-value]


def slow(prompt: str, completion: str, answer: str | None) -> float:
    """0.2 s of waiting, like a grader that calls a checker: for timing a batch."""
    time.sleep(0.2)
    return 1.0


def misbehave(prompt: str, completion: str, answer: str | None) -> float:
    """Does what the completion says: 'hang', 'exit' (os._exit(7)), 'sigkill', 'exit_call' (sys.exit in
    the function: a raise, not a crash); anything else scores the worker's pid, so tests see which worker
    ran a call."""
    if completion == "hang":
        time.sleep(3600)
    elif completion == "exit":
        os._exit(7)
    elif completion == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif completion == "exit_call":
        raise SystemExit(5)
    return float(os.getpid())


def together(prompt: str, completion: str, answer: str | None) -> float:
    """Leaves its pid in directory `completion`, then waits up to 20 s for `answer` calls to be in flight at
    once (files present): 1.0 if they were, 0.0 if not (calls run one after another)."""
    folder, needed = Path(completion), int(answer or 0)
    (folder / f"{os.getpid()}.{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if len(list(folder.iterdir())) >= needed:
            return 1.0
        time.sleep(0.01)
    return 0.0


def leave_child_and_hang(prompt: str, completion: str, answer: str | None) -> float:
    """Starts a child process that would outlive the call (its pid written to file `completion`), then hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "3600"])
    Path(completion).write_text(str(child.pid))
    time.sleep(3600)
    return 1.0


def unit_bonus(prompt: str, completion: str, answer: str | None, extra: dict | None = None) -> float:
    """Reads a data column (`run.data.extra`): 1.0 when the completion carries the row's unit."""
    unit = (extra or {}).get("unit")
    return 1.0 if unit and completion.rstrip(";").endswith(unit) else 0.0


# TRL's batched signature (GRPOTrainer's `reward_funcs`): keyword arguments, one list entry per completion.
def trl_reward(completions, **kwargs):
    """The function from issue 25: 1.0 for a completion that holds the row's answer."""
    return [1.0 if answer and answer in c else 0.0 for c, answer in zip(completions, kwargs["answer"])]


def trl_sees(prompts, completions, completion_ids, answer, **kwargs):
    """What TRL's arguments carry, as a number per completion: len(prompt) + len(completion ids) + the row's
    `unit` column's length (from `run.data.extra`)."""
    return [len(p) + len(ids) + len(u or "") for p, ids, u in zip(prompts, completion_ids, kwargs.get("unit", [None] * len(prompts)))]


def trl_chat(prompts, completions, **kwargs):
    """A conversational function: reads `completion[0]["content"]`, and counts the prompt's messages."""
    return [float(len(p)) + (1.0 if c[0]["content"] else 0.0) for p, c in zip(prompts, completions)]


def trl_only_sevens(completions, **kwargs):
    """Scores only rows whose answer is 7 (None for the others), as a multi-task TRL function does."""
    return [1.0 if a == "7" else None for a in kwargs["answer"]]


def never_mine(prompt: str, completion: str, answer: str | None) -> float | None:
    return None


def trl_short(completions, **kwargs):
    return [1.0]


def trl_text(completions, **kwargs):
    return ["high"] * len(completions)


def trl_scalar(completions, **kwargs):
    return 1.0


def trl_needs_column(completions, solution, **kwargs):
    return [1.0] * len(completions)


def trl_batch_size(completions, **kwargs):
    """Every completion scores the size of the batch it was called with."""
    return [float(len(completions))] * len(completions)


def trl_raises(completions, **kwargs):
    raise ValueError("always")


def two_args(prompt, completion):
    return 1.0


def trl_digits(completions, **kwargs):
    """TRL's signature: the share of digits in each completion (the tiny model writes digits, so > 0)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def trl_service_down(completions, **kwargs):
    """Works on the one-row check before launch, fails on every real batch (a grader service that went away)."""
    if len(completions) > 1:
        raise ConnectionError("grader service at localhost:9 refused the connection")
    return [0.0] * len(completions)


def hang_batch(completions, **kwargs):
    time.sleep(3600)
