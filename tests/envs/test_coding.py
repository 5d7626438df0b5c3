"""The coding task family end to end in real bubblewrap: a scripted policy that writes the fix solves every
shipped task (reward 1.0) through `CodingSession`; doing nothing does not; bad tool calls are observations."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from composer_mesh.envs.coding.catalog import EVAL_IDS, TASKS, split_ids
from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.envs.coding.environment import CodingEnvironment, UnknownCodingTask
from composer_mesh.envs.coding.session import BEHAVIOUR, CodingSession
from composer_mesh.envs.tools import EXPECTED_FORMAT, one_line
from tests.sandbox.conftest import bwrap_config


@dataclass
class Row:
    """A prompt row as the run's prompt source gives it (the fields `EpisodePrompt` names)."""

    prompt_id: str
    text: str = ""
    answer: str | None = None
    messages: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def counted(tool_calls: float, tool_errors: float = 0.0, parse_errors: float = 0.0, **behaviour: float) -> dict:
    """A turn's `info`: the call counters and every behaviour counter (0 unless given)."""
    assert set(behaviour) <= set(BEHAVIOUR)
    return {"tool_calls": tool_calls, "tool_errors": tool_errors, "parse_errors": parse_errors,
            **{k: behaviour.get(k, 0.0) for k in BEHAVIOUR}}


@pytest.fixture
def env() -> CodingEnvironment:
    return CodingEnvironment(CodingConfig(kind="coding", sandbox=bwrap_config(wall_s=5.0), max_turns=4), seed=0)


@pytest.fixture
async def fizz(env: CodingEnvironment) -> AsyncIterator[CodingSession]:
    session = env.session(Row("coding/fizzbuzz", extra={"task_id": "fizzbuzz"}), seed=0)
    await session.reset()
    yield session
    await session.close()


def test_eval_tasks_are_held_out() -> None:
    train, held_out = set(split_ids("train")), set(split_ids("eval"))
    assert not train & held_out and train | held_out == set(TASKS) and held_out == set(EVAL_IDS)
    with pytest.raises(ValueError, match="unknown coding split"):
        split_ids("test")


async def test_reset_shows_the_task_and_the_tools(env: CodingEnvironment) -> None:
    session = env.session(Row("coding/flatten"), seed=0)
    try:
        obs = await session.reset()
    finally:
        await session.close()
    assert obs.messages[0]["role"] == "user" and TASKS["flatten"].statement in obs.messages[0]["content"]
    schemas = {t["function"]["name"]: t["function"] for t in obs.tools}
    assert list(schemas) == ["read_file", "write_file", "run_tests", "run_python", "submit"]
    assert schemas["write_file"]["parameters"]["required"] == ["path", "content"]
    assert "hidden" not in session.tools.box.read("solution.py") and session.grade is None


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_scripted_policy_solves_every_task(env: CodingEnvironment, task_id: str) -> None:
    session = env.session(Row(f"coding/{task_id}", extra={"task_id": task_id}), seed=0)
    await session.reset()
    try:
        wrote = await session.step(call("write_file", path="solution.py", content=TASKS[task_id].reference))
        tested = await session.step(call("run_tests"))
        end = await session.step(call("submit"))
    finally:
        await session.close()
    assert wrote.messages[0]["content"].startswith("wrote ") and not wrote.done
    assert tested.messages[0]["content"].startswith("1 of 1 visible tests passed (exit code 0)")
    assert end.done and end.status == "done" and end.reward == 1.0
    assert end.info["tests_passed"] == end.info["tests_total"] == len(TASKS[task_id].hidden_test_names())


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_doing_nothing_scores_below_one(env: CodingEnvironment, task_id: str) -> None:
    session = env.session(Row(f"coding/{task_id}"), seed=0)
    await session.reset()
    try:
        end = await session.step("I am done.")  # a final message without a tool call ends the episode
    finally:
        await session.close()
    assert end.done and end.status == "done" and end.reward is not None and end.reward < 1.0


