"""Teacher failures (issue 14): an unavailable teacher is skipped or stops the run per its `on_failure`; a bug in
a binding always stops it. The real `TeacherPool` with scripted bindings (no Monarch), the local teachers'
mapping of out-of-memory and engine death, the topology field, and one pass through a real actor mesh.
"""

from __future__ import annotations

import logging
import pickle
import sys
from typing import Any

import pytest
import torch

from composer_mesh.actors.messages import Prompt, Rollout, TeacherRequest
from composer_mesh.actors.teacher_errors import TeacherFailed, TeacherUnavailable
from composer_mesh.actors.teacher_pool import WARN_EVERY, PoolMember, TeacherPool
from tests.actors.teacher_pool.scripted_teachers import ScriptedSettings, ScriptedTeacher

SCRIPTED = "tests.actors.teacher_pool.scripted_teachers:ScriptedTeacher"
BOTH = frozenset({"distill", "replay"})


def member(name: str, on_failure: str = "skip", channels: frozenset[str] = BOTH, **settings: Any) -> PoolMember:
    return PoolMember(name, channels, ScriptedTeacher(ScriptedSettings(**settings)), on_failure)  # type: ignore[arg-type]


def pool(*members: PoolMember) -> TeacherPool:
    p = TeacherPool(list(members))
    p.start(None)
    return p


def request(rollouts: int = 4, prompts: int = 2) -> TeacherRequest:
    rs = [Rollout(f"p{i}", [1, 2], [3, 4, 5], [-1.0] * 3, weight_version=1) for i in range(rollouts)]
    ps = [Prompt(f"p{i}", "3+4=", [3, 10, 4, 11]) for i in range(prompts)]
    return TeacherRequest(rollouts=rs, prompts=ps, top_k=0, max_new_tokens=4)


def warnings_about(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and f"teacher {name!r}" in r.getMessage()]


# ------------------------------------------------------------------------------------------ skip
async def test_skip_leaves_out_only_the_unavailable_teacher_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    p = pool(member("good"), member("down", fail="unavailable"))
    with caplog.at_level(logging.DEBUG, logger="composer_mesh"):
        signals = await p.signals(request())
    # Rollouts go round-robin (good: 0, 2; down: 1, 3): the down teacher's rows are None, the good one's intact.
    assert [d is not None and d.teacher for d in signals.distributions] == ["good", False, "good", False]
    assert [(t.teacher, t.prompt_id) for t in signals.traces] == [("good", "p0"), ("good", "p1")]
    u = signals.usage
    assert u["down/failures"] == 2 and u["down/consecutive_failures"] == 2  # one per channel
    assert u["down/skipped_rollouts"] == 2 and u["down/skipped_prompts"] == 2
    assert u["good/failures"] == 0 and u["good/skipped_rollouts"] == 0 and u["good/calls"] == 2
    assert "HTTP 503" in p.last_errors["down"] and "good" not in p.last_errors
    [warning] = warnings_about(caplog, "down")  # the first failure is warned at once, with its cause
    assert "on_failure: skip" in warning and "HTTP 503" in warning


