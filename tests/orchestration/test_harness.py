"""The harness driver and its OpenAI-compatible endpoint, driven by the official `openai` client.

The agent is a small tool-using loop written against `openai.AsyncOpenAI` as anyone would write it (create with
tools, run the calculator on each tool call, send the results back, answer, report the reward); it plays
calculator tasks of the run's prompt stream through a real uvicorn server. The generators are a token-in/
token-out fake (`TurnGenerators` of test_multi_turn: ids a function of each turn's seed) whose text is a scripted
policy that calls the tool, then answers. What is checked: the rollouts handed to the scheduler (what the
trainer trains on) hold exactly the ids and log-probs the endpoint served, streaming and not; bad requests get
one-line 4xx errors; an endpoint beyond loopback refuses callers without the token; tasks exist only for
admitted chunks."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import openai
import pytest
import torch
from orchestration.fakes import FakeChunks, FakeTeachers
from orchestration.test_multi_turn import TurnGenerators

from composer_mesh.actors.messages import Prompt, Rollout
from composer_mesh.envs import load_environment
from composer_mesh.envs.calculator import calculator
from composer_mesh.envs.config import CalculatorConfig
from composer_mesh.orchestration.config import HarnessConfig, RunConfig
from composer_mesh.orchestration.prompts import EnvironmentPrompts
from composer_mesh.orchestration.rollout.base import RolloutServices
from composer_mesh.orchestration.rollout.harness import HarnessRollout, HarnessRunConfig, MissingToken
from composer_mesh.orchestration.rollout.harness_episodes import HarnessTask
from composer_mesh.orchestration.schedule import Chunk
from composer_mesh.orchestration.scoring import Scoring, ScoringConfig


def calculator_policy(p: Prompt) -> str:
    """Turn 1 calls the calculator on the problem; after the tool's answer, answers with it."""
    if p.bridge_messages is None:
        problem = p.messages[-1]["content"] if p.messages else p.text
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{problem}"}}}}</tool_call>'
    return str(p.bridge_messages[-1]["content"])


def tasks(n: int) -> list[Prompt]:
    return EnvironmentPrompts(load_environment(CalculatorConfig(kind="calculator", seed=1), seed=0)).take(n)


class Served:
    """What the agents were served, per episode: each answer's token ids and log-probs."""

    def __init__(self) -> None:
        self.turns: dict[str, list[tuple[list[int], list[float]]]] = {}


def calculator_agent(served: Served, stream: bool = False) -> Any:
    async def agent(task: HarnessTask) -> float:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
        messages: list[Any] = list(task.messages)
        for _ in range(4):
            msg, ids, logprobs = await _ask(client, task, messages, stream)
            served.turns.setdefault(task.episode_id, []).append((ids, logprobs))
            messages.append(msg)
            if not msg.get("tool_calls"):
                return float((msg["content"] or "").strip() == task.answer)
            for call in msg["tool_calls"]:
                expression = json.loads(call["function"]["arguments"])["expression"]
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculator(expression)})
        return 0.0

    return agent


async def _ask(client: openai.AsyncOpenAI, task: HarnessTask, messages: list[Any],
               stream: bool) -> tuple[dict[str, Any], list[int], list[float]]:
    """One request; the assistant message as a dict, the served ids (vLLM's `return_token_ids`) and log-probs."""
    kw: dict[str, Any] = {"model": "policy", "messages": messages, "tools": task.tools, "logprobs": True,
                          "extra_headers": task.headers, "extra_body": {"return_token_ids": True}}
    if not stream:
        r = await client.chat.completions.create(**kw)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        lps = [c.logprob for c in r.choices[0].logprobs.content]
        return msg, r.choices[0].model_extra["token_ids"], lps
    content, calls, ids, lps = "", [], [], []
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += [t.model_dump(exclude_none=True, exclude={"index"}) for t in c.delta.tool_calls or []]
            lps += [x.logprob for x in (c.logprobs.content if c.logprobs else None) or []]
            ids += (c.model_extra or {}).get("token_ids", [])
    msg = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
    return msg, ids, lps


SPAWNED: list[asyncio.Task[Any]] = []  # the drivers' background tasks (the endpoint, the intake)


