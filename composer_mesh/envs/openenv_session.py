"""OpenEnv played for real over many steps: one WebSocket session per episode (`EnvSession`), reset once, then a
step per policy turn until the environment says done.

Two kinds of environment:
- **text** (`tools: false`): each policy turn is the action `{action_field: text}`; the step observation's
  `feedback_field` (default `prompt_field`) is the next user message; the step's reward and done are the
  turn's.
- **MCP** (`tools: true`, an `MCPEnvironment`): at reset the session also steps a `ListToolsAction` and hands
  the tools to the chat template as `{"type": "function", "function": {name, description, parameters}}`. Each
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a policy turn (the Hermes / Qwen format, read by
  `envs.tools.parse_tool_calls`) is stepped as a `CallToolAction` and its result is a `tool` message; a tool the
  server does not know or a tool that fails is a `tool` message saying so (counted in `info["tool_errors"]`), a
  call that cannot be read is never sent and is answered, as in `ToolSession`, by one user message after the
  turn's tool messages (counted in `info["parse_errors"]`); never an exception. A turn with no call at all is
  answered with a user message asking for one (nothing is sent).
  The environment ends the episode (e.g. on a `submit` tool) with its reward.

A session holds its connection for the whole episode: the server keeps one environment instance per connection,
so a second connection would be another episode. Only the start (connect, reset, list tools) is retried; a step
that times out (`message_timeout_s`), a connection the server drops and an error the server answers all raise
(`OpenEnvTimeout` is also a `TimeoutError`), and the driver ends the episode (`error_timeout`,
`error_environment`): replaying steps in a new session could not be the same episode.

`lookup_app` is a small MCP environment that ships here for the tests and examples: follow a chain of keys with
a `lookup` tool, then `submit` the number at its end (`topologies/openenv_tools.yaml` trains on it). `LookupTask`
is the same task as a warm-start task: perfect episodes played locally on the tables the server draws, so a tiny
model learns the tool-call format before the run plays it against the server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from typing import TYPE_CHECKING, Any

from pydantic import Field

from composer_mesh.envs.config import OpenEnvConfig
from composer_mesh.envs.openenv import (
    EXTRA_KEY,
    EpisodeClient,
    OpenEnvEnvironment,
    OpenEnvError,
    OpenEnvServerError,
    OpenEnvTimeout,
    OpenEnvUnavailable,
    Step,
    _describe,
    _drop,
    _step,
    prompt_of,
)
from composer_mesh.envs.session import EpisodePrompt, Message, Observation, StepResult
from composer_mesh.envs.tool_session import format_error_message
from composer_mesh.envs.tools import format_tool_call, parse_tool_calls

if TYPE_CHECKING:
    from fastapi import FastAPI
    from openenv.core.generic_client import GenericEnvClient

NO_TOOL_CALL = ("No tool call found. Call one of the tools as <tool_call>{\"name\": ..., \"arguments\": {...}}"
                "</tool_call>.")


class OpenEnvStepTimeout(OpenEnvTimeout, TimeoutError):
    """A step of an episode got no answer within `message_timeout_s` (the driver's `error_timeout`)."""


class OpenEnvSession:
    """One episode on an OpenEnv server (`EnvSession`). `reset_args`: the prompt's reset arguments (seed and
    split included); `expected`: the prompt text its reset must show again (the server's reset must be
    deterministic in the seed), or None to take whatever it shows."""

    def __init__(self, client: EpisodeClient, cfg: OpenEnvConfig, reset_args: dict[str, Any],
                 expected: str | None = None) -> None:
        self.client, self.cfg, self.reset_args, self.expected = client, cfg, dict(reset_args), expected
        self.url = client.url
        self.steps = 0  # steps sent to the server (a tool call is a step)
        self._env: GenericEnvClient | None = None
        self._state = "new"  # new -> open -> done | failed | closed

    async def reset(self) -> Observation:
        """Open the session, reset it with the prompt's arguments and (MCP) list its tools."""
        if self._state != "new":
            raise OpenEnvError(f"OpenEnv server {self.url}: reset of a session that is {self._state}; a session "
                               "plays one episode")
        env, (first, tools) = await self.client.opened("episode reset", self._start)
        self._env, self._state = env, "open"
        text, messages = prompt_of(self.cfg, first.observation)
        if self.expected is not None and text != self.expected:
            await self.close()
            raise OpenEnvError(f"OpenEnv server {self.url} reset {self.reset_args} to another prompt than the "
                               f"episode's ({text[:60]!r}, not {self.expected[:60]!r}): its reset must be "
                               "deterministic in the seed, and the server the same one")
        return Observation(messages=messages or [{"role": "user", "content": text}], tools=tools)

    async def _start(self, env: GenericEnvClient) -> tuple[Step, list[dict[str, Any]]]:
        first = _step(await env.reset(**self.reset_args))
        if not self.cfg.tools:
            return first, []
        listed = _step(await env.step({"type": "list_tools"}))
        raw = listed.observation.get("tools")
        if not isinstance(raw, list):
            raise OpenEnvServerError(f"OpenEnv server {self.url} answered list_tools without a tools list "
                                     f"(observation fields: {sorted(listed.observation)}): is it an MCPEnvironment?")
        return first, [function_schema(t) for t in raw]

    async def step(self, action: str) -> StepResult:
        """The policy's turn: one text action, or (MCP) a step per tool call until one ends the episode."""
        if self._state != "open":
            raise OpenEnvError(f"OpenEnv server {self.url}: step of a session that is {self._state}"
                               + (" (reset it first)" if self._state == "new" else ""))
        result = await (self._tool_turn(action) if self.cfg.tools else self._text_turn(action))
        if result.done:
            self._state = "done"
        return result

    async def _text_turn(self, action: str) -> StepResult:
        step = await self._send({self.cfg.action_field: action})
        field = self.cfg.feedback_field or self.cfg.prompt_field
        text = step.observation.get(field)
        if isinstance(text, str) and text:
            messages: list[Message] = [{"role": "user", "content": text}]
        elif step.done:
            messages = []
        else:
            raise OpenEnvServerError(f"OpenEnv server {self.url}: step {self.steps}'s observation has no text in "
                                     f"{field!r} to show the policy (observation fields: {sorted(step.observation)}); "
                                     "set run.environment.feedback_field")
        return StepResult(messages=messages, reward=step.reward, done=step.done)

    async def _tool_turn(self, action: str) -> StepResult:
        turn = parse_tool_calls(action)
        if turn.is_final:
            return StepResult(messages=[{"role": "user", "content": NO_TOOL_CALL}],
                              info={"tool_calls": 0.0, "tool_errors": 0.0, "parse_errors": 0.0})
        messages: list[Message] = []
        reward: float | None = None
        done, errors, sent = False, 0, 0
        for call in turn.calls:  # the unreadable ones (turn.errors) are never sent: the policy is told below
            step = await self._send({"type": "call_tool", "tool_name": call.name, "arguments": call.arguments})
            sent += 1
            content, failed = tool_result(step.observation)
            messages.append({"role": "tool", "name": call.name, "content": content})
            errors += failed
            if step.reward is not None:
                reward = (reward or 0.0) + step.reward
            if step.done:
                done = True
                break
        if turn.errors and not done:
            messages.append(format_error_message(turn.errors))
        return StepResult(messages=messages, reward=reward, done=done, info={
            "tool_calls": float(sent), "tool_errors": float(errors), "parse_errors": float(len(turn.errors))})

    async def _send(self, action: dict[str, Any]) -> Step:
        """One step on the open connection; any failure leaves the session failed (its connection dropped)."""
        assert self._env is not None
        self.steps += 1
        try:
            return _step(await self._env.step(action))
        except BaseException as e:  # cancelled too: the answer would come later, out of step
            self._state = "failed"
            _drop(self._env)
            if isinstance(e, Exception):
                raise self._failure(e) from e
            raise

    def _failure(self, e: Exception) -> OpenEnvError:
        from websockets.exceptions import ConnectionClosed

        where = f"OpenEnv server {self.url}: step {self.steps} of the episode"
        if isinstance(e, TimeoutError | asyncio.TimeoutError):
            return OpenEnvStepTimeout(f"{where} got no answer within {self.client.settings.message_timeout_s:g}s "
                                      "(run.environment.message_timeout_s); the session is dropped")
        if isinstance(e, ConnectionClosed | OSError):
            return OpenEnvUnavailable(f"{where}: the server closed the connection ({_describe(e)}): did it stop "
                                      "or restart?")
        if isinstance(e, RuntimeError) and "VALIDATION_ERROR" in str(e):
            return OpenEnvServerError(f"{where}: the server refused the action ({_describe(e)}): does its action "
                                      f"have a field {self.cfg.action_field!r} (run.environment.action_field), or "
                                      "is it an MCP environment (run.environment.tools)?")
        return OpenEnvServerError(f"{where} failed: {_describe(e)}")

    async def close(self) -> None:
        """End the session: the closing handshake when the connection is healthy, else drop it; idempotent."""
        env, self._env = self._env, None
        failed, self._state = self._state == "failed", "closed"
        if env is None:
            return
        if failed:
            _drop(env)
            return
        try:
            await asyncio.wait_for(env.close(), self.client.settings.connect_timeout_s)
        except Exception:
            _drop(env)


class OpenEnvEpisodes(OpenEnvEnvironment):
    """An OpenEnv server's prompts (the same train stream and eval set as `OpenEnvEnvironment`) played as
    multi-step episodes (`EpisodeEnvironment`); `load_environment` makes one when `run.environment.episodes`."""

    def session(self, prompt: EpisodePrompt, seed: int) -> OpenEnvSession:
        """`prompt` as an episode: a session reset with the prompt's own reset arguments (its `extra["openenv"]`,
        which hold the seed the prompt was drawn with), so the same prompt is the same episode. `seed` is not
        sent: the server's draws are fixed by that reset seed, and another seed would be another problem."""
        replay = prompt.extra.get(EXTRA_KEY)
        if not isinstance(replay, dict) or not isinstance(replay.get("reset"), dict):
            raise ValueError(f"prompt {prompt.prompt_id} has no extra['openenv'] reset arguments: only prompts of an "
                             "openenv run.environment can be played as its episodes")
        return OpenEnvSession(self.client, self.cfg, replay["reset"], expected=prompt.text)


# ---------------------------------------------------------------------------------------------- tools
def function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (name, description, input_schema) in the function format chat templates take."""
    parameters = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": str(tool.get("name", "")),
                                             "description": str(tool.get("description") or ""),
                                             "parameters": parameters}}


def tool_result(observation: dict[str, Any]) -> tuple[str, bool]:
    """(the text of a `CallToolObservation` for the policy, whether the call failed)."""
    error = observation.get("error")
    if isinstance(error, dict):
        return f"error ({error.get('error_type', 'error')}): {error.get('message', '')}", True
    result = observation.get("result")
    if not isinstance(result, dict):
        return ("" if result is None else json.dumps(result, default=str)), False
    texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
    text = "\n".join(texts) if texts else json.dumps(result.get("data"), default=str)
    failed = bool(result.get("is_error"))
    return (f"error: {text}" if failed else text), failed


# ---------------------------------------------------------------------------------------------- a small MCP environment
WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "iris", "juniper", "kestrel",
         "lilac", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sage", "thistle", "umber", "violet",
         "willow", "yarrow")


LOOKUP_HOPS = 3  # keys to follow from the start key to the number
LOOKUP_MAX_CALLS = 8  # tool calls after which an episode ends with reward 0
# The tools as the server lists them (`function_schema` of its MCP tools; tests/envs/test_openenv_session.py checks
# they are the same): what `LookupTask` declares to the chat template.
LOOKUP_TOOLS: tuple[dict[str, Any], ...] = (
    {"type": "function", "function": {
        "name": "lookup", "description": "Look up a key in the table: another key, or a number.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"key": {"type": "string", "description": "the key to look up"}},
                       "required": ["key"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Submit the number the chain of keys ends at; ends the task.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"answer": {"type": "string", "description": "the number"}},
                       "required": ["answer"]}}},
)


def lookup_prompt(start: str) -> str:
    """The task as the environment's reset shows it."""
    return f"Look up {start!r} with the lookup tool, then the key it gives, until you get a number; submit that number."


def lookup_problem(seed: int | None, split: str, hops: int) -> tuple[str, dict[str, str], str]:
    """(start key, table, answer): a chain of `hops` keys, each `lookup` giving the next, the last a number;
    the other keys lead elsewhere. Train and eval draw from separate seeds' streams (`split` in the seed)."""
    rng = random.Random(f"{split}/{seed}")
    keys = rng.sample(WORDS, len(WORDS))
    answer = str(rng.randrange(100))
    table = {keys[i]: keys[i + 1] for i in range(hops - 1)}
    table[keys[hops - 1]] = answer
    for key in keys[hops:]:  # distractors: a wrong number, or another key
        table[key] = str(rng.randrange(100)) if rng.random() < 0.5 else rng.choice(keys)
    return keys[0], table, answer


@functools.cache
def lookup_classes() -> tuple[type, type, type]:
    """(environment, action, observation) classes of the shipped lookup environment, built on first use so that
    importing this module does not import `openenv` (subclass the environment to change it)."""
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation as EnvObservation
    from openenv.core.env_server.types import State

    class TaskObservation(EnvObservation):  # type: ignore[misc]
        prompt: str = Field("", description="The task (after reset).")

    class LookupEnvironment(MCPEnvironment):  # type: ignore[misc]
        """Follow keys with `lookup(key)` from the start key to a number and `submit(answer)` it: reward 1 for the
        right number, 0 otherwise; the episode also ends, with 0, after `max_calls` tool calls."""

        SUPPORTS_CONCURRENT_SESSIONS = True
        hops, max_calls = LOOKUP_HOPS, LOOKUP_MAX_CALLS

        def __init__(self) -> None:
            mcp = FastMCP("lookup")
            self._table: dict[str, str] = {}
            self._answer, self._calls, self._reward = "", 0, 0.0

            @mcp.tool()
            def lookup(key: str) -> str:
                """Look up a key in the table: another key, or a number.

                Args:
                    key: the key to look up
                """
                return self._table.get(key.strip(), f"no key {key!r}")

            @mcp.tool()
            def submit(answer: str) -> str:
                """Submit the number the chain of keys ends at; ends the task.

                Args:
                    answer: the number
                """
                self._reward = float(answer.strip() == self._answer)
                return "correct" if self._reward else "wrong"

            super().__init__(mcp)
            self._state = State(step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, split: str = "train",
                  **kwargs: Any) -> Any:
            start, self._table, self._answer = lookup_problem(seed, split, self.hops)
            self._calls, self._reward = 0, 0.0
            self._state = State(episode_id=episode_id, step_count=0)
            return TaskObservation(prompt=lookup_prompt(start))

        def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            raise ValueError("this environment takes tool calls only (list_tools, call_tool)")

        async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
            if isinstance(action, CallToolAction):
                self._calls += 1
                self._state.step_count += 1
                if (action.tool_name == "submit" and observation.error is None) or self._calls >= self.max_calls:
                    observation.done, observation.reward = True, self._reward
            return observation

        @property
        def state(self) -> Any:
            return self._state

    return LookupEnvironment, CallToolAction, CallToolObservation


def lookup_app(max_sessions: int = 64) -> FastAPI:
    """The lookup environment's server app: `uvicorn --factory composer_mesh.envs.openenv_session:lookup_app`."""
    from openenv.core.env_server import create_app

    env, action, observation = lookup_classes()
    return create_app(env, action, observation, env_name="lookup", max_concurrent_envs=max_sessions)


class LookupTask:
    """The lookup environment as a warm-start task (`model.warmstart.task:
    composer_mesh.envs.openenv_session:LookupTask`). `chat_demonstration` plays a perfect episode of a train
    problem locally, on the table `lookup_problem` draws (the server's own draw for that seed): one `lookup` call a
    turn along the chain, then `submit`. Why: an untrained tiny model never writes a tool call, so its episodes
    against the server would be reminders only; warm-started, it calls the tools (with the keys right or not) and
    every call is a real step of the server. Eval-split problems are never demonstrated."""

    name = "lookup"
    alphabet = "".join(sorted(set("".join(WORDS)) | set("0123456789")))
    splits = ("train", "eval")

    def sample(self, rng: random.Random, split: str = "train") -> tuple[str, str]:
        start, _, answer = lookup_problem(rng.randrange(10**9), split, LOOKUP_HOPS)
        return lookup_prompt(start), answer

    def reward(self, prompt: str, completion: str, answer: str | None) -> float:
        return float(answer is not None and completion.strip() == answer)

    def chat_demonstration(self, rng: random.Random) -> tuple[list[Message], list[dict[str, Any]]]:
        """A perfect episode of a train problem (the messages the session would produce) and the tools."""
        start, table, answer = lookup_problem(rng.randrange(10**9), "train", LOOKUP_HOPS)
        messages: list[Message] = [{"role": "user", "content": lookup_prompt(start)}]
        key = start
        for _ in range(LOOKUP_HOPS):
            messages.append({"role": "assistant", "content": format_tool_call("lookup", {"key": key})})
            messages.append({"role": "tool", "name": "lookup", "content": table[key]})
            key = table[key]
        messages.append({"role": "assistant", "content": format_tool_call("submit", {"answer": answer})})
        return messages, [dict(t) for t in LOOKUP_TOOLS]
