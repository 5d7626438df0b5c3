"""OpenEnv played over many steps, against real servers on localhost (the library's `create_app`, `MCPEnvironment`
and `EnvClient`, no fakes): a text episode steps until the server says done and keeps its reward; an MCP
environment's tools are listed at reset in the chat template's function format and a Hermes tool call round
trips as a `CallToolAction`; a malformed or unknown call is an observation; a step that times out, an error the
environment raises and a server killed mid-episode each raise from `step`, naming the server. And the multi-turn
driver (with test_multi_turn.py's token-in/token-out generators playing the lookup task perfectly) over real
servers, one SIGKILLed in the middle of an episode: that episode alone ends `error_environment` with what was
played, or with `environment_retries` is played again from its start on a live server."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from orchestration.test_multi_turn import BRIDGE, TurnGenerators, episodes, multi_turn_run, run_chunks
from pydantic import ValidationError

from composer_mesh.actors.messages import Prompt
from composer_mesh.envs import load_environment
from composer_mesh.envs.openenv import (
    EnvServer,
    OpenEnvConfig,
    OpenEnvError,
    OpenEnvServerError,
    OpenEnvUnavailable,
    ServerCommand,
)
from composer_mesh.envs.openenv_session import (
    LOOKUP_TOOLS,
    NO_TOOL_CALL,
    OpenEnvEpisodes,
    OpenEnvSession,
    OpenEnvStepTimeout,
    lookup_problem,
    lookup_prompt,
)
from composer_mesh.envs.session import EpisodePrompt, Observation, StepResult
from composer_mesh.orchestration.prompts import EnvironmentPrompts
from composer_mesh.orchestration.rollout.episode import TURN_SEED_STRIDE
from composer_mesh.orchestration.schedule import Chunk, row_seed
from envs.test_openenv import free_port, uvicorn

# Real uvicorn servers (OpenEnv's client import alone is ~25 s on 2 cores): the slow tier, which CI runs.
pytestmark = pytest.mark.slow

# One server process for the module: a text guessing game at /guess and the shipped MCP lookup environment at
# /lookup. The game's action "sleep <s>" sleeps, "raise" raises in the environment.
APPS = '''
import random
import time

from fastapi import FastAPI
from pydantic import Field
from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from composer_mesh.envs.openenv_session import lookup_app


class GuessAction(Action):
    message: str = Field(description="A guess.")


class GuessObservation(Observation):
    prompt: str = Field("")


class Guess(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._secret, self._state = 0, State(step_count=0)

    def reset(self, seed=None, episode_id=None, split="train", **kwargs):
        self._secret = secret(seed, split)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Guess my number, 0 to 15 (game {split} {seed}).")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        text = action.message.strip()
        if text.startswith("sleep "):
            time.sleep(float(text.split()[1]))
            return GuessObservation(prompt="slept")
        if text == "raise":
            raise RuntimeError("the game broke")
        guess = int(text) if text.isdigit() else -1
        if guess == self._secret:
            return GuessObservation(prompt="correct", reward=1.0, done=True)
        if self._state.step_count >= 8:
            return GuessObservation(reward=0.0, done=True)
        return GuessObservation(prompt="higher" if guess < self._secret else "lower", reward=0.0)

    @property
    def state(self):
        return self._state


def secret(seed, split):
    return random.Random(f"{split}/{seed}").randrange(16)


def app():
    root = FastAPI()
    root.mount("/guess", create_app(Guess, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=4))
    root.mount("/lookup", lookup_app(4))
    return root
'''


def secret(seed: int, split: str) -> int:
    import random

    return random.Random(f"{split}/{seed}").randrange(16)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module's server; yields its base URL (the games are at <url>/guess and <url>/lookup)."""
    app_dir = tmp_path_factory.mktemp("openenv_episodes")
    (app_dir / "episode_apps.py").write_text(APPS)
    base = f"http://127.0.0.1:{free_port()}"
    spec = ServerCommand(command=uvicorn("episode_apps:app", app_dir), log=str(app_dir / "server.log"))
    with EnvServer(spec, f"{base}/guess"):
        yield base


def config(url: str, **fields: object) -> OpenEnvConfig:
    base = {"kind": "openenv", "url": url, "episodes": True, "eval_size": 2, "backoff_s": 0.05}
    return OpenEnvConfig.model_validate({**base, **fields})


