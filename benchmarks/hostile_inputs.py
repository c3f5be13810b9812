"""A hostile-input campaign against a live server: what any request, valid or not, does to it.

    PYTHONPATH=. python benchmarks/hostile_inputs.py --cases 5000 --out benchmarks/results/hostile-inputs.json

Starts its own `tokenmill serve` (the embedded model, --max-model-len 512, --kv-cache-memory 256MiB, two API keys
from a TOML [[keys]] config: one admin, one not; a usage ledger in a temporary folder) unless ``--url`` names a
running server (then ``--api-key``, repeatable, and ``--server-log`` to follow its engine's pid). Then, one request
at a time (each failure has one cause):
(a) schemathesis over every operation of the server's /openapi.json (positive and negative cases; the body's
    "model" set to the served model so requests reach it, the API key sent, one case in ten with the generated
    authorization headers instead);
(b) hostile_cases.py's strategies for the generation operations (chat, completions, responses, messages,
    count_tokens, embeddings, tokenize, detokenize, GET /v1/usage; the schema leaves Anthropic content and system
    blocks, Responses input items, tool schemas and metadata free-form objects, which schemathesis fills with
    nothing hostile, so (b) reaches into them): a valid body with one to three fields replaced
    by boundary numbers (0, -1, 2**31, 2**63, 2**64, 10**30, 1e308, 1e-320, NaN, Infinity as raw JSON literals),
    wrong types, unicode digits as logit_bias keys, huge arrays (10^5 token ids, 10^4 stop strings), nesting
    50 / 500 / 5000 deep, bad UTF-8 bytes, empty strings; a third of them streamed (read to the end). Up to half
    of each operation's share goes first to the sweep: every numeric field with every boundary value, and every odd
    logit_bias key, one a case (a seeded sample when the share is shorter).
About 40% of ``--cases`` go to (a), spread evenly over its operations, the rest to (b), weighted to generation.

Checks on every response: no 5xx (a 503 with Retry-After, overload, is allowed), every 4xx body in the API's own
error shape (OpenAI's {"error": {"message", "type", "param", "code"}}; Anthropic's {"type": "error", "error":
{"type", "message"}} under /v1/messages), JSON bodies strict JSON (no NaN / Infinity), streams that end with
their terminal event and carry errors as the API's error event (a server_error event counts as a 5xx), no timeouts
or dropped connections. A thread polls /health every 3 s and the engine's pid (from the server log); an engine
death (a pid that exits or changes, a /health that is not 200) is recorded with the case that caused it, and a
server of our own is restarted (a mutation that killed it is replayed alone to name it, then skipped) so the
campaign goes on; against --url it waits ``--wait-s`` for the server to come back. A 5xx of a case with several
mutations is replayed one mutation at a time to name the culprit. At the end: /health 200, the engine pid the
same as at the start, and a normal chat request answered.

Writes JSON to ``--out``: per operation cases and a status histogram, every response's (operation, status),
failures (kinds counted, the first 50 with the request truncated to 2 KB and the response), engine deaths, the
final checks, duration, the command line and the host's CPU flags; prints a summary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.errors import Unsatisfiable

import hostile_cases as hc
import hostile_campaign as campaigns
import hostile_checks as checks
from live_serve import OwnServer, cpu_flags

KEYS = {"hostile-a": "sk-hostile-a-0123456789abcdef", "hostile-b": "sk-hostile-b-fedcba9876543210"}
SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "256MiB"]
OWN_WEIGHTS = {"POST /v1/chat/completions": 3, "POST /v1/completions": 3, "POST /v1/responses": 2,
               "POST /v1/messages": 2, "POST /v1/messages/count_tokens": 1, "POST /v1/embeddings": 1,
               "POST /tokenize": 1, "POST /detokenize": 1, "GET /v1/usage": 1}


def own_config(folder: Path) -> Path:
    path = folder / "hostile.toml"
    lines = [f'usage_db = "{folder / "usage.sqlite3"}"']
    for i, (name, key) in enumerate(KEYS.items()):
        lines += ["[[keys]]", f'name = "{name}"', f'key = "{key}"', f"admin = {'true' if i == 0 else 'false'}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def split(total: int, weights: dict[str, int]) -> dict[str, int]:
    whole = sum(weights.values())
    return {name: max(1, round(total * w / whole)) for name, w in weights.items()}


def hypothesis_settings(count: int, chosen_seed: int | None):
    def wrap(fn):
        fn = settings(max_examples=count, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=chosen_seed is None, database=None, phases=[Phase.explicit, Phase.generate],
                      verbosity=Verbosity.quiet, print_blob=False)(fn)
        return seed(chosen_seed)(fn) if chosen_seed is not None else fn
    return wrap


def cheapen(body) -> None:
    """A token limit the server accepts as it is (17..4096) becomes 16: long generations find nothing more, and on
    two shared cores one of 500 tokens costs as much as a hundred other cases."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(name)
            if type(value) is int and 16 < value <= 4096:
                body[name] = 16