async def test_a_teacher_failing_repeatedly_is_warned_the_first_time_and_every_nth(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = pool(member("good"), member("down", fail="unavailable", channels=frozenset({"distill"})))
    with caplog.at_level(logging.DEBUG, logger="composer_mesh"):
        for _ in range(2 * WARN_EVERY):
            signals = await p.signals(request())
    assert signals.usage["down/failures"] == 2 * WARN_EVERY
    assert signals.usage["down/skipped_rollouts"] == 2 * 2 * WARN_EVERY
    warned = warnings_about(caplog, "down")
    assert len(warned) == 3  # failures 1, WARN_EVERY and 2 * WARN_EVERY
    assert f"{2 * WARN_EVERY} failure(s) so far, {2 * WARN_EVERY} in a row" in warned[-1]


async def test_a_teacher_that_recovers_is_used_again() -> None:
    p = pool(member("flaky", fail="unavailable", fail_calls=2))
    first = await p.signals(request())
    assert first.distributions == [None] * 4 and first.traces == []
    second = await p.signals(request())
    assert all(d is not None for d in second.distributions) and len(second.traces) == 2
    assert second.usage["flaky/failures"] == 2 and second.usage["flaky/consecutive_failures"] == 0


# ------------------------------------------------------------------------------------------ stop
async def test_stop_raises_naming_the_teacher_channel_and_cause() -> None:
    good = member("good")
    p = pool(good, member("down", "stop", channels=frozenset({"distill"}), fail="unavailable"))
    with pytest.raises(TeacherFailed) as info:
        await p.signals(request())
    err = info.value
    assert err.teacher == "down" and err.channel == "distill"
    assert "teacher 'down'" in str(err) and "channel-2 distributions" in str(err) and "on_failure: stop" in str(err)
    assert "HTTP 503" in str(err) and isinstance(err.__cause__, TeacherUnavailable)
    assert good.backend.calls == 2  # every call finished before the pool raised (none left running)
    back = pickle.loads(pickle.dumps(err))  # Monarch pickles it to the controller
    assert (type(back), str(back), back.teacher, back.channel) == (TeacherFailed, str(err), "down", "distill")


async def test_stop_only_when_the_teacher_fails() -> None:
    p = pool(member("a", "stop"), member("b", "stop"))
    signals = await p.signals(request())
    assert all(d is not None for d in signals.distributions) and len(signals.traces) == 4


# ------------------------------------------------------------------------------------------ bugs
@pytest.mark.parametrize("on_failure", ["skip", "stop"])
async def test_a_bug_in_a_binding_propagates_whatever_on_failure_says(on_failure: str) -> None:
    good = member("good")
    p = pool(good, member("buggy", on_failure, fail="bug"))
    with pytest.raises(TypeError, match="scripted bug") as info:
        await p.signals(request())
    if sys.version_info >= (3, 11):
        assert any("teacher 'buggy'" in n for n in info.value.__notes__)
    assert p.counters["buggy"]["failures"] == 0  # a bug is not an expected failure
    assert good.backend.calls == 2


def test_on_failure_is_checked_by_the_plain_pool_too() -> None:
    with pytest.raises(ValueError, match="on_failure must be 'skip' or 'stop'"):
        TeacherPool([member("a", "retry")])


# ------------------------------------------------------------------------------------------ local teachers
def _local_teacher(error: Exception, binding: str = "hf") -> Any:
    """An hf (or vllm) teacher whose model computation raises `error`; no model is loaded."""
    if binding == "hf":
        from composer_mesh.actors.backends.teachers.hf_teacher import HFTeacher as Base
    else:
        from composer_mesh.actors.backends.teachers.vllm_teacher import VLLMTeacher as Base

    class Broken(Base):  # type: ignore[misc, valid-type]
        def _require_started(self) -> Any:
            return object()

        def _compute_distributions(self, rollouts: list[Rollout], top_k: int) -> Any:
            raise error

    t = Broken()
    t.name, t._vocab, t.student_vocab = "local", 16, 16
    return t


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), TeacherUnavailable),
        (TypeError("unsupported operand"), TypeError),
        (ValueError("bad shape"), ValueError),
    ],
)
async def test_hf_teacher_maps_out_of_memory_and_nothing_else(error: Exception, expected: type) -> None:
    t = _local_teacher(error)
    with pytest.raises(expected) as info:
        await t.distributions(request().rollouts, top_k=0)
    if expected is TeacherUnavailable:
        assert "teacher 'local' (binding hf): out of memory" in str(info.value) and info.value.__cause__ is error
    else:
        assert info.value is error  # a bug propagates unchanged
    assert t.usage()["failures"] == 1


@pytest.mark.vllm
async def test_vllm_teacher_maps_engine_death() -> None:
    from services import require_module

    require_module("vllm")
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    for error, reason in [(EngineDeadError(), "engine died"), (EngineGenerateError("x"), "engine failed")]:
        t = _local_teacher(error, "vllm")
        with pytest.raises(TeacherUnavailable, match=f"binding vllm\\): the vLLM {reason}"):
            await t.distributions(request().rollouts, top_k=0)
    with pytest.raises(KeyError):
        await _local_teacher(KeyError("bug"), "vllm").distributions(request().rollouts, top_k=0)


