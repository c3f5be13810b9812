"""Dense linear layers on a CPU over weights packed once, at load, into oneDNN's blocked layout.

``F.linear`` on a plain weight lets the BLAS (or oneDNN, for bfloat16) re-block the weight on every call; a packed
weight (``torch.ops.mkldnn._reorder_linear_weight``) is blocked once for the host's best kernel (AVX2, AVX-512, AMX)
and read as is. Packed wins from a few rows up; at one row (a lone decode) the plain matrix-vector product can read
the weight faster (benchmarks/cpu_gemm.py). So each layer keeps what its shape's measured ``packed_from_rows``
threshold needs (engine/settle.py decides it per shape at start-up; it is in the settled config): the packed weight,
the plain one, or both, and picks per call by the call's row count.

Inside a compiled graph each layer is one opaque op (``tokenmill::cpu_linear``) naming its layer by its index in
the model's ``packed_linears`` table, which ``linear_table`` publishes for the duration of a forward (as
kernels/attention_op.py publishes the KV cache): inductor cannot take an opaque packed tensor as a graph input, the
per-call choice by row count must not become a guard on the dynamic token count, and an index, unlike an object's
identity, is the same in every instance of a model, so a restart's graphs match the on-disk compile cache. Eagerly
a layer runs itself, with no op in between.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.gated_activation import silu_mul
from tokenmill.kernels.rotary import rope_qk_inplace

log = logging.getLogger(__name__)

# The row count oneDNN is told to expect when it blocks a weight (a busy decode step). One packed copy serves every
# row count; engine/layouts.py times exactly this copy against the plain weight, so the threshold accounts for it.
PACK_ROWS_HINT = 16

# Per thread, the packed layers of the model whose forward is running (engines on different threads never share).
_local = threading.local()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] blocked for oneDNN's linear, or None where oneDNN cannot pack this dtype on this CPU
    (bfloat16 without AVX-512 or AMX)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(weight.new_zeros(1, weight.shape[1]), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        log.debug("oneDNN cannot pack a %s weight here: %s", weight.dtype, exc)
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] contiguous over a ``pack_weight`` result -> [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An ``nn.Linear`` after loading: packed from ``packed_from_rows`` rows up (None: never), plain below it.

    Invariant: ``weight`` is kept exactly when a call can take the plain path (fewer rows than the threshold) or
    ``keep_plain`` says someone else reads it (a tied embedding, the LM head's float32 refinement)."""

    def __init__(self, linear: nn.Linear, packed_from_rows: int | None, keep_plain: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self._packed = pack_weight(linear.weight) if packed_from_rows is not None else None
        self.packed_from_rows = packed_from_rows if self._packed is not None else None
        plain_needed = keep_plain or self.packed_from_rows is None or self.packed_from_rows > 1
        self.weight = linear.weight if plain_needed else None
        self.index = 0  # in its model's packed_linears table (pack_linears numbers them)

    def packed_only_bytes(self) -> int:
        """Bytes of a weight held packed only (no plain copy: the model's parameters do not show it), its logical
        size; 0 where the plain weight is kept."""
        if self.weight is not None or self._packed is None:
            return 0
        return self.in_features * self.out_features * self._packed.element_size()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.packed_from_rows is not None and rows.shape[0] >= self.packed_from_rows:
            out = packed_linear(rows, self._packed, self.bias)
        else:
            out = F.linear(rows, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.tokenmill.cpu_linear(x, self.index, self.out_features)
        return self.run(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"packed_from_rows={self.packed_from_rows}"


@contextmanager
def linear_table(layers: Sequence[PackedLinear]) -> Iterator[None]:
    """Publish a model's packed layers (``layers[i].index == i``) to the compiled graph's ops for one forward."""
    previous = getattr(_local, "layers", None)
    _local.layers = layers
    try:
        yield
    finally:
        _local.layers = previous


def _cpu_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """x [..., in] -> [..., out] through layer ``index`` of the published table."""
    layers = getattr(_local, "layers", None)
    if layers is None:
        raise RuntimeError("cpu_linear called outside linear_table (DecoderLM.forward sets it)")
    return layers[index].run(x)


# Registered through torch.library.Library, not torch.library.custom_op: a decode step makes over a hundred of these
# calls, and custom_op's Python wrapper costs ~35 us more per call (measured) than a plain CPU kernel registration.
_library = torch.library.Library("tokenmill", "FRAGMENT")
_library.define("cpu_linear(Tensor x, int index, int out_features) -> Tensor")
_library.impl("cpu_linear", _cpu_linear, "CPU")


@torch.library.register_fake("tokenmill::cpu_linear")
def _(x, index, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def _cpu_linear_silu_mul(x: torch.Tensor, index: int, intermediate: int) -> torch.Tensor:
    """A SwiGLU's gate_up projection (layer ``index``, rows [gate | up]) and its activation in one op:
    [..., in] -> [..., intermediate]. One call from the graph where two would cost a dispatch each (~8 us: as much as
    the activation itself at a decode's few rows)."""
    return silu_mul(_cpu_linear(x, index, 2 * intermediate))


_library.define("cpu_linear_silu_mul(Tensor x, int index, int intermediate) -> Tensor")
_library.impl("cpu_linear_silu_mul", _cpu_linear_silu_mul, "CPU")


@torch.library.register_fake("tokenmill::cpu_linear_silu_mul")
def _(x, index, intermediate):
    return x.new_empty(*x.shape[:-1], intermediate)


def _cpu_linear_rope(x: torch.Tensor, index: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_heads: int, kv_heads: int, out_features: int) -> torch.Tensor:
    """An attention layer's fused qkv projection (layer ``index``, features [q | k | v]) with its q and k heads
    rotated where the projection wrote them (kernels/rotary.py): [T, in] -> [T, out_features]. One call from the
    graph, and no copies of q and k."""
    return rope_qk_inplace(_cpu_linear(x, index, out_features), positions, cos, sin, q_heads, kv_heads)


_library.define("cpu_linear_rope(Tensor x, int index, Tensor positions, Tensor cos, Tensor sin, int q_heads, "
                "int kv_heads, int out_features) -> Tensor")
_library.impl("cpu_linear_rope", _cpu_linear_rope, "CPU")


@torch.library.register_fake("tokenmill::cpu_linear_rope")
def _(x, index, positions, cos, sin, q_heads, kv_heads, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def pack_linears(model: nn.Module, packed_from_rows: dict[tuple[int, int], int | None],
                 keep_plain: tuple[str, ...] = ("lm_head",), skip: tuple[str, ...] = ()) -> int:
    """Number the model's CPU linear layers into ``model.packed_linears`` (the table the compiled graph's
    ``cpu_linear`` ops index): every ``nn.Linear`` (but those named in ``skip``, whose weight others read as a tensor)
    swapped for a PackedLinear with its shape's threshold from ``packed_from_rows`` (a shape not in it stays plain;
    an empty table swaps none), and every quantized layer (models/layers/linear.py), whose dense copy, where it keeps
    one, is packed the same way. Returns how many layers were packed."""
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    swaps, layers = [], []
    for module in model.modules():
        for child_name, child in module.named_children():
            if hasattr(child, "dense_from_rows"):  # a QuantLinear: it stays, numbered
                child.prepare_cpu()
                if child.weight is not None and packed_from_rows:
                    dense = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                    dense.weight, dense.bias = child.weight, child.bias
                    child.dense = PackedLinear(dense, packed_from_rows.get((child.out_features, child.in_features)),
                                               keep_plain=counts[id(child.weight)] > 1)
                    if child.dense.weight is None:  # packed only: the plain copy goes
                        child.weight = None
                layers.append(child)
                continue
            if type(child) is not nn.Linear or child_name in skip or not packed_from_rows:
                continue
            threshold = packed_from_rows.get((child.out_features, child.in_features))
            shared = counts[id(child.weight)] > 1
            packed = PackedLinear(child, threshold, shared or child_name in keep_plain)
            swaps.append((module, child_name, packed))
            layers.append(packed)
    for module, child_name, packed in swaps:
        setattr(module, child_name, packed)
    for index, layer in enumerate(layers):
        layer.index = index
    model.packed_linears = tuple(layers)
    dense = [layer.dense if hasattr(layer, "dense_from_rows") else layer for layer in layers]
    return sum(1 for layer in dense if layer is not None and layer.packed_from_rows is not None)
