"""The calculator task: multiply two numbers through a `calculator` tool (`run.environment: {kind: calculator}`).

Why this task: it is the smallest one where calling a tool is the only way to succeed. A product of two 2-3
digit numbers is beyond a tiny model's head, copying it into a tool call and the result back is not, and the
prompt is a few bytes (`47*83`: every byte is a token of the byte-level tiny model). A perfect episode:

    user       47*83
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "47*83"}}</tool_call>
    tool       3901
    assistant  3901

The reward is 0/1: 1 when the final answer (the last turn, stripped) is the product, 0 otherwise (no partial
credit, no penalty per malformed call or per turn: those cost turns, which the driver's `max_turns` bounds).

Problems are operand pairs, an unordered pair being one problem (`47*83` and `83*47` are the same question). An
eighth of all problems is held out by a hash of the pair (`held_out`), whatever the seed or config: the eval set
is the first `eval_size` distinct held-out pairs of the eval seed, and the train stream (and a warm start,
`CalculatorTask`) skips every held-out pair, so nothing held out is ever trained on. Train problem `i` is drawn
from its own RNG (`seed`, `i`): the stream position is its whole state.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import math
import operator
import random
from typing import Any

from composer_mesh.envs.base import EnvironmentConfigError, StreamPosition
from composer_mesh.envs.config import CalculatorConfig
from composer_mesh.envs.session import EpisodePrompt, Message
from composer_mesh.envs.tool_session import ToolSession
from composer_mesh.envs.tools import Tool, Toolbox, format_tool_call
from composer_mesh.tasks.data import DataRow

EXTRA_KEY = "calculator"  # Prompt.extra[EXTRA_KEY] = {"a": ..., "b": ...}: the problem's operands
MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64  # AST nodes of one expression
MAX_BITS = 256  # |any intermediate value| < 2^MAX_BITS: no huge powers or products


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the tool's error, shown to the policy)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value: int | float) -> int | float:
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) >= 2**MAX_BITS:
        raise CalculatorError(f"result too large (over 2^{MAX_BITS})")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    """`base ** exponent`, refused before it is computed when the result would exceed the bound."""
    if abs(base) > 1 and abs(exponent) * math.log2(abs(base)) >= MAX_BITS:
        raise CalculatorError(f"power too large (over 2^{MAX_BITS})")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("fractional power of a negative number")
    return result


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        try:
            value = _power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"result too large (over 2^{MAX_BITS})") from None
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    what = type(node.value).__name__ if isinstance(node, ast.Constant) else type(node).__name__
    raise CalculatorError(f"only integers, + - * / // % ** and parentheses are allowed, not {what}")


def safe_eval(expression: str) -> int | float:
    """Evaluate an arithmetic expression of integer literals, `+ - * / // % **` and parentheses, without
    `eval`: the AST is walked and anything else (names, calls, attributes, strings, floats) is refused, as are
    expressions over `MAX_EXPRESSION_CHARS` or `MAX_NODES` and values of `MAX_BITS` or more (checked before a power
    is computed). Raises `CalculatorError`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an expression: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression of more than {MAX_NODES} parts")
    return _eval(tree)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: integers with + - * / // % ** and parentheses, e.g. "47*83".
    """
    value = safe_eval(expression)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.12g}"
    return str(value)


CALCULATOR = Tool(calculator)


def calculator_tool(latency_s: float = 0.0) -> Tool:
    """The `calculator` tool; with `latency_s` > 0 a coroutine that sleeps that long before answering (a
    benchmark's slow tool, `run.environment.tool_latency_s`). Async so the wait holds no worker thread: the
    toolbox runs a plain function in the default thread pool (a few threads on a small machine), which would
    serialise hundreds of concurrent episodes' waits; sleeping on the event loop overlaps them all."""
    if latency_s <= 0:
        return CALCULATOR

    async def slow_calculator(expression: str) -> str:
        await asyncio.sleep(latency_s)
        return calculator(expression)

    slow_calculator.__doc__ = calculator.__doc__  # the same schema: the latency is not the policy's to see
    return Tool(slow_calculator, name="calculator")


def problem_key(a: int, b: int) -> tuple[int, int]:
    """What identifies a problem for the train/eval split: its operands, unordered."""
    return (a, b) if a <= b else (b, a)


def held_out(a: int, b: int) -> bool:
    """Whether `a*b` belongs to the held-out eighth of all problems (a hash of the unordered pair: the same for
    every seed and config, so warm starts and train streams can leave it out without knowing the eval set)."""
    lo, hi = problem_key(a, b)
    return hashlib.sha256(f"calculator/{lo}*{hi}".encode()).digest()[0] < 32


class CalculatorSession(ToolSession):
    """One calculator episode: the opening conversation of its prompt, the `calculator` tool, graded 0/1."""

    def __init__(self, prompt: EpisodePrompt, answer: int, timeout_s: float | None = 5.0,
                 tool: Tool = CALCULATOR) -> None:
        super().__init__(prompt.messages or [{"role": "user", "content": prompt.text}], Toolbox([tool]),
                         timeout_s=timeout_s)
        self.answer = answer

    def grade(self, answer: str) -> float:
        return 1.0 if answer.strip() == str(self.answer) else 0.0

    def answer_feedback(self, answer: str, reward: float) -> str | None:
        return None if reward > 0 else wrong_answer(answer)


def wrong_answer(answer: str) -> str:
    """The calculator's feedback on a wrong final answer: the answer named as wrong (not corrected: the hint's
    teacher must still work it out). Short: with a byte-level tokenizer every character of a hint is a token of
    the hinted episode."""
    return f"{answer.strip()[:12]!r} is wrong"


def operands(prompt: EpisodePrompt) -> tuple[int, int]:
    """The operands of a calculator prompt (from `extra["calculator"]`)."""
    where = prompt.extra.get(EXTRA_KEY)
    if not isinstance(where, dict):
        raise ValueError(f"prompt {prompt.prompt_id!r} has no extra['calculator']: it is not a calculator prompt")
    return int(where["a"]), int(where["b"])


def demonstration(prompt: EpisodePrompt) -> list[Message]:
    """A perfect episode of `prompt` as chat messages: the opening conversation, the assistant's tool call, the
    tool's result and the assistant's answer (for warm starts and tests)."""
    a, b = operands(prompt)
    return solved(prompt.messages or [{"role": "user", "content": prompt.text}], a, b)


def solved(opening: list[Message], a: int, b: int) -> list[Message]:
    """`opening` followed by a perfect episode of `a*b`: the tool call, its result, the answer."""
    expression = f"{a}*{b}"
    return [*(dict(m) for m in opening),
            {"role": "assistant", "content": format_tool_call("calculator", {"expression": expression})},
            {"role": "tool", "name": "calculator", "content": calculator(expression)},
            {"role": "assistant", "content": str(a * b)}]


def _draw(cfg: CalculatorConfig, rng: random.Random) -> tuple[int, int]:
    def one() -> int:
        digits = rng.randint(cfg.min_digits, cfg.max_digits)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    return one(), one()


def problem_row(cfg: CalculatorConfig, a: int, b: int, where: str) -> DataRow:
    """The prompt row of `a*b`: the problem as the user message, the tool's schema, the operands as extra."""
    text = f"{a}*{b}"
    messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt is not None else [])
    return DataRow(text=text, answer=str(a * b), messages=[*messages, {"role": "user", "content": text}],
                   extra={EXTRA_KEY: {"a": a, "b": b}}, where=where, tools=[CALCULATOR.schema])


