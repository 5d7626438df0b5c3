"""The coding environment's sandbox checked before launch: bubblewrap runs here, every path the sandbox section
names is visible in it, and its interpreter starts (`sandbox.run.check_available`: `python -c pass` once in the
configured sandbox, a fraction of a second).

Why here: the environment runs in the controller's process, on this host, and a sandbox that cannot run
otherwise stops the run only once the meshes are up and the environment is built.
"""

from __future__ import annotations

from composer_mesh.envs.coding.config import CodingConfig
from composer_mesh.topology.schema import Topology


def check_sandbox(topology: Topology) -> str | None:
    """Raise `SandboxUnavailable` (one line naming the field and the fix) when the run's sandbox cannot run here;
    what was checked, in a few words, or None when the run has no sandbox."""
    environment = topology.run.environment
    if not isinstance(environment, CodingConfig):
        return None
    from composer_mesh.sandbox.run import check_available

    sandbox = environment.sandbox
    check_available(sandbox)
    return f"sandbox: {sandbox.mode} runs {sandbox.python or 'the base interpreter'} here"
