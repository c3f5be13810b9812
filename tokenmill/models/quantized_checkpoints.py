"""Quantized Hugging Face checkpoints as shipped -> kernels/quant_linear.py's formats, tensor by tensor.

Each method stores a quantized linear layer ``<module>`` as a few tensors; ``convert`` gathers them per module and
yields the layer's ``<module>.qweight``, ``.scales`` and ``.mins`` (names the model copies into a QuantLinear's
buffers). Codes are repacked (the nibble order differs), never dequantized; zero points become mins,
``w = (q - z) * s`` = ``q * s + (-z * s)``, exact in float32 (the ``-zp`` formats) for an integer z and an fp16 s.

- compressed-tensors (what llm-compressor writes), ``format``:
  - ``pack-quantized`` (W4A16 / W8A16): ``weight_packed`` int32 [out, in * bits / 32], element i of a row at bits
    ``bits * i`` of the row's little-endian bit stream, stored as ``q + 2^(bits-1)``; ``weight_scale`` [out, groups];
    asymmetric: ``weight_zero_point`` int32 packed the same way along the output dimension; ``weight_shape``.
  - ``float-quantized`` (FP8, W8A8-FP8): ``weight`` float8_e4m3fn [out, in], ``weight_scale`` [out, 1] or [1];
    a static ``input_scale`` is not used (activations are quantized per token, dynamically).
  - ``int-quantized`` / ``naive-quantized`` (W8A8 int8, W8A16): ``weight`` int8 [out, in], ``weight_scale``.
- AWQ (``version: gemm``): ``qweight`` int32 [in, out / 8], ``qzeros`` int32 [in / group, out / 8], eight 4-bit
  values a word in AWQ's order (0, 2, 4, 6, 1, 3, 5, 7); ``scales`` fp16 [in / group, out].
- GPTQ: ``qweight`` int32 [in * bits / 32, out] packed along the input, ``qzeros`` int32 [groups, out * bits / 32]
  along the output, ``scales`` fp16 [groups, out], ``g_idx`` [in]; the ``gptq`` checkpoint format stores zeros
  minus one (``gptq_v2`` does not). With ``desc_act`` the groups follow ``g_idx`` (activation order: input i is in
  group ``g_idx[i]``) rather than the input order.

Activation order (GPTQ's ``desc_act``, compressed-tensors' ``actorder: group`` with ``weight_g_idx``): the layer's
inputs are sorted by group (``input_perm``: a stable argsort of g_idx), its codes' columns permuted alike, and the layer
permutes its input before the matmul (models/layers/linear.py): ``x @ W^T = x[:, perm] @ W[:, perm]^T``, and in the
permuted order every group is consecutive, as the kernels need. A g_idx whose groups are not all ``group_size`` inputs
(the last one excepted) is a ModelLoadError.

A tensor that does not have the shape its method defines is a ModelLoadError naming it, before anything is served.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from tokenmill.kernels.quant_linear import pack_int4
from tokenmill.models.paths import ModelLoadError
from tokenmill.models.quant_methods import PARTS, has_input_order, linear_format

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each 4-bit slot of a word holds, by slot


# --- the tensors

def convert(weights: Iterator[tuple[str, torch.Tensor]], quant: dict[str, Any], modules: Iterable[str]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass every tensor but those of the quantized ``modules`` (checkpoint names) through; gather each quantized
    module's tensors and yield its pieces."""
    method, fmt = linear_format(quant)
    quantized = set(modules)
    needed = set(PARTS[method])
    if method == "pack-quantized":
        needed |= {"weight_zero_point"} if _asymmetric(quant) else set()
        needed |= {"weight_g_idx"} if has_input_order(quant) else set()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if module not in quantized:
            yield name, tensor
            continue
        if leaf == "input_scale":
            continue  # static activation scales: activations are quantized dynamically here
        if leaf not in needed:
            raise ModelLoadError(f"unexpected tensor {name} in a {method} checkpoint")
        found = pending.setdefault(module, {})
        found[leaf] = tensor
        if needed <= found.keys():
            del pending[module]
            for piece, value in pieces(method, fmt, quant, module, found).items():
                yield f"{module}.{piece}", value
    if pending:
        module, found = next(iter(pending.items()))
        raise ModelLoadError(f"quantized layer {module} is missing tensors: has {sorted(found)}, "
                             f"needs {sorted(needed - found.keys())}")


