"""Process bookkeeping for the launch tests (reads /proc; no extra dependency)."""

from __future__ import annotations

import os
import time


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])  # state, ppid


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X", "x")


def descendants(root: int | None = None) -> set[int]:
    """Live (non-zombie) descendants of `root` (default: this process)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None and st[0] not in ("Z", "X", "x"):
            children.setdefault(st[1], []).append(int(entry))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def wait_gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    """Wait (bounded) for `pids` to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left


def new_descendants_after_exit(before: set[int], timeout: float = 30.0) -> set[int]:
    """Descendants that appeared since `before` and are still alive after a bounded wait."""
    return wait_gone(descendants() - before, timeout)
