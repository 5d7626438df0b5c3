"""OpenEnv as a run's environment, against a real environment server on localhost (the library's `create_app` and
`EnvClient`, no fakes): prompts are the server's reset observations, train and eval share no prompt, an episode
replayed over the WebSocket API scores a completion (also in the `python` rewarder's worker processes), timeouts
and a busy server are retried, a server that is down is named, `EnvServer` starts, stops when the run's prompt
source is closed and never outlives the process that started it, and the shipped topology runs a few RL steps
on CPU with every loss channel on real Monarch meshes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import TypeAdapter
from websockets.sync.client import connect as ws_connect

from composer_mesh.envs.base import EnvironmentStateError
from composer_mesh.envs.openenv import (
    ClientSettings,
    EnvServer,
    EpisodeClient,
    OpenEnvConfig,
    OpenEnvEnvironment,
    OpenEnvError,
    OpenEnvServerError,
    OpenEnvTimeout,
    OpenEnvUnavailable,
    ServerCommand,
    score,
    ws_url,
)
from composer_mesh.orchestration.config import RunConfig
from composer_mesh.orchestration.prompts import EnvironmentPrompts, prompt_source
from composer_mesh.tasks.arithmetic import AdditionTask
from envs.e2e import run_every_channel, scores_in_workers, shortened

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "topologies" / "openenv.yaml"
SESSIONS = 3  # the test server's session limit

# The shipped addition environment, with a step that sleeps for the action "sleep <seconds>" (for timeouts).
SLOW_ADDITION = '''
import time

from openenv.core.env_server import create_app

from composer_mesh.envs.openenv import addition_classes

Addition, TextAction, TextObservation = addition_classes()


class SlowAddition(Addition):
    def step(self, action, timeout_s=None, **kwargs):
        if action.message.startswith("sleep "):
            time.sleep(float(action.message.split()[1]))
        return super().step(action, timeout_s, **kwargs)


def app():
    return create_app(SlowAddition, TextAction, TextObservation, env_name="slow_addition",
                      max_concurrent_envs={sessions})
'''

# A stand-in server for lifecycle tests that need no environment: answers 200 on every GET.
HEALTH_ONLY = textwrap.dedent("""
    import http.server, sys
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_stopped(url: str, pid: int) -> None:
    """The server started as process group `pid` is gone and nothing answers at `url` any more."""
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=1.0)


def uvicorn(app: str, app_dir: Path | None = None) -> list[str]:
    extra = ["--app-dir", str(app_dir)] if app_dir else []
    return ["{python}", "-m", "uvicorn", "--factory", app, *extra, "--host", "{host}", "--port", "{port}",
            "--log-level", "warning"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvServer]:
    """A real OpenEnv server on localhost for the module: the slow-step addition environment."""
    app_dir = tmp_path_factory.mktemp("openenv_app")
    (app_dir / "slow_addition.py").write_text(SLOW_ADDITION.format(sessions=SESSIONS))
    spec = ServerCommand(command=uvicorn("slow_addition:app", app_dir), log=str(app_dir / "server.log"))
    with EnvServer(spec, f"http://127.0.0.1:{free_port()}") as running:
        yield running
    assert running.process is None


def config(url: str, **fields: object) -> OpenEnvConfig:
    base = {"kind": "openenv", "url": url, "answer_field": "answer", "eval_size": 8, "backoff_s": 0.05}
    return OpenEnvConfig.model_validate({**base, **fields})


def test_prompts_are_the_servers_reset_observations(server: EnvServer) -> None:
    src = EnvironmentPrompts(OpenEnvEnvironment(config(server.url, seed=5), seed=0))
    task = AdditionTask()  # the environment draws the addition task's problems with Random(seed)
    prompts = src.take(4)
    assert [p.prompt_id for p in prompts] == ["p0", "p1", "p2", "p3"]
    for i, p in enumerate(prompts):
        assert (p.text, p.answer) == task.sample(random.Random(5 + i), "train")
        assert p.messages is None  # a text prompt (`system_prompt` or `messages_field` make it chat)
        replay = p.extra["openenv"]
        assert replay["url"] == server.url and replay["reset"] == {"seed": 5 + i, "split": "train"}
        assert json.loads(json.dumps(p.extra)) == p.extra  # crosses to the reward workers as JSON
    evals = src.eval_prompts(8)
    assert [p.prompt_id for p in evals] == [f"eval{i}" for i in range(8)] and len({p.text for p in evals}) == 8
    assert {p.extra["openenv"]["reset"]["split"] for p in evals} == {"eval"}
    chat = OpenEnvEnvironment(config(server.url, system_prompt="Add.", eval_size=1), seed=0).train_rows(1)[0]
    assert chat.messages == [{"role": "system", "content": "Add."}, {"role": "user", "content": chat.text}]


