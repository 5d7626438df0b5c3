"""A user error raised inside an actor (a bad data row, a prompt the tokenizer cannot read, a missing API key)
reaches the console as its one line, through a real Monarch actor: `UserInputError` survives the trip (whatever
its subclass's `__init__` takes) and `failure_of` finds it in the `ActorError`. Any other exception from an actor
is still reported as a bug with its traceback."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from composer_mesh.cli import EXIT_BUG, EXIT_INVALID, EXIT_RUN_FAILED, failure_of, report_failure
from composer_mesh.errors import UserInputError
from composer_mesh.models.tokenizer import UnencodableTextError
from composer_mesh.tasks.data import DataRowError
from tests.app.failing_actor import Failing


@pytest.fixture(scope="module")
def actor() -> Any:
    import monarch.actor
    from monarch.actor import this_host

    faults: list[Any] = []
    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="user_errors")
    yield procs.spawn("failing", Failing)
    procs.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook
    assert faults == []


@pytest.mark.parametrize(("kind", "expected"), [
    ("row", "data/train.jsonl, row 7, field 'prompt': expected non-empty text"),
    ("prompt", "the tokenizer cannot represent 'What is 1 plus 1?'"),
    ("key", "environment variable COMPOSER_MESH_TEST_NO_SUCH_KEY is not set or empty"),
])
def test_a_user_error_in_an_actor_is_one_line(actor: Any, kind: str, expected: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from monarch.actor import ActorError

    with pytest.raises(ActorError) as info:
        actor.fail.call_one(kind).get()
    assert isinstance(info.value.exception, UserInputError)
    wrapped = RuntimeError("the loop's task failed")
    wrapped.__cause__ = info.value  # as the loop re-raises it
    for error in (info.value, wrapped):
        code, message = failure_of(error) or (None, "")
        assert code == EXIT_RUN_FAILED and message.startswith("composer-mesh: run failed: ") and expected in message
        assert "\n" not in message and "Traceback" not in message
    assert report_failure(info.value) == EXIT_RUN_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bug" not in err


def test_any_other_actor_error_is_still_a_bug(actor: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from monarch.actor import ActorError

    with pytest.raises(ActorError) as info:
        actor.fail.call_one("bug").get()
    assert failure_of(info.value) is None
    assert report_failure(info.value) == EXIT_BUG
    assert "it is a bug" in capsys.readouterr().err


def test_user_errors_before_launch_exit_1_and_survive_pickling() -> None:
    error = DataRowError("rows.jsonl", 3, "answer", "expected text or a number, got list []")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is DataRowError and str(copy) == str(error) and copy.row == 3
    assert failure_of(error) == (EXIT_INVALID, f"composer-mesh: {error}")
    assert issubclass(UnencodableTextError, ValueError)  # callers catching ValueError still do