async def test_bad_calls_are_observations_and_the_episode_goes_on(fizz: CodingSession) -> None:
    turn = await fizz.step(call("rm_rf") + "<tool_call>{not json}</tool_call>"
                           + call("read_file", path="/etc/passwd") + call("read_file", file="x")
                           + call("write_file", path="../escape.py", content="x") + call("run_python", code=3)
                           + "<tool_call>{\"name\": 1")
    answers = [m["content"] for m in turn.messages]
    assert not turn.done and turn.info == counted(5, 5, 2, paths_refused=2, writes_outside_solution=1)
    assert [m["role"] for m in turn.messages] == ["tool"] * 5 + ["user"]  # the unreadable calls: one user message
    assert [m["name"] for m in turn.messages[:5]] == ["rm_rf", "read_file", "read_file", "write_file", "run_python"]
    assert answers[0].startswith("error: rm_rf: no such tool; the tools are read_file, write_file")
    assert answers[1].startswith("error: cannot read '/etc/passwd'")
    assert answers[2] == "error: read_file: unknown argument(s) file; it takes path"
    assert answers[3].startswith("error: '../escape.py' not written")
    assert answers[4] == "error: run_python: argument code must be string, got int 3"
    assert answers[5].startswith("error: tool call 2: not valid JSON") and "\nerror: tool call 7: <tool_call> " \
        "without </tool_call>" in answers[5]
    assert turn.feedback is not None and turn.feedback.splitlines() == [
        "unreadable tool call: tool call 2: not valid JSON (Expecting property name enclosed in double quotes at char "
        f"1); {EXPECTED_FORMAT}",
        f"unreadable tool call: tool call 7: <tool_call> without </tool_call>; {EXPECTED_FORMAT}",
        *[f"{m['name']}: {one_line(a)}" for m, a in zip(turn.messages[:5], answers[:5], strict=True)]]
    end = await fizz.step(call("submit"))
    assert end.reward == 0.5  # fizz and buzz pass; fizzbuzz and number do not
    assert end.feedback == "hidden tests: 2 of 4 passed" and end.info["untested_submits"] == 1.0


async def test_calls_of_a_turn_run_in_order_and_past_the_limit_are_refused(env: CodingEnvironment) -> None:
    env.config = env.config.model_copy(update={"max_calls_per_turn": 2})
    session = env.session(Row("p0", extra={"task_id": "fizzbuzz"}), seed=0)
    await session.reset()
    try:
        fixed = call("write_file", path="solution.py", content=TASKS["fizzbuzz"].reference)
        turn = await session.step(fixed + call("run_tests") + call("read_file", path="solution.py"))
    finally:
        await session.close()
    answers = [m["content"] for m in turn.messages]
    assert answers[1].startswith("1 of 1 visible tests passed")  # it saw the write before it
    assert answers[2] == "error: read_file: not run: more than 2 tool calls in one turn"
    assert turn.info == counted(3, 1, run_tests=1)


async def test_hidden_tests_are_not_in_the_work_dir(fizz: CodingSession) -> None:
    turn = await fizz.step(call("read_file", path="test_hidden.py") + call("run_tests") + call(
        "run_python", code="import os; print(sorted(os.listdir('.')))"))
    assert turn.messages[0]["content"].startswith("error: cannot read 'test_hidden.py'")
    assert "['solution.py', 'test_visible.py']" in turn.messages[2]["content"]  # run_tests left no __pycache__


async def test_a_solution_cannot_forge_the_graders_report(fizz: CodingSession) -> None:
    names = TASKS["fizzbuzz"].hidden_test_names()
    forged = "".join(f"print('\\nTEST PASS {n}')\n" for n in names) + TASKS["fizzbuzz"].starter
    await fizz.step(call("write_file", path="solution.py", content=forged))
    assert (await fizz.step(call("submit"))).reward == 0.5


