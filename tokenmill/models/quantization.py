"""Which linear layers of a model hold quantized weights, in which format: the plan settle measures and build applies.

- ``--quantization auto`` (the default): as the checkpoint ships them. A GGUF file's Q4_0 / Q4_1 / Q8_0 tensors are
  candidates (a fused layer only where all its parts share a format); engine/layouts.py times each candidate shape
  against the dense GEMM and keeps it quantized only at the row counts where it wins (a candidate that never wins is
  dequantized, as before).
- ``checkpoint``: the checkpoint's quantized tensors at every row count (no timing, no dense copy).
- ``none``: every layer full precision (dequantized at load).
- ``int8`` / ``int4`` / ``fp8``: every linear layer of the decoder and the LM head rounded at load (int8 per output
  channel; int4 asymmetric in groups of ``quantization_group_size`` inputs, 128 by default, a row's last group shorter
  where it does not divide the width; fp8 e4m3 per channel; the LM head in int8 for int4, as llama.cpp's files keep
  it at 8 bits). A layer whose input width is not a multiple of 32 stays full precision.
"""

from __future__ import annotations

from tokenmill.models.config import ModelConfig

BLOCK = 32  # kernels/quant_linear.py's block: every quantized input width is a multiple of it

def at_load_format(mode: str, in_features: int, head: bool, group_size: int = 128) -> str | None:
    """The format ``--quantization mode`` rounds an [*, in_features] layer into; None: it stays full precision."""
    if in_features % BLOCK:
        return None
    if mode == "int8" or (mode == "int4" and head):
        return "int8-ch"
    if mode == "fp8":
        return "fp8-ch"
    return f"int4-g{group_size}"


def candidate_formats(model, model_config: ModelConfig, mode: str, group_size: int = 128
                      ) -> dict[str, tuple[str, bool]]:
    """Module path -> (format name, quantize_at_load) for each linear layer that may hold a quantized weight.
    ``model``: a model class instance (the meta device will do) with ``linear_sources``."""
    sources = getattr(model, "linear_sources", None)
    if mode == "none" or sources is None:
        return {}
    plan = {}
    for path, parts in sources().items():
        layer = model.get_submodule(path)
        if mode in ("int8", "int4", "fp8"):
            fmt = at_load_format(mode, layer.in_features, path == "lm_head", group_size)
            if fmt is not None:
                plan[path] = (fmt, True)
        elif model_config.quantization is not None:
            formats = {model_config.quantization.format_of(part) for part in parts}
            if len(formats) == 1 and None not in formats:
                plan[path] = (formats.pop(), False)
    return plan


def check_supported(model, model_config: ModelConfig, mode: str) -> None:
    """A ValueError where ``mode`` asks for quantized layers a model cannot hold yet."""
    if mode in ("int8", "int4", "fp8") and getattr(model, "linear_sources", None) is None:
        raise ValueError(f"--quantization {mode} is not built for {model_config.architecture} yet")


def matrix_bytes(fmt: str, out_features: int, in_features: int) -> int:
    """Bytes of an [out, in] weight in format ``fmt`` (kernels/quant_linear.py's layout; pure, for ``tokenmill plan``):
    the codes plus, per group of each row, an fp16 scale (fp8: float32) and, for int4 and ``-zp`` formats, a min
    (fp16; float32 for ``-zp``)."""
    kind, group, *zp = fmt.split("-")
    size = in_features if group == "ch" else int(group[1:])
    groups = -(-in_features // size)
    per_group = (4 if kind == "fp8" else 2) + (4 if zp else 2 if kind == "int4" else 0)
    return out_features * ((in_features // 2 if kind == "int4" else in_features) + groups * per_group)


def dense_quantized_bytes(model_config: ModelConfig, mode: str, group_size: int = 128, other_bytes: int = 2) -> int:
    """What a dense (GQA/MHA) model's weights take under ``--quantization mode``: its linear layers and LM head in
    their formats (at_load_format), the rest (embedding, norms, biases) at ``other_bytes`` each (bf16: 2). A tied
    embedding is held twice: dense for the lookup, quantized as the head."""
    m = model_config
    h, d, inter, vocab = m.hidden_size, m.head_dim, m.intermediate_size, m.vocab_size
    matrices = [(m.num_heads * d, h), (m.num_kv_heads * d, h), (m.num_kv_heads * d, h), (h, m.num_heads * d),
                (inter, h), (inter, h), (h, inter)]
    total = 0
    for out_features, in_features in matrices:
        fmt = at_load_format(mode, in_features, False, group_size)
        total += matrix_bytes(fmt, out_features, in_features) if fmt else out_features * in_features * other_bytes
    total *= m.num_layers
    biases = (m.num_heads + 2 * m.num_kv_heads) * d if m.attention_bias else 0
    total += (2 * h + biases) * m.num_layers * other_bytes + h * other_bytes  # norms, biases, the final norm
    head = at_load_format(mode, h, True, group_size)
    total += matrix_bytes(head, vocab, h) if head else vocab * h * other_bytes
    return total + vocab * h * other_bytes  # the embedding
