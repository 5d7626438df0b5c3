"""Reward callables referenced by import path in tests."""


def length_bonus(prompt: str, completion: str, answer: str | None) -> float:
    return min(len(completion), 4) / 4


def broken(prompt: str, completion: str, answer: str | None) -> float:
    raise KeyError("no such field")


def not_finite(prompt: str, completion: str, answer: str | None) -> float:
    return float("nan")