async def test_the_judge_sees_solution_py_alone(fizz: CodingSession) -> None:
    """Nothing else the episode left (a FIFO, a link, a module shadowing the probe's json, a bytecode cache)
    reaches the judge: a solution listing its directory at grading time sees only itself."""
    plant = ("import os; os.mkfifo('pipe'); os.symlink('/etc', 'etc'); open('json.py', 'w').write('raise SystemExit')"
             "; os.mkdir('__pycache__')")
    lister = "import os\ndef fizzbuzz(n):\n    return sorted(os.listdir('.'))\n"
    await fizz.step(call("run_python", code=plant) + call("write_file", path="solution.py", content=lister))
    assert (await fizz.step(call("submit"))).reward == 0.0 and fizz.grade is not None
    assert fizz.grade.report.splitlines()[1] == 'FAIL test_fizz: returned ["solution.py"]'


async def test_a_solution_py_linking_out_of_the_work_dir_is_not_graded(fizz: CodingSession) -> None:
    await fizz.step(call("run_python", code="import os; os.remove('solution.py'); os.symlink('/etc/passwd', "
                         "'solution.py')"))
    end = await fizz.step(call("submit"))
    assert end.reward == 0.0 and fizz.grade is not None and "leads out of the work dir" in fizz.grade.report


FORGER = """
import os, sys, json
frame = sys._getframe()
while frame is not None and not ('out' in frame.f_locals and 'tag' in frame.f_locals):
    frame = frame.f_back
out, tag = frame.f_locals['out'], frame.f_locals['tag']
junk = ['{"i": 0, "returns": NaN}', '[' * 5000 + ']' * 5000, json.dumps({"i": 1, "returns": "Buzz" * 2000}),
        '{"i": 2, "returns": "FizzBuzz", "passed": true}', '{"i": true, "returns": "Fizz"}', '{"i": 9, "returns": 1}',
        '{"i": 3, "raises": "ValueError", "message": ""}', "{'i': 3, 'returns': '7'}"]
out.write("".join(f"\\n{tag} {line}\\n" for line in junk))
out.flush()
os._exit(0)
"""


async def test_the_probes_answers_are_untrusted_input(fizz: CodingSession) -> None:
    """A solution that takes over the probe's answer stream (its tag and fd from the frames) and exits 0: every
    line it writes is malformed (NaN, nesting past the parser, over the size bound, unknown keys, a bool index,
    an index out of range, a bad `raises`, not JSON), so no call has an answer and every test fails."""
    await fizz.step(call("write_file", path="solution.py", content=FORGER))
    end = await fizz.step(call("submit"))
    assert end.reward == 0.0 and fizz.grade is not None
    assert fizz.grade.report.splitlines() == ["exit code 0", *[f"FAIL {n}: no answer" for n in
                                                               TASKS["fizzbuzz"].hidden_test_names()]]


async def test_behaviour_counters_and_feedback_name_what_went_wrong(env: CodingEnvironment) -> None:
    """A turn that rewrites the visible tests, runs a command the sandbox kills and fails a visible test: each
    shows in its counters and as one feedback line; the graded end says how many hidden tests passed, not which."""
    session = env.session(Row("coding/fizzbuzz", extra={"task_id": "fizzbuzz"}), seed=0)
    await session.reset()
    try:
        broken = call("write_file", path="solution.py", content="def fizzbuzz(n):\n    return n\n")
        turn = await session.step(broken + call("run_tests") + call("write_file", path="test_visible.py", content="")
                                  + call("run_python", code="while True: pass") + call("read_file", path="nope.py"))
        quiet = await session.step(call("read_file", path="solution.py"))
        end = await session.step(call("submit"))
    finally:
        await session.close()
    assert turn.info == counted(5, 2, run_tests=1, run_python=1, writes_outside_solution=1, paths_refused=1,
                                sandbox_kills=1)
    assert turn.feedback is not None and turn.feedback.splitlines() == [
        "run_tests: FAIL test_fizz AssertionError", "run_python: error: killed by SIGXCPU: cpu time limit (1 s) "
        "exceeded", "read_file: error: cannot read 'nope.py': [Errno 2] No such file or directory: " + repr(
            str(session.tools.box.workdir / "nope.py"))]
    assert quiet.feedback is None and quiet.info == counted(1)
    assert end.info["untested_submits"] == 0.0 and end.feedback == "hidden tests: 0 of 4 passed"
    assert "test_" not in end.feedback