def session(url: str, seed: int = 3, **fields: object) -> OpenEnvSession:
    """A session on a train prompt of `url` drawn as the run draws it (its prompt source), reset with `seed`."""
    env = load_environment(config(url, seed=seed, **fields), seed=0)
    assert isinstance(env, OpenEnvEpisodes)
    prompt = EnvironmentPrompts(env).take(1)[0]
    made = env.session(prompt, seed=0)
    assert isinstance(made, OpenEnvSession)
    return made


def call(name: str, **arguments: object) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def test_a_text_episode_steps_until_done_with_the_servers_reward(servers: str) -> None:
    s = session(f"{servers}/guess", seed=3)
    first = await s.reset()
    assert first.messages == [{"role": "user", "content": "Guess my number, 0 to 15 (game train 3)."}]
    assert first.tools == []
    target, low, high = secret(3, "train"), 0, 15
    results: list[StepResult] = []
    while not (results and results[-1].done):  # binary search, told "higher" / "lower" by the server
        guess = (low + high) // 2
        results.append(await s.step(str(guess)))
        hint = results[-1].messages[0]["content"]
        assert results[-1].messages[0]["role"] == "user"
        assert hint == ("correct" if guess == target else "higher" if guess < target else "lower")
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
    assert len(results) == s.steps >= 2 and results[-1].reward == 1.0
    assert [r.reward for r in results[:-1]] == [0.0] * (len(results) - 1)
    with pytest.raises(OpenEnvError, match="step of a session that is done"):
        await s.step("1")
    await s.close()
    await s.close()  # idempotent


async def test_an_episode_without_feedback_text_ends_empty_or_names_the_field(servers: str) -> None:
    s = session(f"{servers}/guess", seed=4)
    await s.reset()
    wrong = str((secret(4, "train") + 1) % 16)
    for _ in range(7):
        assert not (await s.step(wrong)).done
    last = await s.step(wrong)  # the eighth wrong guess: done, reward 0, nothing to say
    assert (last.done, last.reward, last.messages) == (True, 0.0, [])
    await s.close()
    s = session(f"{servers}/guess", feedback_field="hint")
    await s.reset()
    with pytest.raises(OpenEnvServerError, match=r"no text in 'hint'.*observation fields: \['prompt'\].*feedback_field"):
        await s.step("0")
    await s.close()


async def test_mcp_tools_are_listed_at_reset_and_calls_round_trip(servers: str) -> None:
    s = session(f"{servers}/lookup", seed=7, tools=True)
    first = await s.reset()
    start, table, answer = lookup_problem(7, "train", hops=3)
    assert first.messages[0]["role"] == "user" and repr(start) in first.messages[0]["content"]
    assert first.tools == list(LOOKUP_TOOLS)  # what the warm-start task (LookupTask) declares to the template
    assert first.messages == [{"role": "user", "content": lookup_prompt(start)}]
    by_name = {t["function"]["name"]: t for t in first.tools}
    assert sorted(by_name) == ["lookup", "submit"] and all(t["type"] == "function" for t in first.tools)
    lookup = by_name["lookup"]["function"]
    assert lookup["parameters"]["properties"] == {"key": {"type": "string", "description": "the key to look up"}}
    assert lookup["parameters"]["required"] == ["key"]
    assert lookup["description"].startswith("Look up a key")
    key = start
    for _ in range(2):  # two turns of one lookup each: the server's table answers
        result = await s.step(f"Looking up.\n{call('lookup', key=key)}")
        assert result.messages == [{"role": "tool", "name": "lookup", "content": table[key]}]
        assert (result.done, result.reward, result.info) == (False, None, {"tool_calls": 1.0, "tool_errors": 0.0,
                                                                        "parse_errors": 0.0})
        key = table[key]
    both = await s.step(call("lookup", key=key) + call("submit", answer=table[key]))  # two calls in one turn
    assert [m["content"] for m in both.messages] == [answer, "correct"]
    assert (both.done, both.reward, both.info["tool_calls"], s.steps) == (True, 1.0, 2.0, 4)
    await s.close()
    wrong = session(f"{servers}/lookup", seed=7, tools=True)
    await wrong.reset()
    end = await wrong.step(call("submit", answer=str(int(answer) + 1)))
    assert (end.done, end.reward, end.messages[0]["content"]) == (True, 0.0, "wrong")
    await wrong.close()


