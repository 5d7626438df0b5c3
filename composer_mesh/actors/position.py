"""Where an actor sits in its whole mesh, independent of the slice a message came through."""

from __future__ import annotations

from monarch.actor import context


def actor_position() -> tuple[int, int]:
    """(rank, size) of this actor in its whole actor mesh.

    `current_rank()`/`current_size()` describe the *message's* slice: a call through
    `mesh.slice(procs=1)` sees rank 0 of size 1. Placement decisions need the actor's own position.
    """
    point = context().actor_instance.rank
    extent = point.extent
    size = 1
    for label in extent:
        size *= extent[label]
    return point.rank, size
