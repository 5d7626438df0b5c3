"""Single-digit addition: `3+4=` -> `7`. Small enough that a tiny model learns it on a CPU in minutes."""

from __future__ import annotations

import random


class AdditionTask:
    """`a+b=` for single digits. A fixed fifth of the 100 operand pairs is held out for evaluation: training
    (and SFT warm starts) never see those problems, so the eval split measures generalisation, not recall.
    Held out: the 20 pairs with (a + 2b) % 5 == 4; every sum still occurs in training."""

    name = "addition"
    alphabet = "0123456789+=;"
    eos = ";"  # completions end with ';' — the reward reads up to the first one
    splits = ("train", "eval")

    def __init__(self, max_operand: int = 9) -> None:
        self.max_operand = max_operand
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        self.pairs = {
            "eval": [(a, b) for a, b in pairs if (a + 2 * b) % 5 == 4],
            "train": [(a, b) for a, b in pairs if (a + 2 * b) % 5 != 4],
        }

    def sample(self, rng: random.Random, split: str = "train") -> tuple[str, str]:
        """One problem of `split` ("train" or "eval"; disjoint by construction)."""
        if split not in self.pairs:
            raise ValueError(f"addition has splits {list(self.pairs)}, not {split!r}")
        a, b = rng.choice(self.pairs[split])
        return f"{a}+{b}=", str(a + b)

    def problems(self, split: str) -> list[tuple[str, str]]:
        """Every (prompt, answer) of `split`, once each: the held-out evaluation scores each eval problem once
        rather than a sample that repeats some and misses others."""
        if split not in self.pairs:
            raise ValueError(f"addition has splits {list(self.pairs)}, not {split!r}")
        return [(f"{a}+{b}=", str(a + b)) for a, b in self.pairs[split]]

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