@pytest.fixture(autouse=True)
async def _stop_spawned() -> Any:
    """Each test ends its drivers' tasks, the endpoint's server included, as the run does at its end."""
    yield
    for task in SPAWNED:
        task.cancel()
    await asyncio.gather(*SPAWNED, return_exceptions=True)
    SPAWNED.clear()


def driver(agent: Any = None, gens: TurnGenerators | None = None, **endpoint: Any) -> HarnessRollout:
    run = RunConfig(samples_per_prompt=2, max_new_tokens=8, rollout={"kind": "harness", "harness": endpoint})
    spawned = SPAWNED
    services = RolloutServices(gens or TurnGenerators(n=2, policy=calculator_policy),
                               Scoring(ScoringConfig(0, 8, 0, True, False), None, FakeTeachers()),
                               lambda c: spawned.append(asyncio.ensure_future(c)) or spawned[-1], lambda _: None)
    return HarnessRollout(HarnessRunConfig.of(run), services, agent)


async def run_chunks(d: HarnessRollout, chunks: FakeChunks) -> None:
    drivers = [asyncio.ensure_future(d.drive(i, chunks)) for i in range(2)]
    try:
        await asyncio.wait_for(chunks.done.wait(), 20)
    finally:
        for t in drivers:
            t.cancel()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_openai_agent_plays_tool_episodes_and_the_trainer_gets_the_served_tokens(stream: bool) -> None:
    served = Served()
    d = driver(calculator_agent(served, stream))
    chunks = FakeChunks([Chunk(1, 0, tasks(2)), Chunk(1, 2, tasks(4)[2:])])
    await run_chunks(d, chunks)
    results = [r for rs in chunks.finished.values() for r in rs]
    assert len(results) == 4
    for result in results:
        assert [r.score for r in result.group.rewards] == [1.0, 1.0]  # the agent's reward: the right product
        assert all(dist is not None for dist in result.distributions)  # the teachers saw the episodes
        for j, rollout in enumerate(result.group.group.rollouts):
            assert rollout.status == "done"
            turns = served.turns[f"{result.index}-{j}"]
            assert len(turns) == 2  # the tool call, then the answer
            assert policy_spans(rollout) == turns  # token for token, log-prob for log-prob
            assert rollout.completion_ids[2] >= 900  # the tool result bridged in between (the fake's template)
    assert len(served.turns) == 8


async def test_held_out_episodes_are_served_before_the_first_step_and_after_the_runs_tasks_ended() -> None:
    """The run evaluates before its first step (nothing serves yet) and after its last, once its tasks (the
    endpoint's among them) are cancelled: an evaluation brings the endpoint up for itself."""
    served = Served()
    d = driver(calculator_agent(served))
    before = await asyncio.wait_for(d.evaluate(tasks(2), 2, 0.0, seed=7), 20)
    await run_chunks(d, FakeChunks([Chunk(1, 0, tasks(2))]))  # a step, on an endpoint of the run's
    for task in SPAWNED:  # the run ends: its tasks are cancelled
        task.cancel()
    await asyncio.gather(*SPAWNED, return_exceptions=True)
    after = await asyncio.wait_for(d.evaluate(tasks(2), 2, 0.0, seed=7), 20)
    for version, groups in (before, after):
        assert [[r.score for r in g.rewards] for g in groups] == [[1.0, 1.0], [1.0, 1.0]]  # every turn served
        assert version == 1
    assert sum(len(t) for t in served.turns.values()) == 2 * 12  # two turns of 4 held-out episodes, twice, and 4 of the step


def policy_spans(r: Rollout) -> list[tuple[list[int], list[float]]]:
    return [(r.completion_ids[t.start:t.end], r.logprobs[t.start:t.end]) for t in r.turns or [] if t.policy]


async def test_turns_of_concurrent_agents_share_requests_with_their_own_seeds() -> None:
    gens = TurnGenerators(n=1, policy=calculator_policy)
    d = driver(calculator_agent(Served()), gens)
    chunks = FakeChunks([Chunk(1, 0, tasks(3))])
    drive = asyncio.ensure_future(d.drive(0, chunks))
    try:
        await asyncio.wait_for(chunks.done.wait(), 20)
    finally:
        drive.cancel()
    sizes = [len(req.prompts) for _, req in gens.requests]
    assert sum(sizes) == 12 and max(sizes) > 1  # 6 episodes x 2 turns, batched
    seeds = [s for _, req in gens.requests for s in req.seeds or []]
    assert len(set(seeds)) == 12