async def test_a_malformed_or_unknown_call_is_an_observation(servers: str) -> None:
    s = session(f"{servers}/lookup", tools=True)
    await s.reset()
    start, table, _ = lookup_problem(3, "train", hops=3)
    bad = await s.step('<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>')
    assert bad.messages[0]["role"] == "user" and bad.messages[0]["content"].startswith("error: tool call 1: not valid JSON")
    assert (bad.done, bad.info, s.steps) == (False, {"tool_calls": 0.0, "tool_errors": 0.0, "parse_errors": 1.0}, 0)
    none = await s.step("I think the answer is 42.")
    assert none.messages == [{"role": "user", "content": NO_TOOL_CALL}] and not none.done
    unknown = await s.step(call("search", query="x") + call("lookup", kee=start) + '<tool_call>{"name": 3}</tool_call>')
    contents = [m["content"] for m in unknown.messages]
    assert contents[0].startswith("error (tool_not_found)") and contents[1].startswith("error (invalid_args)")
    assert [m["role"] for m in unknown.messages] == ["tool", "tool", "user"]  # the unreadable call: not sent
    assert contents[2].startswith('error: tool call 3: no "name" (a string); call a tool as <tool_call>')
    assert unknown.info == {"tool_calls": 2.0, "tool_errors": 2.0, "parse_errors": 1.0} and not unknown.done
    ok = await s.step(call("lookup", key=start))  # the episode goes on
    assert ok.messages == [{"role": "tool", "name": "lookup", "content": table[start]}]
    await s.close()


async def test_a_step_timeout_or_an_environment_error_raises_from_step(servers: str) -> None:
    s = session(f"{servers}/guess", message_timeout_s=0.5)
    await s.reset()
    t0 = time.monotonic()
    with pytest.raises(OpenEnvStepTimeout, match=r"step 1 of the episode got no answer within 0.5s") as caught:
        await s.step("sleep 3")
    assert isinstance(caught.value, TimeoutError) and time.monotonic() - t0 < 3  # cut, not the step's 3 s
    with pytest.raises(OpenEnvError, match="step of a session that is failed"):
        await s.step("1")
    await s.close()
    await s.close()
    broken = session(f"{servers}/guess")
    await broken.reset()
    with pytest.raises(OpenEnvServerError, match=r"/guess: step 1 of the episode failed: .*the game broke"):
        await broken.step("raise")
    await broken.close()


def lookup_server(tmp_path: Path) -> EnvServer:
    """A lookup server of its own (one a test kills), started."""
    spec = ServerCommand(command=uvicorn("composer_mesh.envs.openenv_session:lookup_app"), log=str(tmp_path / "log"))
    return EnvServer(spec, f"http://127.0.0.1:{free_port()}").start()


def kill(server: EnvServer) -> None:
    """SIGKILL the server's process group and reap it: nothing answers its connections any more."""
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


async def test_a_server_killed_mid_episode_raises_from_step(tmp_path: Path) -> None:
    server = lookup_server(tmp_path)
    url = server.url
    try:
        s = session(url, tools=True)
        start, table, _ = lookup_problem(3, "train", hops=3)
        await s.reset()
        assert (await s.step(call("lookup", key=start))).messages[0]["content"] == table[start]
        kill(server)
        with pytest.raises(OpenEnvUnavailable, match=rf"{url}: step 2 of the episode: the server closed the connection"):
            await s.step(call("lookup", key=table[start]))
        await s.close()
    finally:
        server.stop()


def lookup_policy(turn: Prompt) -> str:
    """A perfect lookup player: the task's start key, then each key the last lookup gave, then submit the number."""
    if turn.bridge_messages is None:
        start = re.search(r"'(\w+)'", str(turn.messages[0]["content"]))  # type: ignore[index]
        assert start is not None
        return call("lookup", key=start[1])
    last = str(turn.bridge_messages[-1]["content"])
    return call("submit", answer=last) if last.isdigit() else call("lookup", key=last)


class DiesAfterFirstStep:
    """A session on `server`, which is SIGKILLed as soon as the session's first step is answered."""

    def __init__(self, inner: OpenEnvSession, server: EnvServer) -> None:
        self.inner, self.server, self.steps = inner, server, 0

    async def reset(self) -> Observation:
        return await self.inner.reset()

    async def step(self, action: str) -> StepResult:
        result = await self.inner.step(action)
        self.steps += 1
        if self.steps == 1:
            kill(self.server)
        return result

    async def close(self) -> None:
        await self.inner.close()


