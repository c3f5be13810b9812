"""Work shared fairly among callers: a thread pool whose queue is one FIFO per caller, served round-robin.

The API process prepares requests on a few threads (tokenization and chat templates on one, grammar checks on two:
engine/client.py). With one FIFO for everybody, a caller that queues many costly jobs makes every other caller wait
behind all of them. Here each job is queued under the current ``caller`` (a context variable: the server sets it to
the request's API key name at the edge, server/edge.py), and a free worker takes the oldest job of the next caller in
turn: with k callers waiting, each gets at least 1/k of the workers' turns, whatever the others queued.

``FairExecutor`` is a ``concurrent.futures.Executor``, so ``loop.run_in_executor`` uses it as it is (it reads the
caller in the submitting task's context).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Executor, Future
from contextvars import ContextVar
from typing import Any, Callable

# Who the current work is for (an API key's name; None: everybody who is not told apart).
caller: ContextVar[str | None] = ContextVar("tokenmill_caller", default=None)


class FairExecutor(Executor):
    def __init__(self, max_workers: int, thread_name_prefix: str = "tokenmill-fair"):
        self._max_workers, self._prefix = max_workers, thread_name_prefix
        # caller -> its jobs, oldest first; the caller served next is the first key (a served caller moves last).
        self._queues: OrderedDict[str | None, deque[tuple[Future, Callable, tuple, dict]]] = OrderedDict()
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._cv:
            if self._shutdown:
                raise RuntimeError("cannot submit after shutdown")
            self._queues.setdefault(caller.get(), deque()).append((future, fn, args, kwargs))
            if not self._idle and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._work, name=f"{self._prefix}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cv.notify()
        return future

    def queued(self) -> dict[str | None, int]:
        """Jobs waiting per caller (not those running)."""
        with self._cv:
            return {who: len(jobs) for who, jobs in self._queues.items()}

    def _next(self) -> tuple[Future, Callable, tuple, dict] | None:
        with self._cv:
            self._idle += 1
            while not self._queues and not self._shutdown:
                self._cv.wait()
            self._idle -= 1
            if not self._queues:
                return None  # shut down, nothing left
            who, jobs = next(iter(self._queues.items()))
            job = jobs.popleft()
            del self._queues[who]
            if jobs:
                self._queues[who] = jobs  # to the back of the turn
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._shutdown = True
            if cancel_futures:
                for jobs in self._queues.values():
                    for future, *_ in jobs:
                        future.cancel()
                self._queues.clear()
            self._cv.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
