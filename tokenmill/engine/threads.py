"""Worker threads for work that may not come back: a pool whose threads never hold up the interpreter's exit, and that
grows when every thread is busy, so that one stuck in a call that cannot be interrupted never starves the others."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from concurrent.futures import Future

# At exit, running jobs get this long (in all) to finish their call before the interpreter goes.
EXIT_WAIT_S = 5.0


class DaemonPool:
    """Daemon worker threads, started as needed up to ``max_workers``: concurrent.futures' pool joins its threads at
    exit (a runaway xgrammar call may run for minutes) and never adds one while its threads are all busy. At exit,
    running jobs get up to ``EXIT_WAIT_S`` to finish their call (a thread still inside C++ when the interpreter goes
    makes it abort)."""

    def __init__(self, max_workers: int, name: str):
        self.max_workers, self.name = max_workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = _Counter()  # threads waiting for a job
        self._lock = threading.Lock()
        _POOLS.add(self)

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on a worker; a cancelled future's job is skipped."""
        future: Future = Future()
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            if self._idle.value == 0 and len(self._threads) < self.max_workers:
                thread = threading.Thread(target=_work, args=(self._queue, self._idle), daemon=True,
                                          name=f"{self.name}-{len(self._threads)}")
                self._idle.add(1)  # counted idle from the start: the next submit does not start another for this one
                thread.start()
                self._threads.append(thread)
            self._idle.add(-1)  # the job below takes one
            self._queue.put((future, fn, args))
        return future

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the threads once their queued jobs are done, waiting up to ``wait_s`` seconds for them."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        deadline = time.monotonic() + wait_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __del__(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


class _Counter:
    def __init__(self):
        self.value, self._lock = 0, threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


def _work(jobs: queue.SimpleQueue, idle: _Counter) -> None:
    while (item := jobs.get()) is not None:
        future, fn, args = item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the result
                future.set_exception(exc)
        idle.add(1)
        del item, future, fn, args  # a finished job keeps nothing alive while the thread waits


_POOLS: weakref.WeakSet[DaemonPool] = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for pool in list(_POOLS):
        pool.close(max(0.0, deadline - time.monotonic()))
