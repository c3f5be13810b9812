"""Compile every Triton kernel for real GPU targets, exactly as the host wrappers launch it, without a GPU.

Triton's compiler runs on any machine (its wheel carries ptxas), so each launch of the real host code
(``paged_attention_triton``, ``mla_decode_triton``, ``fused_moe_triton``, ...) on CPU tensors of the model's real
shapes is intercepted: the kernel is compiled to a cubin for the target instead of being run, and its shared-memory
use is recorded. That proves, beyond the interpreter, that the GPU path type-checks and lowers (tensor-core dots,
fp8 conversions, layouts) for each configuration the engine would launch, and that it fits the GPU's shared memory.

Run as a script (it must own the process: TRITON_INTERPRET is read when the kernels are first imported):
    python tests/kernels/gpu_compile.py 90 > results.json     # sm_90: H100 / H200
Nothing is executed, so outputs are never read: the host code only needs the tensors' shapes, dtypes and strides
(weights are broadcast views that own no memory).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv",
            torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}
RESULTS: list[dict] = []
STATE = {"case": "", "target": None}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(self.arg_names, args)) | kwargs
    signature, constants = {}, {}
    for param in self.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        else:
            signature[param.name] = _arg_type(value)
    compiled = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constants),
                              target=STATE["target"], options=options)
    RESULTS.append({"case": STATE["case"], "kernel": self.fn.__name__, "shared_bytes": compiled.metadata.shared,
                    "num_warps": compiled.metadata.num_warps, "cubin_bytes": len(compiled.asm["cubin"])})


def paged_batch_meta(decodes: int, prefill_lens: list[int], context: int, block_size: int):
    from tokenmill.kernels.metadata import AttentionMetadata

    lens = [1] * decodes + prefill_lens
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    blocks = -(-(context + max(lens)) // block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(starts[-1]), query_start_loc=starts, seq_lens=[context + n for n in lens],
        block_tables=torch.arange(len(lens) * blocks).view(len(lens), blocks), block_size=block_size,
        decode_indices=list(range(decodes)), prefill_indices=list(range(decodes, len(lens))))


def gqa_cases(fp8_ok: bool):
    from tokenmill.kernels.triton.kv_write import write_kv_triton
    from tokenmill.kernels.triton.paged_attention import paged_attention_triton

    for name, hq, hkv, dim in (("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128)):
        for cache in ("fp8", "bf16") if fp8_ok else ("bf16",):
            STATE["case"] = f"{name} {cache} cache"
            meta = paged_batch_meta(decodes=3, prefill_lens=[40, 7], context=100, block_size=16)
            tokens = meta.query_start_loc[-1]
            data = torch.empty(64, 16, 2 * hkv, dim, dtype=torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16)
            scales = torch.empty(64, 16, 2 * hkv) if cache == "fp8" else None
            q = torch.empty(tokens, hq, dim, dtype=torch.bfloat16)
            kv = torch.empty(tokens, 2 * hkv, dim, dtype=torch.bfloat16)
            write_kv_triton(data, scales, kv, meta.slot_mapping)
            paged_attention_triton(q, kv[:, :hkv], kv[:, hkv:], data, scales, meta, dim ** -0.5, num_splits=4)


def mla_cases(fp8_ok: bool):
    from tokenmill.kernels.triton.kv_write import write_kv_triton
    from tokenmill.kernels.triton.mla import mla_decode_triton

    for heads in (128, 16):  # DeepSeek-V3 on one GPU; per GPU at tensor parallel 8
        for cache in ("fp8", "bf16") if fp8_ok else ("bf16",):
            STATE["case"] = f"DeepSeek-V3 MLA {heads} heads {cache} cache"
            data = torch.empty(64, 16, 1, 576, dtype=torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16)
            scales = torch.empty(64, 16, 1) if cache == "fp8" else None
            write_kv_triton(data, scales, torch.empty(8, 1, 576, dtype=torch.bfloat16), torch.arange(8))
            tables = torch.arange(64).view(4, 16)
            mla_decode_triton(torch.empty(4, heads, 512, dtype=torch.bfloat16),
                              torch.empty(4, heads, 64, dtype=torch.bfloat16), data, scales, tables,
                              torch.full((4,), 200, dtype=torch.int32), 16, 0.1, num_splits=4)


def moe_cases(fp8_ok: bool):
    from tokenmill.kernels.fused_moe import Fp8BlockScales
    from tokenmill.kernels.triton.fused_moe import fused_moe_triton

    # The last: fp8 scale blocks of 16 (the kernel tests' small shapes; K steps of 16, below the fp8 MMA's 32).
    shapes = (("DeepSeek-V3", 256, 2048, 7168, 8, 128), ("DeepSeek-V2-Lite", 64, 1408, 2048, 6, 128),
              ("tiny fp8 blocks of 16", 6, 40, 48, 2, 16))
    for name, experts, inter, hidden, top_k, blk in shapes:
        for fp8 in (False, True) if fp8_ok and name != "DeepSeek-V2-Lite" else (False,):
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            w1 = torch.empty(1, 2 * inter, hidden, dtype=dtype).expand(experts, -1, -1)
            w2 = torch.empty(1, hidden, inter, dtype=dtype).expand(experts, -1, -1)
            scales = Fp8BlockScales(torch.empty(experts, -(-2 * inter // blk), -(-hidden // blk)),
                                    torch.empty(experts, -(-hidden // blk), -(-inter // blk)), (blk, blk)) if fp8 \
                else None
            for tokens in (1, 64, 2048) if blk == 128 else (29,):  # decode, small and large prefill
                STATE["case"] = f"{name} MoE {'fp8' if fp8 else 'bf16'} {tokens} tokens"
                ids = torch.randint(0, experts, (tokens, top_k))
                fused_moe_triton(torch.empty(tokens, hidden, dtype=torch.bfloat16), w1, w2,
                                 torch.rand(tokens, top_k), ids, scales)


def main(arch: int) -> None:
    STATE["target"] = GPUTarget("cuda", arch, 32)
    JITFunction.run = _compile_instead_of_launch
    fp8_ok = arch >= 89
    with torch.inference_mode():
        gqa_cases(fp8_ok)
        mla_cases(fp8_ok)
        moe_cases(fp8_ok)
    json.dump(RESULTS, sys.stdout, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
