"""Bench output: a Markdown table for stdout and PNG plots (when matplotlib is installed)."""

from __future__ import annotations

from pathlib import Path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def markdown_table(report: dict) -> str:
    s = report["settings"]
    lines = [f"{s['model']} at {s['base_url']}: {s['endpoint']}, {s['input_len']} prompt + {s['output_len']} output "
             "tokens", "",
             "| concurrency | req/s | output tok/s | total tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
             "| ITL p99 ms | e2e p50/p99 s | errors | KV peak | prefix hits | drafts accepted | preemptions "
             "| $/M output |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in report["levels"]:
        t, p = lv["ttft_s"], lv["tpot_s"]
        server = lv.get("server") or {}
        kv, hit_rate = server.get("kv_cache_usage_peak"), server.get("prefix_cache_hit_rate")
        accepted = server.get("spec_acceptance_rate")
        cost = lv.get("usd_per_million_output_tokens")
        e2e = lv["e2e_s"]
        lines.append(
            f"| {lv['concurrency']} | {lv['request_throughput']:.2f} | {lv['output_tok_per_s']:.1f} | "
            f"{lv['total_tok_per_s']:.1f} | {_ms(t['p50'])}/{_ms(t['p90'])}/{_ms(t['p99'])} | "
            f"{_ms(p['p50'])}/{_ms(p['p90'])}/{_ms(p['p99'])} | {_ms(lv['itl_s']['p99'])} | "
            f"{(e2e['p50'] or 0):.2f}/{(e2e['p99'] or 0):.2f} | {sum(lv['errors'].values()) or 0} | "
            f"{_percent(kv)} | {_percent(hit_rate)} | {_percent(accepted)} | "
            f"{server.get('preemptions') or 0:.0f} | "
            f"{'-' if cost is None else f'{cost:.3f}'} |")
    if not all(lv["usage_reported"] for lv in report["levels"]):
        lines.append("\nThe server reported no usage: output tokens were counted as streamed chunks.")
    return "\n".join(lines)


def _concurrency_axis(ax, levels: list[int], ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, labels=[str(c) for c in levels])
    ax.minorticks_off()
    ax.set(xlabel="concurrency", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()


def write_plots(report: dict, out: Path) -> list[str]:
    """throughput.png and latency.png in ``out``; returns notes for the user."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: pip install matplotlib"]
    levels = report["levels"]
    conc = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(conc, [lv["output_tok_per_s"] for lv in levels], marker="o", label="output tok/s")
    ax.plot(conc, [lv["total_tok_per_s"] for lv in levels], marker="o", label="total tok/s")
    _concurrency_axis(ax, conc, "tokens/s", "Throughput")
    fig.savefig(out / "throughput.png", dpi=120, bbox_inches="tight")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for q in ("p50", "p99"):
            ax.plot(conc, [(lv[key][q] or 0) * 1000 for lv in levels], marker="o", label=q)
        _concurrency_axis(ax, conc, "ms", title)
    fig.savefig(out / "latency.png", dpi=120, bbox_inches="tight")
    plt.close("all")
    return [f"plots written to {out}/throughput.png and {out}/latency.png"]