def run_schemathesis(campaign: campaigns.Campaign, count: int, chosen_seed: int | None) -> None:
    import schemathesis
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(campaign.root + "/openapi.json", headers=campaign.headers(0))
    operations = [result.ok() for result in schema.get_all_operations()]
    campaign.report["schemathesis_operations"] = [f"{op.method.upper()} {op.path}" for op in operations]
    per_op = max(1, round(count / max(1, len(operations))))
    for operation in operations:
        name = f"{operation.method.upper()} {operation.path}"
        strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
        try:
            strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
        except Exception:  # noqa: BLE001 - an operation with nothing to negate
            pass
        for mode, strategy in zip(("positive", "negative"), strategies):
            @given(case=strategy)
            @hypothesis_settings(max(1, per_op // len(strategies)), chosen_seed)
            def fuzz(case):
                if campaign.stopped:
                    return
                if isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = campaign.model  # an unknown model is a 404 before anything else is read
                cheapen(case.body)
                campaign.schemathesis_case(name, mode, case)
            try:
                fuzz()
            except Unsatisfiable:  # e.g. nothing to make invalid in an operation without parameters
                campaign.report.setdefault("schemathesis_unsatisfiable", []).append(f"{name} ({mode})")


def run_own(campaign: campaigns.Campaign, count: int, chosen_seed: int | None) -> None:
    """Per operation, up to half its share on the boundary sweep (a seeded sample of it when the share is short;
    every third case streamed), the rest on hypothesis's combinations of one to three mutations."""
    for name, share in split(count, OWN_WEIGHTS).items():
        op = hc.OPS[name]
        pairs = hc.sweep(op)
        pairs = random.Random(chosen_seed or 0).sample(pairs, len(pairs))[:share // 2]
        for i, mutation in enumerate(pairs):
            if campaign.stopped:
                return
            campaign.own_case(op, (mutation,), stream=op.stream and i % 3 == 0, key_index=i)
        index = {"n": 0}

        @given(case=hc.cases(op))
        @hypothesis_settings(max(1, share - len(pairs)), chosen_seed)
        def fuzz(case):
            if campaign.stopped:
                return
            mutations, stream = case
            index["n"] += 1
            campaign.own_case(op, mutations, stream, key_index=index["n"] % len(campaign.keys))
        fuzz()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=5000, help="total requests, spread over operations")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized)")
    parser.add_argument("--url", help="a running server's root (http://host:port); default: start one")
    parser.add_argument("--api-key", action="append", default=[], help="with --url: a key to send (repeatable)")
    parser.add_argument("--server-log", help="with --url: its log, to follow the engine's pid")
    parser.add_argument("--wait-s", type=float, default=120.0, help="with --url: how long a dead server may take "
                        "to come back before the campaign stops")
    parser.add_argument("--max-restarts", type=int, default=12, help="restarts of our own server, at most")
    parser.add_argument("--out", default="hostile-inputs.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tokenmill-hostile-"))
    server = None
    if args.url:
        root, keys = args.url.rstrip("/").removesuffix("/v1"), args.api_key
    else:
        server = OwnServer([*SERVER_ARGS, "--config", str(own_config(work))], work)
        print(f"starting {' '.join(server.command)} (log {work})", flush=True)
        server.start()
        root, keys = server.root, list(KEYS.values())
    campaign = campaigns.Campaign(root, keys, server, args.server_log, args.wait_s, args.max_restarts)
    started = time.monotonic()
    try:
        campaign.begin()
        schemathesis_cases = round(args.cases * 0.4)
        run_schemathesis(campaign, schemathesis_cases, args.seed)
        run_own(campaign, args.cases - schemathesis_cases, args.seed)
        campaign.finish()
    finally:
        campaign.monitor.stop()
        if server is not None:
            server.stop()
    report = campaign.report
    report.update({"command": " ".join([sys.executable, *sys.argv]), "cpu_flags": cpu_flags(), "url": root,
                   "server_args": None if server is None else server.command, "server_logs": str(work),
                   "cases_requested": args.cases, "seed": args.seed, "duration_s": round(time.monotonic() - started, 1)})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    checks.print_summary(report, args.out)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