def _asymmetric(quant: dict[str, Any]) -> bool:
    weights = next(iter((quant.get("config_groups") or {}).values()), {}).get("weights") or {}
    return not weights.get("symmetric", True)


def _check(module: str, leaf: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]):
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype not in dtypes:
        raise ModelLoadError(f"quantized tensor {module}.{leaf} is {tuple(tensor.shape)} {tensor.dtype}; the format "
                             f"defines {tuple(shape)} {' or '.join(map(str, dtypes))}")


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [rows, words], values packed little-endian ``bits`` apiece along each row -> int32 [rows, count]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    return values.reshape(words.shape[0], -1)[:, :count]


def pieces(method: str, fmt: str, quant: dict[str, Any], module: str, t: dict[str, torch.Tensor]
           ) -> dict[str, torch.Tensor]:
    bits = 4 if fmt.startswith("int4") else 8
    if method == "awq":
        return _awq(module, t, quant.get("group_size", 128))
    if method == "gptq":
        return _gptq(module, t, bits, quant)
    if method == "pack-quantized":
        return _pack_quantized(module, t, bits, fmt)
    return _unpacked(module, t, fmt)


def _codes_out(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, fmt: str,
               ) -> dict[str, torch.Tensor]:
    """codes [out, in] (unsigned, 0..2^bits - 1), scales [out, groups], integer zeros [out, groups] in the codes'
    terms (None: symmetric around 2^(bits-1)) -> our pieces."""
    zero = zeros.float() if zeros is not None else torch.full_like(scales, 2 ** (bits - 1), dtype=torch.float32)
    scale = scales.to(torch.float16)
    mins = -zero * scale.float()
    if bits == 4:
        return {"qweight": pack_int4(codes), "scales": scale, "mins": mins if fmt.endswith("-zp") else
                mins.to(torch.float16)}
    signed = (codes - 128).to(torch.int8)  # int8 codes; w = (c + 128 - z) * s
    out = {"qweight": signed, "scales": scale}
    if fmt.endswith("-zp"):
        out["mins"] = (128 - zero) * scale.float()
    return out


