"""The shipped coding tasks: each a small Python module (`solution.py`, buggy or a stub) defining one function, a
statement, a few visible tests the policy may run, and hidden tests that grade it.

Why the hidden tests are data (calls of the task's function and what each must return or raise) and not test
code: they run outside the sandbox (`judge.py`). The graded code is only ever asked for its function's answers to
the calls, through a JSON protocol into a sandbox that holds nothing but `solution.py`; the expected values stay
in the controller's process, so no code of the solution can read them, walk frames or memory for them, or make a
comparison say yes (docs/sandbox.md, "Grading"). The visible tests are Python source (`def test_*():` with
asserts, run in the sandbox by `runner.py`): the policy is meant to read and run them.

Why Python source here and not package data files: the tasks ship inside the wheel with no data-file
configuration, and a test checks each task's reference solution passes all its hidden tests while its starting
module does not. `EVAL_IDS` are the held-out tasks: never in the train split.
"""

from __future__ import annotations

from dataclasses import dataclass
from textwrap import dedent
from typing import Any


@dataclass(frozen=True)
class Raises:
    """An expected outcome: the call raises this exception class (or a subclass of it), by name."""

    name: str


RAISES_VALUE_ERROR = Raises("ValueError")


@dataclass(frozen=True)
class Call:
    """One call of the task's function with JSON arguments and its expected outcome: `returns` (a JSON value),
    or, when `raises` is set, raising that exception class."""

    args: tuple[Any, ...]
    returns: Any = None
    raises: str | None = None


@dataclass(frozen=True)
class HiddenTest:
    """A named hidden test: it passes when every one of its calls does."""

    name: str
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class CodingTask:
    """One task. `reference` fixes `starter`; it is for tests and scripted policies, never shown to the policy and
    never in a sandbox. `function` is the name the hidden tests call in solution.py."""

    task_id: str
    function: str
    statement: str
    starter: str
    reference: str
    visible_tests: str
    hidden: tuple[HiddenTest, ...]

    def hidden_test_names(self) -> list[str]:
        """The hidden tests' names, in order (what the grade counts)."""
        return [t.name for t in self.hidden]


def _task(task_id: str, function: str, statement: str, starter: str, reference: str, visible: str,
          hidden: dict[str, list[tuple[tuple[Any, ...], Any]]]) -> CodingTask:
    tests = tuple(HiddenTest(name, tuple(Call(args, raises=want.name) if isinstance(want, Raises)
                                         else Call(args, returns=want) for args, want in calls))
                  for name, calls in hidden.items())
    return CodingTask(task_id, function, dedent(statement).strip(), dedent(starter).lstrip(),
                      dedent(reference).lstrip(), dedent(visible).lstrip(), tests)


FIZZBUZZ = _task(
    "fizzbuzz",
    "fizzbuzz",
    """Fix `fizzbuzz(n)` in solution.py: it returns "Fizz" for multiples of 3, "Buzz" for multiples of 5,
    "FizzBuzz" for multiples of both, and str(n) otherwise.""",
    """
    def fizzbuzz(n):
        if n % 3 == 0:
            return "Fizz"
        if n % 5 == 0:
            return "Buzz"
        if n % 15 == 0:
            return "FizzBuzz"
        return n
    """,
    """
    def fizzbuzz(n):
        if n % 15 == 0:
            return "FizzBuzz"
        if n % 3 == 0:
            return "Fizz"
        if n % 5 == 0:
            return "Buzz"
        return str(n)
    """,
    """
    from solution import fizzbuzz

    def test_fizz():
        assert fizzbuzz(9) == "Fizz"
    """,
    {
        "test_fizz": [((9,), "Fizz")],
        "test_buzz": [((10,), "Buzz")],
        "test_fizzbuzz": [((30,), "FizzBuzz")],
        "test_number": [((7,), "7")],
    },
)

