"""The trainer's replicas, each addressed alone, each a lane of calls kept in its mailbox order.

With DiLoCo, a replica whose proc died is replaced alone while the others go on:

1. a one-proc stand-in is spawned on the same host (`LaunchedMeshes.respawn_proc`, counted against
   `run.max_restarts` like any restart); a sharded replica is replaced whole: one stand-in per rank, on its
   rank's host, meeting in a new process group (its survivors fail in their collectives and are left alone);
2. it rejoins at the last round the survivors closed before the first step it must train
   (`TrainerActor.rejoin`): its weights are their global parameters, read from the object store;
3. the replica's batches trained since that round are replayed on it, with the checkpoint `save_state` calls
   whose writes the dead replica had not finished, so it stands where the dead one stood at the round boundary
   (its AdamW moments start afresh: they are local to a replica and were never in the store);
4. every call the dead replica had not answered is sent again, in the same order.

Its next round then has every replica in it, and it leaves the round with the same global parameters as the
others. A lone trainer (no DiLoCo) is not replaced: its state dies with it, the run stops and `--resume`
continues from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from composer_mesh.actors.messages import TrainBatch, TrainMetrics
from composer_mesh.mesh.launch import is_proc_death
from composer_mesh.mesh.objectstore.config import DiLoCoConfig
from composer_mesh.mesh.weights.plane import WeightManifest
from composer_mesh.orchestration.recovery import Recovery, RestartsExhausted
from composer_mesh.roles import RoleMesh

log = logging.getLogger("composer_mesh.replicas")

# Train steps a lane may have sent beyond the last one it answered (the loop pipelines two).
_IN_FLIGHT = 4


@dataclass(eq=False)
class _Call:
    """One call on a replica's lane: a train step, or a `save_state` sent right behind step `step`."""

    endpoint: str
    args: tuple[Any, ...]
    step: int
    future: Any = None  # the answer of its latest send
    answered: bool = False


class _Lane:
    """One replica: its handle, its calls in the order sent, what it still has to report written."""

    def __init__(self, replica: int, handle: Any) -> None:
        self.replica = replica
        self.handle = handle
        self.calls: list[_Call] = []
        self.unreported: dict[str, int] = {}  # checkpoint URL -> step, until the replica reports it written
        self.generation = 0  # stand-ins so far (tells a stale failure apart)
        self.lock = asyncio.Lock()
        self.replacing = False  # calls made meanwhile wait unsent, so they reach the stand-in in order
        self.failure: BaseException | None = None  # why the replica could not be replaced
        self.event: dict[str, Any] | None = None  # the latest replacement, until its first answer

    def send(self, call: _Call) -> None:
        call.future = getattr(self.handle, call.endpoint).call_one(*call.args)


class _AllRanks:
    """One endpoint of every rank of a sharded replica: a call goes to each rank now (so it takes its place in
    every rank's mailbox), and its answer is rank 0's once every rank answered. A rank's failure is the call's;
    when a rank's proc died, that death is the one raised (the survivors fail after it, in their collectives)."""

    def __init__(self, endpoints: list[Any]) -> None:
        self.endpoints = endpoints

    def call_one(self, *args: Any) -> asyncio.Future[Any]:
        futures = [e.call_one(*args) for e in self.endpoints]

        async def first() -> Any:
            answers = await asyncio.gather(*futures, return_exceptions=True)
            errors = [a for a in answers if isinstance(a, BaseException)]
            if errors:
                raise next((e for e in errors if is_proc_death(e)), errors[0])
            return answers[0]

        return asyncio.ensure_future(first())


class ShardedReplica:
    """The ranks of a replica sharded over several procs, called as one (SPMD: the same calls, in the same order,
    on every rank; `TrainerActor.setup` makes them one FSDP2 group)."""

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks

    def __getattr__(self, endpoint: str) -> _AllRanks:
        if endpoint.startswith("_"):
            raise AttributeError(endpoint)
        return _AllRanks([getattr(rank, endpoint) for rank in self.ranks])


