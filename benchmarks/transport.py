"""API process <-> engine process transports, measured: what one engine step's messages cost each way.

    python benchmarks/transport.py [--out benchmarks/results/transport.json]

A child process echoes what it receives. Two candidate transports, both carrying the engine's real message types:
``pipe`` (multiprocessing.Pipe + pickle) and ``zmq`` (ZeroMQ PUSH/PULL over ipc + msgspec's msgpack, as vLLM v1 does).
For a submit (one request, 256 prompt tokens) and a step's outputs (1, 32 and 256 requests, one token each) it
reports the median round-trip time (send, child decodes and re-encodes, receive) over many repeats.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenmill.engine.messages import EngineRequest, EngineStats, RequestOutput, StepOutputs
from tokenmill.sampling.params import SamplingParams


def _submit() -> EngineRequest:
    return EngineRequest("req-0123456789abcdef", list(range(1000, 1256)), SamplingParams(max_tokens=64), 64, 0.0)


def _step(n: int) -> StepOutputs:
    outputs = [RequestOutput(f"req-{i:016x}", [1234], " word", 256, 10, token_time=1.0) for i in range(n)]
    return StepOutputs(outputs, EngineStats(n, 0, 0.5, 0, 0))


def _pipe_child(conn) -> None:
    while (data := conn.recv_bytes()) != b"stop":
        conn.send_bytes(pickle.dumps(pickle.loads(data)))


def _zmq_child(address_in: str, address_out: str) -> None:
    import msgspec
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(address_in)
    push.connect(address_out)
    decoder, encoder = msgspec.msgpack.Decoder(), msgspec.msgpack.Encoder()
    while (data := pull.recv()) != b"stop":
        push.send(encoder.encode(decoder.decode(data)))


def _time(roundtrip, repeats: int) -> float:
    roundtrip()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        roundtrip()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bench_pipe(messages: dict, repeats: int) -> dict[str, float]:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_pipe_child, args=(child,))
    proc.start()

    def roundtrip(msg):
        parent.send_bytes(pickle.dumps(msg))
        pickle.loads(parent.recv_bytes())
    result = {name: _time(lambda m=msg: roundtrip(m), repeats) for name, msg in messages.items()}
    parent.send_bytes(b"stop")
    proc.join()
    return result


def bench_zmq(messages: dict, repeats: int) -> dict[str, float]:
    import msgspec
    import zmq

    tmp = tempfile.mkdtemp()
    address_in, address_out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(address_in)
    pull.bind(address_out)
    proc = mp.get_context("spawn").Process(target=_zmq_child, args=(address_in, address_out))
    proc.start()
    encoder = msgspec.msgpack.Encoder()

    def roundtrip(msg):
        push.send(encoder.encode(msg))
        msgspec.msgpack.decode(pull.recv(), type=type(msg))
    result = {name: _time(lambda m=msg: roundtrip(m), repeats) for name, msg in messages.items()}
    push.send(b"stop")
    proc.join()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", default="benchmarks/results/transport.json")
    args = parser.parse_args(argv)
    messages = {"submit": _submit(), "step_1": _step(1), "step_32": _step(32), "step_256": _step(256)}
    results = {"pipe+pickle": bench_pipe(messages, args.repeats), "zmq+msgspec": bench_zmq(messages, args.repeats)}
    record = {"command": " ".join(["python benchmarks/transport.py", *argv]), "date": time.strftime("%Y-%m-%d"),
              "unit": "microseconds per round trip (median)", "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    for name, row in results.items():
        print(f"{name:>12}: " + ", ".join(f"{k} {v:.0f} us" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
