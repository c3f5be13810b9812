"""A plain pre-norm GQA decoder's whole layer stack in one C call per step (kernels/cpu/decoder.c), on a CPU.

Run from the compiled graph, each layer of a step costs four custom-op dispatches and about seven ctypes calls, Python
on the main thread while the OpenMP workers spin at the next parallel region's edge (~20% of the main thread's time
at 32 decodes of SmolLM2 on two cores). ``CPUDecoderStack`` runs the same C kernels back to back from C instead.

What qualifies (``CPUDecoderStack.build`` logs why a model does not): one rank, bf16 or float32 (the dtype start-up
settles on hosts without AVX512-BF16 or AMX), every layer models/llama.py's DecoderLayer without Gemma's norms, with a
SwiGLU MLP and attention with no q/k norms, sinks, window or soft-cap, every projection a QuantLinear on the
interleaved C kernel (kernels/quant_linear.py) with no input permutation, norms in the model's dtype of one eps, and a
KV cache in one group: bf16 (a float32 model's may be float32 too). A step qualifies when its attention is the C
kernels', in one call each, as kernels/cpu_attention.py's ``paged_attention_cpu`` would run it: decodes through the
paged kernel, and a bf16 model's prefill chunks through the settled prefill kernel: "paged" (causal segments of the
same call), or "amx" / "avx512" (each chunk over its cached prefix, read from the cache, and its own tokens:
cpu_attention.py's ``prefill_with_prefixes``); and when no layer would take its dense copy at the step's rows. Any
other step (``run`` returns None: "sdpa") goes the model's usual way, compiled or eager; both ways compute the same
things with the same kernels, the norms and residual adds rounded to bf16 as eager PyTorch does (a float32 model: in
float32).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from tokenmill.kernels.cpu_attention import (_segments, chunk_prefixes, chunk_runs, paged_prefill_applies,
                                             prefill_kernel, step_arguments)
from tokenmill.kernels.cpu_native import library
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.quant_linear import CPUQuantMatmul
from tokenmill.kvcache.cache import KVCache
from tokenmill.models.layers.attention import PagedGQAttention
from tokenmill.models.layers.mlp import SwiGLU
from tokenmill.models.llama import DecoderLayer

log = logging.getLogger(__name__)

_p = ctypes.c_void_p


class DecoderLayerArgs(ctypes.Structure):
    """decoder.c's tm_decoder_layer."""
    _fields_ = [("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p), ("qkv_bias", _p), ("o_bias", _p),
                ("input_norm", _p), ("post_norm", _p), ("cache", _p)]


class DecoderStepArgs(ctypes.Structure):
    """decoder.c's tm_decoder_step."""
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("rot", ctypes.c_int64),
                ("eps", ctypes.c_float), ("sm_scale", ctypes.c_float), ("cos", _p), ("sin", _p),
                ("num_positions", ctypes.c_int64), ("num_slots", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("final_norm", _p), ("f32", ctypes.c_int64), ("cache_f32", ctypes.c_int64), ("block_tables", _p),
                ("table_stride", ctypes.c_int64), ("req", _p),
                ("q_start", _p), ("q_len", _p), ("kv_first", _p), ("kv_len", _p), ("causal", _p),
                ("num_segments", ctypes.c_int64), ("own_kernel", ctypes.c_int64), ("chunk_starts", _p),
                ("chunk_lens", _p), ("chunk_prefixes", _p), ("num_chunks", ctypes.c_int64), ("lse", _p)]


# The model dtypes the stack runs in (decoder.c: bf16, or float32 with f32 set)
DTYPES = (torch.bfloat16, torch.float32)

# The own-token prefill kernels of kernels/cpu/prefill_attention.c decoder.c calls: settled name -> its code there.
OWN_KERNELS = {"amx": 1, "avx512": 2}


ERRORS = {-1: "a quantized GEMM failed", -2: "a position outside the rotary table", -3: "a KV slot past the cache",
          -4: "attention's scratch memory could not be allocated", -5: "the prefill kernel refused the chunks"}


def _kernel_of(linear) -> CPUQuantMatmul | None:
    """The interleaved C kernel a projection runs on at decode sizes, or None where it has none (or permutes its
    input, which the stack does not)."""
    kernel = getattr(linear, "_cpu_kernel", None)
    if kernel is None or kernel.weight_address is None or getattr(linear, "input_perm", None) is not None:
        return None
    return kernel


def _reason_against(model) -> str | None:
    """Why ``model`` cannot run on the stack, or None where it can."""
    if library() is None:
        return "the CPU kernels are not built"
    if model.tp.size > 1:
        return "tensor parallel"
    if not hasattr(model, "layers") or not len(model.layers) or not hasattr(model, "norm"):
        return "no layer stack"
    if getattr(model, "embed_scale", 1.0) != 1.0:
        return "scaled embeddings"
    norms = [model.norm]
    for layer in model.layers:
        if type(layer) is not DecoderLayer or layer.pre_feedforward_layernorm is not None:
            return f"{type(layer).__name__} is not a plain pre-norm layer"
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not PagedGQAttention or attn.q_norm is not None or attn.sinks is not None or attn.window \
                or attn.softcap or attn.kernels.backend != "cpu":
            return "attention with features (q/k norms, sinks, a window or a soft-cap) or off the C kernels"
        if type(mlp) is not SwiGLU or mlp.activation != "silu":
            return "an MLP that is not SwiGLU"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if _kernel_of(linear) is None:
                return "a projection off the interleaved int4 / int8 C kernel"
        if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return "MLP biases"
        rotary = attn.rotary
        if rotary.cos.dtype is not torch.float32 or rotary.sin.dtype is not torch.float32 \
                or not rotary.cos.is_contiguous() or not rotary.sin.is_contiguous() \
                or not 0 < 2 * rotary.cos.shape[-1] <= attn.head_dim:
            return "a rotary table the C kernel does not take"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    dtype = model.norm.weight.dtype
    if dtype not in DTYPES or any(norm.weight.dtype is not dtype or norm.offset for norm in norms):
        return "norms not all in bf16 or all in float32"
    if any(norm.eps != model.norm.eps for norm in norms):
        return "norms with different eps"  # decoder.c takes one eps for all of them
    first = model.layers[0].self_attn
    if any((layer.self_attn.num_heads, layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.sm_scale,
            layer.self_attn.rotary.cos.data_ptr()) != (first.num_heads, first.num_kv_heads, first.head_dim,
                                                       first.sm_scale, first.rotary.cos.data_ptr())
           for layer in model.layers):
        return "layers of different shapes or rotary tables"
    return None


class CPUDecoderStack:
    """One model's layer stack as decoder.c's arguments, built once (the weights must stay where they are)."""

    def __init__(self, model):
        self.model = model
        layers = model.layers
        attn, mlp = layers[0].self_attn, layers[0].mlp
        self.hidden, self.heads, self.kv_heads, self.head_dim = \
            model.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = mlp.intermediate
        self.dtype = model.norm.weight.dtype  # of the activations, the norms and the embeddings (a DTYPES one)
        self.dense_limits = [linear.dense_from_rows for layer in layers
                             for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                            layer.mlp.down_proj) if linear.dense_from_rows is not None]
        rotary = attn.rotary
        self._keep = [rotary.cos, rotary.sin, model.norm.weight]  # what the pointers below point into
        self.step = DecoderStepArgs(
            hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
            intermediate=self.intermediate, rot=2 * rotary.cos.shape[-1], eps=model.norm.eps, sm_scale=attn.sm_scale,
            cos=rotary.cos.data_ptr(), sin=rotary.sin.data_ptr(), num_positions=rotary.cos.shape[0],
            final_norm=model.norm.weight.data_ptr(), f32=int(self.dtype is torch.float32))
        self.layers = (DecoderLayerArgs * len(layers))()
        for args, layer in zip(self.layers, layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = (_kernel_of(linear) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                          mlp.down_proj))
            args.qkv, args.o, args.gate_up, args.down = (k.weight_address for k in (qkv, o, gate_up, down))
            args.qkv_bias, args.o_bias = qkv.bias_address, o.bias_address
            args.input_norm = layer.input_layernorm.weight.data_ptr()
            args.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            self._keep += [qkv, o, gate_up, down, layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        # the layouts prefill_attention.c's kernels take (its prefill_arguments: bf16), and AMX where this process has
        # it
        takes = self.head_dim % 32 == 0 and self.head_dim <= 256 and self.dtype is torch.bfloat16
        self.own_kernels = {name for name in OWN_KERNELS
                            if takes and (name != "amx" or library().tm_amx_available())}
        self._cache_of = None  # the KVCache whose layer pointers self.layers holds
        self._width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self._step_address, self._layers_address = ctypes.addressof(self.step), ctypes.addressof(self.layers)

    @classmethod
    def build(cls, model) -> "CPUDecoderStack | None":
        """The stack of ``model``, or None (logged with the reason) where it does not qualify."""
        reason = _reason_against(model)
        if reason is not None:
            log.info("layer stack in one C call: not for this model (%s)", reason)
            return None
        log.info("layer stack in one C call: on (steps the C paged attention covers whole)")
        return cls(model)

    def _bind(self, kv_cache: KVCache) -> bool:
        """Point the layers at ``kv_cache``'s tensors; False where it is not a cache of one group that decoder.c
        takes: bf16, or (a float32 model's) float32."""
        if self._cache_of is kv_cache and self.layers[0].cache == kv_cache.data[0].data_ptr():
            return True
        cache_dtypes = (torch.bfloat16,) if self.dtype is torch.bfloat16 else (torch.bfloat16, torch.float32)
        if kv_cache.group_of_layer and any(kv_cache.group_of_layer) or len(kv_cache.data) != len(self.layers) \
                or any(data.dtype not in cache_dtypes or data.dtype is not kv_cache.data[0].dtype
                       or scales is not None or not data.is_contiguous()
                       for data, scales in zip(kv_cache.data, kv_cache.scales)):
            return False
        for args, data in zip(self.layers, kv_cache.data):
            args.cache = data.data_ptr()
        first = kv_cache.data[0]
        if first.shape[2] != 2 * self.kv_heads or first.shape[3] != self.head_dim \
                or any(data.shape != first.shape for data in kv_cache.data):
            return False
        self.step.num_slots, self.step.block_size = first.shape[0] * first.shape[1], first.shape[1]
        self.step.cache_f32 = int(first.dtype is torch.float32)
        self._cache_of = kv_cache
        return True

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_cache: KVCache) -> torch.Tensor | None:
        """The final hidden states [T, hidden] of one step (its K/V written into the cache), or None where this step
        (or cache) does not qualify and nothing was done."""
        tokens = input_ids.shape[0]
        if not tokens or meta.groups or any(tokens >= limit for limit in self.dense_limits) \
                or positions.dtype is not torch.int64 or meta.slot_mapping.dtype is not torch.int64 \
                or not self._bind(kv_cache):
            return None
        # Prefill chunks: under the "paged" kernel, causal segments of the paged kernel's; under an own-token kernel
        # of prefill_attention.c, that kernel, over each chunk's cached prefix and its own tokens
        kernel, own, prefixes = prefill_kernel(), None, None
        causal = bool(meta.prefill_indices) and kernel == "paged" and \
            paged_prefill_applies(self.dtype, kv_cache.data[0].dtype)
        if meta.prefill_indices and not causal:
            if kernel not in self.own_kernels:
                return None
            own = meta.derived("cpu_own_chunks",  # [2, chunks]: first rows, rows
                               lambda: torch.tensor(chunk_runs(meta), dtype=torch.int64).t().contiguous())
            prefixes = chunk_prefixes(meta)
        # the same per-step derivations (and so the same cached objects) as the attention op's: with an own-token
        # kernel, the segments are the decodes alone
        with_prefills = own is None
        segments = meta.derived(("cpu_segments", 0, with_prefills, causal),
                                lambda: _segments(meta, 0, with_prefills=with_prefills, causal=causal))
        if not segments.shape[1] and own is None:
            return None
        tables = meta.derived("cpu_block_tables", lambda: meta.block_tables.long().contiguous())
        arguments = meta.derived(("cpu_step_arguments", 0, with_prefills, causal),
                                 lambda: step_arguments(tables, segments))
        step = self.step
        (step.block_tables, step.table_stride, step.req, step.q_start, step.q_len, step.kv_first, step.kv_len,
         step.causal, step.num_segments) = arguments
        lse = torch.empty(tokens, self.heads, dtype=torch.float32) if own is not None else None
        step.own_kernel, step.num_chunks = (OWN_KERNELS[kernel], own.shape[1]) if own is not None else (0, 0)
        step.chunk_starts, step.chunk_lens, step.lse = \
            (own[0].data_ptr(), own[1].data_ptr(), lse.data_ptr()) if own is not None else (None, None, None)
        step.chunk_prefixes = prefixes.data_ptr() if prefixes is not None else None
        x = self.model.embed(input_ids)
        if x.dtype is not self.dtype:
            return None
        x = x.clone(memory_format=torch.contiguous_format)  # the residual stream, overwritten in place
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        scratch = torch.empty(tokens * (2 * self.hidden + self._width + self.heads * self.head_dim
                                        + 3 * self.intermediate), dtype=self.dtype)
        out = torch.empty(tokens, self.hidden, dtype=self.dtype)
        code = library().tm_decoder_stack(self._step_address, self._layers_address, len(self.layers), x.data_ptr(),
                                          tokens,
                                          positions.data_ptr(), slots.data_ptr(), scratch.data_ptr(), out.data_ptr(),
                                          torch.get_num_threads())
        if code:
            raise (MemoryError if code == -4 else IndexError)(f"decoder stack: {ERRORS.get(code, code)}")
        return out
