"""verifiers tasks with tools and turns played by `composer_mesh.envs.verifiers_agent:play`, the shipped harness
agent, against the real OpenAI-compatible endpoint of a harness rollout (`HarnessRollout`: uvicorn on loopback, the
real `openai` client), with the real verifiers library and tasksets: the shipped calculator taskset
(composer_mesh/envs/calculator_taskset.py) and tests/envs/verifiers_tool_taskset.py (a prompt that opens with a
tool call and its result, a tool that raises). Only the policy is scripted (`TurnGenerators`, the generators'
port speaking token in, token out), so each test says what the policy wrote and checks what the agent made of it:
tool results bridged in, the task's own reward, errors as observations, refusals in one line."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from orchestration.fakes import FakeChunks, FakeTeachers
from orchestration.test_multi_turn import TurnGenerators

from composer_mesh.actors.messages import Prompt
from composer_mesh.envs import load_environment
from composer_mesh.envs.calculator import CALCULATOR
from composer_mesh.envs.config import VerifiersConfig
from composer_mesh.envs.verifiers import completion_trace, rebuild_task, score
from composer_mesh.envs.verifiers_agent import (
    UnplayableToolset,
    VerifiersEpisodes,
    open_toolbox,
    play,
    task_toolsets,
)
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.prompts import EnvironmentPrompts
from composer_mesh.orchestration.rollout.base import RolloutServices
from composer_mesh.orchestration.rollout.harness import HarnessRollout, HarnessRunConfig
from composer_mesh.orchestration.schedule import Chunk, GroupResult
from composer_mesh.orchestration.scoring import Scoring, ScoringConfig

pytest.importorskip("verifiers", reason="verifiers 0.4 needs Python >= 3.11 (the test extra installs it there)")

PRODUCTS = "composer_mesh.envs.calculator_taskset"
TOY = "envs.verifiers_tool_taskset"


def prompts(taskset: str, n: int, **config: Any) -> list[Prompt]:
    cfg = VerifiersConfig(kind="verifiers", taskset=taskset, eval_size=1, taskset_config=config)
    return EnvironmentPrompts(load_environment(cfg, seed=0)).take(n)


def problem(p: Prompt) -> str:
    return p.extra["verifiers"]["task"]["prompt"]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def solver(p: Prompt) -> str:
    """Turn 1 calls the calculator on the problem; then answers with what came back last."""
    return call("calculator", expression=problem(p)) if p.bridge_messages is None else p.bridge_messages[-1]["content"]


async def play_episodes(policy: Callable[[Prompt], str], tasks: list[Prompt], max_turns: int = 4) -> list[GroupResult]:
    """Each prompt's two episodes played by `play` through the endpoint; the finished groups."""
    run = RunConfig(samples_per_prompt=2, max_new_tokens=8, rollout={"kind": "harness", "max_turns": max_turns})
    spawned: list[asyncio.Future[Any]] = []
    services = RolloutServices(TurnGenerators(n=1, policy=policy),
                               Scoring(ScoringConfig(0, 8, 0, True, False), None, FakeTeachers()),
                               lambda c: spawned.append(asyncio.ensure_future(c)) or spawned[-1], lambda _: None)
    chunks = FakeChunks([Chunk(1, 0, tasks)])
    rollout = HarnessRollout(HarnessRunConfig.of(run), services, play)
    spawned.append(asyncio.ensure_future(rollout.drive(0, chunks)))
    try:
        await asyncio.wait_for(chunks.done.wait(), 60)
    finally:
        for task in spawned:
            task.cancel()
        await asyncio.gather(*spawned, return_exceptions=True)
    return chunks.finished[0]


def policy_turns(result: GroupResult) -> list[int]:
    return [sum(t.policy for t in r.turns or []) for r in result.group.group.rollouts]


async def test_a_calculator_episode_calls_the_toolset_and_is_scored_by_the_tasks_reward() -> None:
    results = await play_episodes(solver, prompts(PRODUCTS, 2))
    assert len(results) == 2
    for result in results:
        assert [r.score for r in result.group.rewards] == [1.0, 1.0]  # `correct`: the product, via the tool
        assert all(r.ok for r in result.group.rewards)
        assert policy_turns(result) == [2, 2]  # the call, then the answer
        for rollout in result.group.group.rollouts:
            assert rollout.status == "done"
            assert any(not t.policy for t in rollout.turns or [])  # the tool result, bridged in


