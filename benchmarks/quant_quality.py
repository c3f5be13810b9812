"""Quality of each weight format on the embedded SmolLM2 against its fp32 model dequantized from the GGUF: mean KL
divergence of teacher-forced next-token distributions and greedy (top-1) agreement over tests/data/quality_prompts.txt
(the prompts and the measure of tests/models/test_quantized_quality.py, whose bounds come from this), plus each
variant's weight bytes as the engine holds them.

    python benchmarks/quant_quality.py [--out benchmarks/results/quant-quality.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import next_token_quality  # noqa: E402
from tests.models.test_quantized_quality import VARIANTS, logprobs, prompt_ids  # noqa: E402
from tokenmill import LLM  # noqa: E402

COMMON = {"dtype": "float32", "kv_cache_dtype": "fp32", "kv_cache_memory": "64MiB", "max_model_len": 1024,
          "enforce_eager": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant-quality.json"))
    args = parser.parse_args()
    reference = LLM(quantization="none", **COMMON)
    ids = prompt_ids(reference)
    ref = logprobs(reference, ids)
    results = [{"variant": "fp32 (none)", "weight_bytes": reference.engine.info.weight_bytes}]
    for name, (settings, bounds) in VARIANTS.items():
        llm = LLM(**COMMON, **settings)
        kl, agreement = next_token_quality(ref, logprobs(llm, ids))
        results.append({"variant": name, "settings": settings, "mean_kl": kl, "greedy_agreement": agreement,
                        "test_bounds": {"max_mean_kl": bounds[0], "min_greedy_agreement": bounds[1]},
                        "weight_bytes": llm.engine.info.weight_bytes})
        print(f"{name}: mean KL {kl:.5f}, greedy agreement {agreement:.4f}, {results[-1]['weight_bytes']:,} bytes")
        del llm
    Path(args.out).write_text(json.dumps({"command": "python benchmarks/quant_quality.py",
                                          "positions": sum(map(len, ids)), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
