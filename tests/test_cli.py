"""`composer-mesh` fails cleanly: an expected failure is one message saying where, with its exit code and no
traceback (`--debug` shows it); an unexpected one (a bug) prints its traceback. Bad bytes in a topology file
are a TopologyError at the line, column and byte offset of the first bad byte."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from composer_mesh import cli
from composer_mesh.actors.teacher_errors import TeacherFailed
from composer_mesh.cli import (
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_RUN_FAILED,
    EXIT_TERMINATED,
    failure_of,
    main,
    report_failure,
)
from composer_mesh.mesh.launch import ActorFailure, LaunchError, MeshFailureError
from composer_mesh.orchestration.checkpoint import RunCheckpointError
from composer_mesh.topology import TopologyError, load_topology, parse_topology

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "topologies" / "local.yaml"

# name -> (file content, None for "nothing there" or "a directory"; what stderr says right after the path)
CASES: dict[str, tuple[bytes | None, str]] = {
    "nul_byte": (b"name: x\nmeshes:\n  a\x00b: 1\n", ":3:4: (file): a NUL byte at byte offset 19"),
    "invalid_utf8": (b"name: x\n# caf\xe9\n", ":2:6: (file): not UTF-8 text: byte 0xe9 at byte offset 13"),
    "missing": (None, ": (file): cannot read file: No such file or directory"),
    "directory": (None, ": (file): cannot read file: Is a directory"),
    "yaml_syntax": (b"name: [\n", ":2:1: (file): YAML syntax error"),
    "schema": (b"name: x\nmeshes: {}\nbogus: 1\n", ":3:1: bogus: unknown key 'bogus'"),
}


def _case_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    content, _ = CASES[name]
    if name == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    return path


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The installed console script as a user runs it (`python -m composer_mesh.cli` without one)."""
    exe = Path(sys.executable).parent / "composer-mesh"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "composer_mesh.cli"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_file_is_one_message_without_traceback(tmp_path: Path, name: str) -> None:
    path = _case_file(tmp_path, name)
    out = _cli("validate", str(path))
    assert out.returncode == EXIT_INVALID, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"{path}{CASES[name][1]}" in out.stderr, out.stderr


@pytest.mark.parametrize("name", list(CASES))
def test_debug_shows_the_traceback(tmp_path: Path, name: str) -> None:
    path = _case_file(tmp_path, name)
    # --debug is accepted before and after the subcommand
    argv = (
        ("--debug", "validate", str(path))
        if name in ("nul_byte", "schema")
        else ("validate", str(path), "--debug")
    )
    out = _cli(*argv)
    assert out.returncode == EXIT_INVALID, out.stderr
    assert "Traceback (most recent call last)" in out.stderr, out.stderr
    assert "TopologyError" in out.stderr and str(path) in out.stderr


