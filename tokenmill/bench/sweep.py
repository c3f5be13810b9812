"""``tokenmill bench``: sweep concurrency levels against an OpenAI-compatible server and report.

Settings: CLI flags > the ``[benchmark]`` table of the TOML file given with ``--config`` > defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from tokenmill.bench.loadgen import (LoadSpec, dataset_prompts, error_message, normalize_base_url, random_prompts,
                                     run_level, scrape_metrics, shared_prefix_prompts)
from tokenmill.bench.copy_texts import copy_prompts
from tokenmill.bench.report import markdown_table, write_plots
from tokenmill.bench.stats import RequestResult, summarize

DEFAULTS: dict[str, Any] = {
    "base_url": "http://127.0.0.1:8000/v1", "model": None, "api_key": None, "concurrency": "1,8,16,32,64",
    "input_len": 2048, "output_len": 512, "dataset": None, "num_prompts": None, "warmup": 2, "seed": None,
    "max_seconds": None, "endpoint": "completions", "hourly_cost": None, "out": None, "vocab_size": None,
    "tokenizer": None, "label": None, "prefix_len": 1000, "temperature": 0.0,
}
# Built-in datasets (other --dataset values are JSONL files): random (the default); shared-prefix, whose prompts share
# their first prefix_len tokens; copy, chat requests whose answers repeat their prompt (bench/copy_texts.py).
SHARED_PREFIX, COPY = "shared-prefix", "copy"


def _suffix(name: str, values: dict[str, float]) -> float | None:
    """A metric by name suffix, so tokenmill:, vllm: and llamacpp: names all match."""
    hits = [v for k, v in values.items() if k.endswith(name)]
    return sum(hits) if hits else None


class ServerWatch:
    """Samples a server's /metrics during a level: peaks of gauges, deltas of counters."""

    def __init__(self, base_url: str, api_key: str | None):
        self.base_url, self.api_key = base_url, api_key
        self.first = scrape_metrics(base_url, api_key)
        self.peaks: dict[str, float] = {}

    def sample(self) -> dict[str, float] | None:
        values = scrape_metrics(self.base_url, self.api_key)
        if values:
            for name in ("kv_cache_usage_perc", "kv_cache_usage_ratio", "process_resident_memory_bytes"):
                value = _suffix(name, values)
                if value is not None:
                    self.peaks[name] = max(self.peaks.get(name, 0.0), value)
        return values

    def report(self) -> dict[str, float | None] | None:
        last = self.sample()
        if not self.first or not last:
            return None

        def delta(name: str) -> float | None:
            a, b = _suffix(name, self.first), _suffix(name, last)
            return None if a is None or b is None else b - a

        hits, queries = delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")
        accepted, drafted = delta("spec_decode_num_accepted_tokens_total"), delta("spec_decode_num_draft_tokens_total")
        kv_peak = self.peaks.get("kv_cache_usage_perc", self.peaks.get("kv_cache_usage_ratio"))
        return {"kv_cache_usage_peak": kv_peak, "preemptions": delta("num_preemptions_total"),
                "generation_tokens": delta("generation_tokens_total"),
                "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
                "spec_acceptance_rate": accepted / drafted if accepted is not None and drafted else None,
                "process_peak_memory_bytes": self.peaks.get("process_resident_memory_bytes")}


async def _level(spec: LoadSpec, prompts: list, concurrency: int, settings: dict, detokenize) -> tuple[list, dict]:
    watch = ServerWatch(spec.base_url, spec.api_key)
    done = 0

    def progress(_: RequestResult) -> None:
        nonlocal done
        done += 1
        print(f"\r  concurrency {concurrency}: {done}/{len(prompts)} requests", end="", file=sys.stderr, flush=True)

    async def watcher() -> None:
        while True:
            await asyncio.to_thread(watch.sample)
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(watcher())
    try:
        results = await run_level(spec, prompts, concurrency, settings["max_seconds"], detokenize, progress)
    finally:
        sampler.cancel()
    print(file=sys.stderr)
    return results, await asyncio.to_thread(watch.report) or {}


def _detokenizer(settings: dict):
    if settings["endpoint"] != "chat" or settings["dataset"] not in (None, SHARED_PREFIX):  # token ids to text
        return None
    from tokenmill.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.of_model(settings["tokenizer"])
    return tokenizer.decode


class BenchError(RuntimeError):
    """What the bench cannot measure (a level in which no request succeeded, a server whose models it cannot list):
    an error to report, not a row of zeros."""


def _prompts(settings: dict, count: int, seed: int) -> list:
    """A level's prompts; random ones are fresh per level (``seed``), so no server is flattered by a cache warmed
    by an earlier level (shared-prefix ones share a fresh prefix, warmed only by the level's own warm-up)."""
    if settings["dataset"] == SHARED_PREFIX:
        return shared_prefix_prompts(count, settings["prefix_len"], settings["input_len"], settings["vocab_size"],
                                     seed)
    if settings["dataset"] == COPY:
        return copy_prompts(count)
    if settings["dataset"]:
        return dataset_prompts(settings["dataset"], count)
    return random_prompts(count, settings["input_len"], settings["vocab_size"], seed)


