"""What the rewarder bindings' tests share: one Monarch proc to spawn a real rewarder actor on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def rewarder_procs() -> Iterator[object]:
    """One Monarch proc, like a rewarder mesh's; a fault fails the test instead of exiting pytest."""
    import monarch.actor
    from monarch.actor import this_host

    from composer_mesh.mesh import runtime

    faults: list[object] = []
    previous_hook = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="rewarder", bootstrap=runtime.proc_setup)
    yield procs
    procs.stop().get()
    monarch.actor.unhandled_fault_hook = previous_hook
    assert faults == []