async def setup_args(handle: Any) -> tuple[str, ...]:
    """The arguments of a replica's `TrainerActor.setup`: for a sharded replica, the address its ranks meet at
    (its rank 0's `rendezvous`); none for a replica of one proc."""
    if isinstance(handle, ShardedReplica):
        return (await handle.ranks[0].rendezvous.call_one(),)
    return ()


async def rejoin(handle: Any, replica: int, round_id: int, first_version: int) -> int:
    """`TrainerActor.rejoin` on a stand-in replica (one proc, or the new ranks of a sharded replica, each told its
    rank and their meeting point); the step it healed to."""
    if not isinstance(handle, ShardedReplica):
        healed, _ = await handle.rejoin.call_one(replica, round_id, first_version)
        return int(healed)
    address = await handle.ranks[0].rendezvous.call_one()
    answers = await asyncio.gather(*[rank.rejoin.call_one(replica, round_id, first_version, address, i)
                                     for i, rank in enumerate(handle.ranks)])
    return int(answers[0][0])


def replica_handles(procs: list[Any], per: int) -> list[Any]:
    """One handle per replica from the trainer's per-proc handles: the proc itself, or a `ShardedReplica` of its
    `per` (`procs_per_replica`) consecutive procs."""
    if per <= 1:
        return list(procs)
    return [ShardedReplica(procs[i:i + per]) for i in range(0, len(procs), per)]


