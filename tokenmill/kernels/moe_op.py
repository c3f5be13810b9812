"""The routed experts of an MoE layer as one opaque op, so that torch.compile compiles an MoE model's forward whole.

The experts' work depends on the routing's values: which experts got tokens, and how many (kernels/fused_moe.py runs
only those). Traced, that is data-dependent control flow the compiler cannot follow (dynamo stops at the per-expert
loop: "Could not guard on data-dependent expression"). As one op with a shape-only fake (the output is x's shape and
dtype, whatever the routing), the router before it and the shared experts, norms and residual adds after it compile,
and the experts run eagerly inside the graph, as the attention ops of kernels/attention_op.py do.

The Triton path calls the op's body directly: it takes a launch-config tuner (a Python object, no op argument) and runs
under CUDA graphs, never torch.compile (engine/settle.py ``choose_execution``).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.fused_moe import ExpertActivation, Fp8BlockScales, fused_moe


def run_routed_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, backend: str, gate_up_bias: torch.Tensor | None = None,
                       down_bias: torch.Tensor | None = None, swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0,
                       gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                       block_n: int = 0, block_k: int = 0, tuner=None) -> torch.Tensor:
    """kernels/fused_moe.py's ``fused_moe`` with its dataclasses spelled as op arguments: biases present = gpt-oss's
    clamped SwiGLU ("swiglu_oai", ``swiglu_alpha``, ``swiglu_limit``); scales present = fp8 experts in
    (``block_n`` x ``block_k``) blocks. The op's body; the Triton path calls it directly with its ``tuner``."""
    activation = ExpertActivation("swiglu_oai", swiglu_alpha, swiglu_limit, gate_up_bias, down_bias) \
        if gate_up_bias is not None else None
    scales = Fp8BlockScales(gate_up_scale, down_scale, (block_n, block_k)) if gate_up_scale is not None else None
    return fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, scales, backend=backend, tuner=tuner,
                     activation=activation)


# Registered through torch.library.Library, as kernels/attention_op.py's gqa_attention (custom_op's Python wrapper
# costs more per call, once per MoE layer and step). CompositeExplicitAutograd: every device.
_library = torch.library.Library("tokenmill", "FRAGMENT")
_library.define("routed_experts(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor topk_weights, Tensor topk_ids, "
                "str backend, Tensor? gate_up_bias=None, Tensor? down_bias=None, float swiglu_alpha=0.0, "
                "float swiglu_limit=0.0, Tensor? gate_up_scale=None, Tensor? down_scale=None, int block_n=0, "
                "int block_k=0) -> Tensor")
_library.impl("routed_experts", run_routed_experts, "CompositeExplicitAutograd")
routed_experts = torch.ops.tokenmill.routed_experts


@torch.library.register_fake("tokenmill::routed_experts")
def _(x, w_gate_up, w_down, topk_weights, topk_ids, backend, gate_up_bias=None, down_bias=None, swiglu_alpha=0.0,
      swiglu_limit=0.0, gate_up_scale=None, down_scale=None, block_n=0, block_k=0):
    return torch.empty_like(x)
