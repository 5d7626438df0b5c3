"""Single-digit addition: `3+4=` -> `7`. Small enough that a tiny model learns it on a CPU in minutes."""

from __future__ import annotations

import random


class AdditionTask:
    name = "addition"
    alphabet = "0123456789+=;"
    eos = ";"  # completions end with ';' — the reward reads up to the first one

    def __init__(self, max_operand: int = 9) -> None:
        self.max_operand = max_operand

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return f"{a}+{b}=", str(a + b)

    def reward(self, prompt: str, completion: str, answer: str | None) -> float:
        return exact_match(prompt, completion, answer)

    def target(self, answer: str) -> str:
        """The completion a perfect policy writes (used for SFT warm starts)."""
        return answer + self.eos


def exact_match(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 when the text before the first ';' equals the answer, else 0.0. Import path for rewarders."""
    if answer is None:
        return 0.0
    return 1.0 if completion.split(AdditionTask.eos, 1)[0].strip() == answer else 0.0
