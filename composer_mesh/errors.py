"""`UserInputError`: the base of every error that a user's input causes (a topology field, a data file, an
environment variable, a prompt) as opposed to a bug.

Why a module of its own at the bottom of the layers: such errors are raised in every layer (data rows in
`tasks`, prompts in `models`, API keys in `actors`, checks in `app`), often inside an actor, and the command line
must tell them from bugs wherever they arrive from: directly before launch, or wrapped in Monarch's `ActorError`
after crossing a process boundary. One base class lets `composer_mesh.cli.failure_of` print such an error as its
one line (no traceback, no "it is a bug"), without knowing every layer's exception types.

A `UserInputError` survives pickling whatever its subclass's `__init__` takes (Monarch pickles an endpoint's
exception to send it to the caller; an exception whose `__init__` needs more than its message would otherwise
fail to unpickle and arrive as another error).

`FieldError` is the `ValueError` a config's validator raises about one of its fields when the check spans
several (a model validator): pydantic locates it at the model, and the topology's error rendering takes it down
to the field it names, so the message lands on that field's own line of the file. (A plain `ValueError`
subclass, so that this module stays free of pydantic; `mesh/spec.py` raises a nested `ValidationError` instead
where pydantic's own error location must name the field.)
"""

from __future__ import annotations

from typing import Any


class UserInputError(Exception):
    """An error caused by the user's input: its message names what is wrong, where, and the fix, in one line."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[UserInputError], args: tuple[Any, ...], state: dict[str, Any]) -> UserInputError:
    """The unpickled copy of a `UserInputError`: its class, `args` and attributes, without calling `__init__`."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class FieldError(ValueError):
    """A config validator's error about the field at `loc`, e.g. `FieldError("max_digits", "min_digits 5 >
    max_digits 3")` from a model validator: reported on that field's line of a topology. `loc` is relative to
    where pydantic puts the validator's error: the model for a model validator, the field for a field
    validator (a key inside a dict field, say)."""

    def __init__(self, loc: str | tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc: tuple[str | int, ...] = (loc,) if isinstance(loc, str) else tuple(loc)

    def __reduce__(self) -> tuple[Any, ...]:
        return FieldError, (self.loc, str(self))


def user_error_of(exc: BaseException) -> tuple[BaseException, bool] | None:
    """The `UserInputError` that `exc` is or carries (through Monarch's `ActorError.exception`, explicit causes
    and exception groups), and whether it was raised inside an actor (after launch); None if there is none.
    Implicit contexts are not followed: a bug raised while handling a user error is still a bug."""
    seen: set[int] = set()
    todo: list[tuple[BaseException, bool]] = [(exc, False)]
    while todo:
        error, remote = todo.pop(0)
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, UserInputError):
            return error, remote
        inner = getattr(error, "exception", None)  # monarch.actor.ActorError: the endpoint's own exception
        if isinstance(inner, BaseException):
            todo.append((inner, True))
        if error.__cause__ is not None:
            todo.append((error.__cause__, remote))
        todo += [(e, remote) for e in getattr(error, "exceptions", ()) if isinstance(e, BaseException)]
    return None
