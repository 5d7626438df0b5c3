"""Real bubblewrap: each hostile command is contained, reported as an observation, and the next command in the
same sandbox session still runs."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from composer_mesh.sandbox.config import SandboxConfig
from composer_mesh.sandbox.pool import SandboxBox, SandboxPool
from composer_mesh.sandbox.run import SandboxUnavailable, check_available

from .conftest import bwrap_config

REPO = Path(__file__).resolve().parents[2]


async def still_works(box: SandboxBox) -> None:
    result = await box.run_python("print('alive')")
    assert result.ok and result.stdout == "alive\n", result.observation()


def slot_processes(config: SandboxConfig) -> list[int]:
    """Host pids running as one of the pool's slot uids (only meaningful when the trainer is root)."""
    uids = range(config.uid, config.uid + config.concurrency)
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) in uids]


def _uid(proc: Path) -> int:
    try:
        return proc.stat().st_uid
    except OSError:
        return -1


def test_describe_says_which_isolation_is_in_force() -> None:
    bwrap = SandboxConfig(ro_paths=["/srv/data"]).describe()
    assert bwrap.startswith("bubblewrap: no network, reads only /usr, system libs, a few /etc files, the "
                            "interpreter, /srv/data; private /work (work dir 64 MB, 10000 entries")
    assert "/tmp (64 MB)" in bwrap and "cpu 10s" in bwrap
    rlimits = SandboxConfig(mode="rlimits").describe()
    assert rlimits.startswith("rlimits only (NOT isolated") and "work dir 64 MB, 10000 entries (reported" in rlimits
    assert "every process of the slot's uid is killed when the trainer is root, else only the process group" in rlimits


@pytest.mark.parametrize("host", ["127.0.0.1", "1.1.1.1"])
async def test_no_network(box: SandboxBox, host: str) -> None:
    result = await box.run_python(f"import socket\ns = socket.create_connection(({host!r}, 53), timeout=1)")
    assert result.exit_code == 1 and ("refused" in result.summary() or "unreachable" in result.summary())
    await still_works(box)


@pytest.mark.parametrize("target", ["/etc/sandbox-escape", "/root/sandbox-escape", str(REPO / "sandbox-escape"),
                                    "/usr/sandbox-escape", "/sandbox-escape", "/run/sandbox-escape"])
async def test_no_write_outside_the_work_dir(box: SandboxBox, target: str) -> None:
    result = await box.run_python(f"open({target!r}, 'w').write('x')")
    assert result.exit_code == 1 and "Error" in result.summary(), result.observation()
    assert not Path(target).exists()
    await still_works(box)


async def test_the_work_dir_is_private_and_writable(box: SandboxBox) -> None:
    result = await box.run_python("import os; open('made.txt', 'w').write('x'); print(os.getcwd(), os.listdir('/tmp'))")
    assert result.stdout == "/work []\n" and (box.workdir / "made.txt").read_text() == "x"


async def test_fork_bomb_is_bounded_and_killed() -> None:
    config = bwrap_config()
    async with SandboxPool(config).session() as box:
        counted = await box.run_python(
            "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
            "            time.sleep(5); os._exit(0)\n        n += 1\nfinally:\n    print(n)")
        assert int(counted.stdout) < config.processes and "Resource temporarily unavailable" in counted.summary()
        bomb = await box.run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                                    "        pass")
        # killed either way: by the wall timeout, or by the CPU limit first on a busy machine
        assert bomb.summary() in ("killed: wall time 2 s exceeded", "killed by SIGXCPU: cpu time limit (1 s) exceeded")
        await still_works(box)
    if os.getuid() == 0:  # the slot uids own no process once the commands are over
        assert slot_processes(config) == []


async def test_infinite_loop_is_killed(box: SandboxBox) -> None:
    result = await box.run_python("while True:\n    pass")
    assert result.summary() in {"killed by SIGXCPU: cpu time limit (1 s) exceeded", "killed: wall time 2 s exceeded"}
    await still_works(box)


async def test_ten_gb_allocation_fails(box: SandboxBox) -> None:
    result = await box.run_python("x = bytearray(10 * 1024 ** 3)")
    assert result.summary() == "exit code 1: MemoryError"
    await still_works(box)


async def test_huge_file_is_cut_at_the_file_limit(box: SandboxBox) -> None:
    result = await box.run_python("open('big', 'wb').write(b'x' * (8 * 1024 * 1024))")
    assert "File too large" in result.summary()
    assert (box.workdir / "big").stat().st_size <= 1024 * 1024
    await still_works(box)


async def test_output_is_capped_and_says_so(box: SandboxBox) -> None:
    result = await box.run_python("import sys\nprint('x' * 100000)\nsys.stderr.write('e' * 5000)")
    assert len(result.stdout) == 1024 and result.stdout_truncated and result.stderr_truncated
    assert "--- stdout (truncated to 1024 bytes)" in result.observation()


async def test_trainer_environment_does_not_leak(box: SandboxBox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "s3cret")
    result = await box.run_python("import os; print(os.environ.get('SANDBOX_TEST_SECRET'))")
    assert result.stdout == "None\n"


async def test_paths_stay_in_the_work_dir(box: SandboxBox) -> None:
    await box.run_python("import os; os.symlink('/etc/hostname', 'leak'); os.mkfifo('fifo')")
    assert os.path.islink(box.workdir / "leak") and not os.path.lexists(box.workdir / "fifo")  # FIFOs are not saved
    for bad in ("../x", "/etc/passwd", "leak", "a/../../x"):
        assert box.write(bad, "x").startswith("error: ") and box.read(bad).startswith("error: "), bad
    assert box.write("pkg/mod.py", "X = 1\n") == "wrote 6 characters to pkg/mod.py"
    assert box.read("pkg/mod.py") == "X = 1\n"
    assert (await box.run_python("from pkg.mod import X; print(X)")).stdout == "1\n"


async def test_session_removes_its_work_dir() -> None:
    async with SandboxPool(bwrap_config()).session() as box:
        box.write("f", "x")
        workdir = box.workdir
    assert not workdir.exists()


async def test_pool_bounds_concurrent_commands() -> None:
    pool = SandboxPool(bwrap_config(concurrency=1))
    code = "import time\na = time.monotonic()\ntime.sleep(0.3)\nprint(a, time.monotonic())"
    async with pool.session() as one, pool.session() as two:
        results = await asyncio.gather(one.run_python(code), two.run_python(code))
    (a0, a1), (b0, b1) = (map(float, r.stdout.split()) for r in results)
    assert a1 <= b0 or b1 <= a0  # the second started after the first ended


def test_check_available_runs_bubblewrap_or_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    check_available(bwrap_config())
    with pytest.raises(SandboxUnavailable, match=r"^bubblewrap cannot run here: .*mode: rlimits"):
        check_available(bwrap_config(python="/usr/nonexistent/python3"))
    with pytest.raises(SandboxUnavailable, match=r"^run.environment.sandbox.python: /opt/python3 is not visible in "
                       r"a bwrap sandbox .*add the directory it is installed in to run.environment.sandbox.ro_paths$"):
        check_available(bwrap_config(python="/opt/python3"))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="no 'bwrap' on PATH"):
        check_available(SandboxConfig())
