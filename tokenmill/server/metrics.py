"""Prometheus metrics, all prefixed ``tokenmill:`` and labelled ``model_name``.

Definitions (measured where the server sends tokens; arrival is when the HTTP request was parsed):
- TTFT (time_to_first_token_seconds) = first token sent - arrival;
- inter-token latency (inter_token_latency_seconds) = time between two consecutive tokens sent to one
  request;
- TPOT (time_per_output_token_seconds), one observation per finished request with at least two output tokens
  = (last token sent - first token sent) / (output tokens - 1): the mean inter-token latency of that request;
- e2e latency = last token sent - arrival; queue time = first scheduled - arrival;
  prefill time = first token - first scheduled; decode time = last token - first token.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.engine.client import EngineClient
from tokenmill.server.admission import Admission
from tokenmill.server.ledger import Usage

P = "tokenmill:"
# 429 (admission limit), 400 (prompt + max_tokens too long), 429 (a key over its own rpm / tpm: server/tenants.py)
REJECT_REASONS = ("admission", "context_length", "key_rate_limit")
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Scheduler, client and admission state, read at scrape time (plain attributes: no locking needed for a gauge)."""

    def __init__(self, model: str, engine: Callable[[], "tuple[EngineClient, Admission] | None"]):
        self.model, self.engine = model, engine

    def collect(self):
        engine = self.engine()
        if engine is None:  # not loaded (yet, or unloaded): no series until it is
            return
        client, admission = engine
        stats = client.stats
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", stats.kv_cache_usage),
            ("admission_saturation", "Promised tokens / admission limit; at 1 new requests get 429.",
             admission.saturation),
            ("model_weight_bytes", "Bytes of the model's weights as the engine holds them (quantized layers at "
             "their format's size).", client.info.weight_bytes if client.info else 0),
            # Absent with --no-engine-process (the engine then shares process_resident_memory_bytes).
            *([("engine_process_resident_memory_bytes", "Resident memory of the engine process.",
                stats.resident_memory_bytes)] if client.engine_in_own_process else []),
        ):
            gauge = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            gauge.add_metric([self.model], value)
            yield gauge
        info = client.info
        if info is not None:  # the Gateway API Inference Extension's endpoint picker reads these two labels
            cache = GaugeMetricFamily(P + "cache_config_info", "The KV cache's layout (value 1): tokens per block and "
                                      "blocks in the pool.", labels=["model_name", "block_size", "num_gpu_blocks"])
            cache.add_metric([self.model, str(info.kv_block_size), str(info.kv_capacity_tokens // info.kv_block_size)],
                             1)
            yield cache
        counters = [
            ("num_preemptions", "Requests preempted (KV blocks freed, recomputed later).", stats.num_preemptions_total),
            ("requests_aborted", "Requests aborted before finishing (client gone, cancelled).",
             stats.num_aborted_total),
            ("engine_decode_steps", "Engine steps in which every scheduled request decoded one token.",
             stats.num_decode_steps_total),
            ("engine_decode_step_seconds", "Wall time of those steps (mean decode step = its rate / the steps' rate).",
             stats.decode_step_seconds_total),
            ("prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache.",
             stats.prefix_cache_queries_total),
            ("prefix_cache_hits", "Of those tokens, the ones found cached (their KV reused, not computed).",
             stats.prefix_cache_hits_total),
            ("spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).",
             stats.spec_num_draft_tokens_total),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens_total),
            ("spec_decode_num_draft_tokens_per_pos", "Draft tokens verified at each draft position (0 = first).",
             stats.spec_drafted_by_position),
            ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position; over the "
             "drafted ones it is the acceptance rate by position.", stats.spec_accepted_by_position),
        ]
        for name, doc, value in counters:
            if isinstance(value, list):  # one value per draft position
                counter = CounterMetricFamily(P + name, doc, labels=["model_name", "position"])
                for position, v in enumerate(value):
                    counter.add_metric([self.model, str(position)], v)
            else:
                counter = CounterMetricFamily(P + name, doc, labels=["model_name"])
                counter.add_metric([self.model], value)
            yield counter