REVERSE_WORDS = _task(
    "reverse_words",
    "reverse_words",
    """Implement `reverse_words(text)` in solution.py: the words of `text` (split on any whitespace) in reverse
    order, joined by single spaces; an empty or blank text gives "".""",
    """
    def reverse_words(text):
        raise NotImplementedError
    """,
    """
    def reverse_words(text):
        return " ".join(reversed(text.split()))
    """,
    """
    from solution import reverse_words

    def test_two_words():
        assert reverse_words("hello world") == "world hello"
    """,
    {
        "test_two_words": [(("hello world",), "world hello")],
        "test_extra_spaces": [(("  a   b\tc ",), "c b a")],
        "test_blank": [(("   ",), "")],
        "test_one_word": [(("mesh",), "mesh")],
    },
)

IS_PALINDROME = _task(
    "is_palindrome",
    "is_palindrome",
    """Fix `is_palindrome(text)` in solution.py: True when `text` reads the same backwards considering only its
    letters and digits, ignoring case ("A man, a plan, a canal: Panama" is one).""",
    """
    def is_palindrome(text):
        return text == text[::-1]
    """,
    """
    def is_palindrome(text):
        kept = [c.lower() for c in text if c.isalnum()]
        return kept == kept[::-1]
    """,
    """
    from solution import is_palindrome

    def test_plain():
        assert is_palindrome("level")
    """,
    {
        "test_plain": [(("level",), True)],
        "test_case": [(("Level",), True)],
        "test_punctuation": [(("A man, a plan, a canal: Panama",), True)],
        "test_not": [(("mesh",), False)],
    },
)

RUNNING_SUM = _task(
    "running_sum",
    "running_sum",
    """Fix `running_sum(values)` in solution.py: the list of prefix sums, `[values[0], values[0] + values[1],
    ...]`, as long as `values` (empty for an empty list).""",
    """
    def running_sum(values):
        out, total = [], 0
        for i in range(1, len(values)):
            total += values[i]
            out.append(total)
        return out
    """,
    """
    def running_sum(values):
        out, total = [], 0
        for v in values:
            total += v
            out.append(total)
        return out
    """,
    """
    from solution import running_sum

    def test_empty():
        assert running_sum([]) == []
    """,
    {
        "test_empty": [(([],), [])],
        "test_three": [(([1, 2, 3],), [1, 3, 6])],
        "test_negative": [(([5, -5, 2],), [5, 0, 2])],
    },
)

WORD_COUNT = _task(
    "word_count",
    "word_count",
    """Fix `word_count(text)` in solution.py: a dict from each lower-cased word to how many times it occurs;
    words are runs of letters (punctuation and digits separate words).""",
    """
    def word_count(text):
        counts = {}
        for word in text.split(" "):
            counts[word] = counts.get(word, 0) + 1
        return counts
    """,
    """
    import re

    def word_count(text):
        counts = {}
        for word in re.findall(r"[a-z]+", text.lower()):
            counts[word] = counts.get(word, 0) + 1
        return counts
    """,
    """
    from solution import word_count

    def test_simple():
        assert word_count("a b a") == {"a": 2, "b": 1}
    """,
    {
        "test_simple": [(("a b a",), {"a": 2, "b": 1})],
        "test_case": [(("The the THE",), {"the": 3})],
        "test_punctuation": [(("hi, there! hi.",), {"hi": 2, "there": 1})],
        "test_empty": [(("",), {})],
    },
)

FLATTEN = _task(
    "flatten",
    "flatten",
    """Implement `flatten(items)` in solution.py: the non-list elements of an arbitrarily nested list, in order
    (`flatten([1, [2, [3]], 4]) == [1, 2, 3, 4]`).""",
    """
    def flatten(items):
        return [x for sub in items for x in sub]
    """,
    """
    def flatten(items):
        out = []
        for x in items:
            out.extend(flatten(x) if isinstance(x, list) else [x])
        return out
    """,
    """
    from solution import flatten

    def test_flat():
        assert flatten([1, 2]) == [1, 2]
    """,
    {
        "test_flat": [(([1, 2],), [1, 2])],
        "test_nested": [(([1, [2, [3, [4]]], 5],), [1, 2, 3, 4, 5])],
        "test_empty_lists": [(([[], [[]], 7],), [7])],
    },
)

