"""Causal attention of a prefill chunk over its cached prefix and itself, through PyTorch's fused SDPA kernels.

Shapes: ``q [L, Hq, D]``, ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` with ``N >= L``: the queries are the last ``L`` of
the ``N`` positions, so query ``i`` sees keys ``0 .. N - L + i`` (bottom-right causal). Output ``[L, Hq, Dv]``.

Why this shape of call: SDPA picks its fused kernel (flash attention on CPU, flash/memory-efficient on CUDA) only
for 4-D inputs ``[batch, heads, len, dim]`` whose q, k and v share one head size; anything else (3-D inputs, MLA's
v narrower than its q/k) takes the unfused math path, which materializes ``[heads, L, N]`` scores and cost 8.3 of a
2,000-token prompt's 9.2 s prefill on CPU. GQA stays unexpanded (``enable_gqa``). ``is_causal`` aligns its triangle
top-left, which is right only without a prefix; with one, an explicit boolean mask says the bottom-right triangle.
A sliding window narrows the mask; soft-capping and sinks (kernels/attention_features.py) are not in SDPA, so they
take the explicit math path (scores, cap, mask, softmax with the sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.attention_features import PLAIN, AttentionFeatures, capped, softmax_with_sinks


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                            features: AttentionFeatures = PLAIN) -> torch.Tensor:
    q_len, num_heads, head_dim = q.shape
    seq_len, v_dim = k.shape[0], v.shape[-1]
    if features.softcap or features.sinks is not None:
        return _explicit_attention(q, k, v, sm_scale, _mask(q_len, seq_len, features.window, q.device), features)
    if v_dim != head_dim:  # the fused kernels need one head size: zero-pad the narrower, drop the padding after
        width = max(head_dim, v_dim)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    mask = _mask(q_len, seq_len, features.window, q.device) if seq_len > q_len or features.window else None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        is_causal=mask is None, scale=sm_scale, enable_gqa=num_heads != k.shape[1])  # [1, Hq, L, D']
    return out[0, :, :, :v_dim].transpose(0, 1)


def _mask(q_len: int, seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[L, N] bool: query i (position N - L + i) sees key j <= its position, and > position - window if windowed."""
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    mask = key_pos <= query_pos
    return mask & (key_pos > query_pos - window) if window else mask


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, mask: torch.Tensor,
                        features: AttentionFeatures) -> torch.Tensor:
    """The math path, float32 inside: q [L, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv], mask [L, N] -> [L, Hq, Dv]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [Hq, N, D]
    scores = capped(torch.matmul(q.float().transpose(0, 1), k.transpose(1, 2)) * sm_scale, features.softcap)
    probs = softmax_with_sinks(scores.masked_fill(~mask, float("-inf")), features.sinks)  # [Hq, L, N]
    return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
