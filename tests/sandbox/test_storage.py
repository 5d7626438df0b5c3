"""Real bubblewrap: what a command may write is bounded. /tmp is a tmpfs of `tmp_mb`; the work dir is a tmpfs copy
of `work_mb` that comes back only when the command ended within `work_mb` and `work_files`: otherwise, and when
the wall timeout killed it, the work dir stays as it was before the command and the observation says so."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from services import require

from composer_mesh.sandbox.pool import SandboxBox, SandboxPool

from .conftest import bwrap_config
from .test_sandbox import still_works

UNCHANGED = "work dir not saved, left as it was before this command: "


def tree(root: Path) -> dict[str, str]:
    """Every entry below `root`: file -> its text, link -> '-> target', directory -> '/'."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(base, name)
            rel = str(path.relative_to(root))
            out[rel] = f"-> {os.readlink(path)}" if path.is_symlink() else "/" if path.is_dir() else path.read_text()
    return out


async def test_tmp_is_a_bounded_tmpfs() -> None:
    async with SandboxPool(bwrap_config(tmp_mb=2)).session() as box:
        fits = await box.run_python("open('/tmp/a', 'wb').write(b'x' * 1_000_000); print(len(open('/tmp/a', 'rb')"
                                    ".read()))")
        assert fits.stdout == "1000000\n", fits.observation()
        full = await box.run_python("for i in range(4):\n    open(f'/tmp/{i}', 'wb').write(b'x' * 900_000)")
        assert full.summary() == "exit code 1: OSError: [Errno 28] No space left on device", full.observation()
        await still_works(box)


async def test_writes_persist_between_commands_and_the_rest_is_killed(box: SandboxBox) -> None:
    first = await box.run_python(
        "import os, subprocess\nos.makedirs('pkg/sub')\nopen('pkg/mod.py', 'w').write('X = 1\\n')\n"
        "os.symlink('pkg/mod.py', 'link')\nopen('secret', 'w').write('s')\nos.chmod('secret', 0o600)\n"
        "os.chmod('pkg/sub', 0o500)\n"
        "subprocess.Popen(['/bin/sh', '-c', 'sleep 0.3; echo late > late'], start_new_session=True)")
    assert first.ok and first.work_note is None, first.observation()
    await asyncio.sleep(0.5)  # a process the command left would have written `late` by now
    assert tree(box.workdir) == {"pkg": "/", "pkg/sub": "/", "pkg/mod.py": "X = 1\n", "link": "-> pkg/mod.py",
                                 "secret": "s"}
    assert (box.workdir / "pkg" / "sub").stat().st_mode & 0o777 == 0o500
    second = await box.run_python("import os\nfrom pkg.mod import X\nprint(X, open('secret').read(), "
                                  "oct(os.stat('secret').st_mode & 0o777), os.readlink('link'))")
    assert second.stdout == "1 s 0o600 pkg/mod.py\n", second.observation()


async def test_files_rewritten_in_place_at_once_are_saved_and_the_rest_kept(box: SandboxBox) -> None:
    """A file left as it was copied in is linked back, not copied: one rewritten in place (same inode) by a
    command that starts within the same clock tick must still count as changed."""
    for i in range(40):
        box.write(f"keep{i}", str(i))
    for i in range(5):
        result = await box.run(["/bin/sh", "-c", f"echo {i} > a; echo {i} >> keep0"])
        assert result.ok and result.work_note is None, result.observation()
        assert (box.workdir / "a").read_text() == f"{i}\n"
    assert (box.workdir / "keep0").read_text() == "00\n1\n2\n3\n4\n"
    assert {(box.workdir / f"keep{i}").read_text() for i in range(1, 40)} == {str(i) for i in range(1, 40)}


async def test_more_than_work_files_entries_are_not_saved() -> None:
    async with SandboxPool(bwrap_config(work_files=20)).session() as box:
        box.write("kept.txt", "before")
        result = await box.run_python("for i in range(30):\n    open(f'f{i}', 'w').write('x')\n"
                                      "open('kept.txt', 'w').write('after')\nprint('done')")
        assert result.ok and result.stdout == "done\n"
        assert result.work_note == UNCHANGED + "more than 20 entries (work_files)"
        assert result.observation().splitlines()[:2] == ["exit code 0", result.work_note]
        assert tree(box.workdir) == {"kept.txt": "before"}
        await still_works(box)


async def test_more_than_work_mb_is_refused_and_not_saved() -> None:
    async with SandboxPool(bwrap_config(work_mb=2)).session() as box:
        box.write("kept.txt", "before")
        full = await box.run_python("for i in range(3):\n    open(f'f{i}', 'wb').write(b'x' * 900_000)")
        assert "No space left on device" in full.summary()  # the tmpfs is the work dir's size
        before = tree(box.workdir)  # what the full command wrote fits: it was saved
        assert before["kept.txt"] == "before" and len(before["f0"]) == 900_000
        sparse = await box.run_python("for i in range(4):\n    open(f's{i}', 'wb').truncate(1024 * 1024)\n"
                                      "open('kept.txt', 'w').write('after')")  # 4 MB of holes: no space in /work
        assert sparse.ok and sparse.work_note == UNCHANGED + "more than 2 MB (work_mb)", sparse.observation()
        assert tree(box.workdir) == before


async def test_a_wall_timeout_leaves_the_work_dir_as_before() -> None:
    async with SandboxPool(bwrap_config(wall_s=1.0)).session() as box:
        assert (await box.run_python("open('a', 'w').write('1')")).ok
        result = await box.run_python("import time\nopen('a', 'w').write('2')\nopen('b', 'w').write('x')\n"
                                      "time.sleep(10)")
        assert result.timed_out and result.work_note == ("work dir left as it was before this command (killed at "
                                                         "the wall time before it was saved)")
        assert result.observation().splitlines()[:2] == ["killed: wall time 1 s exceeded", result.work_note]
        assert tree(box.workdir) == {"a": "1"}


async def test_the_launcher_and_its_outbox_are_out_of_reach(box: SandboxBox) -> None:
    """As root the launcher (pid 2) holds the outbox fd while the command runs as the slot's uid: the command can
    neither open the launcher's fds nor kill it, and no path in the sandbox leads to the outbox."""
    require(os.getuid() == 0, "root (the launcher stays root while the command runs as the slot's uid)")
    result = await box.run_python("import os, signal\nfor probe in (lambda: os.listdir('/proc/2/fd'), "
                                  "lambda: os.kill(2, signal.SIGKILL)):\n    try:\n        probe()\n"
                                  "        print('reached')\n    except OSError as e:\n        print(type(e).__name__)")
    assert result.stdout == "PermissionError\nPermissionError\n" and result.work_note is None, result.observation()