class Admitted(FakeChunks):
    """A chunk source whose chunks come only when the test admits them (`admit`), as the lag bound does."""

    def __init__(self, total: int) -> None:
        super().__init__([])
        self.total, self.admitted = total, asyncio.Queue[Chunk]()

    async def next_chunk(self, counts_idle: bool = True) -> Any:
        return await self.admitted.get()


async def test_an_outside_agent_takes_tasks_over_http_only_once_admitted_and_reports_the_end() -> None:
    d = driver()
    chunks = Admitted(total=1)
    drivers = [asyncio.ensure_future(d.drive(i, chunks)) for i in range(2)]
    try:
        async with httpx.AsyncClient(base_url=d.base_url, timeout=30) as http:
            await asyncio.sleep(0.05)  # the endpoint is up; nothing admitted yet
            assert (await http.get("/episodes/next", params={"wait_s": 0.2})).status_code == 204
            chunks.admitted.put_nowait(Chunk(1, 0, tasks(1)))  # the lag bound admits the step
            got = [(await http.get("/episodes/next", params={"wait_s": 5})).json() for _ in range(2)]
            assert sorted(t["episode_id"] for t in got) == ["0-0", "0-1"] and "api_key" not in got[0]
            client = openai.AsyncOpenAI(base_url=d.base_url, api_key="none")
            task = got[0]
            r = await client.chat.completions.create(model="m", messages=task["messages"], tools=task["tools"],
                                                     metadata={"episode_id": task["episode_id"]})
            assert r.choices[0].finish_reason == "tool_calls"
            assert (await http.post(f"/episodes/{task['episode_id']}/end", json={"reward": 0.5})).status_code == 200
            assert (await http.post(f"/episodes/{got[1]['episode_id']}/end", json={"reward": 1})).status_code == 200
            await asyncio.wait_for(chunks.done.wait(), 10)
    finally:
        for t in drivers:
            t.cancel()
    (result,) = chunks.finished[0]
    assert [r.score for r in result.group.rewards] == [0.5, 1.0]
    played, unplayed = result.group.group.rollouts
    assert played.status == "done" and len(policy_spans(played)) == 1
    assert unplayed.status == "error_environment" and not unplayed.completion_ids  # ended without a turn


async def test_bad_requests_get_one_line_errors_naming_the_field() -> None:
    d = driver()
    chunks = FakeChunks([Chunk(1, 0, tasks(1))])
    drive = asyncio.ensure_future(d.drive(0, chunks))
    try:
        client = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        async with httpx.AsyncClient(base_url=d.base_url, timeout=30) as http:
            task = (await http.get("/episodes/next", params={"wait_s": 5})).json()
        h = {"X-Episode-Id": task["episode_id"]}
        base = {"model": "m", "messages": task["messages"], "tools": task["tools"]}

        async def refused(status: type[openai.APIStatusError], **kw: Any) -> str:
            with pytest.raises(status) as e:
                await client.chat.completions.create(**{**base, **kw})
            message = e.value.body["message"]
            assert "\n" not in message
            return message

        assert "'nope' is not open" in await refused(openai.NotFoundError, extra_headers={"X-Episode-Id": "nope"})
        assert "no episode id" in await refused(openai.BadRequestError)
        assert message_has("n:", await refused(openai.BadRequestError, n=2, extra_headers=h))
        r = await client.chat.completions.create(**base, extra_headers=h)
        answer = r.choices[0].message.model_dump(exclude_none=True)
        tool = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "2"}
        assert "adds none" in await refused(openai.BadRequestError, extra_headers=h,
                                            messages=[*task["messages"], answer])  # nothing new to answer
        assert message_has("tools:", await refused(openai.BadRequestError, extra_headers=h, tools=None,
                                                   messages=[*task["messages"], answer, tool]))
        await client.chat.completions.create(**{**base, "messages": [*task["messages"], answer, tool]},
                                             extra_headers=h)  # the conversation as served goes on
    finally:
        drive.cancel()


def message_has(prefix: str, message: str) -> bool:
    return message.startswith(prefix)


