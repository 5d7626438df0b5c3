"""Orchestration: the built-in RL loop over launched role actors, its `run:` config, metrics and plots.

It knows roles and messages, never a topology file: the loop is handed its `RunConfig`, the loss switches
it needs and the launched role handles.
"""