def train_problem(cfg: CalculatorConfig, seed: int, index: int) -> tuple[int, int]:
    """Train problem `index` of `seed` (its own RNG: drawn in any order, the same)."""
    return _draw(cfg, random.Random(f"composer-mesh/calculator/train/{seed}/{index}"))


def sample_rows(cfg: CalculatorConfig, seed: int, n: int) -> list[DataRow]:
    """The first `n` train problems as rows (eval ones not skipped): for the check before launch."""
    return [problem_row(cfg, *train_problem(cfg, seed, i), f"calculator train {i}") for i in range(n)]


class CalculatorEnvironment(StreamPosition):
    """The calculator task as a train stream and a disjoint, fixed eval set (`composer_mesh.envs.Environment`),
    whose prompts are played as episodes (`EpisodeEnvironment.session`)."""

    def __init__(self, cfg: CalculatorConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.tool = calculator_tool(cfg.tool_latency_s)
        self.name = f"calculator/{cfg.min_digits}-{cfg.max_digits}"
        self.eval = self._eval_set()
        self.position = 0
        self.skipped = 0
        # the tool's latency changes no problem: a stream checkpointed with one resumes with another
        ident = {"config": cfg.model_dump(exclude={"seed", "tool_latency_s"}), "seed": seed}
        self.digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def _eval_set(self) -> list[DataRow]:
        rng = random.Random(f"composer-mesh/calculator/eval/{self.seed}")
        rows: list[DataRow] = []
        seen: set[tuple[int, int]] = set()
        for _ in range(1000 * max(self.cfg.eval_size, 1)):
            if len(rows) == self.cfg.eval_size:
                return rows
            a, b = _draw(self.cfg, rng)
            if held_out(a, b) and problem_key(a, b) not in seen:
                seen.add(problem_key(a, b))
                rows.append(problem_row(self.cfg, a, b, f"calculator eval {len(rows)}"))
        if len(rows) < self.cfg.eval_size:
            raise EnvironmentConfigError(
                f"run.environment: eval_size {self.cfg.eval_size} is more than the held-out problems of "
                f"{self.cfg.min_digits}..{self.cfg.max_digits} digits (an eighth of them): lower it or widen the digits")
        return rows

    def train_rows(self, n: int) -> list[DataRow]:
        out: list[DataRow] = []
        while len(out) < n:
            index = self.position
            a, b = train_problem(self.cfg, self.seed, index)
            self.position += 1
            if held_out(a, b):
                self.skipped += 1
                continue
            out.append(problem_row(self.cfg, a, b, f"calculator train {index}"))
        return out

    def eval_rows(self, n: int) -> list[DataRow]:
        return self.eval[:n]

    def session(self, prompt: EpisodePrompt, seed: int) -> CalculatorSession:
        """A new episode of `prompt` (`seed` is unused: the task draws nothing during an episode)."""
        a, b = operands(prompt)
        # the per-call timeout must leave room for the configured latency
        return CalculatorSession(prompt, a * b, timeout_s=5.0 + self.cfg.tool_latency_s, tool=self.tool)

    def demonstration(self, prompt: EpisodePrompt) -> list[Message]:
        return demonstration(prompt)

    def close(self) -> None:
        """Nothing to release."""


def operands_of(row: DataRow) -> tuple[int, int]:
    where: dict[str, Any] = row.extra[EXTRA_KEY]
    return int(where["a"]), int(where["b"])


class CalculatorTask:
    """The calculator task as a warm-start task (`model.warmstart.task:
    composer_mesh.envs.calculator:CalculatorTask`): `chat_demonstration` gives perfect episodes of train problems
    as chat messages with the tool's schema, which the warm start learns turn by turn; held-out problems
    (`held_out`) are never drawn for training, whatever the run's seed. Operands have the environment's default
    2-3 digits."""

    name = "calculator"
    alphabet = "0123456789*"
    splits = ("train", "eval")
    cfg = CalculatorConfig(kind="calculator")

    def sample(self, rng: random.Random, split: str = "train") -> tuple[str, str]:
        while True:
            a, b = _draw(self.cfg, rng)
            if held_out(a, b) == (split == "eval"):
                return f"{a}*{b}", str(a * b)

    def reward(self, prompt: str, completion: str, answer: str | None) -> float:
        return float(answer is not None and completion.strip() == answer)

    def chat_demonstration(self, rng: random.Random) -> tuple[list[Message], list[dict[str, Any]]]:
        """A perfect episode of a train problem and the tools declared to the chat template."""
        text, _ = self.sample(rng)
        a, b = (int(x) for x in text.split("*"))
        return solved([{"role": "user", "content": text}], a, b), [CALCULATOR.schema]


class HintedCalculatorTask(CalculatorTask):
    """The calculator warm start for targeted feedback (`model.warmstart.task:
    composer_mesh.envs.calculator:HintedCalculatorTask`): `CalculatorTask`'s perfect episodes, half of them with a
    hint in the environment's words before the answer (`Hint: '<a wrong product>' is wrong`, what
    `run.rollout.hints: {source: environment}` inserts after a wrong answer), the right answer after it.

    Why: a hint is a teacher only for a policy that reads it. A tiny model warm-started on perfect episodes alone has
    never seen a message between the tool's result and its answer, and conditioned on one it predicts noise
    (benchmarks/agentic_ablation.py measured it: channel 2 then pulls the policy toward that noise). Same train
    problems, same held-out rule as `CalculatorTask`."""

    def chat_demonstration(self, rng: random.Random) -> tuple[list[Message], list[dict[str, Any]]]:
        messages, tools = super().chat_demonstration(rng)
        if rng.random() < 0.5:
            right = messages[-1]["content"]
            wrong = str(int(right) + rng.choice([-1, 1]) * 10 ** rng.randrange(len(right)))
            messages.insert(len(messages) - 1, {"role": "user", "content": f"Hint: {wrong_answer(wrong)}"})
        return messages, tools
