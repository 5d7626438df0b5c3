"""composer-mesh: RL post-training of language models on Monarch actor meshes.

Submodules are imported on demand: `composer_mesh.loss` is pure torch, `composer_mesh.mesh` holds the
topology, launcher and data planes, `composer_mesh.actors` the typed actors and their backends.
"""

__version__ = "0.1.0"
