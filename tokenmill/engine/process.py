"""Where the engine core runs for the API process: its own child process (the default), or a thread beside the server.

Both transports do the same three things: start the core and hand back its ``EngineInfo``; carry submits and aborts
in; carry one ``StepOutputs`` per step out to ``on_step``, or a failure to ``on_dead``.

The child process talks ZeroMQ (PUSH/PULL over ipc sockets) with msgspec's msgpack: measured faster than
multiprocessing pipes with pickle (benchmarks/transport.py: a 256-request step's round trip 1.4 ms vs 2.6 ms).
Every frame is ``[kind, payload]``. The API side watches the child's process sentinel next to the socket, so a
child that dies (killed, out of memory) is noticed within one poll, never waited on. The child ignores SIGINT and
SIGTERM (the API process decides when it stops: after its drain) and never outlives its parent: a watchdog thread
waits on the parent's sentinel and ends the process the moment the parent is gone, however it went (SIGKILL
included) and whatever the engine is doing (a step deep in native code included). Stopping it asks first and kills
(SIGKILL) after a timeout; a message to a child that has already exited is never waited on.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import uuid
from typing import Any, Callable

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.isolation import error_output
from tokenmill.engine.messages import EngineInfo, EngineRequest, RequestOutput, StepOutputs
from tokenmill.engine.start import describe
from tokenmill.logs import configure_logging
from tokenmill.runtime import exit_with_parent

log = logging.getLogger(__name__)

OnStep = Callable[[StepOutputs], None]
OnDead = Callable[[BaseException], None]

_ADD, _ABORT, _STOP, _READY, _ERROR, _STEP = b"add", b"abort", b"stop", b"ready", b"error", b"step"
_POLL_MS = 1000


class EngineDeadError(RuntimeError):
    """The engine failed or exited; no request can be served."""


class InProcessEngine:
    """The engine core on a thread of this process (``--no-engine-process``): one GIL for HTTP and model."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._cv = threading.Condition()
        self._adds: list[EngineRequest] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, on_step: OnStep, on_dead: OnDead) -> EngineInfo:
        from tokenmill.engine.core import EngineCore

        core = EngineCore(self.config)
        self._thread = threading.Thread(target=self._run, args=(core, on_step, on_dead), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        return core.info

    def submit(self, request: EngineRequest) -> None:
        with self._cv:
            self._adds.append(request)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, core, on_step: OnStep, on_dead: OnDead) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._adds or self._aborts or self._stopping or core.has_unfinished()):
                        self._cv.wait()
                    if self._stopping:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                on_step(apply_commands(core, adds, aborts))
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting request
            log.exception("engine thread failed")
            on_dead(exc)
        finally:
            core.close()


def apply_commands(core, adds: list[EngineRequest], aborts: list[str]) -> StepOutputs:
    """Queue ``adds``, apply ``aborts``, then run one step if there is work; aborts are reported as outputs, and so
    is a request the engine refused (a duplicate id: the API side makes them unique, so this is a bug's trace): with
    finish_reason "error" and a generic message (its exception goes to the log). The core answers any other failure
    to add a request itself, in the step's outputs."""
    refused = []
    for request in adds:
        try:
            core.add_request(request)
        except Exception as exc:  # noqa: BLE001 - that request's, never the engine's
            log.error("request %s refused by the engine", request.request_id, exc_info=exc)
            refused.append(error_output(request.request_id, len(request.prompt_token_ids)))
    aborted = refused + [out for rid in aborts if (out := core.abort(rid)) is not None]
    step = core.step() if core.has_unfinished() else StepOutputs([], core.stats())
    step.outputs[:0] = aborted
    return step


