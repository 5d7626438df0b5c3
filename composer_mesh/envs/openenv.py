"""OpenEnv (https://github.com/meta-pytorch/OpenEnv, PyPI `openenv-core`) as a run's prompts and rewards.

An OpenEnv environment is a server; one episode is one session on it. Episodes go through the library's
`EnvClient` over the WebSocket API (`/ws`): one connection is one session with its own environment instance,
whereas plain HTTP `/reset` and `/step` build a fresh environment per call, so a step would never see its reset.

A single-turn text episode: `reset(seed=, split=)` gives the prompt (an observation field), the completion is the
one action, and the step's reward is the score. The controller's prompt source resets seeds `seed + position`
(train) and `seed + 10^9 + i` (eval), and skips a train prompt that is an eval prompt (by sha256), so train and
eval share no prompt. A row's `extra["openenv"]` carries the server URL, the seed and the client settings: the
reward function (`composer_mesh.envs.openenv:score`, in the `python` rewarder's worker processes) replays the
episode in a session of its own, reset with the same seed (checked to give the same prompt), then steps with
the completion. A session per episode rather than one kept per worker: an episode is what a session is for, a
worker killed at its timeout leaves no half-used session to anyone, and nothing idles against the server's
session limit; on localhost a connection costs a millisecond.

`run.environment.server` starts a local environment server for the run (`EnvServer`: a command, waited for
on `GET /health`, stopped when the run ends, killed with the controller by a lifeline). `addition_app` is a
small environment that ships here (single-digit addition, the `addition` task's problems and held-out split),
for `topologies/openenv.yaml` and the tests.

This module stays import-cheap (pydantic, httpx): `openenv` is imported when a client or server is built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import Field

from composer_mesh.envs.base import StreamPosition
from composer_mesh.envs.config import ClientSettings, OpenEnvConfig, ServerCommand
from composer_mesh.tasks.arithmetic import AdditionTask, exact_match
from composer_mesh.tasks.data import DataRow

if TYPE_CHECKING:
    from fastapi import FastAPI
    from openenv.core.generic_client import GenericEnvClient

log = logging.getLogger("composer_mesh.envs.openenv")

EXTRA_KEY = "openenv"  # Prompt.extra[EXTRA_KEY]: how the reward function replays the prompt's episode
EVAL_SEED_OFFSET = 10**9  # eval episodes reset with seeds train positions never reach
EVAL_POOL = (20, 100)  # the eval set's distinct prompts are looked for in the first 20 * eval_size + 100 seeds
MAX_SKIP_STREAK = 10_000  # train prompts in a row that are eval prompts before the stream gives up
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- errors
class OpenEnvError(RuntimeError):
    """An episode that could not be played; the message names the server."""


class OpenEnvUnavailable(OpenEnvError):
    """The server cannot be reached (down, not started, or at its session limit) after the retries."""


class OpenEnvTimeout(OpenEnvError):
    """The server did not answer within the timeouts, after the retries."""


class OpenEnvServerError(OpenEnvError):
    """The server answered with an error (the environment raised, or refused the action): not retried."""


def http_url(url: str) -> str:
    """The server's HTTP base URL (for `/health`), from an http(s) or ws(s) URL."""
    return "http" + url[2:] if url.startswith("ws") else url


def ws_url(url: str) -> str:
    """The WebSocket endpoint `EnvClient` opens for `url`."""
    return "ws" + url[4:] + "/ws" if url.startswith("http") else url + "/ws"


