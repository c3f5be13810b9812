"""Writes deploy/grafana/tokenmill.json, the tokenmill Grafana dashboard (run it after editing PANELS; a test checks
that the JSON is up to date and evaluates every query against a real Prometheus scraping tokenmill).

Variables: ``datasource`` (any Prometheus), ``model`` (model_name label values), ``node_hourly_cost`` (what the
node costs per hour, in your currency: cost per million output tokens = hourly cost / (3600 x output tok/s) x 1e6).
"""

from __future__ import annotations

import json
from pathlib import Path

SEL = '{model_name=~"$model"}'
RATE = "[$__rate_interval]"
KEY_GENERATION = '{model_name=~"$model",kind="generation"}'


def quantiles(metric: str) -> list[tuple[str, str]]:
    """p50/p90/p99 of a tokenmill histogram, over all label values of the selected models."""
    return [(f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate(tokenmill:{metric}_bucket{SEL}{RATE})))")
            for q in (50, 90, 99)]


# (title, unit, description, [(legend, PromQL)])
PANELS = [
    ("Time to first token", "s", "First token sent - request arrival.", quantiles("time_to_first_token_seconds")),
    ("Time per output token (TPOT)", "s", "Per request: (last token - first token) / (output tokens - 1).",
     quantiles("time_per_output_token_seconds")),
    ("Inter-token latency", "s", "Time between consecutive tokens of a request.",
     quantiles("inter_token_latency_seconds")),
    ("End-to-end request latency", "s", "Last token sent - request arrival.",
     quantiles("e2e_request_latency_seconds")),
    ("Queue time", "s", "First scheduled - arrival.", quantiles("request_queue_time_seconds")),
    ("Requests running / waiting", "short", "Requests in the running batch and waiting to be scheduled.",
     [("running", f"sum(tokenmill:num_requests_running{SEL})"),
      ("waiting", f"sum(tokenmill:num_requests_waiting{SEL})")]),
    ("KV cache usage", "percentunit", "Fraction of KV cache blocks in use.",
     [("{{model_name}}", f"max by (model_name) (tokenmill:kv_cache_usage_perc{SEL})")]),
    ("Admission saturation", "percentunit", "Promised tokens / admission limit; at 100% new requests get 429.",
     [("{{model_name}}", f"max by (model_name) (tokenmill:admission_saturation{SEL})")]),
    ("Rejected requests", "reqps", "Refused before running: admission (429) and context length (400).",
     [("{{reason}}", f"sum by (reason) (rate(tokenmill:requests_rejected_total{SEL}{RATE}))")]),
    ("Tokens per second", "short", "Prompt tokens processed and tokens generated per second.",
     [("prompt", f"sum(rate(tokenmill:prompt_tokens_total{SEL}{RATE}))"),
      ("generation", f"sum(rate(tokenmill:generation_tokens_total{SEL}{RATE}))")]),
    ("Finished requests", "reqps", "Requests finished per second, by finish reason.",
     [("{{finish_reason}}", f"sum by (finish_reason) (rate(tokenmill:request_success_total{SEL}{RATE}))")]),
    ("Preemptions", "ops", "Requests preempted per second (KV blocks freed, recomputed later).",
     [("preemptions", f"sum(rate(tokenmill:num_preemptions_total{SEL}{RATE}))")]),
    ("Aborted requests", "reqps", "Requests aborted before finishing (client gone, cancelled), per second.",
     [("aborted", f"sum(rate(tokenmill:requests_aborted_total{SEL}{RATE}))")]),
    ("Tokens per API key", "short", "Tokens per second by API key name (from --api-key-file) and kind.",
     [("{{key_name}} {{kind}}", f"sum by (key_name, kind) (rate(tokenmill:key_tokens_total{SEL}{RATE}))")]),
    ("Generated tokens per second by model", "short", "Tokens generated per second, per served model.",
     [("{{model_name}}", f"sum by (model_name) (rate(tokenmill:generation_tokens_total{SEL}{RATE}))")]),
    ("Time to first token p99 by model", "s", "99th percentile of first token sent - arrival, per model.",
     [("{{model_name}}", "histogram_quantile(0.99, sum by (le, model_name) "
                         f"(rate(tokenmill:time_to_first_token_seconds_bucket{SEL}{RATE})))")]),
    ("Time to first token p99 by API key", "s", "99th percentile of first token sent - arrival, per API key.",
     [("{{key_name}}", "histogram_quantile(0.99, sum by (le, key_name) "
                       f"(rate(tokenmill:key_time_to_first_token_seconds_bucket{SEL}{RATE})))")]),
    ("Cost per million output tokens by model", "currencyUSD",
     "node_hourly_cost x each model's share of engine time (its requests' steps, split by tokens computed) / its "
     "generated tokens x 1e6.",
     [("{{model_name}}", f"$node_hourly_cost / 3600 * 1e6 * sum by (model_name) (rate(tokenmill:engine_seconds_total"
                         f"{SEL}{RATE})) / (sum by (model_name) (rate(tokenmill:generation_tokens_total{SEL}{RATE})) "
                         "> 0)")]),
    ("Cost per million output tokens by API key", "currencyUSD",
     "node_hourly_cost x each key's share of engine time / its generated tokens x 1e6.",
     [("{{key_name}}", f"$node_hourly_cost / 3600 * 1e6 * sum by (key_name) (rate(tokenmill:key_engine_seconds_total"
                       f"{SEL}{RATE})) / (sum by (key_name) (rate(tokenmill:key_tokens_total{KEY_GENERATION}{RATE})) "
                       "> 0)")]),
    ("Requests per API key", "reqps", "Requests per second by API key and outcome (error: refused, failed or cut "
     "off).", [("{{key_name}} {{outcome}}",
                f"sum by (key_name, outcome) (rate(tokenmill:key_requests_total{SEL}{RATE}))")]),
    ("Engine restarts", "short", "Engines restarted after they failed, per model, over the last hour (a server "
     "of several models restarts them with backoff).",
     [("{{model_name}}", f"sum by (model_name) (increase(tokenmill:engine_restarts_total{SEL}[1h]))")]),
    ("Cost per million output tokens", "currencyUSD",
     "node_hourly_cost / (3600 x generated tokens per second) x 1e6; empty while nothing is generated.",
     [("cost", f"$node_hourly_cost * 1e6 / (3600 * (sum(rate(tokenmill:generation_tokens_total{SEL}{RATE})) > 0))")]),
    ("Process resident memory", "bytes", "Resident set size of the API process and of the engine process.",
     [("API {{instance}}", 'process_resident_memory_bytes{job="tokenmill"}'),
      ("engine {{instance}}", f"tokenmill:engine_process_resident_memory_bytes{SEL}")]),
]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel(index: int, title: str, unit: str, description: str, queries: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for i, (legend, expr) in enumerate(queries)],
    }


def dashboard() -> dict:
    return {
        "uid": "tokenmill", "title": "tokenmill", "tags": ["tokenmill", "llm"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "model", "label": "Model", "type": "query", "datasource": DATASOURCE,
             "query": {"query": "label_values(tokenmill:num_requests_running, model_name)", "refId": "models"},
             "definition": "label_values(tokenmill:num_requests_running, model_name)", "refresh": 2,
             "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
            {"name": "node_hourly_cost", "label": "Node cost per hour", "type": "textbox", "query": "2.50",
             "current": {"text": "2.50", "value": "2.50"}},
        ]},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def main() -> None:
    path = Path(__file__).with_name("tokenmill.json")
    path.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
