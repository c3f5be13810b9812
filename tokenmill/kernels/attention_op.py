"""Attention as opaque ops over a per-step context, so that torch.compile can compile a model's forward whole.

A step's ``AttentionMetadata`` (python lists that change every step) and the KV cache tensors never enter a compiled
graph: ``attention_context`` publishes them for the duration of one forward, and the ops below read them by layer
index. Inside a graph each op is a single node with a shape-only fake; the dense work around it (norms, RoPE,
projections, residual adds, the MLP) is what the compiler fuses. The ops write this step's K/V (or MLA latents) into
the cache, a side effect the graph cannot see and does not need to: the cache is not a graph input, and nothing in
the graph reads it except these ops, which run in program order (each one's input depends on the previous one's
output).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from tokenmill.kernels.attention_features import AttentionFeatures
from tokenmill.kernels.cpu_attention import write_kv_cpu
from tokenmill.kernels.dsa import dsa_attention
from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.mla import mla_attention
from tokenmill.kernels.paged_attention import paged_attention


@dataclass(frozen=True)
class StepContext:
    meta: AttentionMetadata
    data: list[torch.Tensor]  # per layer, the cache layout of kvcache/cache.py
    scales: list[torch.Tensor | None]
    group_of_layer: tuple[int, ...]  # per layer, its KV group (kvcache/groups.py): whose metadata it reads

    def layer_meta(self, layer: int) -> AttentionMetadata:
        return self.meta.for_group(self.group_of_layer[layer]) if self.group_of_layer else self.meta


# Per thread: engines on different threads of one process (tests, --no-engine-process beside LLM) never share a step.
_local = threading.local()


@contextmanager
def attention_context(meta: AttentionMetadata, data: list[torch.Tensor], scales: list[torch.Tensor | None],
                      group_of_layer: tuple[int, ...] = ()) -> Iterator[None]:
    """Publish one step's metadata and cache to the attention ops for the duration of a forward; with KV groups,
    ``group_of_layer`` says which of ``meta``'s groups each layer reads (kernels/metadata.py)."""
    previous = getattr(_local, "step", None)
    _local.step = StepContext(meta, data, scales, tuple(group_of_layer))
    try:
        yield
    finally:
        _local.step = previous


def _step() -> StepContext:
    step = getattr(_local, "step", None)
    if step is None:
        raise RuntimeError("attention op called outside attention_context (DecoderLM.forward sets it)")
    return step


def _gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, sm_scale: float, backend: str,
                   sinks: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (roped) -> [T, Hq, D]; writes k/v into layer ``layer``'s cache first.
    ``sinks``, ``window``, ``softcap``: kernels/attention_features.py."""
    step = _step()
    data, scales, meta = step.data[layer], step.scales[layer], step.layer_meta(layer)
    # on a CPU the C kernel writes 16/32-bit caches in one call (each torch op here costs ~10 us after a GEMM)
    if not (backend == "cpu" and scales is None and write_kv_cpu(data, k, v, meta.slot_mapping)):
        write_kv(data, scales, torch.cat([k, v], dim=1), meta.slot_mapping, backend=backend,
                 padded=meta.derived("padded_slots", lambda: bool((meta.slot_mapping < 0).any())))
    return paged_attention(q, k, v, data, scales, meta, sm_scale, backend=backend,
                           features=AttentionFeatures(window, softcap, sinks))


# Registered through torch.library.Library, not torch.library.custom_op: custom_op's Python wrapper costs ~35 us more
# per call (kernels/cpu_linear.py measured it), once per layer and step. CompositeExplicitAutograd: every device.
_library = torch.library.Library("tokenmill", "FRAGMENT")
_library.define("gqa_attention(Tensor q, Tensor k, Tensor v, int layer, float sm_scale, str backend, "
                "Tensor? sinks=None, int window=0, float softcap=0.0) -> Tensor")
_library.impl("gqa_attention", _gqa_attention, "CompositeExplicitAutograd")
gqa_attention = torch.ops.tokenmill.gqa_attention


@torch.library.register_fake("tokenmill::gqa_attention")
def _(q, k, v, layer, sm_scale, backend, sinks=None, window=0, softcap=0.0):
    return torch.empty_like(q)


@torch.library.custom_op("tokenmill::mla_attention", mutates_args=())
def mla_attention_op(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, w_kv_b: torch.Tensor,
                     layer: int, sm_scale: float, backend: str) -> torch.Tensor:
    """q_nope [T, H, N], q_pe [T, H, P], latent [T, R + P] -> [T, H, V]; writes the latents into the cache first."""
    step = _step()
    data, scales = step.data[layer], step.scales[layer]
    write_kv(data, scales, latent.unsqueeze(1), step.meta.slot_mapping, backend=backend)
    return mla_attention(q_nope, q_pe, latent, data, scales, step.meta, w_kv_b, sm_scale, backend=backend)


@mla_attention_op.register_fake
def _(q_nope, q_pe, latent, w_kv_b, layer, sm_scale, backend):
    heads, nope = q_nope.shape[1:]
    v_dim = w_kv_b.shape[0] // heads - nope
    return q_nope.new_empty(q_nope.shape[0], heads, v_dim)


def dsa_attention_op(q_nope: torch.Tensor, q_pe: torch.Tensor, entry: torch.Tensor, q_index: torch.Tensor | None,
                     index_weights: torch.Tensor | None, w_kv_b: torch.Tensor, layer: int, sm_scale: float, topk: int,
                     rope_dim: int, backend: str, chosen: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek Sparse Attention (kernels/dsa.py): writes this step's cache entries [T, R + P + D] (latent and indexer
    key), then selects (or takes ``chosen``) and attends. A plain call, not an op: the DSA models run eagerly."""
    step = _step()
    data, scales = step.data[layer], step.scales[layer]
    write_kv(data, scales, entry.unsqueeze(1), step.meta.slot_mapping, backend=backend)
    return dsa_attention(q_nope, q_pe, q_index, index_weights, data, scales, step.meta, w_kv_b, sm_scale, topk,
                         rope_dim, chosen, backend)
