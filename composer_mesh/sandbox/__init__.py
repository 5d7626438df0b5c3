"""Run untrusted code (a policy's tool calls) in a sandbox: bubblewrap namespaces plus rlimits, a wall timeout
that kills the whole process tree, capped output, and a pool with a concurrency limit. See docs/sandbox.md.

`config` is import-cheap (pydantic only); `run` runs one command, `pool` gives an episode its private work dir.
"""
