"""Is the hinted policy a better teacher than the policy itself? The question targeted feedback rests on, asked of
the ablation's warm start directly (`bench_agentic.py --ablation` prints it beside the arms).

For train problems (never held-out ones) the warm start plays the tool call perfectly and samples its answer at
temperature 1 after the tool's result; for each wrong answer, at its first wrong digit, the probe compares the
policy's next-token distribution without the hint (the student) and with the environment's hint inserted before
the answer turn, as `run.rollout.hints: {source: environment}` inserts it (the teacher):
- P(right digit): a teacher that knows better gives the right digit more than the student does;
- P(the student's wrong digit): a teacher that knows better gives the student's own mistake less.
Channel 2 moves the student toward the teacher on exactly these tokens, so a teacher that is worse on both
teaches the mistake.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from composer_mesh.envs.calculator import CALCULATOR, held_out, solved, wrong_answer
from composer_mesh.orchestration.config import HintsConfig

WRONG_ANSWERS = 60  # wrong answers probed (of at most 2000 sampled)


def environment_hint(answer: str) -> str:
    """The hint `run.rollout.hints: {source: environment}` inserts after a wrong answer: the default template
    around the calculator's feedback."""
    return HintsConfig().template.format(feedback=wrong_answer(answer))


def first_wrong_digit(answer: str, right: str) -> int | None:
    """Where a wrong all-digit answer first differs from the right one (None: it differs only by length)."""
    return next((i for i, (x, y) in enumerate(zip(answer, right)) if x != y), None)


class Probe:
    """The warm start's next-token distributions after a tool result, with and without a hint message."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tok = model.eval(), tokenizer
        self.tools = [CALCULATOR.schema]

    def ids(self, messages: list[dict[str, Any]]) -> torch.Tensor:
        out = self.tok.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        return torch.tensor([out])

    def answer(self, context: torch.Tensor) -> str:
        with torch.no_grad():
            out = self.model.generate(context, do_sample=True, temperature=1.0, max_new_tokens=8,
                                      pad_token_id=self.tok.pad_token_id or 0)
        return str(self.tok.decode(out[0, context.shape[1]:], skip_special_tokens=True)).strip()

    def next_token(self, context: torch.Tensor, prefix: str) -> torch.Tensor:
        ids = self.tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        with torch.no_grad():
            logits = self.model(torch.cat([context, torch.tensor([ids], dtype=torch.long)], 1)).logits[0, -1]
        return torch.softmax(logits.float(), -1)

    def token(self, char: str) -> int:
        return int(self.tok(char, add_special_tokens=False)["input_ids"][0])


def probe(model: Any, tokenizer: Any, seed: int = 0, hint: Callable[[str], str] = environment_hint) -> dict[str, Any]:
    """Mean probabilities at the first wrong digit of up to `WRONG_ANSWERS` sampled wrong answers."""
    torch.manual_seed(seed)
    rng, p = random.Random(seed), Probe(model, tokenizer)
    sums = dict.fromkeys(("student_right", "teacher_right", "student_wrong", "teacher_wrong"), 0.0)
    n = sampled = 0
    while n < WRONG_ANSWERS and sampled < 2000:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if held_out(a, b):
            continue
        messages = solved([{"role": "user", "content": f"{a}*{b}"}], a, b)[:-1]
        student = p.ids(messages)
        answer, right = p.answer(student), str(a * b)
        sampled += 1
        k = first_wrong_digit(answer, right) if answer.isdigit() else None
        if k is None:
            continue
        teacher = p.ids([*messages, {"role": "user", "content": hint(answer)}])
        s, t = p.next_token(student, answer[:k]), p.next_token(teacher, answer[:k])
        good, bad = p.token(right[k]), p.token(answer[k])
        sums["student_right"] += s[good].item()
        sums["teacher_right"] += t[good].item()
        sums["student_wrong"] += s[bad].item()
        sums["teacher_wrong"] += t[bad].item()
        n += 1
    return {"wrong_answers": n, "sampled": sampled, **{key: v / n if n else float("nan") for key, v in sums.items()}}


def table(result: dict[str, Any]) -> list[str]:
    """The probe as markdown: the student's and the hinted teacher's probabilities side by side."""
    return ["| at the first wrong digit | policy (student) | policy + hint (teacher) |", "|---|---:|---:|",
            f"| P(right digit) | {result['student_right']:.3f} | {result['teacher_right']:.3f} |",
            f"| P(the student's wrong digit) | {result['student_wrong']:.3f} | {result['teacher_wrong']:.3f} |",
            f"({result['wrong_answers']} wrong answers of {result['sampled']} sampled)"]