def run_sweep(settings: dict) -> dict:
    """Every level in turn; raises BenchError when every request of a level fails."""
    spec = LoadSpec(normalize_base_url(settings["base_url"]), settings["model"], settings["api_key"],
                    settings["endpoint"], settings["output_len"], temperature=settings["temperature"])
    detokenize = _detokenizer(settings)
    levels = [int(c) for c in str(settings["concurrency"]).split(",")]
    seed = settings["seed"] if settings["seed"] is not None else time.time_ns()
    report = {"settings": settings, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "levels": []}
    for i, concurrency in enumerate(levels):
        count = settings["num_prompts"] or 4 * concurrency
        warmup = settings["warmup"] * concurrency
        prompts = _prompts(settings, warmup + count, seed + i)
        if warmup:
            asyncio.run(run_level(spec, prompts[:warmup], concurrency, None, detokenize))
        results, server = asyncio.run(_level(spec, prompts[warmup:], concurrency, settings, detokenize))
        if results and not any(r.ok for r in results):
            first = results[0]
            raise BenchError(f"every request at concurrency {concurrency} failed ({len(results)} of {len(results)}); "
                             f"the first: {first.error}: {first.detail}")
        level = {"concurrency": concurrency, **summarize(results, settings["hourly_cost"]), "server": server}
        report["levels"].append(level)
    return report


def _settings(args: argparse.Namespace) -> dict:
    settings = dict(DEFAULTS)
    if args.config:
        with open(args.config, "rb") as fh:
            settings.update(tomllib.load(fh).get("benchmark", {}))
    settings.update({k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None})
    unknown = set(settings) - set(DEFAULTS)
    if unknown:
        raise SystemExit(f"tokenmill bench: unknown [benchmark] settings: {', '.join(sorted(unknown))}")
    settings["base_url"] = normalize_base_url(settings["base_url"])
    if settings["model"] is None:
        import httpx
        headers = {"Authorization": f"Bearer {settings['api_key']}"} if settings["api_key"] else {}
        url = settings["base_url"] + "/models"
        try:
            response = httpx.get(url, headers=headers, timeout=10)
            if response.status_code != 200:  # e.g. 503 while the model loads (wait for /ready), 401 a wrong key
                raise BenchError(f"cannot list the models at {url}: HTTP {response.status_code}: "
                                 f"{error_message(response.text)}")
            settings["model"] = response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise BenchError(f"cannot list the models at {url} (pass --model, or check --base-url): "
                             f"{type(exc).__name__}: {exc}") from None
    if settings["vocab_size"] is None:
        settings["vocab_size"] = 32000  # a floor most tokenizers exceed; pass --vocab-size for others
    return settings


def compare(before_path: str, after_path: str) -> str:
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    keys = [("output_tok_per_s", None), ("total_tok_per_s", None), ("request_throughput", None),
            ("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99"), ("e2e_s", "p99")]
    lines = ["| concurrency | figure | before | after | change |", "|---|---|---|---|---|"]
    after_levels = {lv["concurrency"]: lv for lv in after["levels"]}
    for lv in before["levels"]:
        other = after_levels.get(lv["concurrency"])
        if other is None:
            continue
        for key, sub in keys:
            a = lv[key][sub] if sub else lv[key]
            b = other[key][sub] if sub else other[key]
            change = f"{(b - a) / a * 100:+.1f}%" if a and b is not None else "n/a"
            name = f"{key} {sub}" if sub else key
            lines.append(f"| {lv['concurrency']} | {name} | {a:.4g} | {b:.4g} | {change} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        if len(argv) != 3:
            raise SystemExit("usage: tokenmill bench compare BEFORE.json AFTER.json")
        print(compare(argv[1], argv[2]))
        return 0
    parser = argparse.ArgumentParser(prog="tokenmill bench", description=__doc__)
    parser.add_argument("--config", help="TOML file; its [benchmark] table holds defaults for these flags")
    for name, default in DEFAULTS.items():
        kind = type(default) if default is not None and not isinstance(default, str) else None
        if name in ("hourly_cost", "max_seconds"):
            kind = float
        if name in ("num_prompts", "seed", "vocab_size", "prefix_len"):
            kind = int
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                            help=f"(default: {default})")
    try:
        settings = _settings(parser.parse_args(argv))
        report = run_sweep(settings)
    except BenchError as exc:
        print(f"tokenmill bench: error: {exc}", file=sys.stderr)
        return 1
    print(markdown_table(report))
    if settings["out"]:
        out = Path(settings["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(report, indent=2))
        for note in write_plots(report, out):
            print(note, file=sys.stderr)
    return 0
