"""Grading a coding episode from outside its sandbox: the hidden tests' calls go in, the answers come out as
JSON, and the comparison with the expected values happens here, in the controller's process.

Why: a test module imported next to the solution (the first design) shares its process, so the solution can
read the test file, find the expected values in the test's frames or in memory, return an object equal to
anything, or patch the runner's reporting (docs/sandbox.md lists the hacks and the tests that try them). Here
the judge sandbox holds `solution.py` alone (no file the episode left behind: no `__pycache__`, no module that
shadows another), the probe (`probe.py`) only answers calls, and everything it prints is untrusted input: each
line is bounded, strict JSON, never unpickled; a call with no well-formed answer, or with two, fails its test.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_mesh.envs.coding.catalog import Call, CodingTask
from composer_mesh.envs.coding.probe import MAX_ANSWER
from composer_mesh.sandbox.pool import BoxPathError, SandboxBox, SandboxPool

PROBE = Path(__file__).with_name("probe.py").read_text()  # sent to the judge sandbox's python with -c
SOLUTION = "solution.py"


@dataclass
class Grade:
    """The hidden tests' verdict: `passed` of `total`, and a report for logs (how the probe ended, each failing
    test and why; never shown to the policy: it names the hidden tests)."""

    passed: int
    total: int
    report: str

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class Answer:
    """What the probe said of one call: it returned `value`, raised (`raises`: its classes' names), or could not
    answer (`error`)."""

    value: Any = None
    raises: tuple[str, ...] | None = None
    error: str | None = None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_answer(text: str, calls: int) -> tuple[int, Answer] | None:
    """One answer line's (call index, answer), or None when it is not one: longer than `MAX_ANSWER`, not strict
    JSON (NaN and Infinity refused), nesting too deep, not an object of the probe's keys, an index out of range."""
    if len(text) > MAX_ANSWER:
        return None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or type(i := obj.get("i")) is not int or not 0 <= i < calls:
        return None
    keys = set(obj) - {"i"}
    if keys == {"returns"}:
        return i, Answer(value=obj["returns"])
    raises = obj.get("raises")
    if keys == {"raises", "message"} and isinstance(raises, list) and all(isinstance(n, str) for n in raises):
        return i, Answer(raises=tuple(raises), error=str(obj["message"]))
    if keys == {"error"}:
        return i, Answer(error=str(obj["error"]))
    return None


def read_answers(stdout: str, tag: str, calls: int) -> dict[int, Answer]:
    """The well-formed answers under `tag` by call index; a call answered twice is left out (it fails)."""
    seen: dict[int, Answer | None] = {}
    for line in stdout.splitlines():
        if not line.startswith(f"{tag} "):
            continue
        parsed = parse_answer(line[len(tag) + 1:], calls)
        if parsed is not None:
            i, answer = parsed
            seen[i] = None if i in seen else answer
    return {i: a for i, a in seen.items() if a is not None}


def same(expected: Any, got: Any) -> bool:
    """`got` (decoded JSON) equals `expected` as values of the same JSON type: a bool is not a number, an int
    equals the float of its value. Recurses only as deep as `expected`."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(expected) is type(got) and expected == got
    if isinstance(expected, (int, float)):
        return isinstance(got, (int, float)) and math.isfinite(got) and expected == got
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(same, expected, got))
    if isinstance(expected, dict):
        return isinstance(got, dict) and got.keys() == expected.keys() and all(same(v, got[k])
                                                                              for k, v in expected.items())
    return type(got) is type(expected) and got == expected  # str, None


def verdict(call: Call, answer: Answer | None) -> str | None:
    """None when `answer` meets `call`'s expectation, else why not (for the report)."""
    if answer is None:
        return "no answer"
    if call.raises is not None:
        return None if answer.raises and call.raises in answer.raises else f"did not raise {call.raises}"
    if answer.raises is not None or answer.error is not None:
        return answer.error or "raised"
    return None if same(call.returns, answer.value) else f"returned {json.dumps(answer.value)[:100]}"


def solution_source(box: SandboxBox) -> bytes | str:
    """The bytes of the episode's `solution.py` (a regular file in the work dir, at most `file_mb`), or why there
    is none to grade. Read on the host through the work dir's path check: a link out of it is refused."""
    limit = box.pool.config.file_mb * 1024 * 1024
    try:
        path = box.path(SOLUTION)
        if not path.is_file():
            return f"{SOLUTION}: not a regular file"
        data = path.read_bytes()
    except (BoxPathError, OSError) as e:
        return f"{SOLUTION}: {e}"
    return data if len(data) <= limit else f"{SOLUTION}: larger than the {box.pool.config.file_mb} MB file limit"


async def grade(pool: SandboxPool, task: CodingTask, box: SandboxBox) -> Grade:
    """Ask a fresh sandbox holding only the episode's `solution.py` for its answers to the hidden tests' calls;
    compare them here."""
    calls = [call for test in task.hidden for call in test.calls]
    source = solution_source(box)
    if isinstance(source, str):
        return Grade(0, len(task.hidden), source)
    request = json.dumps([{"fn": task.function, "args": list(c.args)} for c in calls])
    tag = secrets.token_hex(16)
    async with pool.session() as judge:
        (judge.workdir / SOLUTION).write_bytes(source)
        result = await judge.run([judge.python, "-I", "-S", "-B", "-c", PROBE], stdin=f"{tag}\n{request}\n")
    answers = read_answers(result.stdout, tag, len(calls))
    lines, passed, index = [result.summary()], 0, 0
    for test in task.hidden:
        why = [verdict(call, answers.get(index + k)) for k, call in enumerate(test.calls)]
        index += len(test.calls)
        failed = [w for w in why if w is not None]
        passed += not failed
        if failed:
            lines.append(f"FAIL {test.name}: {failed[0]}")
    return Grade(passed, len(task.hidden), "\n".join(lines))
