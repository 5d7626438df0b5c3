"""Process-wide Monarch setup for a composer-mesh controller and for every proc it spawns.

Monarch reads some settings only once, at import: the supervision poll interval decides whether a dead
proc is noticed after ~1 s or ~10 s. So this module sets those environment defaults *on import* and
must be imported before anything imports `monarch` (`composer_mesh.mesh.launch` imports it first).
A user's explicit environment always wins (`os.environ.setdefault`).

It also owns:
- the controller's fault hook: Monarch's default hook `sys.exit`s the controller on any actor
  failure; ours hands each failure to the launched meshes that own it (they turn it into a
  `MeshFailureError` naming the actor mesh and mesh) and only logs failures nobody claims;
- `proc_setup`, the `bootstrap=` function every spawned proc runs before any actor: GPU visibility
  per proc and a quiet logging default (Monarch's RDMA TCP-fallback warning is not filtered here: the
  weight plane reports its own fallback, `mesh/weights/rdma.py`, and anyone else's buffers still warn);
- quieting Monarch's job loggers, which print INFO lines to the user's terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

# Defaults applied before `monarch` is imported. Documented in docs/launch.md.
MONARCH_ENV_DEFAULTS: dict[str, str] = {
    # Notice a dead proc within ~1 s instead of ~10 s; only read at `import monarch`.
    "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "1s",
    # Monarch's internal file log grows ~50 KB per run at the default level.
    "MONARCH_FILE_LOG": "error",
}

# Set by launch in each proc's bootstrap environment; read by `proc_setup` inside the proc.
ENV_MESH = "COMPOSER_MESH_MESH"
ENV_GPUS_PER_PROC = "COMPOSER_MESH_GPUS_PER_PROC"
# The host GPUs of a `local` mesh (`composer_mesh.mesh.gpus.assign_gpus`), comma-separated; unset elsewhere.
ENV_GPU_DEVICES = "COMPOSER_MESH_GPU_DEVICES"
# The proc's index on its host when it replaces one proc of a mesh on a one-proc mesh (its own rank is 0 there).
ENV_PROC_INDEX = "COMPOSER_MESH_PROC_INDEX"
# Log level for Python logging inside procs (default WARNING).
ENV_PROC_LOG_LEVEL = "COMPOSER_MESH_PROC_LOG_LEVEL"

log = logging.getLogger("composer_mesh.mesh")

_poll_was_set_late = "monarch" in sys.modules and (
    "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY" not in os.environ
)
for _key, _value in MONARCH_ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
if _poll_was_set_late:
    warnings.warn(
        "composer_mesh.mesh.runtime was imported after monarch: HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY "
        "has no effect now, so failures are detected after ~10 s instead of ~1 s. Import "
        "composer_mesh.mesh.launch (or set the variable) before importing monarch.",
        RuntimeWarning,
        stacklevel=2,
    )


# ------------------------------------------------------------------------------------------- fault hook
# A claimer looks at one Monarch `MeshFailure` and returns True if the failure belongs to it.
FailureClaimer = Callable[[Any], bool]

_claimers: list[FailureClaimer] = []
_claimers_lock = threading.Lock()
_hook_installed = False
_previous_hook: Callable[[Any], None] | None = None


def _on_fault(failure: Any) -> None:
    """Monarch's `unhandled_fault_hook`: route to the owning launch, never exit the controller."""
    with _claimers_lock:
        claimers = list(_claimers)
    claimed = False
    for claim in claimers:
        try:
            claimed = claim(failure) or claimed
        except Exception:  # a broken claimer must not take the controller down
            log.exception("fault claimer failed on %s", getattr(failure, "mesh_name", failure))
    if claimed:
        return
    if _previous_hook is not None:
        _previous_hook(failure)
        return
    name = str(getattr(failure, "mesh_name", "?"))
    level, message = unclaimed_failure_log(name, _report(failure))
    log.log(level, "%s", message)


# Actor meshes Monarch itself spawns on every proc mesh (`<name>-<suffix>`): the per-proc logger, and the
# `setup` actor that runs a spawn's `setup=` callable. When a proc dies they fail alongside the actors a launch
# put there, whose failure that launch claims and handles (`Recovery` replaces the procs, or the run stops and
# says why): their own report is the same death seen twice.
MONARCH_INTERNAL_MESHES = ("logger", "setup")


def unclaimed_failure_log(mesh_name: str, report: str) -> tuple[int, str]:
    """The log level and line of a failure no launch claimed: a Monarch-internal mesh's (a proc died; its
    launch hears it through its own actors) at INFO, anything else at ERROR (nobody handles it)."""
    if mesh_name.split("-", 1)[0] in MONARCH_INTERNAL_MESHES:
        first = report.strip().splitlines()[-1:] or [""]
        return logging.INFO, f"a proc died under Monarch's {mesh_name!r} mesh ({first[0].strip()}); the run's " \
            "own actors on it report the death, and the run replaces the proc or stops"
    return logging.ERROR, f"unhandled Monarch mesh failure on {mesh_name}: {report}"


