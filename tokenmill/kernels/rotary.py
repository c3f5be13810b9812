"""Rotary embeddings of a step's queries and keys together: the C kernel of kernels/cpu/rotary.c on a CPU where the
kernels build, else the reference (``rotate_reference``, which RotaryEmbedding.apply is). Two forms: ``rope_qk``
(copies; the op ``tokenmill::rope_qk``, for q and k that were changed after the projection, as by q/k norms) and
``rope_qk_inplace`` (a fused qkv projection's output rotated where it lies; compiled, inside the projection's op
``tokenmill::cpu_linear_rope``, kernels/cpu_linear.py). Either way a compiled graph calls the C kernel where
inductor would otherwise generate its own loop (its gather of the cos / sin rows by position ran partly in scalar
loops)."""

from __future__ import annotations

import torch

from tokenmill.kernels.cpu_native import library


def rotate_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], positions [T], cos / sin [P, rot / 2] (rot <= D) -> rotated copy in x's dtype: the neox / HF
    ``rotate_half`` pairs (i, i + rot / 2) in float32, features from rot on as they are."""
    rot = 2 * cos.shape[-1]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, rot / 2]
    half = rot // 2
    x1, x2 = x[..., :half].float(), x[..., half:rot].float()
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rot:]], dim=-1)


def _table_ok(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """Whether the C kernel takes these positions and this cos / sin table for heads of ``head_dim``."""
    return (positions.dtype is torch.int64 and positions.is_contiguous() and cos.dtype is torch.float32
            and sin.dtype is torch.float32 and cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
            and 0 < 2 * cos.shape[-1] <= head_dim)


def _c_ready(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float32)


def _c_usable(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The library where the C kernel takes these arguments, else None."""
    lib = library() if q.device.type == "cpu" else None
    usable = (lib is not None and _c_ready(q) and _c_ready(k) and k.dtype == q.dtype and k.shape[-1] == q.shape[-1]
              and q.shape[0] > 0 and _table_ok(positions, cos, sin, q.shape[-1]))
    return lib if usable else None


def _checked(status: int, cos: torch.Tensor) -> None:
    if status != 0:
        raise IndexError(f"rotary embedding: a position outside 0 .. {cos.shape[0] - 1}")


def _call(lib, q, k, q_out, k_out, positions, cos, sin) -> None:
    _checked(lib.tm_rope_qk(q.data_ptr(), q.stride(0), q.stride(1), q.shape[1], k.data_ptr(), k.stride(0),
                            k.stride(1), k.shape[1], q_out.data_ptr(), k_out.data_ptr(), q_out.stride(0),
                            k_out.stride(0), q.shape[0], q.shape[-1], 2 * cos.shape[-1], positions.data_ptr(),
                            cos.shape[0], cos.data_ptr(), sin.data_ptr(), int(q.dtype is torch.bfloat16),
                            torch.get_num_threads()), cos)


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] (any token and head strides) rotated at ``positions`` -> contiguous copies."""
    lib = _c_usable(q, k, positions, cos, sin)
    if lib is None:
        return rotate_reference(q, positions, cos, sin), rotate_reference(k, positions, cos, sin)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    _call(lib, q, k, q_out, k_out, positions, cos, sin)
    return q_out, k_out


def rope_qk_inplace(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_heads: int, kv_heads: int) -> torch.Tensor:
    """A fused projection's output [..., (q_heads + 2 kv_heads) * D], its features [q | k | v], with its q and k
    heads rotated where they lie (its v untouched); returns ``qkv``. The caller owns ``qkv`` (a projection's fresh
    output), and positions has one entry per row. (A decode step makes one such call per layer: no views are made on
    the C path, whose pointers are computed.)"""
    width = qkv.shape[-1]
    head_dim = width // (q_heads + 2 * kv_heads)
    if head_dim * (q_heads + 2 * kv_heads) != width:
        raise ValueError(f"rotary embedding: {width} features are not {q_heads} + 2 x {kv_heads} heads")
    dtype = qkv.dtype
    lib = library() if qkv.device.type == "cpu" else None
    if lib is None or (dtype is not torch.bfloat16 and dtype is not torch.float32) or not qkv.is_contiguous() \
            or not _table_ok(positions, cos, sin, head_dim):
        rows = qkv.view(-1, width)
        q = rows[:, :q_heads * head_dim].view(-1, q_heads, head_dim)
        k = rows[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
        q.copy_(rotate_reference(q, positions, cos, sin))
        k.copy_(rotate_reference(k, positions, cos, sin))
        return qkv
    tokens = qkv.numel() // width
    if tokens == 0:
        return qkv
    q = qkv.data_ptr()
    k = q + q_heads * head_dim * qkv.element_size()
    _checked(lib.tm_rope_qk(q, width, head_dim, q_heads, k, width, head_dim, kv_heads, q, k, width, width, tokens,
                            head_dim, 2 * cos.shape[-1], positions.data_ptr(), cos.shape[0], cos.data_ptr(),
                            sin.data_ptr(), int(dtype is torch.bfloat16), torch.get_num_threads()), cos)
    return qkv


# A plain CPU kernel registration (torch.library.Library), as cpu_linear's: custom_op's Python wrapper costs more per
# call than this whole op at decode sizes.
_library = torch.library.Library("tokenmill", "FRAGMENT")
_library.define("rope_qk(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> (Tensor, Tensor)")
_library.impl("rope_qk", rope_qk, "CPU")


@torch.library.register_fake("tokenmill::rope_qk")
def _(q, k, positions, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)
