"""`run.environment.sandbox`: how tool calls run code (bubblewrap isolation and resource limits).

Import-cheap (pydantic only): topology validation and `plan` read it without starting anything; whether
bubblewrap can actually run here, and whether the paths it names exist, is checked when the environment is built
(`sandbox.run.check_available`).
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SandboxMode = Literal["bwrap", "rlimits"]
# Where a bwrap sandbox mounts its own trees: a path the user binds may not be at or under one of them.
SANDBOX_OWN = ("/dev", "/proc", "/run", "/work")


class SandboxConfig(BaseModel):
    """Limits of one sandboxed command and how it is isolated.

    `bwrap` (the default): a bubblewrap sandbox with no network that sees of the host only /usr, the system
    libraries, a few /etc files, the interpreter and `ro_paths` (read-only); it writes only sized tmpfs trees
    (`/tmp`, and `/work`: a copy of the episode's work dir, saved back when the command ends within the limits);
    its own pid namespace (every process dies with it).
    `rlimits`: the same resource limits and a process group, but NO namespace isolation (the code sees the
    network and can write wherever its uid may): an explicit opt-in for hosts where bubblewrap cannot run."""

    model_config = ConfigDict(extra="forbid")

    mode: SandboxMode = Field("bwrap", description="'bwrap' (isolated) or 'rlimits' (limits only, NOT isolated).")
    cpu_s: int = Field(10, ge=1, description="CPU seconds per command (RLIMIT_CPU: SIGXCPU, then SIGKILL).")
    memory_mb: int = Field(512, ge=32, description="Address space per process in MB (RLIMIT_AS).")
    processes: int = Field(32, ge=1, description="Processes per command (RLIMIT_NPROC): bounds a fork bomb.")
    file_mb: int = Field(16, ge=1, description="Largest file a command may write, in MB (RLIMIT_FSIZE).")
    tmp_mb: int = Field(64, ge=1, description="Size of a bwrap sandbox's /tmp (a tmpfs, in memory), in MB.")
    work_mb: int = Field(64, ge=1, description="Bytes the work dir may hold, in MB: in bwrap mode /work is a tmpfs "
                         "of this size and a work dir over it is not saved; in rlimits mode it is reported.")
    work_files: int = Field(10_000, ge=1, description="Entries (files, directories, links) the work dir may hold: "
                            "in bwrap mode a work dir with more is not saved; in rlimits mode it is reported.")
    wall_s: float = Field(20.0, gt=0, description="Wall-clock seconds per command; then its processes are killed.")
    output_bytes: int = Field(16_384, ge=256, description="Bytes of stdout and of stderr kept (the rest dropped).")
    concurrency: int = Field(4, ge=1, description="Sandboxed commands running at once (the pool's size).")
    uid: int = Field(61000, ge=1, description="When the trainer runs as root: commands run as uids uid.."
                     "uid+concurrency-1 (one per pool slot), so that the process limit holds (root ignores it).")
    python: str | None = Field(None, description="The interpreter that runs code in the sandbox; null: the "
                               "trainer's own base interpreter (stdlib only, no site-packages of the venv). In "
                               "bwrap mode it must lie under /usr or one of ro_paths.")
    ro_paths: list[str] = Field(default_factory=list, description="More host paths a bwrap sandbox sees, "
                                "read-only at the same place (absolute; not /, /dev, /proc, /run, /work or below "
                                "them); each must exist when the environment is built.")

    @field_validator("ro_paths")
    @classmethod
    def _absolute_and_not_the_sandboxes_own(cls, paths: list[str]) -> list[str]:
        """Refuse a relative path, and a path the sandbox's own mounts would hide or that would expose them."""
        for path in paths:
            norm = os.path.normpath(path)
            if not os.path.isabs(path) or norm == "/" or any(norm == d or norm.startswith(d + "/")
                                                              for d in SANDBOX_OWN):
                raise ValueError(f"{path!r} must be an absolute path other than / and outside "
                                 f"{', '.join(SANDBOX_OWN)}")
        return [os.path.normpath(p) for p in paths]

    def describe(self) -> str:
        """One line for `plan`: which isolation is in force and the limits."""
        limits = (f"rlimits cpu {self.cpu_s}s, memory {self.memory_mb} MB, {self.processes} processes, "
                  f"files {self.file_mb} MB; wall {self.wall_s:g}s; {self.concurrency} at once")
        work = f"work dir {self.work_mb} MB, {self.work_files} entries"
        if self.mode == "bwrap":
            seen = "/usr, system libs, a few /etc files, the interpreter" + "".join(f", {p}" for p in self.ro_paths)
            return (f"bubblewrap: no network, reads only {seen}; private /work ({work}, saved when the command ends "
                    f"within them) and /tmp ({self.tmp_mb} MB); {limits}")
        return (f"rlimits only (NOT isolated: network and host files reachable); {limits}; {work} (reported when "
                "over); after each command every process of the slot's uid is killed when the trainer is root, "
                "else only the process group (a setsid() escapes it)")