def test_plan_with_debug_shows_the_traceback_of_each_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _case_file(tmp_path, "nul_byte")
    prices = _case_file(tmp_path, "invalid_utf8")
    assert main(["plan", str(bad), "--prices", str(prices)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{bad}:3:4:" in err and f"{prices}:2:6:" in err
    assert main(["plan", str(bad), "--prices", str(prices), "--debug"]) == EXIT_INVALID
    assert capsys.readouterr().err.count("Traceback (most recent call last)") == 2


# ---- bad bytes in the loader ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (b"\x00", ":1:1: (file): a NUL byte at byte offset 0"),
        (b"name: x\r\nrun:\r\n  steps: 1\x01\n", ":3:11: (file): control character U+0001 at byte offset 25"),
        (b"name: caf\xc3\xa9\n  x: \x7f", ":2:6: (file): control character U+007F at byte offset 17"),
        (b"name: caf\xc3\xa9 \xff\n", ":1:12: (file): not UTF-8 text: byte 0xff at byte offset 12"),
        (b"\xff\xfen\x00a\x00", ":1:1: (file): not UTF-8 text: byte 0xff at byte offset 0"),
        (b"name: x\n\xe2\x82", ":2:1: (file): not UTF-8 text: byte 0xe2 at byte offset 8"),
    ],
    ids=["nul_only", "control_char_crlf", "del_after_utf8", "invalid_byte", "utf16", "truncated"],
)
def test_bad_bytes_are_a_topology_error_at_the_byte(tmp_path: Path, content: bytes, where: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_bytes(content)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert f"{path}{where}" in str(info.value)


def test_nul_in_text_is_a_topology_error() -> None:
    """`parse_topology` on text (no file) too: YAML's ReaderError never escapes."""
    with pytest.raises(TopologyError, match=r"t\.yaml:2:3: \(file\): a NUL byte at byte offset 10"):
        parse_topology("name: x\nab\x00", "t.yaml")


def test_crlf_files_still_load(tmp_path: Path) -> None:
    path = tmp_path / "crlf.yaml"
    path.write_bytes(LOCAL.read_bytes().replace(b"\n", b"\r\n"))
    assert load_topology(path).name == load_topology(LOCAL).name


def _validate_as_nobody(path: Path) -> tuple[int, str]:
    """`composer-mesh validate path` in a forked child that dropped root for uid/gid 65534 (root reads any file,
    so this is how the test runs as root, as in CI): (exit code, stderr)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery past this point, only os._exit
        code = 99
        try:
            os.close(read)
            sys.stderr = os.fdopen(write, "w")  # pytest's capture of stderr is no fd the parent can read
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            code = main(["validate", str(path)])
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as err:
        text = err.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), text


def test_unreadable_file(capsys: pytest.CaptureFixture[str]) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as where:  # not pytest's tmp_path: its parents are private
        os.chmod(where, 0o755)  # an unprivileged uid may walk to the file, not read it
        path = Path(where) / "secret.yaml"
        path.write_text("name: x\n")
        path.chmod(0)
        if os.geteuid() == 0:
            code, err = _validate_as_nobody(path)
        else:
            code, err = main(["validate", str(path)]), capsys.readouterr().err
    assert code == EXIT_INVALID
    assert f"{path}: (file): cannot read file: Permission denied" in err


def test_permission_error_is_a_topology_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same failure without a real file system (the test above runs as an unprivileged uid)."""

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(TopologyError, match=r"secret\.yaml: \(file\): cannot read file: Permission denied"):
        load_topology(tmp_path / "secret.yaml")


# ---- the mapping of exceptions to messages and exit codes -----------------------------------------------


def _raised(exc: BaseException) -> BaseException:
    """`exc` with a traceback, as the CLI sees it."""
    try:
        raise exc
    except BaseException as e:
        return e


def _mesh_failure() -> MeshFailureError:
    report = (
        "Traceback (most recent call last):\n  File 'trainer.py', line 1\nRuntimeError: CUDA out of memory\n"
    )
    failure = ActorFailure(actor="trainer", mesh="gpu", monarch_mesh="trainer_1234", report=report)
    return MeshFailureError([failure], during="while running")


def test_mesh_failure_maps_to_run_failed() -> None:
    code, message = failure_of(_mesh_failure()) or (None, "")
    assert code == EXIT_RUN_FAILED
    assert "run failed: actor failure while running in 'trainer' on mesh 'gpu'" in message
    assert "RuntimeError: CUDA out of memory" in message
    assert ".failures" not in message and "--debug" in message
    assert "Traceback" not in message


def test_mesh_failure_report(capsys: pytest.CaptureFixture[str]) -> None:
    exc = _raised(_mesh_failure())
    assert report_failure(exc) == EXIT_RUN_FAILED
    err = capsys.readouterr().err
    assert "Traceback" not in err and "CUDA out of memory" in err
    assert report_failure(exc, debug=True) == EXIT_RUN_FAILED
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "MeshFailureError" in err
    assert "--- Monarch failure report: trainer on mesh 'gpu' ---" in err and "File 'trainer.py'" in err


@pytest.mark.parametrize(
    ("exc", "code", "text"),
    [
        (
            LaunchError("actor class for role 'trainer': cannot import 'nope'"),
            EXIT_RUN_FAILED,
            "launch failed:",
        ),
        (
            PermissionError(13, "Permission denied", "/runs/x/metrics.jsonl"),
            EXIT_RUN_FAILED,
            "/runs/x/metrics.jsonl",
        ),
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "interrupted"),
        (asyncio.CancelledError(), EXIT_TERMINATED, "SIGTERM"),
        (TopologyError([], "t.yaml"), EXIT_INVALID, "t.yaml: 0 errors"),
        (TeacherFailed("teacher 'api' (replay) unavailable: HTTP 503", teacher="api"), EXIT_RUN_FAILED,
         "run stopped: teacher 'api' (replay) unavailable: HTTP 503"),
        (RunCheckpointError("ckpt: format 9, expected 1"), EXIT_INVALID, "cannot resume: ckpt: format 9"),
    ],
    ids=["launch_error", "os_error_with_path", "ctrl_c", "cancelled", "topology_error", "teacher_stop",
         "checkpoint"],
)
def test_expected_failures(exc: BaseException, code: int, text: str) -> None:
    got = failure_of(exc)
    assert got is not None and got[0] == code and text in got[1]


