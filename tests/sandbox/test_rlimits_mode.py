"""The rlimits-only mode (no namespaces: the network and host files stay reachable, as its description says)
still contains runaway CPU, processes and memory, and the session goes on."""

from __future__ import annotations

import signal

from composer_mesh.sandbox.pool import SandboxBox

from .test_sandbox import still_works


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