BINARY_SEARCH = _task(
    "binary_search",
    "binary_search",
    """Fix `binary_search(values, target)` in solution.py: the index of `target` in the sorted list `values`,
    or -1 when it is absent.""",
    """
    def binary_search(values, target):
        lo, hi = 0, len(values)
        while lo < hi:
            mid = (lo + hi) // 2
            if values[mid] < target:
                lo = mid
            else:
                hi = mid
        return lo if values and values[lo] == target else -1
    """,
    """
    def binary_search(values, target):
        lo, hi = 0, len(values)
        while lo < hi:
            mid = (lo + hi) // 2
            if values[mid] < target:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < len(values) and values[lo] == target else -1
    """,
    """
    from solution import binary_search

    def test_first():
        assert binary_search([1, 3, 5], 1) == 0
    """,
    {
        "test_first": [(([1, 3, 5], 1), 0)],
        "test_last": [(([1, 3, 5, 7], 7), 3)],
        "test_absent": [(([1, 3, 5], 4), -1)],
        "test_empty": [(([], 4), -1)],
    },
)

ROMAN_TO_INT = _task(
    "roman_to_int",
    "roman_to_int",
    """Implement `roman_to_int(numeral)` in solution.py: the value of a Roman numeral ("XIV" -> 14,
    "MCMXC" -> 1990), subtractive pairs included.""",
    """
    def roman_to_int(numeral):
        raise NotImplementedError
    """,
    """
    VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}

    def roman_to_int(numeral):
        total = 0
        for here, after in zip(numeral, numeral[1:] + " "):
            value = VALUES[here]
            total += -value if after != " " and VALUES[after] > value else value
        return total
    """,
    """
    from solution import roman_to_int

    def test_three():
        assert roman_to_int("III") == 3
    """,
    {
        "test_three": [(("III",), 3)],
        "test_subtractive": [(("XIV",), 14)],
        "test_year": [(("MCMXC",), 1990)],
    },
)

PARSE_DURATION = _task(
    "parse_duration",
    "parse_duration",
    """Implement `parse_duration(text)` in solution.py: the seconds in a duration written as numbers with unit
    letters h, m, s in that order, each optional ("1h30m" -> 5400, "45s" -> 45, "2h5s" -> 7205); raise
    ValueError for anything else (e.g. "", "5x").""",
    """
    def parse_duration(text):
        return int(text)
    """,
    """
    import re

    def parse_duration(text):
        match = re.fullmatch(r"(?:(\\d+)h)?(?:(\\d+)m)?(?:(\\d+)s)?", text)
        if not text or match is None:
            raise ValueError(f"not a duration: {text!r}")
        h, m, s = (int(g or 0) for g in match.groups())
        return 3600 * h + 60 * m + s
    """,
    """
    from solution import parse_duration

    def test_seconds():
        assert parse_duration("45s") == 45
    """,
    {
        "test_seconds": [(("45s",), 45)],
        "test_hours_minutes": [(("1h30m",), 5400)],
        "test_hours_seconds": [(("2h5s",), 7205)],
        "test_invalid": [(("",), RAISES_VALUE_ERROR), (("5x",), RAISES_VALUE_ERROR), (("m",), RAISES_VALUE_ERROR)],
    },
)

TASKS: dict[str, CodingTask] = {t.task_id: t for t in (
    FIZZBUZZ, REVERSE_WORDS, IS_PALINDROME, RUNNING_SUM, WORD_COUNT, FLATTEN,
    BINARY_SEARCH, ROMAN_TO_INT, PARSE_DURATION,
)}
EVAL_IDS: tuple[str, ...] = ("binary_search", "roman_to_int", "parse_duration")  # held out: eval only


def split_ids(split: str) -> list[str]:
    """The task ids of `split` ('train' or 'eval'), disjoint by construction."""
    if split == "eval":
        return list(EVAL_IDS)
    if split == "train":
        return [t for t in TASKS if t not in EVAL_IDS]
    raise ValueError(f"unknown coding split {split!r}: 'train' or 'eval'")