class Metrics:
    """One registry for every model of the server; each model's series carry its ``model_name``."""

    def __init__(self, per_key: bool = False):
        self.registry = CollectorRegistry()
        # Series per API key name only where the operator asks (metrics_per_key): /metrics is often scraped by whoever
        # runs the monitoring, and key names name tenants.
        self.per_key = per_key
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "First token sent - arrival.", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1).", labels,
                              buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Last token sent - arrival.", labels,
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "First scheduled - arrival.", labels,
                               buckets=_REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram(P + "request_prefill_time_seconds", "First token - first scheduled.", labels,
                                 buckets=_REQUEST_BUCKETS, registry=r)
        self.decode = Histogram(P + "request_decode_time_seconds", "Last token - first token.", labels,
                                buckets=_REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter(P + "request_success", "Requests finished, by finish reason.",
                               labels + ["finish_reason"], registry=r)
        self.rejected = Counter(P + "requests_rejected", "Requests refused before running, by reason.",
                                labels + ["reason"], registry=r)
        self.engine_seconds = Counter(P + "engine_seconds", "Engine time of finished requests (each step's wall "
                                      "time shared among its requests by tokens computed).", labels, registry=r)
        # Per API key (the keys are the configured ones: a bounded set of label values).
        keyed = labels + ["key_name"]
        self.key_tokens = Counter(P + "key_tokens", "Tokens per API key name and kind (prompt, cached: of the "
                                  "prompt, served from the prefix cache; generation).", keyed + ["kind"], registry=r)
        self.key_requests = Counter(P + "key_requests", "Requests per API key, by outcome (ok; error: refused, "
                                    "failed or cut off before they finished).", keyed + ["outcome"], registry=r)
        self.key_engine_seconds = Counter(P + "key_engine_seconds", "Engine time of a key's finished requests.",
                                          keyed, registry=r)
        self.key_ttft = Histogram(P + "key_time_to_first_token_seconds", "First token sent - arrival, per API key.",
                                  keyed, buckets=_TTFT_BUCKETS, registry=r)
        self.engine_restarts = Counter(P + "engine_restarts", "Engine processes restarted after they failed "
                                       "(a server of several models restarts a model's engine with backoff).",
                                       labels, registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc., for peak-memory reports

    def add_model(self, model: str, engine: Callable[[], "tuple[EngineClient, Admission] | None"]) -> None:
        """The series of one served model; ``engine`` gives its client and admission while it is loaded."""
        # Known label values start at 0, so rate() and the dashboard see the series before the first event.
        for series in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode,
                       self.prompt_tokens, self.generation_tokens, self.engine_seconds):
            series.labels(model)
        for reason in REJECT_REASONS:
            self.rejected.labels(model, reason)
        for finish_reason in ("stop", "length"):
            self.success.labels(model, finish_reason)
        self.engine_restarts.labels(model)
        self.registry.register(_EngineCollector(model, engine))

    def account(self, model: str, key_name: str | None, usage: Usage) -> None:
        """One request's usage (server/ledger.py): the model's engine time, and the key's series."""
        self.engine_seconds.labels(model).inc(usage.engine_seconds)
        if key_name and self.per_key:
            self.key_requests.labels(model, key_name, "error" if usage.errors else "ok").inc()
            for kind, tokens in (("prompt", usage.prompt_tokens), ("cached", usage.cached_tokens),
                                 ("generation", usage.completion_tokens)):
                self.key_tokens.labels(model, key_name, kind).inc(tokens)
            self.key_engine_seconds.labels(model, key_name).inc(usage.engine_seconds)

    def reject(self, model: str, reason: str) -> None:
        assert reason in REJECT_REASONS, reason
        self.rejected.labels(model, reason).inc()

