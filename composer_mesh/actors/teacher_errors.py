"""How a teacher fails: expected failures (outside our control) versus bugs, and what `on_failure: stop` raises.

A binding raises `TeacherUnavailable` (or a subclass) for a failure that is not a programming error: an HTTP
error or rate limit that outlived its retries, a timeout, a malformed response, a CUDA out-of-memory, a dead
inference engine. The pool then applies the member's `on_failure`: `skip` turns that member's channel off for
the request (counted, warned), `stop` raises `TeacherFailed`. Any other exception is a bug and always
propagates, so a broken binding stops the run instead of quietly turning it into GRPO only.

Import-cheap (no torch, no Monarch): bindings, the pool and scripts import these. Messages must never hold a
secret (API keys): bindings build them from already-redacted text.
"""

from __future__ import annotations


class TeacherUnavailable(Exception):
    """A teacher could not give its signals for this request, for a reason outside our code (bindings raise it
    `from` their own error, with the teacher's name in the message)."""


class TeacherFailed(RuntimeError):
    """A teacher with `on_failure: stop` was unavailable: the run stops, naming the teacher, channel and cause.

    `teacher` and `channel` are keyword arguments with defaults so the error pickles (Monarch sends it to the
    controller) and comes back with its fields."""

    def __init__(self, message: str, *, teacher: str = "", channel: str = "") -> None:
        super().__init__(message)
        self.teacher = teacher
        self.channel = channel
