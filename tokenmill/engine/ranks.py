"""The worker ranks of a tensor-parallel engine, and the loop each of them runs.

The engine core is rank 0: it schedules, and before each step it broadcasts the step's ``SchedulerOutput`` and
``GrammarOutput`` (plain data) to ranks 1..N-1, which run the same model runner over their shards and report nothing
(their sampled tokens are rank 0's: distributed/group.py). Ranks 1..N-1 are processes of their own, joined over a TCP
store that rank 0 hosts; once joined, rank 0 broadcasts the configuration and the choices settled for every rank
(engine/settle.py: dtype, threads, kernels, drafting are decided once, on rank 0). Two launches:
- one node (``--tensor-parallel-size N``): the engine core starts ranks 1..N-1 (``python -m tokenmill.engine.ranks``)
  on this host; rank r runs on cuda:r, or on the CPU with gloo;
- several nodes: torchrun (or RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set by hand) starts
  ``tokenmill serve`` once per rank; rank 0 serves and hosts the store on MASTER_PORT + 1 (torchrun's own store holds
  MASTER_PORT), the others run ``run_rank``; a rank runs on cuda:LOCAL_RANK.

Failure: rank 0 checks its workers before every step, and a collective with a dead peer fails at once (the closed
connection), so a rank that dies makes the engine's step raise -- the engine then stops, its requests get errors,
never a hang. A worker exits when rank 0 broadcasts the end (None), when a collective fails (rank 0 is gone), or when
its parent process is.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.group import TIMEOUT, TensorParallel
from tokenmill.engine.build import build_rank_runner
from tokenmill.engine.settle import Settled
from tokenmill.logs import configure_logging

log = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A tensor-parallel rank exited or a collective with it failed: the engine cannot go on."""


def rank_device(config: EngineConfig, settled: Settled, rank: int) -> torch.device:
    """cuda:LOCAL_RANK in a multi-node launch, cuda:rank on one node; the CPU without CUDA."""
    if settled.device != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", config.local_rank if config.world_size else rank)


class WorkerRanks:
    """Ranks 1..N-1 -- child processes of the engine core on one node, or torchrun's elsewhere -- joined with the
    engine core as rank 0; they receive ``config`` and ``settled`` once joined."""

    def __init__(self, config: EngineConfig, settled: Settled):
        size = settled.tensor_parallel_size
        self.procs: list[subprocess.Popen] = []
        if config.world_size:  # torchrun started the others; they meet on the port after its own
            store = dist.TCPStore("0.0.0.0", config.master_port + 1, size, is_master=True, timeout=TIMEOUT,
                                  wait_for_workers=False)
            log.info("tensor parallel: %d ranks, waiting for ranks 1..%d on port %d", size, size - 1, store.port)
        else:
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
            self.procs = [subprocess.Popen([sys.executable, "-m", "tokenmill.engine.ranks", str(rank), str(size),
                                            "127.0.0.1", str(store.port), str(rank_device(config, settled, rank)),
                                            str(os.getpid())]) for rank in range(1, size)]
            log.info("tensor parallel: %d ranks, workers pid %s", size, ", ".join(str(p.pid) for p in self.procs))
        self.tp = TensorParallel.join(store, 0, size, rank_device(config, settled, 0))
        self.tp.broadcast_object((config.model_dump(), settled.to_dict()))
        self._store = store  # the workers' rendezvous and the group's: kept alive with the group
        self._closed = False

    def check(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RankFailedError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                      f"{proc.returncode}")

    def failed_rank(self, wait: float = 2.0) -> RankFailedError | None:
        """After a failed collective: the worker that exited (waiting up to ``wait`` s for it to), if any."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self.check()
            except RankFailedError as exc:
                return exc
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def broadcast_step(self, out, grammar) -> None:
        """Send one step's SchedulerOutput and GrammarOutput to every worker (each runs them as rank 0 does)."""
        self.check()
        try:
            self.tp.broadcast_object((out, grammar))
        except RuntimeError as exc:
            raise RankFailedError(f"a tensor-parallel rank failed: {exc}") from None

    def close(self, timeout: float = 10.0, graceful: bool = True) -> None:
        """Tell the workers to stop (if they can still hear), then make sure the ones started here have. Idempotent.
        ``graceful=False`` (start-up failed: a worker may be in another collective) kills them without a word."""
        if self._closed:
            return
        self._closed = True
        if not graceful:
            timeout = 0.0
        else:
            try:
                self.tp.broadcast_object(None)
            except RuntimeError:
                pass  # a rank is gone: the others see the broken group and exit, or are killed below
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _exit_with_parent(parent_pid: int) -> None:
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True).start()


def worker_main(rank: int, size: int, host: str, port: int, device: torch.device,
                local_rank: int | None = None) -> int:
    """Rank ``rank`` >= 1 on ``device``: join, take rank 0's configuration and settled choices, load this rank's shard,
    then run every step rank 0 broadcasts until None. ``local_rank``: set in a multi-node launch (the rest of the
    config is rank 0's)."""
    store = dist.TCPStore(host, port, size, is_master=False, timeout=TIMEOUT)
    tp = TensorParallel.join(store, rank, size, device)
    fields, settled = tp.broadcast_object()
    if local_rank is not None:
        fields.update(rank=rank, local_rank=local_rank)
    config = EngineConfig(**fields)
    configure_logging(config.log_json)
    runner = build_rank_runner(config, Settled(**settled), tp)
    try:
        while (step := tp.broadcast_object()) is not None:
            runner.execute(*step)
    except RuntimeError as exc:  # rank 0 or another rank is gone
        log.error("tensor-parallel rank %d stops: %s", rank, exc)
        return 1
    return 0


def run_rank(config: EngineConfig) -> int:
    """``tokenmill serve`` on a rank other than 0 of a multi-node launch: run this rank's shard."""
    configure_logging(config.log_json)
    log.info("rank %d of %d: joining rank 0 at %s:%d", config.rank, config.world_size, config.master_addr,
             config.master_port + 1)
    # The group's backend (NCCL or gloo) comes with the device, before rank 0's settled choices can arrive: the
    # same rule as settle's, on this node.
    device = torch.device("cuda", config.local_rank) if config.device != "cpu" and torch.cuda.is_available() \
        else torch.device("cpu")
    return worker_main(config.rank, config.world_size, config.master_addr, config.master_port + 1, device,
                       config.local_rank)


if __name__ == "__main__":  # a rank started by the engine core on this node
    rank_arg, size_arg, host_arg, port_arg, device_arg, parent_arg = sys.argv[1:7]
    _exit_with_parent(int(parent_arg))
    sys.exit(worker_main(int(rank_arg), int(size_arg), host_arg, int(port_arg), torch.device(device_arg)))
