"""Worker processes that run Python reward functions, each call with a timeout.

A Python function cannot be stopped inside the process that runs it, so the rewarder runs every call in a
worker process: a call past its timeout has its worker killed (with anything the worker started) and a
fresh one takes its place, and a worker that dies (`os._exit`, a signal, the OOM killer) fails only the
call it was running. Calls are never retried: a failed call is the caller's scored failure.

A worker is a fresh interpreter (`python -m composer_mesh.actors.backends.rewards.reward_pool`), never a `fork`:
the rewarder's process runs threads (Monarch's and ours), and forking a threaded process can hand the child
a lock some other thread held. Unlike multiprocessing's `spawn` and `forkserver`, it does not re-run the
parent's `__main__`. Calls and answers cross its stdin/stdout as JSON lines; a function's prints go to stderr.

A call is one of two kinds (`config.reward_style`): a per-rollout call `fn(prompt, completion, answer)` answered
by one number or None, or a batched call with TRL's keyword arguments answered by a list of them, one per
completion. The worker checks what came back, so a wrong return is that call's failure, naming what it was.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import numbers
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from composer_mesh.bindings import import_object

# A new worker imports the reward functions before its first call; that is not part of any call's timeout.
START_TIMEOUT_S = 120.0
MAX_ERROR_CHARS = 300


class CallFailed(Exception):
    """A call that gave no number: it raised, timed out, or its worker died. The message says which."""


Score = float | None  # None: the function gave no score for this rollout ("not mine", as TRL's None)


@dataclass
class _Call:
    path: str
    args: tuple[str, str, str | None]  # per rollout: (prompt, completion, answer)
    timeout_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # the prompt's extra data columns (`run.data.extra`)
    batch: dict[str, Any] | None = None  # batched: TRL's keyword arguments, each a list with one entry per rollout
    future: Future[Any] = field(default_factory=Future)  # a `Score`, or a list of them for a batched call

    def request(self) -> dict[str, Any]:
        if self.batch is not None:
            return {"path": self.path, "batch": self.batch}
        return {"path": self.path, "args": self.args, "extra": self.extra}


class _Worker:
    """One worker process with its pipes, and a lifeline: the worker exits when the lifeline closes, so it
    never outlives the pool's process, even when that process is SIGKILLed in the middle of a call."""

    def __init__(self, paths: list[str]) -> None:
        lifeline, self._lifeline = os.pipe()
        # The parent's import path, so a function it can import, the worker can too (as `spawn` does).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(lifeline), json.dumps(paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(lifeline,),
            start_new_session=True,  # its own process group: a kill reaches whatever the function started
            env=env,
        )
        os.close(lifeline)
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in, self._out = self.process.stdin, self.process.stdout
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._out, selectors.EVENT_READ)
        self._buffer = b""
        self._reap_lock = threading.Lock()  # no signal to the pid once reaped: the number may be reused
        self.pid = self.process.pid
        self.alive = True

    def wait_ready(self) -> None:
        """Wait for the worker's imports; raises `CallFailed` if it cannot take calls."""
        answer = self._answer(START_TIMEOUT_S, timeout_error=f"its worker did not start in {START_TIMEOUT_S:g}s")
        if "error" in answer:
            self.stop()
            raise CallFailed(f"its worker could not start: {answer['error']}")

    def call(self, call: _Call) -> Any:
        """Run `call`: its `Score` (a list of them for a batched call); raises `CallFailed` for an exception, a
        wrong return, a timeout or a dead worker."""
        try:
            self._in.write(json.dumps(call.request()).encode() + b"\n")
            self._in.flush()
        except OSError:
            raise CallFailed(self._died()) from None
        answer = self._answer(call.timeout_s, timeout_error=f"timed out after {call.timeout_s:g}s")
        if "error" in answer:
            raise CallFailed(answer["error"])
        return answer["value"]

    def _answer(self, timeout_s: float, timeout_error: str) -> dict[str, Any]:
        """The worker's next answer line, read within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                self.stop()
                if self.process.returncode != -signal.SIGKILL:  # it had died, and what it started held the pipe
                    raise CallFailed(_crashed(self.process.returncode))
                raise CallFailed(timeout_error)
            chunk = os.read(self._out.fileno(), 65536)
            if not chunk:
                raise CallFailed(self._died())
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _died(self) -> str:
        self.stop()  # the group is killed before the reap: the exit status stays the worker's own
        return _crashed(self.process.returncode)

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and whatever it started). Safe from any thread."""
        with self._reap_lock:
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
                    os.killpg(self.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Kill, reap and close the pipes. Only the thread that owns this worker calls it."""
        if not self.alive:
            return
        self.alive = False
        self.kill()
        with self._reap_lock:
            self.process.wait()
        self._selector.close()
        with contextlib.suppress(OSError):  # flushing into a dead worker's stdin
            self._in.close()
        self._out.close()
        os.close(self._lifeline)


def _crashed(code: int) -> str:
    if code >= 0:
        return f"crashed: its worker exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    return f"crashed: its worker was killed by signal {name}"


class FunctionPool:
    """`workers` worker processes, each owned by one thread that feeds it calls from a shared queue.

    Workers start on first use and after each one lost to a timeout or crash. `submit` may be called from
    any thread; every future it returns completes (a float, or `CallFailed`).
    """

    def __init__(self, paths: list[str], workers: int) -> None:
        self._paths = sorted(set(paths))
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._live: set[_Worker] = set()
        self.started_pids: list[int] = []  # every worker ever started, for tests and debugging
        self._threads = [
            threading.Thread(target=self._serve, name=f"reward-pool-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, path: str, args: tuple[str, str, str | None], timeout_s: float,
               extra: dict[str, Any] | None = None) -> Future[Score]:
        """Score `fn(prompt, completion, answer)` in a worker; a function with an `extra` parameter (or
        `**kwargs`) also gets `extra=` the prompt's extra data columns."""
        return self._put(_Call(path, args, timeout_s, extra or {}))

    def submit_batch(self, path: str, kwargs: dict[str, list[Any]], timeout_s: float) -> Future[list[Score]]:
        """Score a whole batch with one call `fn(**kwargs)` (TRL's signature) in a worker: a list of one `Score`
        per completion (`kwargs["completions"]`), else `CallFailed` saying what came back."""
        return self._put(_Call(path, ("", "", None), timeout_s, batch=kwargs))

    def _put(self, call: _Call) -> Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward function pool is closed")
            self._calls.put(call)
        return call.future

    def close(self) -> None:
        """Kill every worker (calls in flight fail), stop the threads, and fail the calls not yet started."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._live:
                worker.kill()  # only a signal: each thread reaps its own worker
        for _ in self._threads:
            self._calls.put(None)
        for thread in self._threads:
            thread.join()

    def _serve(self) -> None:
        worker: _Worker | None = None
        try:
            while (call := self._calls.get()) is not None:
                if not call.future.set_running_or_notify_cancel():
                    continue
                if self._closed:
                    call.future.set_exception(CallFailed("not run: the rewarder was closed"))
                else:
                    worker = self._run(call, worker)
        finally:
            if worker is not None:
                self._retire(worker)

    def _run(self, call: _Call, worker: _Worker | None) -> _Worker | None:
        """Run one call on `worker` (started if None); returns the worker if it can take the next call."""
        try:
            if worker is None:
                worker = self._start_worker()
            call.future.set_result(worker.call(call))
        except CallFailed as e:
            call.future.set_exception(e)
        except Exception as e:  # a bug here must fail the call, not leave its caller waiting forever
            call.future.set_exception(CallFailed(f"failed in the reward pool: {type(e).__name__}: {e}"))
            if worker is not None:
                worker.stop()
        if worker is not None and not worker.alive:
            self._retire(worker)
            return None
        return worker

    def _start_worker(self) -> _Worker:
        with self._lock:  # under the lock, so `close` either sees this worker or stops us first
            if self._closed:
                raise CallFailed("not run: the rewarder was closed")
            worker = _Worker(self._paths)
            self._live.add(worker)
            self.started_pids.append(worker.pid)
        try:
            worker.wait_ready()
        except CallFailed:
            self._retire(worker)
            raise
        return worker

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.stop()


def _worker_main(lifeline: int, paths: list[str]) -> None:
    """A worker: import the functions, then answer calls until the pool closes stdin."""
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a function's prints go to stderr, not into the answers
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    threading.Thread(target=_exit_with_pool, args=(lifeline,), daemon=True).start()
    try:
        functions = {path: import_object(path) for path in paths}
    except BaseException as e:
        _send(answers, {"error": _describe(e)})
        return
    _send(answers, {"ready": True})
    for line in requests:
        request = json.loads(line)
        fn = functions[request["path"]]
        if "batch" in request:
            _send(answers, _run_batch(fn, request["batch"]))
        else:
            _send(answers, _run_call(fn, request["args"], request.get("extra") or {}))


def _run_call(fn: Any, args: list[Any], extra: dict[str, Any]) -> dict[str, Any]:
    try:
        value = fn(*args, extra=extra) if extra and _takes_extra(fn) else fn(*args)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the call failed, the worker is fine
        return {"error": f"raised {_describe(e)}"}
    if not _is_score(value):
        return {"error": f"returned {_show(value)}, expected a number (or None: no score)"}
    return {"value": None if value is None else float(value)}


def _run_batch(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One batched call; its answer must be a sequence of numbers or None, one per completion."""
    n = len(kwargs["completions"])
    try:
        values = fn(**kwargs)
    except BaseException as e:
        return {"error": f"raised {_describe(e)}"}
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        return {"error": f"returned {_show(values)}, expected a list of {n} numbers (or None), one per completion"}
    values = list(values)
    if len(values) != n:
        return {"error": f"returned {len(values)} scores for a batch of {n} completions"}
    for i, value in enumerate(values):
        if not _is_score(value):
            return {"error": f"returned {_show(value)} at index {i}, expected a number (or None: no score)"}
    return {"value": [None if v is None else float(v) for v in values]}


def _is_score(value: Any) -> bool:
    """None, or a number (bool, numpy and 0-d tensor scalars too: whatever TRL's `torch.tensor` takes)."""
    if value is None or isinstance(value, numbers.Real):
        return True
    return hasattr(type(value), "__float__") and getattr(value, "ndim", 0) == 0


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def _takes_extra(fn: Any) -> bool:
    """Whether `fn` accepts `extra=` (a parameter of that name or `**kwargs`): older functions do not."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "extra" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _send(answers: BinaryIO, answer: dict[str, Any]) -> None:
    answers.write(json.dumps(answer).encode() + b"\n")
    answers.flush()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]


def _exit_with_pool(lifeline: int) -> None:
    """Block until the pool closes the lifeline or its process dies, then kill this worker's process group
    (the worker and whatever its functions started), even in the middle of a call."""
    with contextlib.suppress(OSError):
        os.read(lifeline, 1)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), json.loads(sys.argv[2]))
