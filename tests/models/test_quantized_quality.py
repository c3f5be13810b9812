"""Quantized SmolLM2 against the fp32 model dequantized from its GGUF (the only full-precision SmolLM2 here): mean KL
divergence of the teacher-forced next-token distributions and greedy (top-1) agreement over the prompts committed in
tests/data/quality_prompts.txt, one bound per format (measured: BENCHMARKS.md, benchmarks/quant_quality.py)."""

from pathlib import Path

import pytest

from tests.helpers import next_token_quality, teacher_forced_logits
from tokenmill import LLM
from tokenmill.kernels.cpu_native import library
from tokenmill.models.layers.linear import QuantLinear

PROMPTS = (Path(__file__).parent.parent / "data" / "quality_prompts.txt").read_text().split("\n")
# format -> engine settings, (mean KL bound, greedy agreement bound). Measured over these prompts' 349 positions
# (benchmarks/quant_quality.py, BENCHMARKS.md): the file's own Q4_1 / Q8_0 weights 0.0036 / 0.963 (its int8
# activations are all that differs), int8 per channel 0.0096 / 0.937, int4 groups of 64 0.42 / 0.670 and of 128
# 0.62 / 0.596 (re-rounding a 135M model's already 4-bit weights to a coarser grid: 8% error per weight at g64).
# Each bound has about 1.5x headroom on the KL and a few points on the agreement.
VARIANTS = {
    "gguf-q4_1": ({"quantization": "checkpoint"}, (0.006, 0.94)),
    "int8-ch": ({"quantization": "int8"}, (0.015, 0.91)),
    "int4-g64": ({"quantization": "int4", "quantization_group_size": 64}, (0.6, 0.62)),
    "int4-g128": ({"quantization": "int4", "quantization_group_size": 128}, (0.9, 0.54)),
}


def prompt_ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS if p.strip()]


def logprobs(llm, ids):
    runner = llm.engine.runner
    return [teacher_forced_logits(runner.model, runner.kv_cache, t).log_softmax(-1) for t in ids]


@pytest.fixture(scope="module")
def reference(smollm_llm):
    ids = prompt_ids(smollm_llm)
    return ids, logprobs(smollm_llm, ids)


@pytest.mark.skipif(library() is None, reason="no C compiler: the CPU kernels are not built")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantized_quality_bounds(reference, variant):
    settings, (max_kl, min_agreement) = VARIANTS[variant]
    llm = LLM(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="64MiB", max_model_len=1024, **settings)
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * model.config.num_layers + 1  # every linear layer and the LM head
    assert all(m.dense_from_rows is None for m in quantized)
    ids, ref = reference
    kl, agreement = next_token_quality(ref, logprobs(llm, ids))
    print(f"{variant}: mean KL {kl:.4f}, greedy agreement {agreement:.3f} over {sum(map(len, ids))} positions")
    assert kl < max_kl and agreement > min_agreement, (kl, agreement)
    assert kl > 1e-5  # it did run quantized


@pytest.mark.skipif(library() is None, reason="no C compiler: the CPU kernels are not built")
def test_auto_runs_each_call_on_the_layout_its_row_count_settled(smollm_llm):
    """``auto`` keeps the GGUF's own weights where the start-up timing found them faster: each layer runs its
    quantized kernel below its ``dense_from_rows`` and the dense weight (the fp32 model's) from it up."""
    import torch

    from tokenmill.kernels.quant_linear import dequantize, quant_linear_reference

    llm = LLM(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="64MiB", max_model_len=1024,
              quantization="auto")
    dense_model = smollm_llm.engine.runner.model
    quantized = {name: m for name, m in llm.engine.runner.model.named_modules() if isinstance(m, QuantLinear)}
    table = {(out, inp, fmt): (t, amx) for out, inp, fmt, t, amx in llm.engine.settled.quant_layouts}
    for name, layer in quantized.items():
        threshold, amx_from = table[(layer.out_features, layer.in_features, layer.fmt.name)]
        assert threshold == layer.dense_from_rows != 1 and amx_from == layer.amx_from_rows
        dense = dense_model.get_submodule(name)
        for rows in (1, 3, 16, 64):
            x = torch.randn(rows, layer.in_features)
            got = layer.run(x)
            if layer.dense_from_rows is not None and rows >= layer.dense_from_rows:
                torch.testing.assert_close(got, dense.run(x) if hasattr(dense, "run") else dense(x))
            elif layer.amx_from_rows and rows >= layer.amx_from_rows:  # x and the weight rounded to bf16
                w = dequantize(layer.fmt, *layer.canonical()).bfloat16().double()
                ref = (x.bfloat16().double() @ w.t()).float()
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
            else:
                ref = quant_linear_reference(x, layer.fmt, *layer.canonical(), int8_activations=True)
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-4)
