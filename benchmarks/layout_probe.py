"""How steady the start-up choice of quantized vs dense per layer shape is: the probe of engine/quant_layouts.py
(``dense_over_quantized``: dense / quantized time at each of QUANT_PROBE_ROWS) repeated ``--repeats``
times on the default model's shapes, each repeat's threshold by the rule in use (engine/layouts.py
``cheapest_threshold``: least summed relative time) and by the earlier one (dense from the smallest probed count
after which it never lost), from the same measured ratios.

    python benchmarks/layout_probe.py [--repeats 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenmill.engine.layouts import cheapest_threshold
from tokenmill.engine.quant_layouts import FALLBACK_DENSE_FROM_ROWS, QUANT_PROBE_ROWS, dense_over_quantized

# SmolLM2-135M's GGUF (Q4_0 layers, a Q8_0 LM head): (out, in, format, layers of the shape)
SHAPES = [(960, 576, "int4-g32", 30), (576, 576, "int4-g32", 30), (3072, 576, "int4-g32", 30),
          (576, 1536, "int4-g32", 30), (49152, 576, "int8-g32", 1)]


def never_lost_from(ratios: list[float | None], fallback_from: int) -> int | None:
    """The earlier rule: dense from the smallest probed count from which it won at every larger one."""
    threshold = None
    for rows, ratio in zip(reversed(QUANT_PROBE_ROWS), reversed(ratios)):
        if not (rows >= fallback_from if ratio is None else ratio <= 1.0):
            break
        threshold = rows
    return threshold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/layout-probe.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_out = []
    for out, inp, fmt, count in SHAPES:
        for repeat in range(args.repeats):  # the dense layout packed from 1 row: oneDNN's packed GEMM throughout
            ratios = dense_over_quantized(out, inp, count, fmt, torch.bfloat16, 1)
            row = {"shape": f"{out}x{inp}", "format": fmt, "repeat": repeat,
                   "dense_over_quantized": dict(zip(QUANT_PROBE_ROWS, ratios)),
                   "threshold_cheapest": cheapest_threshold(ratios, FALLBACK_DENSE_FROM_ROWS, QUANT_PROBE_ROWS),
                   "threshold_never_lost": never_lost_from(ratios, FALLBACK_DENSE_FROM_ROWS)}
            rows_out.append(row)
            print(f"{out}x{inp} {fmt} #{repeat}: cheapest {row['threshold_cheapest']}, never-lost "
                  f"{row['threshold_never_lost']}; ratios " + " ".join(
                      f"{r}:{v:.2f}" if v is not None else f"{r}:-" for r, v in zip(QUANT_PROBE_ROWS, ratios)),
                  flush=True)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/layout_probe.py --repeats {args.repeats} --threads {args.threads}"
    out_path.write_text(json.dumps({"command": command, "results": rows_out}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