async def test_a_wrong_answer_gets_the_rubrics_zero() -> None:
    results = await play_episodes(lambda p: "12", prompts(PRODUCTS, 1))
    assert [r.score for r in results[0].group.rewards] == [0.0, 0.0]
    assert policy_turns(results[0]) == [1, 1]  # no tool call: the answer ends the episode


async def test_a_malformed_call_is_told_to_the_policy_which_plays_on() -> None:
    told: list[str] = []

    def policy(p: Prompt) -> str:
        if p.bridge_messages is None:
            return '<tool_call>{"name": "calculator", "arguments": '  # never closed
        if p.bridge_messages[-1]["role"] == "user":
            told.append(p.bridge_messages[-1]["content"])
            return call("calculator", expression=problem(p))
        return p.bridge_messages[-1]["content"]

    results = await play_episodes(policy, prompts(PRODUCTS, 1))
    assert [r.score for r in results[0].group.rewards] == [1.0, 1.0]
    assert policy_turns(results[0]) == [3, 3]  # the malformed call, the call, the answer
    assert len(told) == 2 and all(t.startswith("error: tool call 1: <tool_call> without </tool_call>") for t in told)


async def test_a_tool_that_raises_is_an_error_observation_and_the_opening_keeps_its_tool_messages() -> None:
    seen: list[Prompt] = []

    def policy(p: Prompt) -> str:
        seen.append(p)
        return call("toy_explode", reason="why") if p.bridge_messages is None else "done"

    results = await play_episodes(policy, prompts(TOY, 1))
    assert [r.score for r in results[0].group.rewards] == [1.0, 1.0]  # the reward saw the error tool message
    assert policy_turns(results[0]) == [2, 2]
    opening = seen[0].messages
    assert [m["role"] for m in opening] == ["user", "assistant", "tool", "user"]
    word = opening[2]["content"]  # the opening's tool result, answering its call, rendered for the template
    assert opening[1]["tool_calls"][0]["function"] == {"name": "toy_echo", "arguments": {"text": word}}
    assert seen[0].tools is not None and {t["function"]["name"] for t in seen[0].tools} == {"toy_echo", "toy_explode"}
    answers = [p.bridge_messages[0]["content"] for p in seen if p.bridge_messages]
    assert answers == ["error: toy_explode: RuntimeError: boom: why"] * 2


async def test_the_runs_turn_limit_ends_an_episode_that_never_answers_and_it_is_still_scored() -> None:
    results = await play_episodes(lambda p: call("calculator", expression="1+1"), prompts(PRODUCTS, 1), max_turns=2)
    assert policy_turns(results[0]) == [2, 2]
    assert [r.status for r in results[0].group.group.rollouts] == ["truncated_turns"] * 2
    assert [(r.score, r.ok) for r in results[0].group.rewards] == [(0.0, True)] * 2  # the rubric's, not a failure


async def test_the_toolsets_tools_are_named_and_described_as_verifiers_serves_them() -> None:
    products, toy = prompts(PRODUCTS, 1)[0], prompts(TOY, 1)[0]
    for p in (products, toy):
        where = p.extra["verifiers"]
        task = rebuild_task(where["env"], where["task"])
        toolbox = await open_toolbox(*task_toolsets(task, where["env"]), task)
        if p is products:  # the calculator environment's tool, to the byte: a model warm-started there calls it
            assert toolbox.schemas == [CALCULATOR.schema]
        else:  # `toy_echo` documents no argument: its schema is the MCP server's
            schemas = {s["function"]["name"]: s["function"] for s in toolbox.schemas}
            assert schemas["toy_echo"]["parameters"]["properties"]["text"]["type"] == "string"
            assert schemas["toy_explode"]["parameters"]["properties"]["reason"]["description"] == "why."