def _awq(module: str, t: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = -(-in_features // group_size)
    _check(module, "qweight", qweight, (in_features, out_features // 8), (torch.int32,))
    _check(module, "qzeros", qzeros, (groups, out_features // 8), (torch.int32,))
    _check(module, "scales", scales, (groups, out_features), (torch.float16, torch.bfloat16, torch.float32))
    order = torch.tensor(AWQ_ORDER).argsort()  # slot holding each column within a word
    def columns(words):  # [rows, out / 8] -> [rows, out] in column order
        values = unpack_int32(words, 4, words.shape[1] * 8).view(words.shape[0], -1, 8)
        return values[:, :, order].reshape(words.shape[0], -1)
    codes = columns(qweight).T.contiguous()  # [out, in]
    zeros = columns(qzeros).T.contiguous()  # [out, groups]
    return _codes_out(codes, scales.T.contiguous(), zeros, 4, "int4-zp")


def _gptq(module: str, t: dict[str, torch.Tensor], bits: int, quant: dict[str, Any]) -> dict[str, torch.Tensor]:
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t["g_idx"]
    per_word = 32 // bits
    in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
    group_size = quant.get("group_size", 128)
    group_size = in_features if group_size in (-1, None) else group_size
    groups = -(-in_features // group_size)
    _check(module, "qweight", qweight, (in_features // per_word, out_features), (torch.int32,))
    _check(module, "qzeros", qzeros, (groups, -(-out_features // per_word)), (torch.int32,))
    _check(module, "scales", scales, (groups, out_features), (torch.float16, torch.bfloat16, torch.float32))
    codes = unpack_int32(qweight.T.contiguous(), bits, in_features)  # [out, in]
    zeros = unpack_int32(qzeros, bits, out_features).T.contiguous()  # [out, groups]
    if quant.get("checkpoint_format", "gptq") != "gptq_v2":
        zeros = zeros + 1
    perm = _input_order(module, "g_idx", g_idx, in_features, group_size, ordered=bool(quant.get("desc_act")))
    if perm is not None:
        codes = codes[:, perm]
    return _ordered(_codes_out(codes, scales.T.contiguous(), zeros, bits, f"int{bits}-zp"), perm)


def _input_order(module: str, leaf: str, g_idx: torch.Tensor, in_features: int, group_size: int, ordered: bool
                 ) -> torch.Tensor | None:
    """The input permutation that makes a layer's groups consecutive (int32 [in]); None where the layer is not served
    in activation order (``ordered``: the config says it is), where g_idx must then be the consecutive grouping."""
    consecutive = torch.arange(in_features) // group_size
    _check(module, leaf, g_idx, (in_features,), (torch.int32, torch.int64))
    if not ordered:
        if not torch.equal(g_idx.long(), consecutive):
            raise ModelLoadError(f"{module}.{leaf} groups the inputs in activation order, but the config does not "
                                 "say so (desc_act / actorder: group)")
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], consecutive):
        raise ModelLoadError(f"{module}.{leaf} does not put {group_size} inputs in every group")
    return perm.to(torch.int32)


def _ordered(pieces: dict[str, torch.Tensor], perm: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A layer's pieces, with its input permutation where it has one (every layer of an activation-order checkpoint
    holds one: the identity where its g_idx is consecutive)."""
    return pieces if perm is None else {**pieces, "input_perm": perm}


def _pack_quantized(module: str, t: dict[str, torch.Tensor], bits: int, fmt: str) -> dict[str, torch.Tensor]:
    packed, scales = t["weight_packed"], t["weight_scale"]
    out_features, in_features = (int(v) for v in t["weight_shape"].tolist())
    words = -(-in_features * bits // 32)
    groups = scales.shape[1] if scales.dim() == 2 else 1
    _check(module, "weight_packed", packed, (out_features, words), (torch.int32,))
    _check(module, "weight_scale", scales, (out_features, groups), (torch.float16, torch.bfloat16, torch.float32))
    codes = unpack_int32(packed, bits, in_features)
    zeros = None
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        zeros = unpack_int32(zp.T.contiguous(), bits, out_features).T.contiguous() if zp.dtype == torch.int32 \
            else zp.to(torch.int32) + 2 ** (bits - 1)
        _check(module, "weight_zero_point", zeros, (out_features, groups), (torch.int32,))
    perm = None
    if "weight_g_idx" in t:
        perm = _input_order(module, "weight_g_idx", t["weight_g_idx"], in_features, -(-in_features // groups),
                            ordered=True)
        codes = codes[:, perm]
    return _ordered(_codes_out(codes, scales, zeros, bits, fmt), perm)


def _unpacked(module: str, t: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    weight, scale = t["weight"], t["weight_scale"].float()
    out_features = weight.shape[0]
    kind_dtype = torch.float8_e4m3fn if fmt.startswith("fp8") else torch.int8
    _check(module, "weight", weight, tuple(weight.shape), (kind_dtype,))
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(out_features, 1)
    _check(module, "weight_scale", scale, (out_features, 1), (torch.float32,))
    scale = scale.reshape(out_features, 1).contiguous()
    return {"qweight": weight, "scales": scale if fmt.startswith("fp8") else scale.to(torch.float16)}
