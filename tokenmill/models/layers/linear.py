"""Linear layers over quantized weights (kernels/quant_linear.py: the formats, the kernels, the reference).

A model is built with ``nn.Linear`` layers; ``quantize_linears`` swaps the ones a quantization plan names for a
QuantLinear of the same shape before the weights are materialized, so a checkpoint's quantized tensors are copied
into the layer's buffers as they are (``qweight``, ``scales``, ``mins``: names a loader yields beside the weight's),
never through a full-precision copy. A layer may also keep the dense ``weight`` (``dense_from_rows``: calls of at
least that many rows run on it, where the start-up measurement found the dense GEMM faster: engine/layouts.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from typing import NamedTuple

from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.cpu_native import library, x16_available
from tokenmill.kernels.quant_linear import (CPUQuantMatmul, WeightFormat, quant_linear, quantize, repack_x16,
                                            unpack_x16)

QUANT_BUFFERS = ("qweight", "scales", "mins", "input_perm")


class LinearPlan(NamedTuple):
    """How one linear layer holds its weight: ``fmt`` (a format name); calls of ``dense_from_rows`` rows and more run
    on a dense copy (None: none is kept); ``quantize_at_load``: the checkpoint's tensor is full precision and is
    rounded into the format as it is copied in (else the checkpoint offers it quantized); ``input_order``: the
    checkpoint groups the inputs in activation order, so the layer holds an input permutation; ``amx_from_rows``:
    calls of that many rows and more take the C kernel's AMX build (0: never; engine/quant_layouts.py)."""
    fmt: str
    dense_from_rows: int | None = None
    quantize_at_load: bool = False
    input_order: bool = False
    amx_from_rows: int = 0


