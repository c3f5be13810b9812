"""A soak test of the embedded model: two tenants for ``--minutes``, one polite and measured, one hostile.

    PYTHONPATH=. python benchmarks/soak.py --minutes 30 --out benchmarks/results/soak.json

Starts its own `tokenmill serve` (the embedded SmolLM2, --max-model-len 2048, --kv-cache-memory 512MiB, a TOML
config with two [[keys]]: tenant "a" and tenant "b", a usage ledger in a temporary folder) unless ``--url`` with
``--key-a`` / ``--key-b`` names a running server (``--server-log`` gives its engine's pid, ``--api-pid`` its API
process, for RSS). One asyncio process with httpx drives, from both keys at once:
- closed-loop workers (``--workers`` per tenant) cycling through chat completions (whole, and streamed: tenant a's
  streamed ones give TTFT, to the first chunk with content, and so does tenant a's open-loop probe, one streamed
  chat every 2 s whatever the others wait for), streams the client aborts after three chunks,
  structured output (response_format json_schema, a two-field object; whether the answer parses is counted),
  embeddings (left out, and recorded, if the first answers 400), and Responses with store=true, then GET of the
  stored response and a previous_response_id follow-up;
- tenant b besides: a burst of 50 concurrent chat requests with max_tokens 1800 every 30 s (over the admission
  limit: their 429s are expected, not errors; each stops at its first sentence), and 8 readers: raw-socket
  streams with n=16 and max_tokens=300, one each per phase (a refused one tries again a second later), read at
  ~100 bytes/s (a 4 KiB receive buffer, so the server cannot unload them into the kernel) in the "slow_readers"
  phases and as fast as they come in the "baseline" phases.
Phases: ``--rounds`` rounds (default: one per 10 minutes, at least one), each a "baseline" phase (the same load, the
same streams, without slow reading) then a "slow_readers" phase, all phases the same length; TTFT is attributed to
the phase in which the request started. The two phases give the engine the same work: what the ratio measures is
what slow reading costs the other tenant.

Measured, with the targets the summary marks PASS/FAIL: tenant a's TTFT p50/p99 per phase and p99(slow_readers) /
p99(baseline) <= 2 (INCONCLUSIVE with fewer than 20 samples in a phase; a request the end cut off before its
first token counts with its wait, a lower bound); RSS (VmRSS) of the API process and of the engine process every
10 s, max <= 1.10 x min over the last 20 minutes (the whole run when shorter); after every client stops and /metrics shows
tokenmill:num_requests_running == 0 and num_requests_waiting == 0: tokenmill:kv_cache_usage_perc == 0 (no KV block
leaked; prefix-cached blocks count as free) and tokenmill:admission_saturation == 0; tenant a's requests all 200
but for explicit 429s (counted). Requests are counted by tenant, kind and status. Writes JSON to ``--out`` (the
numbers, the RSS and metrics time series, per-phase TTFT lists, the command line, the CPU flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import httpx

import soak_load as load
from live_serve import OwnServer, cpu_flags, engine_pid, metrics, rss_bytes

KEYS = {"a": "sk-soak-a-0123456789abcdef", "b": "sk-soak-b-fedcba9876543210"}
SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "512MiB"]
IDLE = ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting")
MIN_TTFT_SAMPLES = 20


def own_config(folder: Path) -> Path:
    path = folder / "soak.toml"
    lines = [f'usage_db = "{folder / "usage.sqlite3"}"']
    for name, key in KEYS.items():
        lines += ["[[keys]]", f'name = "{name}"', f'key = "{key}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sample(run: load.Run, pids, root: str, headers: dict, stop: asyncio.Event, every: float = 10.0) -> None:
    """RSS of both processes and the gauges that matter, every ``every`` s and once more when stopped, into
    run.series."""
    stopped = False
    while not stopped:
        api_pid, eng_pid = pids()
        values = await asyncio.to_thread(metrics, root, headers) or {}
        run.series.append({"t": round(time.monotonic() - run.start, 1), "phase": run.phase,
                           "api_rss": rss_bytes(api_pid), "engine_rss": rss_bytes(eng_pid),
                           **{name.split(":")[1]: values.get(name) for name in load.GAUGES}})
        try:
            await asyncio.wait_for(stop.wait(), every)
            stopped = True
        except asyncio.TimeoutError:
            pass
    api_pid, eng_pid = pids()
    run.series.append({"t": round(time.monotonic() - run.start, 1), "phase": "idle", "api_rss": rss_bytes(api_pid),
                       "engine_rss": rss_bytes(eng_pid)})


async def wait_idle(root: str, headers: dict, timeout: float = 180.0) -> dict:
    """/metrics once nothing runs or waits (or ``timeout`` s passed): the gauges then, and how long it took."""
    start = time.monotonic()
    values = {}
    while time.monotonic() - start < timeout:
        values = await asyncio.to_thread(metrics, root, headers) or {}
        if values and all(values.get(name) == 0 for name in IDLE):
            break
        await asyncio.sleep(1.0)
    await asyncio.sleep(1.0)  # the last release reaches the gauges
    values = await asyncio.to_thread(metrics, root, headers) or values
    return {"waited_s": round(time.monotonic() - start, 1), "idle": all(values.get(n) == 0 for n in IDLE),
            **{name: values.get(name) for name in load.GAUGES}}


def rss_window(series: list[dict], minutes: float) -> dict:
    """max / min of each process's RSS over the last ``minutes`` of the series."""
    if not series:
        return {}
    last = series[-1]["t"]
    window = [s for s in series if s["t"] >= last - minutes * 60]
    out = {"window_s": round(last - window[0]["t"], 1), "samples": len(window)}
    for name in ("api_rss", "engine_rss"):
        values = [s[name] for s in window if s[name]]
        out[name] = {"min": min(values), "max": max(values), "ratio": round(max(values) / min(values), 4)} \
            if values else None
    return out


