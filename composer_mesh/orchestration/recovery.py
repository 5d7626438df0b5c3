"""Replacing role actors whose proc died, so the run goes on: at most `max_restarts` per role.

`Recovery.attempt(role, call)` runs `call()` (which must read the role's handles afresh each time) and, when
the call failed because a proc under it died (Monarch supervision, not an exception of the endpoint), waits
for the role's mesh to be replaced through the launcher (new procs, the actors spawned and set up again) and
runs it again: the request the dead actor had in flight is re-issued with the same inputs (prompts, seeds), so
nothing is generated, scored or trained twice and nothing is lost. Calls that fail together (every actor of a
mesh, or roles sharing a mesh) share one replacement. The trainer's mesh is never replaced here: its state
lives in its processes, so a lone trainer's death stops the run and the last checkpoint is where `--resume`
continues; a DiLoCo replica is replaced alone through `respawn_proc` (see `replicas.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from composer_mesh.mesh.launch import LaunchError, failure_reason, is_proc_death
from composer_mesh.orchestration.ports import RestartsExhausted
from composer_mesh.roles import RoleMesh

log = logging.getLogger("composer_mesh.recovery")
T = TypeVar("T")


class Recovery:
    """Replaces dead role actors through the launcher and counts what it cost (restarts per role, re-issued
    requests, seconds lost waiting for replacements). `set_up(roles, warm)` is the loop's: it builds the new
    actors (models, weights; only weights when a warm spare took over) before the failed calls are re-issued."""

    def __init__(self, mesh: RoleMesh, max_restarts: int,
                 set_up: Callable[[list[str], bool], Awaitable[None]]) -> None:
        self.mesh = mesh
        self.max_restarts = max_restarts
        self.set_up = set_up
        self.restarts: dict[str, int] = {}  # role -> times replaced
        self.reissued = 0  # calls re-issued to a replacement
        self.lost_s = 0.0  # seconds spent replacing (calls waiting meanwhile)
        self._generation: dict[str, int] = {}  # mesh -> replacements so far (tells a stale failure apart)
        self._locks: dict[str, asyncio.Lock] = {}
        # One entry per replacement (perf_counter times): when the death surfaced, when the replacement was set
        # up, when the first call re-issued to it answered. benchmarks/bench_recovery.py reads these.
        self.events: list[dict[str, Any]] = []
        self._unanswered: dict[str, dict[str, Any]] = {}  # mesh -> event of a replacement not yet answered

    async def attempt(self, role: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, re-issued after a replacement each time the proc under it died."""
        while True:
            mesh = self.mesh.mesh_of(role)  # type: ignore[arg-type]
            seen = self._generation.get(mesh, 0)
            try:
                result = await call()
            except Exception as e:
                if not is_proc_death(e):
                    raise
                await self._replace(role, mesh, seen, e)
                self.reissued += 1
                continue
            event = self._unanswered.pop(mesh, None)
            if event is not None:  # the replacement's first answer: its role works again
                event["first_result_s"] = time.perf_counter()
            return result

    async def replace_mesh(self, mesh: str, why: str) -> None:
        """Replace mesh `mesh` before a call failed on it (its Slurm job ended): calls still in flight there fail
        later (Monarch reports them once the procs' state goes stale) and are re-issued to the replacement."""
        roles = self.mesh.roles_on(mesh)
        await self._replace(roles[0], mesh, self._generation.get(mesh, 0), LaunchError(why))

    async def _replace(self, role: str, mesh: str, seen: int, error: BaseException) -> None:
        async with self._locks.setdefault(mesh, asyncio.Lock()):
            if self._generation.get(mesh, 0) != seen:  # replaced while this call was failing: just re-issue
                return
            roles = self.mesh.roles_on(mesh)
            why = failure_reason(str(error))
            if "trainer" in roles:
                raise RestartsExhausted(f"mesh {mesh!r} holds the trainer, whose state dies with it ({why})") from error
            over = [r for r in roles if self.restarts.get(r, 0) >= self.max_restarts]
            if over:
                self.mesh.launched.give_up(mesh)  # the run stops with a checkpoint instead
                raise RestartsExhausted(f"{over[0]} died again after {self.restarts[over[0]]} restart(s) "
                                        f"(run.max_restarts={self.max_restarts}): {why}") from error
            log.warning("%s on mesh %s died (%s): replacing its procs", role, mesh, why)
            t0 = time.perf_counter()
            try:
                replaced, warm = await self.mesh.respawn(role)  # type: ignore[arg-type]
            except LaunchError as e:  # e.g. its Slurm job ended: the run stops with a checkpoint instead
                self.mesh.launched.give_up(mesh)
                raise RestartsExhausted(f"{role} cannot be replaced: {e}") from error
            respawned = time.perf_counter()
            await self.set_up(replaced, warm)
            self.lost_s += time.perf_counter() - t0
            event = {"role": role, "mesh": mesh, "roles": replaced, "warm": warm, "failed_s": t0,
                     "respawned_s": respawned, "replaced_s": time.perf_counter()}
            self.events.append(event)
            self._unanswered[mesh] = event
            for r in replaced:
                self.restarts[r] = self.restarts.get(r, 0) + 1
            self._generation[mesh] = seen + 1

    async def respawn_proc(self, role: str, rank: int | list[int], error: BaseException) -> dict[str, Any]:
        """Replace proc `rank` of `role`'s mesh alone (`LaunchedMeshes.respawn_proc`: the others go on), or the
        procs `rank` (a list: every rank of a sharded replica, one restart), counted against `max_restarts` like a
        whole-mesh replacement; the caller sets the new actors up, then calls `replaced`. Returns the
        replacement's event."""
        ranks = [rank] if isinstance(rank, int) else list(rank)
        which = f"proc {ranks[0]}" if len(ranks) == 1 else f"procs {ranks[0]}..{ranks[-1]}"
        why = failure_reason(str(error))
        if self.restarts.get(role, 0) >= self.max_restarts:
            raise RestartsExhausted(f"{role} {which} died again after {self.restarts[role]} restart(s) "
                                    f"(run.max_restarts={self.max_restarts}): {why}") from error
        mesh = self.mesh.mesh_of(role)  # type: ignore[arg-type]
        log.warning("%s %s on mesh %s died (%s): replacing %s alone", role, which, mesh, why,
                    "it" if len(ranks) == 1 else "them")
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(self.mesh.launched.respawn_proc(mesh, r) for r in ranks))
        except LaunchError as e:
            raise RestartsExhausted(f"{role} {which} cannot be replaced: {e}") from error
        self.restarts[role] = self.restarts.get(role, 0) + 1
        event = {"role": role, "mesh": mesh, "rank": ranks[0] if len(ranks) == 1 else ranks, "roles": [role],
                 "warm": False, "failed_s": t0, "respawned_s": time.perf_counter()}
        self.events.append(event)
        return event

    def replaced(self, event: dict[str, Any], reissued: int = 0) -> None:
        """The replacement of `event` is set up; `reissued` calls were sent to it again."""
        event["replaced_s"] = time.perf_counter()
        self.lost_s += event["replaced_s"] - event["failed_s"]
        self.reissued += reissued

    def metrics(self) -> dict[str, float]:
        out = {"faults/restarts": float(sum(self.restarts.values())), "faults/reissued": float(self.reissued),
               "faults/lost_s": self.lost_s}
        out.update({f"faults/restarts/{role}": float(n) for role, n in sorted(self.restarts.items())})
        return out

    def state(self) -> dict[str, Any]:
        return {"restarts": dict(self.restarts), "reissued": self.reissued, "lost_s": self.lost_s}

    def restore(self, state: dict[str, Any]) -> None:
        self.restarts = {str(k): int(v) for k, v in state.get("restarts", {}).items()}
        self.reissued, self.lost_s = int(state.get("reissued", 0)), float(state.get("lost_s", 0.0))
