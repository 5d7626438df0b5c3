"""composer-mesh: RL post-training of language models on Monarch actor meshes.

Submodules are imported on demand: `composer_mesh.loss` is pure torch, `composer_mesh.mesh` holds the
topology, launcher and data planes, `composer_mesh.actors` the typed actors and their backends.
"""

# Monarch reads its supervision settings once, at import: set our defaults now, whatever the user's
# import order (this module does not import monarch itself).
from composer_mesh.mesh import runtime as _runtime  # noqa: F401

__version__ = "0.1.0"