async def soak(args, root: str, keys: dict, pids) -> dict:
    phase_s = args.minutes * 60 / (2 * args.rounds)
    run = load.Run(root, keys, args.workers, seed=args.seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=20.0),
                                 limits=httpx.Limits(max_connections=200, max_keepalive_connections=40)) as client:
        run.client = client
        run.model = (await client.get(root + "/v1/models", headers=run.headers("a"))).json()["data"][0]["id"]
        await run.probe_embeddings()
        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(sample(run, pids, root, run.headers("a"), stop_sampling))
        tasks = [asyncio.create_task(run.worker(tenant, i)) for tenant in "ab" for i in range(args.workers)]
        tasks.append(asyncio.create_task(run.bursts(period=30.0, size=50)))
        tasks.append(asyncio.create_task(run.ttft_probe(period=2.0)))
        for round_index in range(args.rounds):
            for phase in ("baseline", "slow_readers"):
                run.begin_phase(phase, round_index)
                readers = [asyncio.create_task(run.slow_reader(i, slow=phase == "slow_readers")) for i in range(8)]
                await asyncio.sleep(phase_s)
                for task in readers:
                    task.cancel()
                await asyncio.gather(*readers, return_exceptions=True)
        run.end_phase()
        run.stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        idle = await wait_idle(root, run.headers("a"))
        stop_sampling.set()
        await sampler
    return {"run": run, "idle": idle, "phase_s": phase_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=None, help="baseline + slow_readers rounds (default: one per "
                        "10 minutes, at least one)")
    parser.add_argument("--workers", type=int, default=2, help="closed-loop workers per tenant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server's root; default: start one")
    parser.add_argument("--key-a", help="with --url: the polite tenant's key")
    parser.add_argument("--key-b", help="with --url: the hostile tenant's key")
    parser.add_argument("--server-log", help="with --url: its log (the engine's pid, for RSS)")
    parser.add_argument("--api-pid", type=int, help="with --url: its API process (for RSS)")
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args()
    args.rounds = args.rounds or max(1, int(args.minutes // 10))

    work = Path(tempfile.mkdtemp(prefix="tokenmill-soak-"))
    server = None
    if args.url:
        root, keys = args.url.rstrip("/").removesuffix("/v1"), {"a": args.key_a, "b": args.key_b}
        pids = lambda: (args.api_pid, engine_pid(args.server_log))  # noqa: E731
    else:
        server = OwnServer([*SERVER_ARGS, "--config", str(own_config(work))], work)
        print(f"starting {' '.join(server.command)} (log {work})", flush=True)
        server.start()
        root, keys = server.root, dict(KEYS)
        pids = lambda: (server.api_pid(), server.engine_pid())  # noqa: E731
    started = time.monotonic()
    try:
        result = asyncio.run(soak(args, root, keys, pids))
    finally:
        if server is not None:
            server.stop()
    report = build_report(args, result, time.monotonic() - started)
    report.update({"command": " ".join([sys.executable, *sys.argv]), "cpu_flags": cpu_flags(), "url": root,
                   "server_args": None if server is None else server.command, "server_logs": str(work)})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print_summary(report, args.out)
    return 0 if report["passed"] else 1


def build_report(args, result: dict, duration: float) -> dict:
    run: load.Run = result["run"]
    ttft = {}
    for phase in ("baseline", "slow_readers"):
        # A request still waiting for its first token when the run ended counts with its wait (a lower bound).
        values, censored = run.ttft[phase], run.ttft_censored[phase]
        both = values + censored
        ttft[phase] = {"n": len(values), "censored": len(censored), "p50": quantile(both, 0.5),
                       "p99": quantile(both, 0.99), "mean": sum(both) / len(both) if both else None,
                       "values": [round(v, 4) for v in values], "censored_waits": [round(v, 4) for v in censored]}
    base, slow = ttft["baseline"]["p99"], ttft["slow_readers"]["p99"]
    ratio = slow / base if base and slow is not None else None
    rss = rss_window(run.series, 20.0)
    gauges = {}
    for phase in ("baseline", "slow_readers"):
        rows = [row for row in run.series if row["phase"] == phase]
        gauges[phase] = {name.split(":")[1]: _mean([row.get(name.split(":")[1]) for row in rows])
                         for name in load.GAUGES}
    idle = result["idle"]
    a_counts = run.counts.get("a", {})
    a_bad = {f"{kind} {status}": n for kind, statuses in a_counts.items() for status, n in statuses.items()
             if status not in ("200", "429")}
    a_429 = sum(statuses.get("429", 0) for statuses in a_counts.values())
    targets = {
        # None: too few samples in a phase to say (a p99 of a handful is its maximum)
        "ttft_p99_ratio<=2": None if min(t["n"] + t["censored"] for t in ttft.values()) < MIN_TTFT_SAMPLES
        else ratio is not None and ratio <= 2.0,
        "api_rss_max<=1.10*min": bool(rss.get("api_rss")) and rss["api_rss"]["ratio"] <= 1.10,
        "engine_rss_max<=1.10*min": bool(rss.get("engine_rss")) and rss["engine_rss"]["ratio"] <= 1.10,
        "idle_reached": idle["idle"],
        "kv_cache_usage_perc==0": idle.get("tokenmill:kv_cache_usage_perc") == 0,
        "admission_saturation==0": idle.get("tokenmill:admission_saturation") == 0,
        "tenant_a_only_200_or_429": not a_bad,
    }
    return {"minutes": args.minutes, "rounds": args.rounds, "phase_s": result["phase_s"],
            "layout": f"{args.rounds} round(s) of baseline then slow_readers, {result['phase_s']:.0f} s each phase",
            "workers_per_tenant": args.workers, "duration_s": round(duration, 1), "model": run.model,
            "phases": run.phases, "ttft_s": ttft, "ttft_p99_ratio": ratio, "rss": rss, "idle": idle,
            "counts": run.counts, "by_phase": run.by_phase, "gauges_mean_by_phase": gauges,
            "tenant_a_not_200_or_429": a_bad, "tenant_a_429": a_429,
            "errors": run.errors[:50], "error_count": len(run.errors), "structured_json": run.structured_json,
            "embeddings": run.embeddings, "slow_reader_streams": run.slow_streams, "bursts": run.burst_log,
            "series": run.series, "client_cpu_s": round(resource.getrusage(resource.RUSAGE_SELF).ru_utime +
                                                        resource.getrusage(resource.RUSAGE_SELF).ru_stime, 1),
            "targets": targets, "passed": all(v is True for v in targets.values())}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def print_summary(report: dict, out: str) -> None:
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"\nsoak: {report['duration_s']} s, {report['layout']}; client CPU {report['client_cpu_s']} s; "
          f"CPU flags {' '.join(report['cpu_flags'])}")
    for phase, t in report["ttft_s"].items():
        print(f"  tenant a TTFT {phase:12s} n={t['n']:4d} (+{t['censored']} cut off by the end) p50 {fmt(t['p50'])} s"
              f"  p99 {fmt(t['p99'])} s")
    for phase, g in report["gauges_mean_by_phase"].items():
        print(f"  mean over {phase}: running {g['num_requests_running']}, kv usage {g['kv_cache_usage_perc']}, "
              f"admission saturation {g['admission_saturation']}; statuses by tenant "
              f"{report['by_phase'].get(phase)}")
    ratio = report["ttft_p99_ratio"]
    targets = report["targets"]
    mark = lambda name: {True: "PASS", False: "FAIL", None: "INCONCLUSIVE"}[targets[name]]  # noqa: E731
    print(f"  {mark('ttft_p99_ratio<=2')} p99(slow_readers) / p99(baseline) = {fmt(ratio)} (target <= 2; "
          f"needs {MIN_TTFT_SAMPLES} samples a phase)")
    rss = report["rss"]
    for name in ("api_rss", "engine_rss"):
        r = rss.get(name)
        text = f"min {r['min'] / 2**20:.0f} MiB max {r['max'] / 2**20:.0f} MiB ratio {r['ratio']:.3f}" if r else "n/a"
        print(f"  {mark(name + '_max<=1.10*min')} {name} over the last {rss.get('window_s')} s: {text} (target <= 1.10)")
    idle = report["idle"]
    print(f"  {mark('idle_reached')} idle after {idle['waited_s']} s (running {idle.get(IDLE[0])}, "
          f"waiting {idle.get(IDLE[1])})")
    print(f"  {mark('kv_cache_usage_perc==0')} kv_cache_usage_perc at idle {idle.get('tokenmill:kv_cache_usage_perc')}")
    print(f"  {mark('admission_saturation==0')} admission_saturation at idle "
          f"{idle.get('tokenmill:admission_saturation')}")
    print(f"  {mark('tenant_a_only_200_or_429')} tenant a: {report['tenant_a_429']} explicit 429s; other statuses: "
          f"{report['tenant_a_not_200_or_429'] or 'none'}")
    for tenant, kinds in report["counts"].items():
        print(f"  tenant {tenant}: " + "; ".join(f"{k} " + " ".join(f"{s}:{n}" for s, n in sorted(v.items()))
                                                for k, v in sorted(kinds.items())))
    print(f"  structured output: {report['structured_json']}; embeddings: {report['embeddings']}; "
          f"slow-reader streams: {report['slow_reader_streams']}; errors: {report['error_count']}")
    for error in report["errors"][:8]:
        print(f"    {error}")
    print(f"{'PASS' if report['passed'] else 'FAIL'}; JSON in {out}")


if __name__ == "__main__":
    sys.exit(main())