def test_what_cannot_be_played_is_refused_in_one_line_naming_the_task() -> None:
    remote = prompts(PRODUCTS, 1, task={"tools": {"url": "http://127.0.0.1:9/mcp"}})[0]
    where = remote.extra["verifiers"]
    task = rebuild_task(where["env"], where["task"])
    with pytest.raises(UnplayableToolset, match=r"^verifiers task \d+: toolset CalculatorToolset is served at a url "
                       r"\(http://127.0.0.1:9/mcp\); composer_mesh plays toolsets in its own process only"):
        task_toolsets(task, where["env"])
    with pytest.raises(ValueError, match=r"^verifiers task 0: a tool message answers call 'nobody', which no earlier "
                       "assistant message made$"):
        prompts(TOY, 1, broken_prompt=True)


def test_a_single_turn_completion_after_a_tool_opening_is_scored_on_the_whole_trace() -> None:
    p = prompts(TOY, 1)[0]
    where = p.extra["verifiers"]
    trace = completion_trace(rebuild_task(where["env"], where["task"]), "done")
    assert [n.message.role for n in trace.nodes] == ["user", "assistant", "tool", "user", "assistant"]
    assert [n.sampled for n in trace.nodes] == [False] * 4 + [True]
    assert score(p.text, "done", p.answer, p.extra) == 0.0  # no tool ran after the opening


def test_the_docs_show_the_shipped_tool_taskset() -> None:
    """docs/verifiers.md's block after `<!-- taskset: composer_mesh/envs/calculator_taskset.py -->` is that file."""
    path = "composer_mesh/envs/calculator_taskset.py"
    root = Path(__file__).resolve().parents[2]
    match = re.search(rf"<!-- taskset: {path} -->\n<!-- illustration -->\n```python\n(.*?)```",
                      (root / "docs" / "verifiers.md").read_text(), re.S)
    assert match, "docs/verifiers.md lost its tool taskset block"
    assert match.group(1) == (root / path).read_text(), f"docs/verifiers.md shows another taskset than {path}"


def session_of(taskset: str) -> tuple[VerifiersEpisodes, Prompt]:
    env = load_environment(VerifiersConfig(kind="verifiers", taskset=taskset, eval_size=1), seed=0)
    assert isinstance(env, VerifiersEpisodes)
    return env, EnvironmentPrompts(env).take(1)[0]


async def test_a_multi_turn_session_plays_the_same_loop_for_the_episode_driver() -> None:
    env, p = session_of(PRODUCTS)
    session = env.session(p, seed=0)
    opening = await session.reset()
    assert opening.messages == p.messages and opening.tools == [CALCULATOR.schema]
    told = await session.step('<tool_call>{"name": "calculator"')  # never closed: told, and the episode goes on
    assert not told.done and told.messages[0]["role"] == "user" and told.info["parse_errors"] == 1
    ran = await session.step(call("calculator", expression=problem(p)))
    assert ran.messages == [{"role": "tool", "name": "calculator", "content": p.answer, "tool_call_id": "call_1_0"}]
    assert ran.info == {"tool_calls": 1.0, "tool_errors": 0.0, "parse_errors": 0.0}
    answered = await session.step(f" {p.answer} ")
    assert answered.done and answered.reward == 1.0  # the rubric on the whole conversation
    await session.close()


async def test_a_multi_turn_session_answers_a_raising_tool_with_an_error_and_the_rubric_reads_it() -> None:
    env, p = session_of(TOY)
    session = env.session(p, seed=0)
    await session.reset()
    failed = await session.step(call("toy_explode", reason="x") + call("toy_nothing"))
    assert [m["content"] for m in failed.messages] == [
        "error: toy_explode: RuntimeError: boom: x", "error: toy_nothing: no such tool; the tools are toy_echo, "
        "toy_explode"]
    assert failed.info["tool_errors"] == 2.0 and failed.feedback is not None
    assert (await session.step("done")).reward == 1.0
    await session.close()


def test_a_verifiers_environment_may_be_played_as_multi_turn_episodes() -> None:
    run = RunConfig.model_validate({"rollout": {"kind": "multi_turn"},
                                    "environment": {"kind": "verifiers", "taskset": PRODUCTS}})
    assert run.environment is not None and run.environment.plays_episodes