async def test_a_solved_episode_ends_without_feedback(fizz: CodingSession) -> None:
    fixed = call("write_file", path="solution.py", content=TASKS["fizzbuzz"].reference)
    end = await fizz.step(fixed + call("submit"))
    assert end.reward == 1.0 and end.feedback is None and end.info == counted(1, untested_submits=1) | {
        "tests_passed": 4.0, "tests_total": 4.0}


async def test_last_turn_is_graded_as_truncated(fizz: CodingSession) -> None:
    fixed = call("write_file", path="solution.py", content=TASKS["fizzbuzz"].reference)
    results = [await fizz.step(call("run_tests")) for _ in range(3)] + [await fizz.step(fixed)]
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].status == "truncated_turns" and results[-1].reward == 1.0


def test_unknown_task_is_a_one_line_error(env: CodingEnvironment) -> None:
    with pytest.raises(UnknownCodingTask, match=r"prompt 'coding/nope': unknown coding task 'nope'; shipped: "):
        env.session(Row("coding/nope"), seed=0)


# ---- the coding tasks as the run's prompts (`Environment`) ----------------------------------------------------
def coding_env(seed: int = 0) -> CodingEnvironment:
    return CodingEnvironment(CodingConfig(kind="coding"), seed=seed)  # no sandbox is started for rows


def test_train_stream_is_seeded_epochs_of_every_train_task_and_never_an_eval_one() -> None:
    size = len(split_ids("train"))
    rows = coding_env(seed=3).train_rows(3 * size)
    ids = [r.extra["task_id"] for r in rows]
    for epoch in range(3):
        assert sorted(ids[epoch * size:(epoch + 1) * size]) == sorted(split_ids("train"))
    assert len({tuple(ids[e * size:(e + 1) * size]) for e in range(3)}) > 1  # each epoch its own order
    assert ids == [r.extra["task_id"] for r in coding_env(seed=3).train_rows(3 * size)]  # deterministic
    assert ids != [r.extra["task_id"] for r in coding_env(seed=4).train_rows(3 * size)]
    assert not set(ids) & set(EVAL_IDS)
    row = rows[0]
    assert row.messages == [{"role": "user", "content": row.text}] and row.answer is None and row.tools is None
    assert TASKS[row.extra["task_id"]].statement in row.text and row.where == f"coding task {row.extra['task_id']}"


def test_eval_rows_are_the_held_out_tasks() -> None:
    env = coding_env()
    assert [r.extra["task_id"] for r in env.eval_rows(100)] == list(EVAL_IDS)
    assert [r.extra["task_id"] for r in env.eval_rows(2)] == list(EVAL_IDS[:2]) == \
        [r.extra["task_id"] for r in env.eval_rows(2)]


def test_state_restore_continues_the_stream_and_refuses_another_seed() -> None:
    from composer_mesh.envs import EnvironmentStateError

    env = coding_env(seed=5)
    env.train_rows(4)
    state = json.loads(json.dumps(env.state()))  # JSON-able, as checkpoints store it
    expected = env.train_rows(9)
    resumed = coding_env(seed=5)
    resumed.restore(state)
    assert resumed.train_rows(9) == expected and resumed.state() == env.state()
    with pytest.raises(EnvironmentStateError, match=r"run\.environment or the seed changed"):
        coding_env(seed=6).restore(state)


def test_load_environment_checks_the_sandbox_and_sample_rows_are_the_stream(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Any) -> None:
    from pydantic import TypeAdapter

    from composer_mesh.envs import load_environment, sample_environment_rows
    from composer_mesh.envs.config import EnvironmentConfig
    from composer_mesh.sandbox.run import SandboxUnavailable

    cfg = TypeAdapter(EnvironmentConfig).validate_python({"kind": "coding", "seed": 2, "sandbox": {"wall_s": 5}})
    assert isinstance(cfg, CodingConfig) and cfg.plays_episodes
    env = load_environment(cfg, seed=0)
    assert isinstance(env, CodingEnvironment) and env.seed == 2
    assert sample_environment_rows(cfg, seed=0, n=7) == env.train_rows(7)
    monkeypatch.setenv("PATH", str(tmp_path))  # a host without bubblewrap
    with pytest.raises(SandboxUnavailable, match=r"^bubblewrap cannot run here: no 'bwrap' on PATH; [^\n]*$"):
        load_environment(cfg, seed=0)
    assert sample_environment_rows(cfg, seed=0, n=2) is not None  # rows alone need no sandbox


