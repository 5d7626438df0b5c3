"""The calculator task (`composer_mesh.envs.calculator`): a safe evaluator as the tool, prompts from
`run.environment: {kind: calculator}` with the tool's schema, train and held-out problems disjoint, a stream that
survives a checkpoint, and episodes graded 0/1 when played by scripted policies."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from composer_mesh.actors.messages import Prompt
from composer_mesh.envs import sample_environment_rows
from composer_mesh.envs.base import EnvironmentConfigError
from composer_mesh.envs.calculator import (
    CALCULATOR,
    CalculatorError,
    CalculatorSession,
    CalculatorTask,
    calculator,
    demonstration,
    held_out,
    problem_key,
    safe_eval,
)
from composer_mesh.envs.config import CalculatorConfig
from composer_mesh.envs.session import StepResult
from composer_mesh.envs.tools import Toolbox, ToolCall, format_tool_call, parse_tool_calls
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.prompts import EnvironmentPrompts, PromptSourceError, prompt_source


def source(**env: object) -> EnvironmentPrompts:
    src = prompt_source(RunConfig(environment={"kind": "calculator", **env}, eval_prompts=4))
    assert isinstance(src, EnvironmentPrompts)
    return src


# ---- the evaluator ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expression", "value"), [
    ("47*83", "3901"), (" (2+3) * -4 ", "-20"), ("7//2", "3"), ("7%3", "1"), ("6/3", "2"), ("1/3", "0.333333333333"),
    ("2**10", "1024"), ("2**-1", "0.5"), ("999*999*999", "997002999"),
])
def test_calculator_evaluates_integer_arithmetic(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "says"), [
    ("__import__('os').system('true')", "not Call"),
    ("(1).real", "not Attribute"),
    ("x*2", "not Name"),
    ("'a'*3", "not str"),
    ("1.5*2", "not float"),
    ("True+1", "not bool"),
    ("[1][0]", "not Subscript"),
    ("2**100000", "power too large"),
    ("9**9**9", "power too large"),
    ("(10**70)*(10**70)", "result too large"),
    ("9" * 100, "result too large"),
    ("1/0", "division by zero"),
    ("5%0", "division by zero"),
    ("(-8)**(1/3)", "fractional power of a negative number"),
    ("1+" * 40 + "1", "more than 64 parts"),
    ("1" * 201, "longer than 200 characters"),
    ("47*", "not an expression"),
    ("lambda: 1", "not Lambda"),
])
def test_calculator_refuses_everything_else(expression: str, says: str) -> None:
    with pytest.raises(CalculatorError, match=says):
        safe_eval(expression)


def test_a_refused_expression_is_a_tool_error_for_the_policy() -> None:
    box = Toolbox([calculator])
    answer = asyncio.run(box.call(ToolCall("calculator", {"expression": "__import__('os')"})))
    assert answer == {"role": "tool", "name": "calculator", "content": "error: calculator: CalculatorError: only "
                      "integers, + - * / // % ** and parentheses are allowed, not Call"}
    assert box.errors == 1


# ---- prompts -----------------------------------------------------------------------------------------------
def test_prompts_are_short_chats_with_the_tool_schema() -> None:
    src = source(seed=5)
    prompts = src.take(20)
    assert [p.prompt_id for p in prompts[:3]] == ["p0", "p1", "p2"]
    for p in prompts:
        a, b = p.extra["calculator"]["a"], p.extra["calculator"]["b"]
        assert 10 <= a <= 999 and 10 <= b <= 999
        assert (p.text, p.answer) == (f"{a}*{b}", str(a * b))
        assert p.messages == [{"role": "user", "content": p.text}]
        assert [t["function"]["name"] for t in p.tools] == ["calculator"]
        assert p.tools[0]["function"]["parameters"]["required"] == ["expression"]
    assert {len(p.text) for p in prompts} <= {5, 6, 7}  # every byte is a token of the tiny model
    assert {len(str(p.extra["calculator"]["a"])) for p in prompts} == {2, 3}
    assert [p.prompt_id for p in src.eval_prompts(2)] == ["eval0", "eval1"]
    system = source(system_prompt="Use the calculator.").take(1)[0]
    assert system.messages[0] == {"role": "system", "content": "Use the calculator."}


def test_train_and_held_out_problems_are_disjoint() -> None:
    # 1-digit operands: 45 distinct problems, 5 of them in the held-out eighth (by a hash of the pair); 600 draws
    # reach every train problem many times.
    every = {problem_key(a, b) for a in range(1, 10) for b in range(1, 10)}
    bucket = {k for k in every if held_out(*k)}
    assert len(every) == 45 and len(bucket) == 5
    src = source(min_digits=1, max_digits=1, eval_size=5, seed=3)
    held = {problem_key(p.extra["calculator"]["a"], p.extra["calculator"]["b"]) for p in src.eval_prompts(5)}
    assert held == bucket
    train = {problem_key(p.extra["calculator"]["a"], p.extra["calculator"]["b"]) for p in src.take(600)}
    assert train.isdisjoint(held)
    assert train == every - bucket  # and nothing else is left out
    assert src.env.skipped > 0  # eval problems were drawn, in either operand order, and skipped
    assert src.eval_prompts(5) == src.eval_prompts(5)


def test_the_held_out_eighth_is_never_a_warm_start_problem_and_too_big_an_eval_set_is_refused() -> None:
    rng = random.Random(0)
    task = CalculatorTask()
    for _ in range(300):
        messages, tools = task.chat_demonstration(rng)
        a, b = (int(x) for x in messages[0]["content"].split("*"))
        assert not held_out(a, b) and tools == [CALCULATOR.schema]
    assert all(held_out(*map(int, task.sample(rng, "eval")[0].split("*"))) for _ in range(50))
    with pytest.raises(EnvironmentConfigError, match="eval_size 6 is more than the held-out problems"):
        source(min_digits=1, max_digits=1, eval_size=6, seed=3)


def test_the_stream_survives_a_checkpoint_and_refuses_another_one() -> None:
    first = source(seed=11)
    first.take(7)
    state = first.state()
    again = source(seed=11)
    again.restore(state)
    assert [p.text for p in again.take(5)] == [p.text for p in first.take(5)]
    other = source(seed=12)
    with pytest.raises(PromptSourceError, match="calculator/2-3"):
        other.restore(state)


def test_config_mistakes_are_refused() -> None:
    with pytest.raises(ValidationError, match="min_digits 3 > max_digits 2"):
        RunConfig(environment={"kind": "calculator", "min_digits": 3, "max_digits": 2})
    with pytest.raises(ValidationError, match="eval_size 30 holds out more than half of the 45 distinct problems"):
        CalculatorConfig(kind="calculator", min_digits=1, max_digits=1, eval_size=30)
    with pytest.raises(ValidationError, match="extra_forbidden"):
        CalculatorConfig(kind="calculator", digits=2)


def test_preflight_samples_rows_without_building_the_eval_set() -> None:
    rows = sample_environment_rows(CalculatorConfig(kind="calculator", seed=1), 0, 3)
    assert rows is not None and [r.where for r in rows] == ["calculator train 0", "calculator train 1",
                                                            "calculator train 2"]
    assert rows[0].tools is not None


# ---- episodes -----------------------------------------------------------------------------------------------
def play(prompt: Prompt, turns: list[str]) -> list[StepResult]:
    session = source().env.session(prompt, seed=0)
    assert isinstance(session, CalculatorSession)

    async def run() -> list[StepResult]:
        obs = await session.reset()
        assert obs.messages == prompt.messages and obs.tools == prompt.tools
        out = []
        for turn in turns:
            out.append(await session.step(turn))
            if out[-1].done:
                break
        await session.close()
        return out

    return asyncio.run(run())


def play_policy(prompt: Prompt, policy: Callable[[list[dict]], str], max_turns: int = 4) -> list[StepResult]:
    """An episode played by `policy` (the conversation so far -> its next turn), as the rollout driver plays it."""
    session = source().env.session(prompt, seed=0)

    async def run() -> list[StepResult]:
        conversation = list((await session.reset()).messages)
        out: list[StepResult] = []
        while len(out) < max_turns and not (out and out[-1].done):
            turn = policy(conversation)
            out.append(await session.step(turn))
            conversation += [{"role": "assistant", "content": turn}, *out[-1].messages]
        return out

    return asyncio.run(run())


def scripted(offset: int) -> Callable[[list[dict]], str]:
    """Call the calculator on the problem, then answer what it said plus `offset` (0: the correct policy)."""
    def policy(conversation: list[dict]) -> str:
        last = conversation[-1]
        if last["role"] == "user":
            return format_tool_call("calculator", {"expression": last["content"]})
        return str(int(last["content"]) + offset)

    return policy


def test_a_correct_policy_gets_reward_1_and_a_wrong_one_0() -> None:
    for prompt in source(seed=2).take(5):
        right = play_policy(prompt, scripted(0))
        assert right[0].messages == [{"role": "tool", "name": "calculator", "content": prompt.answer}]
        assert [s.done for s in right] == [False, True]
        assert (right[1].reward, right[1].status) == (1.0, "done")
        wrong = play_policy(prompt, scripted(1))
        assert [s.done for s in wrong] == [False, True] and wrong[1].reward == 0.0
        guess = play_policy(prompt, lambda _: "I think it is 12")  # no tool, wrong: the episode ends
        assert len(guess) == 1 and guess[0].done and guess[0].reward == 0.0


def test_a_malformed_call_is_an_observation_and_the_episode_continues() -> None:
    prompt = source(seed=4).take(1)[0]
    bad_json = '<tool_call>{"name": "calculator", "arguments": {"expression": 47*83}}</tool_call>'
    unknown = format_tool_call("calc", {"expression": prompt.text})
    refused = format_tool_call("calculator", {"expression": "__import__('os')"})
    steps = play(prompt, [bad_json, unknown, refused, format_tool_call("calculator", {"expression": prompt.text}),
                          f" {prompt.answer}\n"])
    assert [s.done for s in steps] == [False, False, False, False, True]
    assert steps[0].messages[0]["role"] == "user" and "not valid JSON" in steps[0].messages[0]["content"]
    assert steps[0].info["parse_errors"] == 1.0
    assert steps[1].messages[0]["content"] == "error: calc: no such tool; the tools are calculator"
    assert steps[2].messages[0]["content"].startswith("error: calculator: CalculatorError")
    assert [s.info.get("tool_errors") for s in steps[:4]] == [0.0, 1.0, 1.0, 0.0]
    assert steps[4].reward == 1.0  # the answer is read stripped


def test_demonstration_is_a_perfect_episode_that_chat_templates_render() -> None:
    from composer_mesh.models.tokenizer import build_byte_tokenizer

    prompt = source(seed=6).take(1)[0]
    messages = demonstration(prompt)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[0] == {"role": "user", "content": prompt.text}
    assert parse_tool_calls(messages[1]["content"]).calls == [ToolCall("calculator", {"expression": prompt.text})]
    assert messages[2]["content"] == messages[3]["content"] == prompt.answer
    steps = play(prompt, [messages[1]["content"], messages[3]["content"]])
    assert steps[0].messages == [messages[2]] and steps[1].reward == 1.0

    tokenizer = build_byte_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert f"<|im_start|>tool\n{prompt.answer}<|im_end|>" in text and messages[1]["content"] in text
    qwen = Path(__import__("trl").__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tokenizer.chat_template = qwen.read_text()
    text = tokenizer.apply_chat_template(messages, tools=prompt.tools, tokenize=False)
    assert '"name": "calculator"' in text.split("<|im_end|>")[0]  # the schema, in Qwen's system turn
    assert messages[1]["content"] in text and f"<tool_response>\n{prompt.answer}\n</tool_response>" in text


def test_warm_start_pairs_are_the_ids_an_episode_feeds_and_samples() -> None:
    """The warm start's (prompt, target) of each assistant turn are exactly the ids a played episode has: turn
    1's prompt is the opening through the template with the tool, turn 2's is turn 1's ids + the tool's bridge."""
    from composer_mesh.models.chat import chat_token_ids, next_turn_token_ids
    from composer_mesh.models.tokenizer import build_byte_tokenizer
    from composer_mesh.models.warmstart import IGNORE, task_examples

    tok = build_byte_tokenizer()
    draw = task_examples(CalculatorTask(), tok)
    seen = {}
    for seed in range(40):
        rng = random.Random(seed)
        messages, tools = CalculatorTask().chat_demonstration(random.Random(seed))
        ids, labels = draw(rng)
        n = labels.count(IGNORE)
        prompt, target = ids[:n], ids[n:]
        assert labels[n:] == target
        first = chat_token_ids(tok, messages[:1], tools=tools)
        call = tok.encode(messages[1]["content"] + "<|im_end|>", add_special_tokens=False)
        if prompt == first:
            assert target == call
            seen["call"] = True
        else:
            assert prompt == next_turn_token_ids(tok, first + call, [messages[2]], tools=tools)
            assert tok.decode(target) == messages[3]["content"] + "<|im_end|>"
            seen["answer"] = True
    assert seen == {"call": True, "answer": True}


def test_a_whole_episode_warm_start_example_learns_both_assistant_turns() -> None:
    """A warm-start example has exactly the ids a played episode has (turn 1's prompt is the opening through the
    template with the tool, turn 2's is turn 1's ids + the tool's bridge), and learns exactly the two assistant
    turns: the opening and the bridge are only read."""
    from composer_mesh.models.chat import chat_token_ids, next_turn_token_ids
    from composer_mesh.models.tokenizer import build_byte_tokenizer
    from composer_mesh.models.warmstart import IGNORE, task_examples

    tok = build_byte_tokenizer()
    draw = task_examples(CalculatorTask(), tok, "whole")
    for seed in range(8):
        messages, tools = CalculatorTask().chat_demonstration(random.Random(seed))
        ids, labels = draw(random.Random(seed))
        first = chat_token_ids(tok, messages[:1], tools=tools)
        call = tok.encode(messages[1]["content"] + "<|im_end|>", add_special_tokens=False)
        second = next_turn_token_ids(tok, first + call, [messages[2]], tools=tools)
        answer = tok.encode(messages[3]["content"] + "<|im_end|>", add_special_tokens=False)
        bridge = len(second) - len(first) - len(call)
        assert ids == second + answer and second[: len(first) + len(call)] == first + call and bridge > 0
        assert labels == [IGNORE] * len(first) + call + [IGNORE] * bridge + answer


# ---- a slow tool, for benchmarks (run.environment.tool_latency_s) ------------------------------------------------
def test_tool_latency_waits_on_the_event_loop_so_concurrent_episodes_overlap() -> None:
    """Each call waits `tool_latency_s`; 24 episodes' calls at once take about one wait, not 24 (nor 24 / the
    default thread pool's few threads), and the tool, its schema and its answers are the same as without one."""
    slow = source(seed=5, tool_latency_s=0.4)
    assert slow.env.tool.schema == CALCULATOR.schema and slow.env.tool.is_async
    assert source(seed=5).env.tool is CALCULATOR  # no latency: the plain tool
    prompts = slow.take(24)
    call = format_tool_call("calculator", {"expression": "47*83"})

    async def episode(prompt: Prompt) -> tuple[float, StepResult]:
        session = slow.env.session(prompt, seed=0)
        await session.reset()
        t0 = asyncio.get_running_loop().time()
        result = await session.step(call)
        return asyncio.get_running_loop().time() - t0, result

    async def run_all() -> tuple[float, list[tuple[float, StepResult]]]:
        t0 = asyncio.get_running_loop().time()
        out = await asyncio.gather(*(episode(p) for p in prompts))
        return asyncio.get_running_loop().time() - t0, out

    wall, results = asyncio.run(run_all())
    assert all(r.messages == [{"role": "tool", "name": "calculator", "content": "3901"}] for _, r in results)
    assert all(took >= 0.4 for took, _ in results)  # every call waited
    assert wall < 0.4 * 3, wall  # overlapped: serial would be 9.6 s, 6 threads 1.6 s
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        CalculatorConfig(kind="calculator", tool_latency_s=-1)
    checkpoint = source(seed=5)
    checkpoint.take(3)
    slow.restore(checkpoint.state())  # the latency changes no problem: the same stream resumes


def test_the_hinted_warm_start_reads_a_hint_before_half_its_answers() -> None:
    """`HintedCalculatorTask`: the same train problems, half the demonstrations with the environment's hint
    (a wrong product named wrong) before the right answer."""
    from composer_mesh.envs.calculator import HintedCalculatorTask

    rng, hinted = random.Random(1), 0
    for _ in range(200):
        messages, tools = HintedCalculatorTask().chat_demonstration(rng)
        a, b = (int(x) for x in messages[0]["content"].split("*"))
        assert not held_out(a, b) and tools == [CALCULATOR.schema] and messages[-1]["content"] == str(a * b)
        if len(messages) == 5:
            hint = messages[3]
            assert hint["role"] == "user" and hint["content"].startswith("Hint: '") and hint["content"].endswith(
                "' is wrong") and hint["content"] != f"Hint: '{a * b}' is wrong"
            hinted += 1
    assert 70 < hinted < 130
