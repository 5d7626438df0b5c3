"""Orchestration: the built-in RL loop over launched role actors, its `run:` config, metrics and plots.

It knows roles and messages, never a topology file: the loop is handed its `RunConfig`, the loss switches
it needs and the launched role handles. `loop.RLLoop` wires components, one file each (`rollout/`, scoring,
pipeline, commits, evaluation, recorder, spares, resume), which reach the roles only through the protocols of
`ports.py` (implemented over the launched meshes by `mesh_ports.py`).
"""