def test_train_and_eval_share_no_prompt(server: EnvServer) -> None:
    # With no split sent, the environment draws eval problems from its train split: the stream skips them.
    env = OpenEnvEnvironment(config(server.url, split_field=None, eval_size=10), seed=0)
    eval_texts = {r.text for r in env.eval_rows(10)}
    train_texts = {r.text for r in env.train_rows(200)}
    assert len(eval_texts) == 10 and not train_texts & eval_texts
    assert env.skipped > 0 and env.position == 200 + env.skipped
    # With the split, the environment's own held-out problems (the addition task's eval fifth) are the eval set.
    split = OpenEnvEnvironment(config(server.url, eval_size=20), seed=0)
    assert {r.text for r in split.eval_rows(20)} == {f"{a}+{b}=" for a, b in AdditionTask().pairs["eval"]}
    assert not {r.text for r in split.train_rows(100)} & {r.text for r in split.eval_rows(20)}


def test_an_episode_over_the_websocket_api_scores_the_completion(server: EnvServer) -> None:
    row = OpenEnvEnvironment(config(server.url, eval_size=0), seed=0).train_rows(1)[0]
    assert row.answer is not None
    assert score(row.text, f"{row.answer};", row.answer, row.extra) == 1.0
    assert score(row.text, f"{int(row.answer) + 1};", row.answer, row.extra) == 0.0
    with pytest.raises(ValueError, match="no extra"):
        score(row.text, "1;", row.answer, {})
    moved = {"openenv": {**row.extra["openenv"], "reset": {"seed": 99, "split": "eval"}}}
    with pytest.raises(ValueError, match=r"reset .* to another prompt than the controller's"):
        score(row.text, f"{row.answer};", row.answer, moved)
    # Plain HTTP /reset and /step build an environment per call: the step never sees the reset's problem.
    http = httpx.Client(base_url=server.url)
    assert http.post("/reset", json={"seed": 0}).json()["observation"]["prompt"] == row.text
    assert http.post("/step", json={"action": {"message": f"{row.answer};"}}).json()["reward"] == 0.0


def test_python_rewarder_plays_episodes_in_its_workers(server: EnvServer) -> None:

    prompt = EnvironmentPrompts(OpenEnvEnvironment(config(server.url, eval_size=0), seed=0)).take(1)[0]
    texts = (f"{prompt.answer};", "19;", "no idea")  # sums of two digits are 0..18
    assert scores_in_workers(prompt, texts, "composer_mesh.envs.openenv:score", workers=2) == [1.0, 0.0, 0.0]


def test_a_busy_server_is_retried_until_a_session_frees(server: EnvServer) -> None:
    with contextlib.ExitStack() as held:
        for _ in range(SESSIONS):  # every session the server allows
            held.enter_context(ws_connect(ws_url(server.url)))

        retries: list[str] = []

        class FreeOnRetry(logging.Handler):  # frees the sessions once the client met the limit and retries
            def emit(self, record: logging.LogRecord) -> None:
                retries.append(record.getMessage())
                held.close()

        release = FreeOnRetry()
        logging.getLogger("composer_mesh.envs.openenv").addHandler(release)
        try:
            client = EpisodeClient(server.url, ClientSettings(max_retries=3, backoff_s=0.1))
            first, step = client.episode({"seed": 0, "split": "train"}, {"message": "0;"})
        finally:
            logging.getLogger("composer_mesh.envs.openenv").removeHandler(release)
    assert first.observation["prompt"] and step.done
    assert retries and ("busy" in retries[0] or "dropped" in retries[0]), retries


def test_a_server_that_is_down_is_named_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    client = EpisodeClient(url, ClientSettings(max_retries=2, backoff_s=0.01))
    with pytest.raises(OpenEnvUnavailable) as e:
        client.resets([{"seed": 0}])
    assert f"OpenEnv server {url} is not reachable at {ws_url(url)} (after 3 attempts" in str(e.value)
    assert "is it running?" in str(e.value)
    with pytest.raises(OpenEnvUnavailable, match=f"OpenEnv server {url} is not reachable"):
        OpenEnvEnvironment(config(url, max_retries=0), seed=0)  # the run stops before any work


def test_errors_of_the_environment_are_not_retried(server: EnvServer) -> None:
    client = EpisodeClient(server.url, ClientSettings(max_retries=5, backoff_s=10.0, backoff_max_s=10.0))
    started = time.monotonic()
    with pytest.raises(OpenEnvServerError, match=f"OpenEnv server {server.url}: reset failed.*splits"):
        client.resets([{"seed": 0, "split": "test"}])  # the environment raises: repeating would not help
    assert time.monotonic() - started < 5  # one retry would have slept at least 5 s (10 s, jittered x0.5-1)
    with pytest.raises(ValueError, match=r"observation's 'question' is missing.*\['answer', 'prompt'\]"):
        OpenEnvEnvironment(config(server.url, prompt_field="question"), seed=0)


