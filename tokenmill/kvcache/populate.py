"""Making a CPU KV cache's pages resident before requests reach them.

The cache's tensors are anonymous mappings (kvcache/cache.py ``zeros``): the OS supplies each 4 KiB page at its first
write, inside the engine step of whichever request first reaches that block. On a VM whose host backs guest memory
lazily a first write costs ~12 us a page (an Intel Xeon VM: 8 prompts of 256 tokens spent 130-150 ms of a 0.53 s
prefill step in the KV write's faults, 9 ms once the pages were resident), and the block pool hands out blocks not used
before until all have been, so every request pays that until the whole cache has been written once.

``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) faults pages in as a write would, without changing their contents.
Modes (the ``kv_cache_populate`` setting):
- ``startup`` (the default): before the engine reports ready, on the engine's threads. As vLLM's and llama.cpp's
  zeroed caches, the cache is resident from the start (a machine short of memory fails at start-up, not under load)
  and no step pays for a first write: offline, 128 requests of 256 + 64 tokens, 32 at a time, made 426-436 output
  tokens/s against 374-402 lazily, for 2.0-2.4 s more start-up (2 GiB; benchmarks/results/kv-populate-amx.json);
- ``lazy``: nothing; pages come at first use (and blocks never used never become resident).
A third mode was tried and dropped: a background thread at the lowest priority (SCHED_IDLE) from the end of start-up
gets no core under load, where the steps fault the pages in themselves, and slowed them (365-367 tokens/s above).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, every architecture
SLICE_BYTES = 8 << 20  # one madvise call
MODES = ("startup", "lazy")

Region = tuple[int, int]  # (page-aligned address, bytes)


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def slices(regions: Sequence[Region]) -> list[Region]:
    """The regions cut into pieces of SLICE_BYTES (the last of each shorter): one madvise call each."""
    return [(address + offset, min(SLICE_BYTES, size - offset))
            for address, size in regions for offset in range(0, size, SLICE_BYTES)]


def populate(regions: Sequence[Region]) -> tuple[int, str | None]:
    """Fault every page of ``regions`` in, a slice at a time -> (bytes populated, the reason it gave up or None).
    ctypes releases the GIL for each call."""
    madvise, done = _madvise(), 0
    for address, length in slices(regions):
        if madvise(address, length, MADV_POPULATE_WRITE) != 0:
            errno = ctypes.get_errno()
            return done, f"madvise(MADV_POPULATE_WRITE): {os.strerror(errno)}" + (
                " (Linux before 5.14)" if errno == 22 else "")
        done += length
    return done, None


def populate_on_threads(regions: Sequence[Region], threads: int) -> int:
    """populate() on ``threads`` threads (this one included), each taking every threads-th slice: the host backs
    pages faster with every core asking (3 GiB in 2.0 s on two threads against 3.2-5.1 s on one, on a 2-core VM).
    -> bytes populated; a refusal is logged, and the pages not reached come at first use."""
    start, pieces, threads = time.perf_counter(), slices(regions), max(1, threads)
    results: list[tuple[int, str | None]] = [(0, None)] * threads

    def work(i: int) -> None:
        results[i] = populate(pieces[i::threads])

    helpers = [threading.Thread(target=work, args=(i,), name=f"kv-populate-{i}") for i in range(1, threads)]
    for helper in helpers:
        helper.start()
    work(0)
    for helper in helpers:
        helper.join()
    done = sum(n for n, _ in results)
    problem = next((p for _, p in results if p is not None), None)
    if problem is not None:
        log.warning("KV cache: %s after %.0f MiB; its other pages come at first use", problem, done / 2**20)
    else:
        log.info("KV cache resident: %.0f MiB populated in %.1f s on %d thread%s", done / 2**20,
                 time.perf_counter() - start, threads, "" if threads == 1 else "s")
    return done