class ServerPool:
    """The lookup episodes over two real servers, as a pool of environment servers routes them: the first session
    of the episode seeded `doomed` plays on `server` (which dies after that session's first step), every other
    session, a replay of the doomed episode included, on the live server."""

    name = "lookup"

    def __init__(self, live: OpenEnvEpisodes, doomed: OpenEnvEpisodes, server: EnvServer, seed: int) -> None:
        self.live, self.doomed, self.server, self.seed = live, doomed, server, seed
        self.tries: Counter[int] = Counter()

    def session(self, prompt: EpisodePrompt, seed: int) -> OpenEnvSession | DiesAfterFirstStep:
        self.tries[seed] += 1
        if seed == self.seed and self.tries[seed] == 1:
            return DiesAfterFirstStep(self.doomed.session(prompt, seed), self.server)
        return self.live.session(prompt, seed)


def lookup_episodes(url: str) -> OpenEnvEpisodes:
    env = load_environment(config(url, seed=3, tools=True), seed=0)
    assert isinstance(env, OpenEnvEpisodes)
    return env


@pytest.mark.parametrize("retries", [0, 1])
async def test_the_driver_ends_only_the_episode_whose_server_died_or_replays_it_on_a_live_one(
        servers: str, tmp_path: Path, retries: int) -> None:
    live = lookup_episodes(f"{servers}/lookup")
    prompts = EnvironmentPrompts(live).take(2)
    doomed = row_seed(3, 1, 2) + 1  # the run's seed is 3: stream prompt 1, its second episode
    server = lookup_server(tmp_path)
    try:
        pool = ServerPool(live, lookup_episodes(server.url), server, doomed)
        gens = TurnGenerators(n=2, policy=lookup_policy)
        source = await run_chunks(gens, pool, [Chunk(1, 0, prompts)], run=multi_turn_run(retries))
        assert server.process is not None and server.process.poll() is not None  # it died mid-episode
    finally:
        server.stop()
    played = episodes(source)  # run_chunks checked that nothing raised out of the driver
    rewards = {(r.index, j): rw for r in source.finished[0] for j, rw in enumerate(r.group.rewards)}
    assert sorted(played) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    tries = Counter({row_seed(3, i, 2) + j: 1 for i in range(2) for j in range(2)})
    tries[doomed] += retries  # once more, on the live server
    assert pool.tries == tries
    # every episode played on the live server: 3 lookups and a submit, reward 1
    perfect = [True, False] * 3 + [True]
    live_played = [k for k in played if k != (1, 1) or retries]
    assert all([t.policy for t in played[k].turns or []] == perfect and played[k].status == "done" for k in live_played)
    assert all(rewards[k].ok and rewards[k].score == 1.0 and rewards[k].components["tool_calls"] == 4.0
               for k in live_played)
    start, table, _ = lookup_problem(prompts[1].extra["openenv"]["reset"]["seed"], "train", hops=3)
    dead = played[1, 1]
    if retries:  # played again from its start, with its own seeds: turn k's tokens are of seed + k * stride
        assert dead.prompt_ids == played[1, 0].prompt_ids and dead.turns == played[1, 0].turns
        policy = [dead.completion_ids[t.start:t.end] for t in dead.turns or [] if t.policy]
        assert policy == [[(doomed + k * TURN_SEED_STRIDE) % 97, k] for k in range(4)]
        return
    # no retries: the episode ends with what was played (its first turn, the server's answer to it, the turn whose
    # step found the server dead), trained with reward 0 as a failed score
    assert dead.status == "error_environment" and [t.policy for t in dead.turns or []] == [True, False, True]
    assert dead.completion_ids[2] == BRIDGE + len(table[start])  # the server's answer, bridged in
    assert not rewards[1, 1].ok and rewards[1, 1].score == 0.0
    assert "OpenEnvUnavailable" in (rewards[1, 1].error or "") and "closed the connection" in (rewards[1, 1].error or "")


async def test_a_prompt_is_replayed_with_its_own_reset_and_checked(servers: str) -> None:
    env = OpenEnvEpisodes(config(f"{servers}/guess", eval_size=1), seed=0)
    prompt = EnvironmentPrompts(env).take(1)[0]
    moved = type(prompt)(**{**prompt.__dict__, "text": "another prompt"})
    with pytest.raises(OpenEnvError, match=r"reset .* to another prompt than the episode's"):
        await env.session(moved, seed=0).reset()
    with pytest.raises(ValueError, match="has no extra\\['openenv'\\] reset arguments"):
        env.session(type(prompt)(**{**prompt.__dict__, "extra": {}}), seed=0)


def test_tools_need_episodes() -> None:
    with pytest.raises(ValidationError, match="tools needs episodes: true"):
        OpenEnvConfig.model_validate({"kind": "openenv", "url": "http://127.0.0.1:1", "tools": True})