class EngineProcess:
    """The engine core in a child process (the default under ``tokenmill serve``)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="tokenmill-")
        name = uuid.uuid4().hex[:8]
        self._to_engine, self._from_engine = f"ipc://{self._dir}/{name}-in", f"ipc://{self._dir}/{name}-out"
        self._zmq = zmq.Context()
        self._push = self._zmq.socket(zmq.PUSH)
        self._push.bind(self._to_engine)
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.bind(self._from_engine)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self.process: mp.process.BaseProcess | None = None
        self._poller: zmq.Poller | None = None
        self._receiver: threading.Thread | None = None
        self._stopping = False

    def start(self, on_step: OnStep, on_dead: OnDead) -> EngineInfo:
        """Spawn the child and wait until it has loaded the model (or failed to)."""
        ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads or CUDA state
        self.process = ctx.Process(target=run_engine_process, name="tokenmill-engine", daemon=True,
                                   args=(self.config.model_dump(), self._to_engine, self._from_engine))
        self.process.start()
        # The child ignores SIGTERM, which is how multiprocessing's own exit hook stops daemons: stop it ourselves,
        # whatever way this process exits (this hook runs before multiprocessing's).
        atexit.register(self.stop)
        log.info("engine process started for %s (pid %d)",
                 self.config.served_model_name or self.config.model or "the default model", self.process.pid)
        self._poller = zmq.Poller()  # the child's output socket and its process sentinel, watched together
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self.process.sentinel, zmq.POLLIN)
        kind, payload = self._receive()
        if kind != _READY:
            raise EngineDeadError(f"the engine failed to start: {payload}")
        info = msgspec.msgpack.decode(payload, type=EngineInfo)
        self._receiver = threading.Thread(target=self._receive_loop, args=(on_step, on_dead),
                                          name="tokenmill-engine-outputs", daemon=True)
        self._receiver.start()
        return info

    def submit(self, request: EngineRequest) -> None:
        self._send(_ADD, request)

    def abort(self, request_id: str) -> None:
        self._send(_ABORT, [request_id])

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the child to stop, kill it (SIGKILL) if it has not within ``timeout`` seconds (at once for 0).
        Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self.process is not None and self.process.is_alive():
            if timeout > 0:
                try:
                    self._send(_STOP, None, block=False)
                except zmq.Again:  # the child is not reading (exiting, or gone): nothing to wait for
                    pass
                self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._zmq.term()

    def _send(self, kind: bytes, payload: Any, block: bool = True) -> None:
        with self._send_lock:
            self._push.send_multipart([kind, self._encoder.encode(payload)], copy=False,
                                      flags=0 if block else zmq.NOBLOCK)

    def _receive(self) -> tuple[bytes, bytes]:
        """The next frame from the child; raises EngineDeadError if the child exits first."""
        while True:
            events = dict(self._poller.poll(_POLL_MS))
            if self._pull in events:
                kind, payload = self._pull.recv_multipart()
                if kind == _ERROR:
                    raise EngineDeadError(msgspec.msgpack.decode(payload, type=str))
                return kind, payload
            if self.process.sentinel in events or not self.process.is_alive():
                raise EngineDeadError(f"the engine process exited (exit code {self.process.exitcode})")

    def _receive_loop(self, on_step: OnStep, on_dead: OnDead) -> None:
        decoder = msgspec.msgpack.Decoder(StepOutputs)
        try:
            while not self._stopping:
                kind, payload = self._receive()
                if kind == _STEP:
                    on_step(decoder.decode(payload))
        except EngineDeadError as exc:
            if not self._stopping:
                log.error("%s", exc)
                on_dead(exc)


def use_devices(devices: list[int] | None) -> None:
    """The GPUs of this engine process (and of the ranks it starts, which inherit its environment): rank r then runs
    on the r-th of them. Set before anything initializes CUDA."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)


def run_engine_process(config: dict[str, Any], to_engine: str, from_engine: str) -> None:
    """The child's main: load the engine core, report ready, then loop (commands in, one StepOutputs per step out)."""
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process stops us, after its drain
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(to_engine)
    push.connect(from_engine)
    encoder = msgspec.msgpack.Encoder()
    try:
        from tokenmill.engine.core import EngineCore

        engine_config = EngineConfig(**config)
        configure_logging(engine_config.log_json)  # the API process's format: a spawned child starts without one
        use_devices(engine_config.devices)
        core = EngineCore(engine_config)
    except BaseException as exc:  # noqa: BLE001 - reported to the API process, which exits non-zero
        push.send_multipart([_ERROR, encoder.encode(describe(exc))])  # one line: engine/start.py
        push.close(linger=5000)
        return
    push.send_multipart([_READY, encoder.encode(core.info)])
    try:
        _serve(core, pull, push, encoder)
    except BaseException as exc:  # noqa: BLE001 - a failed step (a dead tensor-parallel rank): tell the API first
        push.send_multipart([_ERROR, encoder.encode(f"{type(exc).__name__}: {exc}")])
        raise
    finally:
        core.close()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
    logging.shutdown()
    os._exit(0)  # no interpreter teardown: a grammar thread may still be inside an xgrammar call (engine/grammar.py)


def _serve(core, pull, push, encoder) -> None:
    """Commands in, one StepOutputs per step out -- but for a step that changed nothing (every request waiting for its
    grammar: the loop then ticks every few milliseconds), which is not sent."""
    request_decoder, ids_decoder = msgspec.msgpack.Decoder(EngineRequest), msgspec.msgpack.Decoder(list[str])
    sent_stats = None
    while True:
        adds, aborts, refused = [], [], []
        idle = not core.has_unfinished()
        while pull.poll(_POLL_MS if idle else 0):
            kind, payload = pull.recv_multipart()
            if kind == _STOP:
                return
            if kind == _ADD:
                request = _decode_request(request_decoder, payload)
                (adds if isinstance(request, EngineRequest) else refused).append(request)
            elif kind == _ABORT:
                aborts += ids_decoder.decode(payload)
            idle = False
        if adds or aborts or refused or core.has_unfinished():
            step = apply_commands(core, adds, aborts)
            step.outputs[:0] = refused
            if step.outputs or step.stats != sent_stats:
                push.send_multipart([_STEP, encoder.encode(step)], copy=False)
                sent_stats = step.stats


def _decode_request(decoder: msgspec.msgpack.Decoder, payload: bytes) -> EngineRequest | RequestOutput:
    """The request a submit carries, or, where it does not decode in this process (its parameters judged otherwise
    here than where they were made), its answer: ended with an error. Raises only when not even its id can be read."""
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raw = msgspec.msgpack.decode(payload)
        request_id = raw.get("request_id") if isinstance(raw, dict) else None
        if not isinstance(request_id, str):
            raise
        log.error("request %s could not be read by the engine", request_id, exc_info=exc)
        return error_output(request_id, len(raw.get("prompt_token_ids") or ()))