async def test_a_train_row_plays_as_an_episode_of_its_task(env: CodingEnvironment) -> None:
    from composer_mesh.orchestration.prompts import EnvironmentPrompts

    source = EnvironmentPrompts(env)
    prompt = source.take(1)[0]
    assert source.episode_environment() is env
    session = env.session(prompt, seed=0)
    try:
        obs = await session.reset()
        end = await session.step(call("write_file", path="solution.py",
                                      content=TASKS[prompt.extra["task_id"]].reference) + call("submit"))
    finally:
        await session.close()
    assert obs.messages == prompt.messages and end.done and end.reward == 1.0


def test_every_environment_config_says_whether_it_plays_episodes() -> None:
    from composer_mesh.envs.config import CalculatorConfig, OpenEnvConfig, ReasoningGymConfig, VerifiersConfig

    assert CalculatorConfig.plays_episodes and CodingConfig.plays_episodes
    assert VerifiersConfig.plays_episodes  # a taskset's tools and turns (envs/verifiers_agent.py)
    assert not ReasoningGymConfig.plays_episodes
    openenv = {"kind": "openenv", "url": "http://127.0.0.1:8765"}  # built unchecked: openenv need not be installed
    assert OpenEnvConfig.model_construct(**openenv, episodes=True).plays_episodes
    assert not OpenEnvConfig.model_construct(**openenv).plays_episodes
    assert "plays_episodes" not in CodingConfig.model_fields  # not a setting: a YAML key of that name is refused


@functools.cache
def tokenizer() -> Any:
    from composer_mesh.models.tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


def first_prompt(env: CodingEnvironment) -> Any:
    """The train stream's first prompt, as the run's prompt source gives it."""
    from composer_mesh.orchestration.prompts import EnvironmentPrompts

    return EnvironmentPrompts(env).take(1)[0]


async def play_scripted(session: CodingSession, prompt: Any, texts: list[str]) -> Any:
    """`prompt` played in `session` by the real episode loop (`play_episode`), with a policy that says `texts` in
    order, token in, token out through the byte tokenizer's real chat template (tools declared from the session's
    reset, each observation bridged): the `Episode`."""
    from composer_mesh.actors.messages import Prompt, Rollout
    from composer_mesh.models.chat import chat_end_token_id, next_turn_token_ids, prompt_token_ids
    from composer_mesh.orchestration.rollout.episode import EpisodeLimits, play_episode

    script, tok = iter(texts), tokenizer()

    async def policy(turn: Prompt, seed: int) -> Rollout:
        ids = (prompt_token_ids(tok, turn) if turn.bridge_messages is None
               else next_turn_token_ids(tok, turn.token_ids, turn.bridge_messages))
        text = next(script)
        out = [*tok.encode(text, add_special_tokens=False), chat_end_token_id(tok)]
        return Rollout(turn.prompt_id, ids, out, [-0.1] * len(out), 1, text=text)

    limits = EpisodeLimits(max_turns=4, max_new_tokens=4096, max_context=None, step_timeout_s=30.0,
                           episode_timeout_s=None)
    try:
        return await play_episode(session, prompt, 0, limits, policy)
    finally:
        await session.close()


def bridged(episode: Any, index: int) -> str:
    """The text of the episode's `index`-th span, an environment span (what the chat template bridged in)."""
    span = episode.rollout.turns[index]
    assert not span.policy
    return str(tokenizer().decode(episode.rollout.completion_ids[span.start:span.end]))


