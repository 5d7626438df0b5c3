"""The rlimits-only mode (no namespaces: the network and host files stay reachable, as its description says)
still contains runaway CPU, processes and memory, kills (as root) every process a command left, reports a work
dir over its limits, and the session goes on."""

from __future__ import annotations

import os
import signal

from services import require

from composer_mesh.sandbox.pool import SandboxBox, SandboxPool

from .conftest import rlimits_config
from .test_sandbox import slot_processes, still_works


async def test_infinite_loop_is_killed(rbox: SandboxBox) -> None:
    result = await rbox.run_python("while True:\n    pass")
    assert result.summary() in {"killed by SIGXCPU: cpu time limit (1 s) exceeded", "killed: wall time 2 s exceeded"}
    await still_works(rbox)


async def test_fork_bomb_is_bounded_and_killed(rbox: SandboxBox) -> None:
    counted = await rbox.run_python(
        "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n        n += 1\nfinally:\n    print(n)")
    assert int(counted.stdout) < rbox.pool.config.processes
    bomb = await rbox.run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                                 "        pass")
    # killed either way: by the wall timeout, or by the CPU limit first on a busy machine
    assert bomb.timed_out or bomb.signal == signal.SIGXCPU, bomb.summary()
    await still_works(rbox)


async def test_ten_gb_allocation_fails(rbox: SandboxBox) -> None:
    assert (await rbox.run_python("x = bytearray(10 * 1024 ** 3)")).summary() == "exit code 1: MemoryError"
    await still_works(rbox)


def test_describe_says_not_isolated(rbox: SandboxBox) -> None:
    assert "NOT isolated" in rbox.pool.config.describe()


async def test_a_process_that_left_the_group_does_not_survive(rbox: SandboxBox) -> None:
    """A child that calls setsid() leaves the process group the wall timeout kills; as root, every process of
    the slot's uid is killed after the command, so it is gone when the result returns."""
    require(os.getuid() == 0, "root (each pool slot runs as its own uid)")
    result = await rbox.run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
                                   "    os._exit(0)\nprint('parent exits')")
    assert slot_processes(rbox.pool.config) == []  # not even a zombie: the slot's next command can fork
    # the result came when the parent exited, not at the wall time, though the child held stdout open
    assert result.ok and not result.timed_out and result.stdout == "parent exits\n", result.observation()


async def test_a_work_dir_over_its_limits_is_reported() -> None:
    async with SandboxPool(rlimits_config(work_files=20, work_mb=1)).session() as box:
        many = await box.run_python("for i in range(30):\n    open(f'f{i}', 'w').write('x')")
        assert many.ok and many.work_note == "work dir over its limit: more than 20 entries (work_files)"
        assert many.observation().splitlines()[:2] == ["exit code 0", many.work_note]
        removed = await box.run(["/bin/sh", "-c", "rm f*"])
        assert removed.ok and removed.work_note is None, removed.observation()
        big = await box.run_python("for i in range(3):\n    open(f'b{i}', 'wb').write(b'x' * 500_000)")
        assert big.work_note == "work dir over its limit: more than 1 MB (work_mb)"
