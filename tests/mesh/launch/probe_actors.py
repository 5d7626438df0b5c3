"""Probe actors for the launch tests: report where they run; fail on request.

They live in an importable module (not a test module) because Monarch procs import actor classes by
reference. `ProbeBinding` lets test topologies bind every role without the real model bindings.
Failure knobs come from the mesh `env` so they do not depend on any role's settings schema:
`PROBE_FAIL_INIT=<role>[,<role>]` makes those roles raise in `__init__`.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from monarch.actor import Actor, context, endpoint
from pydantic import BaseModel, ConfigDict, Field

from composer_mesh.actors.configs import RoleConfig


class ProbeSettings(BaseModel):
    """Settings of the probe binding (tests only)."""

    model_config = ConfigDict(extra="forbid")
    tag: str = Field("", description="Free text echoed back by the probe.")


class ProbeBinding:
    """A binding that can be named for any role in a test topology; it does nothing."""

    Settings = ProbeSettings
    capabilities = frozenset({"distill", "replay", "sharded"})

    def __init__(self, settings: ProbeSettings) -> None:
        self.settings = settings


class ProbeActor(Actor):
    """Stands in for any role actor: constructed like one, with the role's config (a `RoleConfig`)."""

    def __init__(self, config: RoleConfig) -> None:
        if not isinstance(config, RoleConfig):
            raise TypeError(f"role actors get a RoleConfig, got {type(config).__name__}")
        self.config_type = type(config).__name__
        self.config = config
        failing = {r.strip() for r in os.environ.get("PROBE_FAIL_INIT", "").split(",") if r.strip()}
        if config.role in failing:
            raise RuntimeError(f"probe {config.role} fails in __init__ on purpose")

    @endpoint
    def ready(self) -> None:
        return None

    @endpoint
    def where(self) -> dict[str, Any]:
        rank = context().actor_instance.rank
        return {
            "role": self.config.role,
            "mesh": self.config.mesh,
            "env_mesh": os.environ.get("COMPOSER_MESH_MESH"),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "host": socket.gethostname(),
            "rank": {k: rank[k] for k in ("hosts", "procs")},
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "probe_env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_")},
            "config": self.config_type,
            "sys_path": list(sys.path),
        }

    @endpoint
    def boom(self) -> None:
        raise ValueError(f"probe {self.config.role} endpoint error on purpose")

    @endpoint
    def crash(self, code: int = 3) -> None:
        os._exit(code)
