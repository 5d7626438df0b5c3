"""Real bubblewrap: a sandboxed command reads only what programs need (/usr, the system libraries, a few /etc
files, the interpreter) and the paths the user lists in `ro_paths`; never a host file beside them, the installed
composer_mesh or the coding tasks' hidden tests."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

import composer_mesh
import composer_mesh.envs.coding.catalog as catalog
from composer_mesh.sandbox.config import SandboxConfig
from composer_mesh.sandbox.pool import SandboxBox, SandboxPool
from composer_mesh.sandbox.run import SandboxUnavailable, check_available
from composer_mesh.sandbox.view import SYSTEM_DIRS

from .conftest import bwrap_config
from .test_sandbox import still_works

PACKAGE = Path(composer_mesh.__file__).resolve().parent
REPO = PACKAGE.parent


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A world-readable host directory outside /tmp, /root and /home (which the sandbox hid before too)."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-host-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def readable(path: str | Path) -> str:
    return f"try:\n    print(open({str(path)!r}).read(), end='')\nexcept OSError as e:\n    print(type(e).__name__, end='')"


async def test_a_host_file_beside_the_work_dir_is_not_readable_unless_listed(host_dir: Path) -> None:
    secret = host_dir / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    async with SandboxPool(bwrap_config()).session() as box:
        assert (await box.run_python(readable(secret))).stdout == "FileNotFoundError"
        seen = await box.run_python("import os; print([d for d in ('/var', '/opt', '/srv', '/mnt', '/home', "
                                    "'/root', '/boot', '/media') if os.path.lexists(d)])")
        assert seen.stdout == "[]\n", seen.observation()
    async with SandboxPool(bwrap_config(ro_paths=[str(host_dir)])).session() as box:
        assert (await box.run_python(readable(secret))).stdout == "s3cret"
        written = await box.run_python(f"open({str(host_dir / 'new')!r}, 'w')")
        assert "Read-only file system" in written.summary() and not (host_dir / "new").exists()


async def test_the_installed_package_and_the_hidden_tests_are_not_readable(box: SandboxBox) -> None:
    for path in (Path(composer_mesh.__file__).resolve(), Path(catalog.__file__).resolve()):
        assert (await box.run_python(readable(path))).stdout == "FileNotFoundError", path
    assert "ModuleNotFoundError" in (await box.run_python("import composer_mesh")).summary()
    await still_works(box)


async def test_the_package_is_masked_even_under_a_listed_path(host_dir: Path) -> None:
    """A listed path that holds composer_mesh (here a link to the checkout) shows the rest, not the package."""
    (host_dir / "checkout").symlink_to(REPO)
    inner = host_dir / "checkout"
    async with SandboxPool(bwrap_config(ro_paths=[str(inner)])).session() as box:
        assert (await box.run_python(readable(inner / "tests" / "__init__.py"))).ok  # world-readable in CI's clone
        assert (await box.run_python(f"import os; print(sorted(os.listdir({str(inner)!r})))")).stdout == \
            f"{sorted(os.listdir(REPO))}\n"
        hidden = inner / PACKAGE.name / "envs" / "coding" / "catalog.py"
        assert (await box.run_python(readable(hidden))).stdout == "FileNotFoundError"
        listing = await box.run_python(f"import os; print(os.listdir({str(inner / PACKAGE.name)!r}))")
        assert listing.stdout == "[]\n", listing.observation()


async def test_python_and_sh_still_run(box: SandboxBox) -> None:
    code = ("import json, sqlite3, subprocess, tempfile, time\n"
            "print(*subprocess.run(['ls', '/'], capture_output=True, text=True).stdout.split())\n"
            "print(tempfile.gettempdir(), time.strftime('%Z'))")
    result = await box.run_python(code)
    top = {"dev", "etc", "proc", "run", "tmp", "usr", "work"} | {d[1:] for d in SYSTEM_DIRS if os.path.exists(d)}
    assert result.ok and result.stdout == f"{' '.join(sorted(top))}\n/tmp {time.strftime('%Z')}\n", result.stdout
    shell = await box.run(["/bin/sh", "-c", "echo hi > f && cat f && date +%Y >/dev/null && ls -l f | cut -c1-10"])
    assert shell.ok and shell.stdout == "hi\n-rw-r--r--\n", shell.observation()


def test_ro_paths_are_absolute_outside_the_sandboxes_own_trees() -> None:
    for bad in ("data", "/", "/proc/1", "/work", "/run/x", "/dev/shm"):
        with pytest.raises(ValidationError, match="must be an absolute path other than / and outside /dev, /proc"):
            SandboxConfig(ro_paths=[bad])
    assert SandboxConfig(ro_paths=["/srv//data/"]).ro_paths == ["/srv/data"]


def test_a_missing_ro_path_is_one_line_when_the_environment_is_built() -> None:
    with pytest.raises(SandboxUnavailable) as e:
        check_available(bwrap_config(ro_paths=["/srv/nonexistent-sandbox-path"]))
    assert str(e.value) == "run.environment.sandbox.ro_paths: /srv/nonexistent-sandbox-path does not exist on this host"

