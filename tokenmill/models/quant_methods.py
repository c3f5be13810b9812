"""The quantization methods of Hugging Face checkpoints, as config.json describes them (pure Python: models/config.py
and ``tokenmill plan`` read it without torch). models/quantized_checkpoints.py converts the tensors."""

from __future__ import annotations

import re
from typing import Any

# Tensors of one quantized module per method (compressed-tensors: per format), by suffix.
PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
         "pack-quantized": ("weight_packed", "weight_scale", "weight_shape"),
         "float-quantized": ("weight", "weight_scale"), "int-quantized": ("weight", "weight_scale"),
         "naive-quantized": ("weight", "weight_scale")}
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")
# compressed-tensors' actorder values, by effect: quantized in activation order with consecutive groups (nothing to do
# at inference), or groups in activation order (a ``weight_g_idx`` per layer; newer releases no longer write them).
ACTORDER_WEIGHT, ACTORDER_GROUP = ("weight", "static"), ("group", "dynamic", True)


def linear_format(quant: dict[str, Any]) -> tuple[str, str]:
    """(method key of PARTS, format name) of a quantization_config; ValueError for what is not served."""
    method = quant.get("quant_method")
    if method == "awq":
        if quant.get("version", "gemm").lower() != "gemm" or quant.get("bits", 4) != 4:
            raise ValueError(f"AWQ {quant.get('version')} with {quant.get('bits')} bits is not supported "
                             "(only version gemm, 4 bits)")
        return "awq", f"int4-{_group_name(quant.get('group_size', 128))}-zp"
    if method == "gptq":
        bits = quant.get("bits", 4)
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
        return "gptq", f"int{bits}-{_group_name(quant.get('group_size', 128))}-zp"
    if method == "compressed-tensors":
        groups = list((quant.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported (one)")
        group = groups[0]
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights") or {}
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if fmt not in PARTS or fmt in ("awq", "gptq"):
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported "
                             "(pack-quantized, float-quantized, int-quantized, naive-quantized)")
        if weights.get("actorder") not in (None, False, *ACTORDER_WEIGHT, *ACTORDER_GROUP):
            raise ValueError(f"compressed-tensors actorder {weights.get('actorder')!r} is not supported "
                             "(weight, static, group, dynamic)")
        group_name = _group_name(weights.get("group_size") if strategy == "group" else -1)
        if strategy not in ("group", "channel", "tensor"):
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported")
        if weights.get("actorder") in ACTORDER_GROUP and (fmt != "pack-quantized" or strategy != "group"):
            raise ValueError(f"compressed-tensors actorder {weights.get('actorder')!r} is served for pack-quantized "
                             f"group weights, not {fmt} {strategy}")
        if kind == "float" and bits == 8:
            return fmt, "fp8-ch"
        if kind == "int" and bits in (4, 8):
            asymmetric = not weights.get("symmetric", True)
            return fmt, f"int{bits}-{group_name}" + ("-zp" if asymmetric or bits == 4 else "")
        raise ValueError(f"compressed-tensors weights of type {kind} with {bits} bits are not supported")
    raise ValueError(f"quantization_config quant_method {method!r} is not supported")


def has_input_order(quant: dict[str, Any]) -> bool:
    """Whether a checkpoint's quantized layers may group their inputs in activation order (a ``g_idx`` per layer, not
    consecutive inputs): GPTQ's ``desc_act`` and compressed-tensors' ``actorder: group``. Their layers then take their
    inputs permuted so that each group is consecutive (models/quantized_checkpoints.py)."""
    if quant.get("quant_method") == "gptq":
        return bool(quant.get("desc_act"))
    if quant.get("quant_method") == "compressed-tensors":
        groups = list((quant.get("config_groups") or {}).values())
        return bool(groups) and (groups[0].get("weights") or {}).get("actorder") in ACTORDER_GROUP
    return False


def _group_name(group_size: int | None) -> str:
    return "ch" if group_size in (None, -1, 0) else f"g{int(group_size)}"


def is_quantized_module(quant: dict[str, Any], module: str) -> bool:
    """Whether checkpoint module ``module`` (e.g. model.layers.0.mlp.down_proj) is stored quantized."""
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        if any(_matches(pattern, module) for pattern in quant.get("ignore") or ()):
            return False
        targets = next(iter((quant.get("config_groups") or {}).values()), {}).get("targets") or ()
        return any(t == "Linear" or _matches(t, module) for t in targets)  # asked of linear layers only
    skipped = quant.get("modules_to_not_convert") or ()
    return module.startswith("model.layers.") and not any(s in module for s in skipped) or \
        (module == "lm_head" and bool(quant.get("lm_head")))


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)
