"""Test-session setup shared by every tier.

Monarch reads its supervision settings at import, so they are set here before anything imports it.
Monarch's default fault hook would `sys.exit` the whole pytest session on an actor failure: tests that use
`launch()` get the launcher's hook, and tests that spawn proc meshes directly install one in their fixture.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# Monarch children import actor classes by reference: they need the repo and tests dirs on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, _HERE, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
os.environ.setdefault("MONARCH_FILE_LOG", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.gpu` tests skip, with the reason, where CUDA is not available (torch only imported
    when some selected test carries the marker)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)")
    for item in gpu_items:
        item.add_marker(skip)


IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _skip_in_ci(report: pytest.TestReport | pytest.CollectReport, gpu_only: bool) -> None:
    """In CI (CI=true) a skip hides a regression: it fails instead, naming its reason, unless the test is GPU-only
    (`@pytest.mark.gpu`). Locally skips stay skips (a missing optional service or extra)."""
    if not IN_CI or not report.skipped or gpu_only or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"a skip fired in CI: {reason}. Only GPU-only tests (@pytest.mark.gpu) may skip there; "
                       "install what the test needs in .ci/run (tests/conftest.py)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    _skip_in_ci(report, item.get_closest_marker("gpu") is not None)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[pytest.CollectReport]:
    """A module that skips itself at import (`pytest.importorskip` at its top) is a skip too."""
    report = yield
    _skip_in_ci(report, gpu_only=False)
    return report


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Every test builds (and warm-starts) tiny models into one session cache, never into ~/.cache.

    Set in the environment so Monarch procs spawned by the tests inherit it.
    """
    path = str(tmp_path_factory.mktemp("model_cache"))
    previous = os.environ.get("COMPOSER_MESH_CACHE")
    os.environ["COMPOSER_MESH_CACHE"] = path
    yield path
    if previous is None:
        os.environ.pop("COMPOSER_MESH_CACHE", None)
    else:
        os.environ["COMPOSER_MESH_CACHE"] = previous