def test_state_restores_the_stream_and_refuses_another_environment(server: EnvServer) -> None:
    a = OpenEnvEnvironment(config(server.url), seed=0)
    a.train_rows(7)
    state = json.loads(json.dumps(a.state()))  # as in controller.json
    b = OpenEnvEnvironment(config(server.url), seed=0)
    b.restore(state)
    assert [r.extra for r in b.train_rows(5)] == [r.extra for r in a.train_rows(5)]
    with pytest.raises(EnvironmentStateError, match="the seed or the environment's prompts changed"):
        OpenEnvEnvironment(config(server.url), seed=1).restore(state)


def test_server_lifecycle_errors_name_the_command_and_its_log(server: EnvServer, tmp_path: Path) -> None:
    with pytest.raises(OpenEnvError, match=r"something already answers at .*/health"):
        EnvServer(ServerCommand(command=["true"]), server.url).start()
    crash = ServerCommand(command=["{python}", "-c", "print('no such environment: chess'); raise SystemExit(3)"])
    with pytest.raises(OpenEnvError, match=r"(?s)exited with code 3 before answering.*no such environment: chess"):
        EnvServer(crash, f"http://127.0.0.1:{free_port()}").start()
    silent = ServerCommand(command=["sleep", "30"], ready_timeout_s=0.5)
    with pytest.raises(OpenEnvError, match=r"did not answer at .* within 0.5s"):
        EnvServer(silent, f"http://127.0.0.1:{free_port()}").start()


def test_the_server_never_outlives_the_process_that_started_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    driver = textwrap.dedent(f"""
        import time
        from composer_mesh.envs.openenv import EnvServer, ServerCommand
        server = EnvServer(ServerCommand(command=["{{python}}", "-c", {HEALTH_ONLY!r}, "{{port}}"]), {url!r}).start()
        print(server.process.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and int(proc.stdout.readline()) > 0
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup code runs: only the lifeline is left
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=0.5)
        except httpx.HTTPError:
            return
        time.sleep(0.1)
    pytest.fail(f"the server at {url} outlived the process that started it")


def test_closing_the_prompt_source_stops_the_server_its_environment_started() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    server = {"command": uvicorn("composer_mesh.envs.openenv:addition_app")}
    src = prompt_source(RunConfig(environment={"kind": "openenv", "url": url, "server": server, "eval_size": 4}))
    assert isinstance(src, EnvironmentPrompts) and isinstance(src.env, OpenEnvEnvironment)
    assert src.env.server is not None and src.env.server.process is not None
    pid = src.env.server.process.pid
    assert len(src.take(2)) == 2
    src.close()
    assert_stopped(url, pid)
    src.close()  # twice is fine


def test_the_shipped_topology_starts_the_shipped_environment() -> None:
    from composer_mesh.envs.config import EnvironmentConfig
    from composer_mesh.topology import load_topology

    data = yaml.safe_load(TOPOLOGY.read_text())
    env = OpenEnvConfig.model_validate(data["run"]["environment"])
    assert env.server is not None and "composer_mesh.envs.openenv:addition_app" in env.server.command
    assert data["roles"]["rewarder"]["settings"]["functions"][0]["path"] == "composer_mesh.envs.openenv:score"
    TypeAdapter(EnvironmentConfig).validate_python(data["run"]["environment"])
    assert load_topology(TOPOLOGY).run.environment == env


@pytest.mark.e2e  # a shipped topology run end to end: its own tier (`pytest -m e2e`), run by .ci/run
async def test_a_few_steps_on_cpu_with_every_loss_channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped topology, shortened, on real local Monarch meshes, with its server on a free port (not 8765,
    so runs side by side do not clash); the run's end stops the server it started."""
    url = f"http://127.0.0.1:{free_port()}"
    data = shortened(TOPOLOGY, tmp_path)
    data["run"]["environment"]["url"] = url
    started: list[int] = []  # the pids of the servers the run starts
    start = EnvServer.start

    def record(self: EnvServer) -> EnvServer:
        running = start(self)
        assert running.process is not None
        started.append(running.process.pid)
        return running

    monkeypatch.setattr(EnvServer, "start", record)
    await run_every_channel(data, TOPOLOGY)
    assert len(started) == 1
    assert_stopped(url, started[0])


def test_a_timed_out_episode_is_retried_then_named(server: EnvServer) -> None:
    """Last in the module: the sleeping steps hold their sessions for seconds after the client gave up."""
    client = EpisodeClient(server.url, ClientSettings(message_timeout_s=0.3, max_retries=1, backoff_s=0.01))
    started = time.monotonic()
    with pytest.raises(OpenEnvTimeout) as e:
        client.episode({"seed": 0}, {"message": "sleep 3"})
    assert time.monotonic() - started < 3  # both attempts were cut at the message timeout (one step takes 3 s)
    assert f"OpenEnv server {server.url}: episode timed out (after 2 attempts" in str(e.value)
    assert "message timeout 0.3s" in str(e.value)

