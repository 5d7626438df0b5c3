"""`run.environment.sandbox`: how tool calls run code (bubblewrap isolation and resource limits).

Import-cheap (pydantic only): topology validation and `plan` read it without starting anything; whether
bubblewrap can actually run here is checked when the environment is built (`sandbox.run.check_available`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SandboxMode = Literal["bwrap", "rlimits"]


class SandboxConfig(BaseModel):
    """Limits of one sandboxed command and how it is isolated.

    `bwrap` (the default): a bubblewrap sandbox with no network, a read-only view of the host's `/`, private
    `/tmp`, `/run` and `/work` (the episode's work dir), its own pid namespace (every process dies with it).
    `rlimits`: the same resource limits and a process group, but NO namespace isolation (the code sees the
    network and can write wherever its uid may): an explicit opt-in for hosts where bubblewrap cannot run."""

    model_config = ConfigDict(extra="forbid")

    mode: SandboxMode = Field("bwrap", description="'bwrap' (isolated) or 'rlimits' (limits only, NOT isolated).")
    cpu_s: int = Field(10, ge=1, description="CPU seconds per command (RLIMIT_CPU: SIGXCPU, then SIGKILL).")
    memory_mb: int = Field(512, ge=32, description="Address space per process in MB (RLIMIT_AS).")
    processes: int = Field(32, ge=1, description="Processes per command (RLIMIT_NPROC): bounds a fork bomb.")
    file_mb: int = Field(16, ge=1, description="Largest file a command may write, in MB (RLIMIT_FSIZE).")
    wall_s: float = Field(20.0, gt=0, description="Wall-clock seconds per command; then its processes are killed.")
    output_bytes: int = Field(16_384, ge=256, description="Bytes of stdout and of stderr kept (the rest dropped).")
    concurrency: int = Field(4, ge=1, description="Sandboxed commands running at once (the pool's size).")
    uid: int = Field(61000, ge=1, description="When the trainer runs as root: commands run as uids uid.."
                     "uid+concurrency-1 (one per pool slot), so that the process limit holds (root ignores it).")
    python: str | None = Field(None, description="The interpreter that runs code in the sandbox; null: the "
                               "trainer's own base interpreter (stdlib only, no site-packages of the venv).")

    def describe(self) -> str:
        """One line for `plan`: which isolation is in force and the limits."""
        limits = (f"rlimits cpu {self.cpu_s}s, memory {self.memory_mb} MB, {self.processes} processes, "
                  f"files {self.file_mb} MB; wall {self.wall_s:g}s; {self.concurrency} at once")
        if self.mode == "bwrap":
            return f"bubblewrap: no network, read-only /, private /work and /tmp; {limits}"
        return f"rlimits only (NOT isolated: network and host files reachable); {limits}"