async def test_the_rollout_driver_plays_a_coding_episode_token_in_token_out(env: CodingEnvironment) -> None:
    """The real episode driver and a scripted policy: one Rollout whose env spans hold the tool answers."""
    prompt = first_prompt(env)
    fix = call("write_file", path="solution.py", content=TASKS[prompt.extra["task_id"]].reference)
    episode = await play_scripted(env.session(prompt, seed=0), prompt, [fix + call("run_tests"), call("submit")])
    rollout = episode.rollout
    assert (rollout.status, episode.reward) == ("done", 1.0)
    assert [t.policy for t in rollout.turns] == [True, False, True]
    assert episode.info["tool_calls"] == 2.0 and episode.info["tool_errors"] == 0.0
    assert "write_file" in tokenizer().decode(rollout.prompt_ids)  # the tools, declared by the chat template
    assert "1 of 1 visible tests passed" in bridged(episode, 1)


def descendants() -> list[tuple[int, list[bytes]]]:
    """This process's descendants as (pid, argv), parents before children (read from /proc)."""
    children: dict[int, list[int]] = {}
    argv: dict[int, list[bytes]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):  # not a process, or one that just ended
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append((child, argv[child]))
            todo.append(child)
    return out


HANG = "print('started', flush=True)\nopen('started', 'w').close()\nimport time\ntime.sleep(60)"


async def kill_when_started(session: CodingSession, what: str) -> int:
    """Once the session's `run_python` code (`HANG`) wrote `started` in its work dir (the sandbox's /work, seen
    through the command's /proc/PID/root: the host's work dir gets it only when the command ends), SIGKILL from
    outside the process running it (`what`: "command") or the whole sandbox (`what`: "sandbox", bubblewrap); the
    pid killed."""
    from composer_mesh.sandbox.pool import RUN_STDIN

    while True:
        # bubblewrap and its namespace's pid 1, the launcher and the command it forked all hold the command's argv
        sandboxes = [(pid, argv) for pid, argv in descendants() if RUN_STDIN.encode() in argv]
        command = [pid for pid, argv in sandboxes if argv[1:3] == [b"-c", RUN_STDIN.encode()]]
        if command and Path(f"/proc/{command[0]}/root/work/started").exists():
            break
        await asyncio.sleep(0.01)
    bwrap = [pid for pid, argv in sandboxes if os.path.basename(argv[0]) == b"bwrap"]
    pid = bwrap[0] if what == "sandbox" else command[0]
    os.kill(pid, signal.SIGKILL)  # the sandbox: the outer bubblewrap (its pid namespace dies with it)
    return pid


@pytest.mark.parametrize("what", ["command", "sandbox"])
async def test_a_call_whose_sandbox_is_killed_from_outside_is_an_error_answer_and_the_episode_goes_on(
        env: CodingEnvironment, what: str) -> None:
    """The process of a `run_python` call, or its whole bubblewrap sandbox, SIGKILLed by something outside (an OOM
    killer, an operator) while the call runs: the call's answer is `error: killed by SIGKILL` with what the code
    printed, counted as a tool error, and the episode goes on: solved, submitted and graded (docs/sandbox.md). A
    killed command's work dir is saved; a killed sandbox's is not, and the answer says so."""
    prompt = first_prompt(env)
    session = env.session(prompt, seed=0)
    fix = call("write_file", path="solution.py", content=TASKS[prompt.extra["task_id"]].reference)
    killer = asyncio.ensure_future(kill_when_started(session, what))
    try:
        episode = await play_scripted(session, prompt, [call("run_python", code=HANG), fix + call("run_tests"),
                                                        call("submit")])
        assert killer.done() and killer.result() > 0  # the kill came while the call ran (its code sleeps 60 s)
    finally:
        killer.cancel()
    assert (episode.rollout.status, episode.reward) == ("done", 1.0)
    assert [t.policy for t in episode.rollout.turns] == [True, False, True, False, True]
    assert episode.info["tool_calls"] == 3.0 and episode.info["tool_errors"] == 1.0
    lost = "work dir left as it was before this command (the sandbox ended before it was saved)\n"
    assert f"error: killed by SIGKILL\n{lost if what == 'sandbox' else ''}--- stdout\nstarted" in bridged(episode, 1)
    assert "1 of 1 visible tests passed" in bridged(episode, 3)
