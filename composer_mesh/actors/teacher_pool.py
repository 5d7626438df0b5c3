"""A pool of teachers of mixed bindings behind one request: channel-2 distributions and channel-3 traces.

Distill teachers share the student's tokenizer; rollouts are spread over them round-robin (one teacher per
rollout). Every replay teacher gives one trace per prompt (N-teacher trace replay), or only those a request
names (`TeacherRequest.teachers`: a teacher playing an episode is asked for its own turns). Teachers are queried
concurrently, and every call finishes before the pool answers or raises (no orphaned request keeps spending).

Failures (`composer_mesh.actors.teacher_errors`): a binding raises `TeacherUnavailable` for what is outside
our control; the member's `on_failure` then decides: `skip` leaves its signals out of this answer (counted in
`<teacher>/failures`, warned the first time and every `WARN_EVERY` failures), `stop` raises `TeacherFailed`.
Any other exception is a bug and propagates whatever `on_failure` says.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from composer_mesh.actors.backends.teachers.base import TeacherBackend
from composer_mesh.actors.configs import OnFailure
from composer_mesh.actors.messages import TeacherRequest, TeacherSignals, TeacherTrace, TokenDistribution
from composer_mesh.actors.teacher_errors import TeacherFailed, TeacherUnavailable

log = logging.getLogger(__name__)

WARN_EVERY = 10  # a skipped teacher is warned about on its 1st failure and every WARN_EVERY-th after
CHANNEL_NAMES = {"distill": "channel-2 distributions", "replay": "channel-3 traces", "hint": "targeted-feedback hints"}
# The pool's own counters, per teacher (they replace a binding's counter of the same name in `usage`).
COUNTERS = ("failures", "consecutive_failures", "skipped_rollouts", "skipped_prompts")


@dataclass
class PoolMember:
    name: str
    channels: frozenset[str]
    backend: TeacherBackend
    on_failure: OnFailure = "skip"


@dataclass
class TeacherPool:
    members: list[PoolMember]
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    last_errors: dict[str, str] = field(default_factory=dict)  # teacher -> its latest failure, for scripts

    def __post_init__(self) -> None:
        names = [m.name for m in self.members]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        for m in self.members:
            needed = {"replay" if c == "hint" else c for c in m.channels}  # a hint is text, as a replay trace
            missing = needed - frozenset(getattr(m.backend, "capabilities", frozenset()))
            if missing:
                raise ValueError(f"teacher {m.name!r} is asked for channels {sorted(missing)} its binding cannot supply")
            if m.on_failure not in ("skip", "stop"):
                raise ValueError(f"teacher {m.name!r}: on_failure must be 'skip' or 'stop', got {m.on_failure!r}")
            self.counters.setdefault(m.name, dict.fromkeys(COUNTERS, 0))

    @property
    def distill(self) -> list[PoolMember]:
        return [m for m in self.members if "distill" in m.channels]

    @property
    def replay(self) -> list[PoolMember]:
        return [m for m in self.members if "replay" in m.channels]

    def start(self, student_model: Any) -> None:
        """Start every member; a `distill` member whose tokenizer is not the student's fails here, at setup
        (its `check_distill`), instead of failing every later call while the run goes on without channel 2."""
        for m in self.members:
            m.backend.start(student_model, m.name)
            check = getattr(m.backend, "check_distill", None)
            if "distill" in m.channels and check is not None:
                check()

    async def signals(self, request: TeacherRequest) -> TeacherSignals:
        """Every member's signals for `request`; a skipped member's are absent (its rollouts get None).

        All calls finish before anything is raised; the first error in member order (distill, then replay)
        is raised: `TeacherFailed` for a `stop` member that was unavailable, or a binding's bug as it is."""
        rollouts, prompts = request.rollouts, request.prompts
        distill = [(m, rows) for m, rows in self._assign(len(rollouts)) if rows]
        replay = self._replay_for(request)
        seeds = {} if request.seeds is None else {"seeds": list(request.seeds)}  # bindings before seeds still work
        calls = [
            self._ask(m, "distill", len(rows), functools.partial(
                m.backend.distributions, [rollouts[i] for i in rows], request.top_k))
            for m, rows in distill
        ]
        calls += [
            self._ask(m, "replay" if "replay" in m.channels else "hint", len(prompts), functools.partial(
                m.backend.traces, prompts, request.max_new_tokens, seed=request.seed, **seeds))
            for m in replay
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        dists: list[TokenDistribution | None] = [None] * len(rollouts)
        for (m, rows), got in zip(distill, results):
            if got is None:
                continue
            if len(got) != len(rows):
                raise RuntimeError(f"teacher {m.name!r} gave {len(got)} distributions for {len(rows)} rollouts")
            for i, d in zip(rows, got):
                dists[i] = d
        traces: list[TeacherTrace] = [t for got in results[len(distill):] for t in (got or [])]
        return TeacherSignals(distributions=dists, traces=traces, usage=self.usage())

    def usage(self) -> dict[str, float]:
        """Per-teacher counters, flattened as `<teacher>/<counter>` for the run's metrics: the binding's own,
        then the pool's (`COUNTERS`: expected failures, the current run of them, what was skipped)."""
        out: dict[str, float] = {}
        for m in self.members:
            for k, v in m.backend.usage().items():
                out[f"{m.name}/{k}"] = float(v)
            for k, n in self.counters[m.name].items():
                out[f"{m.name}/{k}"] = float(n)
        return out

    # -- internals ----------------------------------------------------------------------------------------
    def _replay_for(self, request: TeacherRequest) -> list[PoolMember]:
        """The members that answer `request`'s prompts: every replay member, or those `request.teachers` names
        (a name this proc does not host is another proc's: the procs of a pool share each request). A `hint`
        member writes text only when named (targeted feedback's hint writer), never a replay trace."""
        if not request.prompts:
            return []
        if request.seeds is not None and len(request.seeds) != len(request.prompts):
            raise ValueError(f"TeacherRequest.seeds has {len(request.seeds)} seeds for {len(request.prompts)} prompts")
        if request.teachers is None:
            return self.replay
        names = set(request.teachers)
        return [m for m in self.members if m.name in names and {"replay", "hint"} & m.channels]

    def _assign(self, n: int) -> list[tuple[PoolMember, list[int]]]:
        """Rollout indices per distill teacher, round-robin."""
        teachers = self.distill
        return [(m, list(range(i, n, len(teachers)))) for i, m in enumerate(teachers)]

    async def _ask(
        self, member: PoolMember, channel: str, size: int, call: Callable[[], Awaitable[list[Any]]]
    ) -> list[Any] | None:
        """`call()`'s result, or None when the member is unavailable and skipped. Raises `TeacherFailed` for an
        unavailable `stop` member, and a bug (any other exception) as it is, with the teacher named in a note."""
        try:
            got = await call()
        except TeacherUnavailable as e:
            self._unavailable(member, channel, size, e)
            return None
        except Exception as e:
            add_note = getattr(e, "add_note", None)  # Python 3.11+: shown in the traceback the controller gets
            if add_note is not None:
                add_note(f"raised by teacher {member.name!r} giving {CHANNEL_NAMES[channel]}: a bug in a binding "
                         "stops the run whatever its on_failure says")
            raise
        self.counters[member.name]["consecutive_failures"] = 0
        return list(got)

    def _unavailable(self, member: PoolMember, channel: str, size: int, error: TeacherUnavailable) -> None:
        """Count an expected failure; raise `TeacherFailed` (stop) or warn now and then (skip)."""
        c = self.counters[member.name]
        c["failures"] += 1
        c["consecutive_failures"] += 1
        what = CHANNEL_NAMES[channel]
        cause = f"{type(error).__name__}: {error}"
        self.last_errors[member.name] = cause
        if member.on_failure == "stop":
            raise TeacherFailed(
                f"teacher {member.name!r} could not give {what} (on_failure: stop, so the run stops): {cause}",
                teacher=member.name, channel=channel,
            ) from error
        c["skipped_rollouts" if channel == "distill" else "skipped_prompts"] += size
        n = c["failures"]
        level = logging.WARNING if n == 1 or n % WARN_EVERY == 0 else logging.DEBUG
        log.log(
            level, "teacher %r could not give %s for %d %s (on_failure: skip, so its channel is off for this "
            "request); %d failure(s) so far, %d in a row: %s",
            member.name, what, size, "rollouts" if channel == "distill" else "prompts", n,
            c["consecutive_failures"], cause,
        )