def _report(failure: Any) -> str:
    try:
        return str(failure.report())
    except Exception:
        return repr(failure)


def install_fault_hook() -> None:
    """Replace Monarch's exit-the-controller fault hook with ours (idempotent).

    A hook someone installed before us (for example a test conftest recorder) still receives the
    failures no launched mesh claims; Monarch's own default hook is dropped, because it `sys.exit`s.
    """
    global _hook_installed, _previous_hook
    import monarch.actor
    from monarch._src.actor import supervision

    current = monarch.actor.unhandled_fault_hook
    if current is _on_fault:
        return
    if not _hook_installed and current is not supervision.unhandled_fault_hook:
        _previous_hook = current
    monarch.actor.unhandled_fault_hook = _on_fault
    _hook_installed = True


def add_failure_claimer(claimer: FailureClaimer) -> None:
    with _claimers_lock:
        _claimers.append(claimer)


def remove_failure_claimer(claimer: FailureClaimer) -> None:
    with _claimers_lock:
        if claimer in _claimers:
            _claimers.remove(claimer)


# ------------------------------------------------------------------------------------------ log noise
_MONARCH_CHATTY_LOGGERS = ("monarch._src.job.job", "monarch._src.job.slurm", "monarch._src.job.process")


def quiet_monarch_logs() -> None:
    """Monarch's job modules attach their own stderr handlers at INFO; keep only warnings and errors."""
    import monarch.job  # noqa: F401  (its modules set their loggers to INFO on import: import first)

    for name in _MONARCH_CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def setup_controller() -> None:
    """Everything a controller needs before it spawns anything: fault hook and quiet logs."""
    install_fault_hook()
    quiet_monarch_logs()


# --------------------------------------------------------------------------------------- per-proc setup
def visible_devices(
    local_index: int, gpus_per_proc: int, inherited: str | None, host_devices: Sequence[int] | None = None
) -> str:
    """`CUDA_VISIBLE_DEVICES` for the proc at `local_index` on its host.

    Proc i gets slots [i*g, (i+1)*g) of its mesh's host GPUs: `host_devices` when the mesh was given some
    (local meshes sharing a host get disjoint ones), else 0, 1, 2, ... A slot is an index into what the host
    may use: the inherited list when the scheduler or the user set one (Slurm does for `--gpus-per-node`),
    else the device index itself. A CPU-only proc (`gpus_per_proc == 0`) gets the empty string: no GPU.
    """
    if gpus_per_proc < 0 or local_index < 0:
        raise ValueError(f"gpus_per_proc ({gpus_per_proc}) and local_index ({local_index}) must be >= 0")
    if gpus_per_proc == 0:
        return ""
    lo, hi = local_index * gpus_per_proc, (local_index + 1) * gpus_per_proc
    if host_devices is None:
        slots = list(range(lo, hi))
    elif hi > len(host_devices):
        raise ValueError(
            f"proc {local_index} needs GPUs {lo}..{hi - 1} of its mesh, which has {len(host_devices)}"
        )
    else:
        slots = list(host_devices[lo:hi])
    if inherited is not None and inherited.strip():
        devices = [d.strip() for d in inherited.split(",") if d.strip()]
        if max(slots) >= len(devices):
            raise RuntimeError(
                f"proc {local_index} needs host GPUs {','.join(map(str, slots))} ({gpus_per_proc} per proc) "
                f"but this host only exposes CUDA_VISIBLE_DEVICES={inherited!r}"
            )
        return ",".join(devices[s] for s in slots)
    return ",".join(str(s) for s in slots)


def proc_setup() -> None:
    """`bootstrap=` function run in every spawned proc before its actors are created.

    - pins GPUs: sets `CUDA_VISIBLE_DEVICES` from the proc's `procs` coordinate, the mesh's
      `gpus_per_proc` (carried in `COMPOSER_MESH_GPUS_PER_PROC`) and, for a local mesh, its host GPUs
      (`COMPOSER_MESH_GPU_DEVICES`), before anything can initialise CUDA;
    - gives Python logging a stderr handler at `COMPOSER_MESH_PROC_LOG_LEVEL` (default WARNING).
    """
    gpus = os.environ.get(ENV_GPUS_PER_PROC)
    if gpus is not None:
        from monarch.actor import current_rank

        point = current_rank()
        try:
            local_index = int(os.environ.get(ENV_PROC_INDEX) or point["procs"])
        except KeyError:
            local_index = 0
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        listed = os.environ.get(ENV_GPU_DEVICES)
        host = None if listed is None else [int(d) for d in listed.split(",") if d.strip()]
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(local_index, int(gpus), inherited, host)

    level = os.environ.get(ENV_PROC_LOG_LEVEL, "WARNING").upper()
    mesh = os.environ.get(ENV_MESH, "?")
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        # Level on the handler too: Monarch logs some INFO records past logger-level checks.
        handler.setLevel(level)
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s [{mesh} pid %(process)d] %(name)s: %(message)s")
        )
        root.addHandler(handler)
    root.setLevel(level)