class QuantLinear(nn.Module):
    """out = x @ W^T + bias with W in ``fmt``. Invariant: a dense copy of W (the checkpoint's full-precision weight)
    exists exactly when ``dense_from_rows`` is set: in ``weight`` as loaded, and in ``dense`` once packed for oneDNN
    (``weight`` then None where the packed copy is all that is kept). With an ``input_perm`` (int32 [in], an
    activation-order checkpoint's; None otherwise or where it is the identity) the buffers hold W's columns in that
    order and every call permutes its input alike: out = x[..., perm] @ W[:, perm]^T."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: WeightFormat,
                 dense_from_rows: int | None = None, quantize_at_load: bool = False, dtype: torch.dtype | None = None,
                 input_order: bool = False, amx_from_rows: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.quantize_at_load = quantize_at_load
        for name, (shape, buffer_dtype) in fmt.shapes(out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=buffer_dtype))
        if not fmt.has_min:
            self.mins = None
        self.register_buffer("input_perm", torch.empty(in_features, dtype=torch.int32) if input_order else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.dense_from_rows = dense_from_rows
        self.amx_from_rows = amx_from_rows
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False) \
            if dense_from_rows is not None else None
        self.kernels = KernelChoice()  # set by the model (DecoderLM.use_kernels)
        self.dense = None  # the packed dense layer, on a CPU (kernels/cpu_linear.py pack_linears)
        # The C kernel over these buffers, prepared once they hold the weights (prepare_cpu); None: the dispatch.
        self._cpu_kernel: CPUQuantMatmul | None = None
        self.x16 = False  # the buffers are in the interleaved CPU layout (prepare_cpu): only _cpu_kernel reads them
        self.index = 0  # in its model's packed_linears table (pack_linears numbers it)

    def prepare_cpu(self) -> None:
        """Bind the CPU kernel to this layer's buffers (after loading, with the "cpu" kernel backend); moving the
        buffers afterwards needs another call. Where the host has the interleaved int4 / int8 kernel (AVX-512 VNNI
        or AVX2), the buffers are repacked into its layout once (``x16``, lossless, the same bytes where 16 divides
        the rows): from then on only that kernel reads them."""
        use = self.kernels.backend == "cpu" and self.qweight.device.type == "cpu" and library() is not None
        if not use:
            if self.x16:  # another backend reads the format's own layout
                self.qweight, self.scales, self.mins = self.canonical()
                self.x16 = False
            self._cpu_kernel = None
            return
        if self.fmt.kind != "fp8" and (self.x16 or x16_available()):
            if not self.x16:
                self.qweight, self.scales, self.mins = repack_x16(self.fmt, self.qweight, self.scales, self.mins)
                self.x16 = True
            self._cpu_kernel = CPUQuantMatmul(self.fmt, self.qweight, self.scales, self.mins, self.bias,
                                              repacked_rows=self.out_features, amx_from_rows=self.amx_from_rows)
            return
        if self.fmt.kind == "int4" and self.fmt.group(self.in_features) == 32:
            # A scale and a min every 32 inputs: widening them from fp16 on every block cost the kernel 10-18% at one
            # row (benchmarks/results/quant-kernel.json); float32 copies cost a bit a weight more (held as the
            # buffers, so weight_bytes counts them). Exact: every fp16 value is a float32 one.
            self.scales, self.mins = self.scales.float(), self.mins.float()
        self._cpu_kernel = CPUQuantMatmul(self.fmt, self.qweight, self.scales, self.mins, self.bias)

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scales, mins) in the format's own layout (kernels/quant_linear.py), whichever way they are held."""
        if self.x16:
            return unpack_x16(self.fmt, self.qweight, self.scales, self.mins, self.out_features)
        return self.qweight, self.scales, self.mins

    def drop_identity_order(self) -> None:
        """After loading: an input permutation that is the identity (a layer whose g_idx was consecutive) is dropped."""
        perm = self.input_perm
        if perm is not None and torch.equal(perm, torch.arange(self.in_features, dtype=perm.dtype, device=perm.device)):
            self.input_perm = None

    def run(self, x: torch.Tensor, float32: bool = False) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype. ``float32`` (an LM head's logits): where the call takes the C kernel,
        its float32 result, given x widened (given bf16 it rounds its output to bf16: steps of 0.125 at a logit of 16,
        ties among the best candidates and logprobs on that grid); otherwise the result as it comes."""
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        kernel = self._cpu_kernel  # the hot path (a decode on a CPU) first: Python costs ~1 us a line here
        if kernel is not None and (self.dense_from_rows is None or x.numel() < self.dense_from_rows * self.in_features):
            return kernel(x.float() if float32 else x)
        rows = x.reshape(-1, self.in_features)
        if self.dense_from_rows is not None and rows.shape[0] >= self.dense_from_rows:
            out = self.dense.run(rows) if self.dense is not None else F.linear(rows, self.weight, self.bias)
        else:
            out = quant_linear(rows, self.fmt, self.qweight, self.scales, self.mins, self.bias, self.kernels.backend)
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.device.type == "cpu":
            return torch.ops.tokenmill.cpu_linear(x, self.index, self.out_features)
        return self.run(x)

    def load_dense(self, weight: torch.Tensor, first_row: int = 0) -> dict[str, int]:
        """Round a full-precision [rows, in] weight into rows ``first_row``.. of this layer (``--quantization``);
        returns the elements filled per buffer."""
        filled = {}
        for name, tensor in quantize(weight, self.fmt).items():
            getattr(self, name)[first_row:first_row + tensor.shape[0]].copy_(tensor)
            filled[name] = tensor.numel()
        return filled

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}, " \
               f"dense_from_rows={self.dense_from_rows}"


def quantize_linears(model: nn.Module, plan: dict[str, LinearPlan], dtype: torch.dtype | None = None) -> int:
    """Swap the ``nn.Linear`` layers named in ``plan`` (module path -> LinearPlan) for QuantLinear layers of the same
    shape. Returns how many were swapped."""
    swapped = 0
    for path, entry in plan.items():
        parent_path, _, child_name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        linear = getattr(parent, child_name)
        if type(linear) is not nn.Linear:
            raise ValueError(f"{path} is not a linear layer")
        setattr(parent, child_name, QuantLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                                WeightFormat.parse(entry.fmt), entry.dense_from_rows,
                                                entry.quantize_at_load, dtype or linear.weight.dtype,
                                                entry.input_order, entry.amx_from_rows))
        swapped += 1
    return swapped