class TrainerReplicas:
    """Sends each replica its calls at once (they wait in its mailbox) and hands out awaitables for the
    answers; with DiLoCo, an answer lost to a proc death arrives from the replica's stand-in instead."""

    def __init__(self, mesh: RoleMesh, recovery: Recovery, diloco: DiLoCoConfig | None,
                 first_version: Callable[[], int]) -> None:
        self.mesh = mesh
        self.recovery = recovery
        self.diloco = diloco if diloco is not None and diloco.replicas > 1 else None
        self.first_version = first_version
        handles = replica_handles(mesh.procs("trainer"), mesh.procs_per_replica)
        self.lanes = [_Lane(i, handle) for i, handle in enumerate(handles)]
        # Steps kept for replay: back to the round before the newest (its checkpoint may be the dead one's).
        self._keep = 2 * (self.diloco.sync_every // self.diloco.fragments) + _IN_FLIGHT if self.diloco else 0

    def __len__(self) -> int:
        return len(self.lanes)

    @property
    def handles(self) -> list[Any]:
        """The replicas' current handles, in replica order."""
        return [lane.handle for lane in self.lanes]

    def train(self, step: int, batches: list[TrainBatch]) -> list[Coroutine[Any, Any, tuple[TrainMetrics, WeightManifest]]]:
        """Send train step `step` to every replica now (replica i trains `batches[i]`); their answers."""
        return [self._send(lane, "train_step", (batch,), step) for lane, batch in zip(self.lanes, batches)]

    def save_state(self, step: int, urls: list[str]) -> list[Coroutine[Any, Any, str]]:
        """Send every replica `save_state(urls[i], wait=False)` now, right behind step `step`; their answers."""
        for lane, url in zip(self.lanes, urls):
            lane.unreported[url] = step
        return [self._send(lane, "save_state", (url, False), step) for lane, url in zip(self.lanes, urls)]

    def reported(self, urls: list[str]) -> None:
        """The replicas reported these state writes finished: a stand-in need not write them again."""
        for lane in self.lanes:
            for url in urls:
                lane.unreported.pop(url, None)

    async def setup(self) -> list[Any]:
        """`setup` every replica, answers in replica order (`setup_args`: a sharded replica's meeting point)."""
        args = await asyncio.gather(*[setup_args(lane.handle) for lane in self.lanes])
        return await asyncio.gather(*[self._send(lane, "setup", a, -1) for lane, a in zip(self.lanes, args, strict=True)])

    async def each(self, endpoint: str, *args: Any) -> list[Any]:
        """Call `endpoint(*args)` on every replica (sent to all first), answers in replica order."""
        return await asyncio.gather(*[self._send(lane, endpoint, args, -1) for lane in self.lanes])

    # ---- answers and stand-ins ------------------------------------------------------------------------
    def _send(self, lane: _Lane, endpoint: str, args: tuple[Any, ...], step: int) -> Coroutine[Any, Any, Any]:
        call = _Call(endpoint, args, step)
        if not lane.replacing:
            lane.send(call)
        lane.calls.append(call)
        return self._answer(lane, call)

    async def _answer(self, lane: _Lane, call: _Call) -> Any:
        while True:
            generation = lane.generation
            if call.future is None:  # made during a replacement: the stand-in gets it
                async with lane.lock:
                    if call.future is None:
                        raise RestartsExhausted(f"trainer replica {lane.replica} was not replaced") from lane.failure
                continue
            try:
                value = await call.future
            except Exception as e:  # a death during `setup` fails the run: there is no round to rejoin at yet
                if self.diloco is None or call.endpoint == "setup" or not is_proc_death(e):
                    raise
                await self._replace(lane, generation, e)
                continue
            call.answered = True
            if lane.event is not None:
                lane.event["first_result_s"] = time.perf_counter()
                lane.event = None
            self._forget(lane)
            return value

    def _forget(self, lane: _Lane) -> None:
        """Drop answered calls no stand-in could need: all but the train steps kept for replay."""
        trained = [c.step for c in lane.calls if c.endpoint == "train_step" and c.answered]
        oldest = (max(trained) - self._keep) if trained else 0
        lane.calls = [c for c in lane.calls if not c.answered
                      or (c.endpoint == "train_step" and c.step > oldest and self.diloco is not None)]

    async def _replace(self, lane: _Lane, generation: int, error: BaseException) -> None:
        """Replace the lane's replica by a stand-in, once per death (the lane's calls all fail together)."""
        async with lane.lock:
            if lane.generation != generation or lane.failure is not None:
                if lane.failure is not None:
                    raise lane.failure
                return  # replaced while this call was failing: it was sent again
            lane.replacing = True
            while True:
                try:
                    await self._stand_in(lane, error)
                    break
                except Exception as e:
                    if not is_proc_death(e):
                        lane.failure = e
                        raise
                    error = e  # the stand-in died too: another one (max_restarts bounds this)
            lane.generation += 1

    async def _stand_in(self, lane: _Lane, error: BaseException) -> None:
        assert self.diloco is not None
        lane.replacing = True
        per_round = self.diloco.sync_every // self.diloco.fragments
        pending = [c.step for c in lane.calls if c.endpoint == "train_step" and not c.answered]
        trained = {c.step for c in lane.calls if c.endpoint == "train_step" and c.answered}
        first = min(pending) if pending else max(trained, default=0) + 1
        per = self.mesh.procs_per_replica
        ranks = list(range(lane.replica * per, (lane.replica + 1) * per))  # a sharded replica is replaced whole
        event = await self.recovery.respawn_proc("trainer", ranks if per > 1 else lane.replica, error)
        lane.handle = replica_handles(self.mesh.procs("trainer"), per)[lane.replica]
        healed = await rejoin(lane.handle, lane.replica, (first - 1) // per_round, self.first_version())
        missing = sorted(set(range(healed + 1, first)) - trained)
        lost = [url for url, step in lane.unreported.items() if step < healed]
        if missing or lost:
            raise RestartsExhausted(
                f"trainer replica {lane.replica} rejoined at step {healed} but cannot stand where it died: "
                + (f"steps {missing[0]}..{missing[-1]} are no longer kept to replay" if missing
                   else f"its unfinished state write {lost[0]} cannot be redone"))
        replays, resent = [], 0
        for call in lane.calls:  # no await in this loop: nothing can be sent between these, in the lane's order
            if not call.answered:
                lane.send(call)
                resent += 1
            elif (call.endpoint == "train_step" and call.step > healed) or (
                    call.endpoint == "save_state" and call.step >= healed and call.args[0] in lane.unreported):
                again = _Call(call.endpoint, call.args, call.step)
                lane.send(again)
                replays.append(again.future)
        lane.replacing = False
        await asyncio.gather(*replays)  # the replica's lost steps, trained again ahead of its pending calls
        self.recovery.replaced(event, reissued=len(replays) + resent)
        lane.event = event
        log.warning("trainer replica %d: stand-in rejoined at step %d; %d call(s) replayed, %d pending sent again",
                    lane.replica, healed, len(replays), resent)
