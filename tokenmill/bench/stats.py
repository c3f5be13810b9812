"""Per-request timings -> per-level figures. Definitions match the server's metrics:
TTFT = first token - request start; TPOT = (last token - first token) / (output tokens - 1);
inter-token latency = gap between consecutive streamed chunks carrying text; e2e = end - start."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    start: float
    end: float
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    # Arrival time of every streamed chunk that carried output.
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None  # the kind: "HTTP 404", "stream error", "ConnectError", ...
    detail: str = ""  # the server's error message or the exception's text
    # True when the server reported usage; otherwise output_tokens counts chunks.
    usage_reported: bool = True

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.chunk_times) < 2 or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e(self) -> float:
        return self.end - self.start


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None}


def cost_per_million(hourly_cost: float, tokens_per_second: float) -> float | None:
    """USD per million tokens = hourly cost / tokens per hour x 1e6."""
    if tokens_per_second <= 0:
        return None
    return hourly_cost / (tokens_per_second * 3600) * 1e6


def summarize(results: list[RequestResult], hourly_cost: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    duration = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    output = sum(r.output_tokens for r in ok)
    total = output + sum(r.prompt_tokens for r in ok)
    summary = {
        "requests": len(results), "completed": len(ok), "errors": errors, "duration_s": duration,
        "output_tokens": output, "prompt_tokens": total - output,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_tok_per_s": output / duration if duration else 0.0,
        "total_tok_per_s": total / duration if duration else 0.0,
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itls]),
        "e2e_s": distribution([r.e2e for r in ok]),
        "usage_reported": all(r.usage_reported for r in ok),
    }
    if hourly_cost is not None:
        summary["usd_per_million_output_tokens"] = cost_per_million(hourly_cost, summary["output_tok_per_s"])
        summary["usd_per_million_total_tokens"] = cost_per_million(hourly_cost, summary["total_tok_per_s"])
    return summary
