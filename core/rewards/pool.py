"""Worker processes for slow reward functions, with a timeout per sample.

Each worker runs one sample at a time. A sample that exceeds the timeout has its worker killed and
replaced, so a hung function costs ``timeout_s`` and never blocks the step. Workers are started with
``spawn`` (safe next to CUDA and threads) when first needed and kept for later steps. The function
travels as a picklable reference: the function object (pickled by its module and name), or
``("load", path, name)`` for a user file, which each worker imports once.

This module imports only the standard library, so workers start in well under a second.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Optional, Sequence

#: Seconds a new worker may take to start before it is an error.
START_TIMEOUT_S = 120.0

#: ``(status, value, traceback)``: ``("ok", result, "")``, ``("error", "Type: message", tb)``, ``("timeout", None, "")``.
TaskResult = tuple[str, Any, str]


def _worker_main(conn: Any) -> None:
    """Loop of a worker process: receive ``(ref, kwargs)``, call, send a :data:`TaskResult`."""
    from rlcore.rewards.functions import resolve_ref

    conn.send(("ready", None, ""))
    cache: dict = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ref, kwargs = msg
        try:
            result: TaskResult = ("ok", resolve_ref(ref, cache)(**kwargs), "")
        except Exception as e:  # noqa: BLE001 - the user's function may raise anything: sent back as an error
            result = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send(result)
        except Exception as e:  # noqa: BLE001 - the result cannot be pickled
            conn.send(("error", f"result cannot be sent back from the worker: {type(e).__name__}: {e}", ""))


def describe_exit(code: Optional[int]) -> str:
    """``exit code 3``, ``killed by signal SIGKILL`` (a negative code), or ``still running``."""
    if code is None:
        return "no exit code yet: the process did not end within 5 s of closing its pipe"
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


class _Worker:
    def __init__(self, ctx: Any, slot: int):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True, name=f"rlcore-reward-{slot}")
        self.process.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"reward worker process did not start within {START_TIMEOUT_S:g} s")
        self.conn.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(2)
        self.kill()


class WorkerPool:
    """``num_workers`` processes running reward calls, each call limited to ``timeout_s`` seconds."""

    def __init__(self, num_workers: int, timeout_s: float, start_method: str = "spawn"):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1 for a worker pool, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        self.num_workers, self.timeout_s = int(num_workers), float(timeout_s)
        self._ctx = mp.get_context(start_method)
        self._workers: list[Optional[_Worker]] = [None] * self.num_workers
        #: Workers killed so far (timeouts and crashes).
        self.restarts = 0

    def _worker(self, slot: int) -> _Worker:
        w = self._workers[slot]
        if w is None or not w.process.is_alive():
            w = self._workers[slot] = _Worker(self._ctx, slot)
        return w

    def _drop(self, slot: int) -> None:
        w = self._workers[slot]
        if w is not None:
            w.kill()
        self._workers[slot] = None
        self.restarts += 1

    def run(self, ref: Any, tasks: Sequence[dict[str, Any]]) -> list[TaskResult]:
        """Call the function ``ref`` once per keyword-argument dict; results in the order of ``tasks``."""
        results: list[Optional[TaskResult]] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        busy: dict[int, tuple[int, float]] = {}  # slot -> (task, deadline)
        while queue or busy:
            for slot in range(self.num_workers):
                if slot in busy or not queue:
                    continue
                i = queue.popleft()
                worker = self._worker(slot)
                try:
                    worker.conn.send((ref, dict(tasks[i])))
                except Exception as e:  # noqa: BLE001 - arguments that cannot be pickled
                    results[i] = ("error", f"arguments cannot be sent to a worker: {type(e).__name__}: {e}", "")
                    continue
                busy[slot] = (i, time.monotonic() + self.timeout_s)
            if not busy:
                continue
            wait_s = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            ready = set(wait([self._workers[s].conn for s in busy], timeout=wait_s))  # type: ignore[union-attr]
            now = time.monotonic()
            for slot in list(busy):
                i, deadline = busy[slot]
                worker = self._workers[slot]
                if worker.conn in ready:  # type: ignore[union-attr]
                    try:
                        results[i] = worker.conn.recv()  # type: ignore[union-attr]
                    except (EOFError, OSError):
                        worker.process.join(5)  # type: ignore[union-attr]  # reaped: its exit code is known
                        how = describe_exit(worker.process.exitcode)  # type: ignore[union-attr]
                        results[i] = ("error", f"the worker process died ({how})", "")
                        self._drop(slot)
                    del busy[slot]
                elif now >= deadline:
                    results[i] = ("timeout", None, "")
                    self._drop(slot)
                    del busy[slot]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every worker."""
        for slot, w in enumerate(self._workers):
            if w is not None:
                w.stop()
            self._workers[slot] = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