@pytest.mark.parametrize(
    "exc", [ZeroDivisionError("division by zero"), OSError("no file named"), AttributeError()]
)
def test_unexpected_failure_prints_its_traceback(
    exc: BaseException, capsys: pytest.CaptureFixture[str]
) -> None:
    assert failure_of(exc) is None
    assert report_failure(_raised(exc)) == EXIT_BUG
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and type(exc).__name__ in err and "bug" in err


# ---- `run`: failures inside asyncio.run(run_topology(...)) ----------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code", "text"),
    [
        (
            _mesh_failure(),
            EXIT_RUN_FAILED,
            "run failed: actor failure while running in 'trainer' on mesh 'gpu'",
        ),
        (LaunchError("actor class for role 'trainer': no module 'nope'"), EXIT_RUN_FAILED, "launch failed:"),
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "composer-mesh: interrupted"),
    ],
    ids=["mesh_failure", "launch_error", "ctrl_c"],
)
def test_run_failures_inside_the_event_loop(
    exc: BaseException,
    code: int,
    text: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from composer_mesh.app import runner

    async def failing_run(topology: object, console: object = None, **_: object) -> None:
        await asyncio.sleep(0)
        raise exc

    monkeypatch.setattr(runner, "run_topology", failing_run)
    assert main(["run", str(LOCAL), "--steps", "1"]) == code
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err
    assert main(["run", str(LOCAL), "--debug"]) == code
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_run_with_a_bad_topology_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _case_file(tmp_path, "invalid_utf8")
    assert main(["run", str(path)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"{path}:2:6:" in err and "Traceback" not in err


def test_exit_codes_are_documented() -> None:
    doc = (ROOT / "docs" / "launch.md").read_text()
    section = doc.split("## The command line: exit codes and --debug", 1)[1].split("\n## ", 1)[0]
    for name in dir(cli):
        if name.startswith("EXIT_"):
            assert f"| {getattr(cli, name)} |" in section, name
    assert "--debug" in section


@pytest.mark.parametrize("command", ["validate", "plan", "run", "eval"])
def test_every_command_that_reads_a_topology_takes_python_path_and_set(command: str) -> None:
    """Each of them may import the user's own modules (reward functions, tasks, bindings) and take overrides."""
    args = cli.build_parser().parse_args([command, "t.yaml", "--python-path", "src", "--set", "run.steps=3"])
    assert args.python_path == ["src"] and [(o.key, o.value) for o in args.set] == [("run.steps", 3)]
