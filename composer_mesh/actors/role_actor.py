"""What every role actor shares: the `ready` endpoint the launcher waits for, and the guard on the plain
service object that its `setup` endpoint builds (endpoints delegate to it)."""

from __future__ import annotations

import os
import socket
from typing import Generic, TypeVar

from monarch.actor import Actor, endpoint

S = TypeVar("S")


class RoleActor(Actor, Generic[S]):
    """Base of the role actors. Models are built in `setup`, not `__init__`: an exception in an endpoint
    reaches the caller as an `ActorError`, while one in `__init__` takes the proc mesh down."""

    def __init__(self) -> None:
        self._service: S | None = None

    @endpoint
    async def ready(self) -> bool:
        """Answered once `__init__` succeeded: the launcher waits for it on every actor."""
        return True

    @endpoint
    async def process(self) -> dict[str, int | str]:
        """Where this actor runs (pid, host): for operators and for tests that kill a proc."""
        return {"pid": os.getpid(), "host": socket.gethostname()}

    @property
    def service(self) -> S:
        """The plain object the endpoints delegate to; set by `setup`."""
        if self._service is None:
            raise RuntimeError(f"{type(self).__name__}.setup() was not called")
        return self._service