async def test_beyond_loopback_callers_need_the_token_and_it_is_never_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"token_env is required: host '0\.0\.0\.0' is not a loopback"):
        HarnessConfig(host="0.0.0.0")
    with pytest.raises(MissingToken, match="HARNESS_TEST_TOKEN is not set"):
        driver(host="0.0.0.0", token_env="HARNESS_TEST_TOKEN")
    secret = "s3cret-harness-token"
    monkeypatch.setenv("HARNESS_TEST_TOKEN", secret)
    caplog.set_level(logging.DEBUG)
    served = Served()
    d = driver(calculator_agent(served), host="0.0.0.0", token_env="HARNESS_TEST_TOKEN")
    chunks = FakeChunks([Chunk(1, 0, tasks(1))])
    drive = asyncio.ensure_future(d.drive(0, chunks))
    try:
        async with httpx.AsyncClient(base_url=d.base_url) as http:
            assert (await http.get("/models")).status_code == 401
            wrong = await http.get("/models", headers={"Authorization": "Bearer wrong"})
            assert wrong.status_code == 401 and secret not in wrong.text
            assert (await http.get("/models", headers={"Authorization": f"Bearer {secret}"})).status_code == 200
        await asyncio.wait_for(chunks.done.wait(), 20)  # the agent, given the token, played its episodes
    finally:
        drive.cancel()
    assert len(served.turns) == 2
    assert secret not in caplog.text


def summarising_policy(p: Prompt) -> str:
    """`calculator_policy`, and after the agent's summary (a fresh conversation) the product it states."""
    if p.messages and str(p.messages[-1]["content"]).startswith("The calculator said "):
        return str(p.messages[-1]["content"]).removeprefix("The calculator said ")
    return calculator_policy(p)


def summarising_agent(served: Served) -> Any:
    """Calls the tool, then replaces the whole conversation by a one-line summary of it (as agents that manage
    their context do) and asks for the answer; rewards episode `-0` of each prompt 1 and the other 0."""
    async def agent(task: HarnessTask) -> float:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        msg, ids, logprobs = await _ask(client, task, list(task.messages), False)
        expression = json.loads(msg["tool_calls"][0]["function"]["arguments"])["expression"]
        summary = [{"role": "user", "content": f"The calculator said {calculator(expression)}"}]
        answer, ids2, logprobs2 = await _ask(client, task, summary, False)
        served.turns[task.episode_id] = [(ids, logprobs), (ids2, logprobs2)]
        assert answer["content"] == task.answer
        return float(task.episode_id.endswith("-0"))

    return agent


async def test_an_agent_that_summarises_its_conversation_is_served_and_its_episode_trains_as_two_samples() -> None:
    from composer_mesh.actors.backends.trainer.train_batch import TrainRows
    from composer_mesh.actors.messages import TrainBatch
    from composer_mesh.loss.config import LossConfig

    served, gens = Served(), TurnGenerators(n=2, policy=summarising_policy)
    d = driver(summarising_agent(served), gens)
    chunks = FakeChunks([Chunk(1, 0, tasks(1))])
    await run_chunks(d, chunks)
    (result,) = chunks.finished[0]
    rollouts = result.group.group.rollouts
    assert [(r.episode_id, r.segment) for r in rollouts] == [("0-0", 0), ("0-0", 1), ("0-1", 0), ("0-1", 1)]
    assert [rw.score for rw in result.group.rewards] == [1.0, 1.0, 0.0, 0.0]  # each segment: its episode's reward
    summary = [{"role": "user", "content": f"The calculator said {tasks(1)[0].answer}"}]
    asked = [p for _, req in gens.requests for p in req.prompts]
    assert sum(p.messages == summary and p.bridge_messages is None for p in asked) == 2  # rendered fresh
    for r in rollouts:
        assert r.status == "done" and r.prompt_ids == [1, 2, 3]  # each segment opens with its own rendering
        assert policy_spans(r) == [served.turns[r.episode_id][r.segment]]  # the served turn, token for token
    assert len(result.distributions) == 4 and all(result.distributions)  # the teachers saw every segment
    grpo = LossConfig(alpha_sdpo=0.0)
    data = TrainRows.of(TrainBatch([result.group]), grpo)
    assert data.episode_ids.tolist() == [0, 0, 1, 1]
    adv = data.advantages(grpo)  # two episodes, rewards 1 and 0: +-1/sqrt(2) (not four rows' +-0.87)
    assert torch.allclose(adv, torch.tensor([1, 1, -1, -1]) * 0.5 / (0.5**0.5 + 1e-4))