# ---- reward hacks: none earns a pass the solution's own code does not ----------------------------------------
STARTER_FIZZ = TASKS["fizzbuzz"].starter  # passes test_fizz and test_buzz of four hidden tests: reward 0.5
HACKS = {
    # read the hidden tests' source wherever it might be, and answer their asserts from a table
    "reads_the_hidden_tests": """
import ast, glob
TABLE = {}
for path in glob.glob('**/test_hidden*', recursive=True) + glob.glob('/run/**/test_hidden*', recursive=True):
    try:
        tree = ast.parse(open(path).read())
    except Exception:
        continue
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and node.left.args:
            TABLE[ast.literal_eval(node.left.args[0])] = ast.literal_eval(node.comparators[0])
_starter = {}
exec(STARTER, _starter)
def fizzbuzz(n):
    return TABLE[n] if n in TABLE else _starter["fizzbuzz"](n)
""",
    # the expected values as constants of the calling test's code: up the stack, or any test function in memory
    "walks_frames_and_gc": """
import gc, sys, types
def _expected(n):
    codes, frame = [], sys._getframe(1)
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    codes += [o.__code__ for o in gc.get_objects() if isinstance(o, types.FunctionType) and o.__name__.startswith('test_')]
    for code in codes:
        consts = list(code.co_consts)
        if n in consts and not isinstance(n, bool):
            after = [c for c in consts[consts.index(n) + 1:] if isinstance(c, str)]
            if after:
                return after[0]
    return None
_starter = {}
exec(STARTER, _starter)
def fizzbuzz(n):
    found = _expected(n)
    return found if found is not None else _starter["fizzbuzz"](n)
""",
    # the runner's nonce from its frame, print patched to report every test passed, then exit 0 before any fails
    "forges_the_report_and_exits_0": """
import builtins, os, sys
def _nonce():
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, str) and len(value) == 32:
                return value
        frame = frame.f_back
    return 'TEST'
_TAG, _print = _nonce(), builtins.print
def _forge(*args, **kwargs):
    module = sys.modules.get('test_hidden')
    for name in [n for n in vars(module) if n.startswith('test_')] if module else []:
        _print(f"\\n{_TAG} PASS {name}", flush=True)
    os._exit(0)
builtins.print = _forge
exec(STARTER)
""",
    # an answer equal to anything: the assert's comparison says yes
    "returns_an_object_equal_to_anything": """
class Anything(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
def fizzbuzz(n):
    return Anything()
""",
}


@pytest.mark.parametrize("hack", sorted(HACKS))
async def test_a_hacking_solution_earns_no_unearned_pass(fizz: CodingSession, hack: str) -> None:
    """Each hack (docs/sandbox.md, threat model) earned 1.0 on the old grading, which imported the hidden tests
    into the solution's process; graded from outside the sandbox it earns at most what its honest part does."""
    source = f"STARTER = {STARTER_FIZZ!r}\n{HACKS[hack]}"
    wrote = await fizz.step(call("write_file", path="solution.py", content=source))
    assert wrote.messages[0]["content"].startswith("wrote ")
    end = await fizz.step(call("submit"))
    assert end.done and end.reward is not None and end.reward <= 0.5, end.info


async def test_a_planted_bytecode_cache_is_not_trusted(fizz: CodingSession) -> None:
    """An unchecked-hash .pyc of a test module whose tests all pass, planted in the work dir's __pycache__: the old
    grading copied the work dir to the judge, whose Python loaded the cache instead of the hidden tests (1.0)."""
    fake = "".join(f"def {name}():\n    pass\n" for name in TASKS["fizzbuzz"].hidden_test_names())
    plant = (f"import os, py_compile, sys\nos.makedirs('__pycache__', exist_ok=True)\n"
             f"open('/tmp/fake.py', 'w').write({fake!r})\n"
             "py_compile.compile('/tmp/fake.py', cfile=f'__pycache__/test_hidden.{sys.implementation.cache_tag}.pyc', "
             "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH, doraise=True)\nprint(os.listdir('__pycache__'))")
    planted = await fizz.step(call("run_python", code=plant))
    assert "test_hidden." in planted.messages[0]["content"], planted.messages
    assert (await fizz.step(call("submit"))).reward == 0.5
