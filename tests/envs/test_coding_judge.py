"""The judge's side of the grading protocol, without a sandbox: what the probe prints is untrusted input, so an
answer line is bounded, strict JSON of the probe's keys, a call answered twice has no answer, and a value equals
the expected one only as the same JSON type."""

from __future__ import annotations

import json

import pytest

from composer_mesh.envs.coding.catalog import TASKS, Call
from composer_mesh.envs.coding.judge import Answer, parse_answer, read_answers, same, verdict
from composer_mesh.envs.coding.probe import MAX_ANSWER


@pytest.mark.parametrize("line", [
    '{"i": 0, "returns": NaN}', '{"i": 0, "returns": Infinity}', "[" * 2000 + "]" * 2000,
    json.dumps({"i": 0, "returns": "x" * MAX_ANSWER}), '{"i": 0, "returns": 1, "passed": true}',
    '{"i": true, "returns": 1}', '{"i": 4, "returns": 1}', '{"i": -1, "returns": 1}', '{"i": 0.0, "returns": 1}',
    '{"i": 0, "raises": "ValueError", "message": ""}', '{"i": 0, "raises": [1], "message": ""}',
    '{"i": 0}', "{'i': 0, 'returns': 1}", "", "null", '["i", 0]',
])
def test_a_malformed_answer_line_is_no_answer(line: str) -> None:
    assert parse_answer(line, calls=4) is None


def test_well_formed_answers_by_index_and_a_twice_answered_call_has_none() -> None:
    lines = ['{"i": 0, "returns": "Fizz"}', '{"i": 1, "raises": ["ValueError", "Exception"], "message": "m"}',
             '{"i": 2, "error": "not JSON"}', '{"i": 3, "returns": 1}', '{"i": 3, "returns": 2}']
    stdout = "noise\n" + "".join(f"\nTAG {line}\nOTHER {line}\n" for line in lines)
    answers = read_answers(stdout, "TAG", calls=4)
    assert answers == {0: Answer(value="Fizz"), 1: Answer(raises=("ValueError", "Exception"), error="m"),
                       2: Answer(error="not JSON")}


def test_values_are_equal_only_as_the_same_json_type() -> None:
    assert same("7", "7") and not same("7", 7) and not same(7, "7")
    assert same(True, True) and not same(True, 1) and not same(1, True) and not same(0, False)
    assert same(5400, 5400.0) and not same(None, 0) and same(None, None)
    assert same({"a": [1, 2]}, {"a": [1, 2]}) and not same({"a": [1, 2]}, {"a": [1, 2], "b": 0})
    assert not same([1, 2], [1, 2, 3]) and not same([7], [[7]]) and not same({}, [])
    deep: list = []
    for _ in range(10_000):  # the comparison recurses only as deep as the expected value
        deep = [deep]
    assert not same([1], deep)


def test_verdicts_of_returns_and_raises() -> None:
    want_value, want_error = Call((9,), returns="Fizz"), Call(("",), raises="ValueError")
    assert verdict(want_value, Answer(value="Fizz")) is None
    assert verdict(want_value, Answer(value="Buzz")) == 'returned "Buzz"'
    assert verdict(want_value, None) == "no answer"
    assert verdict(want_value, Answer(raises=("ValueError",), error="ValueError: x")) == "ValueError: x"
    assert verdict(want_error, Answer(raises=("MyError", "ValueError", "Exception"), error="")) is None
    assert verdict(want_error, Answer(value=None)) == "did not raise ValueError"
    assert verdict(want_error, Answer(error="the answer is not JSON")) == "did not raise ValueError"


def test_every_hidden_call_and_expected_value_is_json() -> None:
    """What crosses into the sandbox (the calls) and what the answers are compared with survive JSON unchanged."""
    for task in TASKS.values():
        for c in (c for t in task.hidden for c in t.calls):
            assert json.loads(json.dumps(list(c.args))) == list(c.args)
            assert c.raises is not None or json.loads(json.dumps(c.returns)) == c.returns