# ---------------------------------------------------------------------------------------------- client
@dataclass
class Step:
    """One reset or step answer: the observation's fields, the reward, whether the episode ended."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


class EpisodeClient:
    """Sessions on one environment server with timeouts and retries, callable from sync code and from inside a
    running event loop (the controller's `take` is sync, called from the loop): each call runs its session on a
    private event loop. A retry replays the whole session (a new connection is a new environment instance)."""

    def __init__(self, url: str, settings: ClientSettings, *, rng: random.Random | None = None) -> None:
        self.url, self.settings = url, settings
        self._rng = rng or random.Random()

    def resets(self, resets: list[dict[str, Any]]) -> list[Step]:
        """Reset once per entry of `resets` (its arguments), all in one session."""
        return self._run("reset", lambda env: _each(env, resets))

    def episode(self, reset: dict[str, Any], action: dict[str, Any]) -> tuple[Step, Step]:
        """One episode in its own session: reset with `reset`, then one step with `action`."""
        return self._run("episode", lambda env: _episode(env, reset, action))

    async def opened(self, what: str, play: Callable[[GenericEnvClient], Awaitable[T]]) -> tuple[GenericEnvClient, T]:
        """Open a session and `play` its start (e.g. the reset), with the retries; the session stays open for the
        caller (a multi-step episode's next steps), who closes it. Only the start is retried: once an episode
        has stepped, a new session would not be the same episode."""
        return await self._with_retries(what, play, keep_open=True)  # type: ignore[return-value]

    def _run(self, what: str, play: Callable[[GenericEnvClient], Awaitable[T]]) -> T:
        return _run_sync(self._with_retries(what, play))  # type: ignore[arg-type]

    async def _with_retries(self, what: str, play: Callable[[GenericEnvClient], Awaitable[T]], *,
                            keep_open: bool = False) -> T | tuple[GenericEnvClient, T]:
        from openenv.core.generic_client import GenericEnvClient

        s, attempt = self.settings, 0
        while True:
            attempt += 1
            env = GenericEnvClient(base_url=self.url, connect_timeout_s=s.connect_timeout_s,
                                   message_timeout_s=s.message_timeout_s)
            try:
                await env.connect()
                result = await play(env)
            except Exception as e:
                _drop(env)
                reason = _retry_reason(e)
                if reason is None:
                    raise OpenEnvServerError(f"OpenEnv server {self.url}: {what} failed: {_describe(e)}") from None
                if attempt > s.max_retries:
                    raise self._gave_up(what, reason, e, attempt) from None
                delay = min(s.backoff_max_s, s.backoff_s * 2 ** (attempt - 1)) * self._rng.uniform(0.5, 1.0)
                log.warning("OpenEnv server %s: %s attempt %d/%d: %s (%s); retrying in %.2fs", self.url, what,
                            attempt, s.max_retries + 1, reason, _describe(e), delay)
                await asyncio.sleep(delay)
            else:
                if keep_open:
                    return env, result
                await env.close()  # the closing handshake: the server ends the session now
                return result

    def _gave_up(self, what: str, reason: str, e: BaseException, attempts: int) -> OpenEnvError:
        s, tail = self.settings, f"after {attempts} attempt{'s' * (attempts > 1)}"
        if reason == "timeout":
            return OpenEnvTimeout(f"OpenEnv server {self.url}: {what} timed out ({tail}; connect timeout "
                                  f"{s.connect_timeout_s:g}s, message timeout {s.message_timeout_s:g}s)")
        limit = "its max_concurrent_envs must be at least the rewarder's workers plus one"
        if reason == "busy":
            return OpenEnvUnavailable(f"OpenEnv server {self.url} is at its session limit ({tail}): {limit}")
        if reason == "dropped":
            return OpenEnvUnavailable(f"OpenEnv server {self.url} closed the session ({tail}; last: {_describe(e)}): "
                                      f"is it restarting, or at its session limit? ({limit})")
        return OpenEnvUnavailable(f"OpenEnv server {self.url} is not reachable at {ws_url(self.url)} ({tail}; "
                                  f"last: {_describe(e)}): is it running? run.environment.server starts one")


async def _each(env: GenericEnvClient, resets: list[dict[str, Any]]) -> list[Step]:
    return [_step(await env.reset(**kwargs)) for kwargs in resets]


async def _episode(env: GenericEnvClient, reset: dict[str, Any], action: dict[str, Any]) -> tuple[Step, Step]:
    first = _step(await env.reset(**reset))
    return first, _step(await env.step(action))


def _drop(env: GenericEnvClient) -> None:
    """Drop a failed attempt's connection without the closing handshake: a server stuck in a step would answer
    it only once the step ends. (`EnvClient` keeps its connection in `_ws`; the server ends the session when
    the connection drops.)"""
    ws = getattr(env, "_ws", None)
    if ws is not None:
        ws.transport.abort()
        env._ws = None


def _step(result: Any) -> Step:
    observation = result.observation if isinstance(result.observation, dict) else {}
    reward = None if result.reward is None else float(result.reward)
    return Step(observation=observation, reward=reward, done=bool(result.done))


def _retry_reason(e: BaseException) -> str | None:
    """Why an attempt is worth repeating ("timeout", "dropped", "unreachable", "busy"), or None for an error that would
    only repeat (the environment raised, or rejected the action)."""
    from websockets.exceptions import ConnectionClosed

    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return "timeout"
    if isinstance(e, ConnectionError) and isinstance(e.__cause__, TimeoutError | asyncio.TimeoutError):
        return "timeout"  # EnvClient.connect wraps the WebSocket open timeout
    if isinstance(e, ConnectionClosed):  # e.g. at its session limit: the refusal can beat our first message
        return "dropped"
    if isinstance(e, OSError):  # refused, reset, unresolvable (ConnectionError is an OSError)
        return "unreachable"
    if isinstance(e, RuntimeError) and "CAPACITY_REACHED" in str(e):
        return "busy"
    return None


def _describe(e: BaseException) -> str:
    text = str(e) or (str(e.__cause__) if e.__cause__ else "")
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__


def _run_sync(coro: Awaitable[T]) -> T:
    """Run `coro` to completion on a private event loop: in this thread, or in a helper thread when this thread
    already runs a loop (blocking it for at most the client's timeouts)."""

    async def main() -> T:
        return await coro

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="openenv-client") as pool:
        return pool.submit(asyncio.run, main()).result()


# ---------------------------------------------------------------------------------------------- server
# Runs the server command in its own process group and kills that group when the lifeline closes: the run's
# controller holds the other end, so the server never outlives it, even when it is SIGKILLed.
_WATCHDOG = """
import os, signal, subprocess, sys, threading
lifeline = int(sys.argv[1])
child = subprocess.Popen(sys.argv[2:], pass_fds=())
def watch():
    try:
        os.read(lifeline, 1)
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *_: None)  # the whole group gets it: wait for the server to stop
sys.exit(child.wait())
"""


class EnvServer:
    """A local environment server for a run: `start()` runs `command` and waits for `GET <url>/health`, `stop()`
    ends it (SIGTERM, then SIGKILL after `grace_s`). Refuses to start when something already answers at `url`
    (a stale server would be scored against instead). Output goes to `log` (default: a temporary file)."""

    def __init__(self, spec: ServerCommand, url: str, grace_s: float = 5.0) -> None:
        self.spec, self.url, self.grace_s = spec, url.rstrip("/"), grace_s
        self.health = http_url(self.url) + "/health"
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = spec.log
        self._lifeline: int | None = None

    def argv(self) -> list[str]:
        """The command with `{python}`, `{host}` and `{port}` filled in."""
        parts = urlsplit(self.url)
        values = {"{python}": sys.executable, "{host}": parts.hostname or "", "{port}": str(parts.port or "")}
        return [values.get(arg, arg) for arg in self.spec.command]

    def start(self) -> EnvServer:
        if self._healthy():
            raise OpenEnvError(f"something already answers at {self.health}: stop it, or point run.environment.url "
                               "at another port (run.environment.server starts its own server)")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="openenv-server-", suffix=".log")
            os.close(fd)
        lifeline, self._lifeline = os.pipe()
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(lifeline), *self.argv()], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, pass_fds=(lifeline,), start_new_session=True)
        os.close(lifeline)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("OpenEnv server %s is up (pid %d, log %s)", self.url, self.process.pid, self.log_path)
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise OpenEnvError(f"the environment server {self.argv()} exited with code {code} before answering "
                                   f"at {self.health}; its log ({self.log_path}) ends with:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.2)
        raise OpenEnvError(f"the environment server {self.argv()} did not answer at {self.health} within "
                           f"{self.spec.ready_timeout_s:g}s; its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.health, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not os.path.exists(self.log_path):
            return "(no log)"
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip() or "(empty)"

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; safe to call twice."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def __enter__(self) -> EnvServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------- prompts
def prompt_key(text: str, messages: list[dict[str, str]] | None) -> str:
    """What identifies a prompt for the train/eval split: sha256 of its messages (JSON), else of its text."""
    body = text if messages is None else json.dumps(messages, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


class OpenEnvEnvironment(StreamPosition):
    """An OpenEnv server's episodes as a train stream and a disjoint, fixed eval set (`composer_mesh.envs.Environment`).

    Starts `cfg.server` first if set: the run stops it with `close()`; a finalizer stops it when this object goes
    away unclosed, and the server's lifeline when the process dies. The eval set (the first `eval_size` distinct
    prompts of the eval seeds) is fetched here, so an unreachable server or a wrong observation field fails now.
    The stream's position (train seeds used, skipped ones included) is its state."""

    changed = "run.environment, the seed or the environment's prompts changed"

    def __init__(self, cfg: OpenEnvConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, cfg.seed if cfg.seed is not None else seed
        self.name = f"openenv/{cfg.url}"
        self.server = EnvServer(cfg.server, cfg.url).start() if cfg.server is not None else None
        self._finalizer = weakref.finalize(self, _stop_server, self.server)
        self.client = EpisodeClient(cfg.url, ClientSettings.model_validate(cfg.model_dump(include=_CLIENT_FIELDS)))
        try:
            self.eval = self._eval_set()
        except BaseException:
            self.close()
            raise
        self.eval_keys = frozenset(prompt_key(r.text, r.messages) for r in self.eval)
        self.position = 0
        self.skipped = 0  # train prompts left out: they are eval prompts
        self.digest = self._digest()

    def close(self) -> None:
        """Stop the server this environment started (if any); a second call does nothing."""
        self._finalizer()

    def reset_args(self, seed: int, split: str) -> dict[str, Any]:
        out = {**self.cfg.reset, "seed": seed}
        if self.cfg.split_field is not None:
            out[self.cfg.split_field] = split
        return out

    def row(self, step: Step, seed: int, split: str) -> DataRow:
        """A prompt row for a reset answer; `extra["openenv"]` lets the reward function replay the episode."""
        text, messages = prompt_of(self.cfg, step.observation)
        answer = step.observation.get(self.cfg.answer_field) if self.cfg.answer_field else None
        replay = {"url": self.cfg.url, "reset": self.reset_args(seed, split), **_replay_fields(self.cfg)}
        return DataRow(text=text, answer=None if answer is None else str(answer), messages=messages,
                       extra={EXTRA_KEY: replay}, where=f"OpenEnv {self.cfg.url}, {split} seed {seed}")

    def _rows(self, seeds: list[int], split: str) -> list[DataRow]:
        steps = self.client.resets([self.reset_args(s, split) for s in seeds])
        return [self.row(step, s, split) for step, s in zip(steps, seeds)]

    def _eval_set(self) -> list[DataRow]:
        size = self.cfg.eval_size
        if size == 0:
            return []
        base, pool = self.seed + EVAL_SEED_OFFSET, EVAL_POOL[0] * size + EVAL_POOL[1]
        rows: list[DataRow] = []
        seen: set[str] = set()
        for start in range(0, pool, size):
            for row in self._rows(list(range(base + start, base + min(start + size, pool))), "eval"):
                key = prompt_key(row.text, row.messages)
                if key not in seen and len(rows) < size:
                    seen.add(key)
                    rows.append(row)
            if len(rows) == size:
                return rows
        log.warning("run.environment: %s has only %d distinct eval prompts in its first %d eval seeds "
                    "(eval_size %d)", self.name, len(rows), pool, size)
        return rows

    def train_rows(self, n: int) -> list[DataRow]:
        out: list[DataRow] = []
        streak = 0  # eval prompts in a row
        while len(out) < n:
            seeds = list(range(self.seed + self.position, self.seed + self.position + n - len(out)))
            for row in self._rows(seeds, "train"):
                self.position += 1
                if prompt_key(row.text, row.messages) in self.eval_keys:
                    self.skipped += 1
                    streak += 1
                    if streak > MAX_SKIP_STREAK:
                        raise ValueError(f"run.environment: {MAX_SKIP_STREAK} train prompts of {self.name} in a row "
                                         "are eval prompts: does its reset ignore the seed? lower eval_size")
                    continue
                streak = 0
                out.append(row)
        return out

    def eval_rows(self, n: int) -> list[DataRow]:
        return self.eval[:n]

    def _digest(self) -> str:
        fields = {"seed", "reset", "split_field", "prompt_field", "messages_field", "system_prompt", "eval_size"}
        ident = {**self.cfg.model_dump(include=fields), "seed": self.seed, "eval": sorted(self.eval_keys)}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]



_CLIENT_FIELDS = set(ClientSettings.model_fields)


def _replay_fields(cfg: OpenEnvConfig) -> dict[str, Any]:
    """What the reward function needs besides the URL and the reset arguments."""
    keep = {"prompt_field", "messages_field", "action_field", "system_prompt", *_CLIENT_FIELDS}
    return cfg.model_dump(include=keep)


def _stop_server(server: EnvServer | None) -> None:
    if server is not None:
        server.stop()


def prompt_of(cfg: OpenEnvConfig | dict[str, Any], observation: dict[str, Any]) -> tuple[str, list[dict[str, str]] | None]:
    """(text, chat messages or None) of a reset observation; errors name the field and what the observation has."""
    get = cfg.get if isinstance(cfg, dict) else functools.partial(getattr, cfg)
    messages_field, field = get("messages_field"), get("prompt_field")
    if messages_field:
        value = observation.get(messages_field)
        if not (isinstance(value, list) and value and all(_is_message(m) for m in value)):
            raise ValueError(f"the reset observation's {messages_field!r} is {_show(value)}, expected chat messages "
                             f"[{{role, content}}] (observation fields: {sorted(observation)})")
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        users = [m["content"] for m in messages if m["role"] == "user"]
        return (users[-1] if users else messages[-1]["content"]), messages
    text = observation.get(field)
    if not isinstance(text, str) or not text:
        raise ValueError(f"the reset observation's {field!r} is {_show(text)}, expected the prompt text (observation "
                         f"fields: {sorted(observation)}; set run.environment.prompt_field or messages_field)")
    system = get("system_prompt")
    return text, ([{"role": "system", "content": system}, {"role": "user", "content": text}] if system else None)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _show(value: Any) -> str:
    return "missing" if value is None else f"{type(value).__name__} {str(value)[:60]!r}"


# ---------------------------------------------------------------------------------------------- reward
def score(prompt: str, completion: str, answer: str | None, extra: dict[str, Any] | None = None) -> float:
    """Reward function for the `python` rewarder (`composer_mesh.envs.openenv:score`): replay the prompt's
    episode in a session of its own (reset with its seed, checked to give this prompt; one step with the
    completion) and return the step's reward. Set the function's `timeout_s` above the client's worst case,
    (max_retries + 1) × (connect + 2 × message timeouts) plus the backoffs, or a retry is cut short."""
    replay = (extra or {}).get(EXTRA_KEY)
    if not isinstance(replay, dict):
        raise ValueError("the prompt has no extra['openenv'] (only prompts of an openenv run.environment can be "
                         "scored with composer_mesh.envs.openenv:score)")
    client = EpisodeClient(replay["url"], ClientSettings.model_validate({k: replay[k] for k in _CLIENT_FIELDS}))
    first, step = client.episode(replay["reset"], {replay["action_field"]: completion})
    text, _ = prompt_of(replay, first.observation)
    if text != prompt:
        raise ValueError(f"OpenEnv server {replay['url']} reset {replay['reset']} to another prompt than the "
                         f"controller's ({text[:60]!r}, not {prompt[:60]!r}): its reset must be deterministic in "
                         "the seed, and the server the same one")
    if step.reward is None:
        raise ValueError(f"OpenEnv server {replay['url']} gave no reward for the step (observation fields: "
                         f"{sorted(step.observation)})")
    return step.reward


# ---------------------------------------------------------------------------------------------- a small environment
@functools.cache
def addition_classes() -> tuple[type, type, type]:
    """(environment, action, observation) classes of the shipped addition environment, built on first use so
    that importing this module does not import `openenv`. Subclass the environment to change its behaviour."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    task = AdditionTask()

    class TextAction(Action):  # type: ignore[misc]
        message: str = Field(description="The policy's completion.")

    class TextObservation(Observation):  # type: ignore[misc]
        prompt: str = Field("", description="The problem (after reset).")
        answer: str = Field("", description="The reference answer (after reset).")

    class AdditionEnvironment(Environment):  # type: ignore[misc]
        """`a+b=` for single digits, one step: reward 1 when the completion before its first ';' is the sum.
        `reset(seed, split)`: "train" problems, or the held-out "eval" fifth (the `addition` task's split)."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = State(step_count=0)
            self._problem = ("", "")

        def reset(self, seed: int | None = None, episode_id: str | None = None, split: str = "train",
                  **kwargs: Any) -> Any:
            self._problem = task.sample(random.Random(seed), split)
            self._state = State(episode_id=episode_id, step_count=0)
            return TextObservation(prompt=self._problem[0], answer=self._problem[1])

        def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            self._state.step_count += 1
            reward = exact_match(self._problem[0], action.message, self._problem[1])
            return TextObservation(reward=reward, done=True)

        @property
        def state(self) -> Any:
            return self._state

    return AdditionEnvironment, TextAction, TextObservation


def addition_app(max_sessions: int = 64) -> FastAPI:
    """The addition environment's server app: `uvicorn --factory composer_mesh.envs.openenv:addition_app`.
    `max_sessions`: concurrent WebSocket sessions (the rewarder's workers plus the controller's one)."""
    from openenv.core.env_server import create_app

    env, action, observation = addition_classes()
    return create_app(env, action, observation, env_name="addition", max_concurrent_envs=max_sessions)