# ------------------------------------------------------------------------------------------ topology
TOPOLOGY = """\
name: failures
meshes:
  cpu: {backend: local}
roles:
  trainer: {mesh: cpu, binding: hf}
  generators: {mesh: cpu, binding: hf}
  rewarder: {mesh: cpu, binding: python, settings: {functions: [{path: "composer_mesh.tasks.arithmetic:exact_match"}]}}
  teachers:
    mesh: cpu
    members:
      - {name: a, binding: "SCRIPTED", channels: [distill, replay]}
      - {name: b, binding: "SCRIPTED", channels: [replay], on_failure: ON_FAILURE}
"""


def test_on_failure_defaults_to_skip_and_reaches_the_member_config() -> None:
    from composer_mesh.topology import parse_topology

    topo = parse_topology(TOPOLOGY.replace("SCRIPTED", SCRIPTED).replace("ON_FAILURE", "stop"))
    a, b = topo.role_configs()["teachers"].members  # type: ignore[attr-defined]
    assert (a.name, a.on_failure) == ("a", "skip") and (b.name, b.on_failure) == ("b", "stop")


def test_a_wrong_on_failure_is_a_clear_error_with_its_line() -> None:
    from composer_mesh.topology import TopologyError, parse_topology

    with pytest.raises(TopologyError) as info:
        parse_topology(TOPOLOGY.replace("SCRIPTED", SCRIPTED).replace("ON_FAILURE", "retry"), source="t.yaml")
    text = str(info.value)
    assert "t.yaml:12:" in text and "roles.teachers.members[1].on_failure" in text
    assert "'skip'" in text and "'stop'" in text


# ------------------------------------------------------------------------------------------ actor mesh
@pytest.fixture(scope="module")
def procs() -> Any:
    import monarch.actor
    from monarch.actor import this_host

    faults: list[Any] = []
    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append  # a fault fails the test instead of exiting pytest
    mesh = this_host().spawn_procs(per_host={"procs": 1}, name="teacher_failures")
    yield mesh
    mesh.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook
    assert faults == []


def _actor(procs: Any, name: str, *members: tuple[str, str, str]) -> Any:
    """A TeacherPoolActor on `procs` over scripted members (name, on_failure, fail), set up."""
    from composer_mesh.actors.configs import TeacherMemberConfig, TeachersConfig
    from composer_mesh.actors.teachers import TeacherPoolActor
    from composer_mesh.bindings import BoundBinding
    from composer_mesh.models.config import ModelConfig

    config = TeachersConfig(
        role="teachers", mesh="teachers", student=ModelConfig(),
        members=tuple(
            TeacherMemberConfig(n, ("distill", "replay"), BoundBinding(SCRIPTED, SCRIPTED, ScriptedSettings(fail=f)), o)
            for n, o, f in members
        ),
    )
    actor = procs.spawn(name, TeacherPoolActor, config)
    assert actor.setup.call_one().get() == [n for n, _, _ in members]
    return actor


def test_through_a_real_actor_mesh(procs: Any) -> None:
    """What the controller sees: a skipped teacher's counters in the answer; `TeacherFailed` and a binding's bug
    as endpoint errors carrying the remote exception (the loop's task fails with it and the run stops)."""
    from monarch.actor import ActorError

    skip = _actor(procs, "skip", ("good", "skip", "never"), ("down", "skip", "unavailable"))
    signals = skip.signals.call_one(request()).get()
    assert [d is not None for d in signals.distributions] == [True, False, True, False]
    assert {t.teacher for t in signals.traces} == {"good"} and signals.usage["down/failures"] == 2

    stop = _actor(procs, "stop", ("good", "skip", "never"), ("down", "stop", "unavailable"))
    with pytest.raises(ActorError) as info:
        stop.signals.call_one(request()).get()
    assert isinstance(info.value.exception, TeacherFailed) and info.value.exception.teacher == "down"
    assert "HTTP 503" in str(info.value.exception)

    bug = _actor(procs, "bug", ("buggy", "skip", "bug"))
    with pytest.raises(ActorError) as info:
        bug.signals.call_one(request()).get()
    assert isinstance(info.value.exception, TypeError)
    assert skip.usage.call_one().get()["down/failures"] == 2  # the actors keep serving after an endpoint error
