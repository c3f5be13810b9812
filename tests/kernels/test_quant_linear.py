"""Quantized linear layers: the C kernel against its PyTorch reference, the reference against the formats' own
definitions (gguf's dequantization, bit for bit; the rounding bound of round-to-nearest), and the formats' parsing."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tokenmill.kernels.cpu_native import EXTRA_FLAGS_ENV, amx_available, library, x16_register_rows
from tokenmill.kernels.quant_linear import (WeightFormat, dequantize, pack_int4, quant_linear_cpu,
                                            quant_linear_reference, quantize, quantize_activations, repack_x16,
                                            unpack_int4, unpack_x16)
from tokenmill.models.loader import GGUF_KEPT_TYPES, dequantize_pieces, gguf_quantized_pieces

FORMATS = ["int4-g32", "int4-g64", "int4-g128", "int4-g128-zp", "int8-ch", "int8-g32", "int8-g64-zp", "fp8-ch"]
needs_kernels = pytest.mark.skipif(library() is None, reason="no C compiler: the CPU kernels are not built")


def weights(fmt: WeightFormat, out_features: int, in_features: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g)
    return quantize(w, fmt)


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 131, 300])  # 131, 300: past one chunk of the interleaved kernel
def test_kernel_matches_reference(name, rows):
    fmt = WeightFormat.parse(name)
    # 160 inputs: g64 and g128 end on a short group; 37 outputs: odd, not a multiple of any tile.
    t = weights(fmt, 37, 160)
    x = torch.randn(rows, 160) * 3
    bias = torch.randn(37)
    ref = quant_linear_reference(x, fmt, t["qweight"], t["scales"], t.get("mins"), bias, int8_activations=True)
    got = quant_linear_cpu(x, fmt, t["qweight"], t["scales"], t.get("mins"), bias)
    # float32 sums in another order, where the mins' term and the codes' term cancel (outputs near 0 from terms near
    # 100): well below what one activation code moved by one step changes (d * amax / 127 ~ 2e-3 and up here).
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-4)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("out_features", [5, 20, 37, 100])
@pytest.mark.parametrize("rows", [3, 42, 134])  # 42: 4 x 10 + 2; 134: a second chunk of 4 + 2 rows
def test_every_tile_is_computed_whatever_the_thread_count(threads, out_features, rows):
    """A decode-sized call splits the weight's 16-row tiles into one range per thread (each thread asking for its next
    tile's bytes ahead): with more threads than tiles some ranges are empty, and every output still comes out. From
    32 rows on (and in every chunk of a prompt-sized call) the VNNI build computes tiles three at a time: 1, 2, 3 and
    7 tiles, split among the threads, leave none, one or two to take alone."""
    fmt = WeightFormat.parse("int4-g32")
    t = weights(fmt, out_features, 96)
    x = torch.randn(rows, 96)
    ref = quant_linear_reference(x, fmt, t["qweight"], t["scales"], t["mins"], int8_activations=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = quant_linear_cpu(x, fmt, t["qweight"], t["scales"], t["mins"])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=5e-4)


@needs_kernels
def test_kernel_takes_other_activation_dtypes_and_shapes():
    fmt = WeightFormat.parse("int4-g32")
    t = weights(fmt, 64, 96)
    x = torch.randn(2, 3, 96).to(torch.bfloat16)
    got = quant_linear_cpu(x, fmt, t["qweight"], t["scales"], t["mins"])
    ref = quant_linear_reference(x, fmt, t["qweight"], t["scales"], t["mins"], int8_activations=True)
    assert got.shape == (2, 3, 64) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -6, atol=0.1)  # two bf16 steps at |y| ~ 8


@needs_kernels
@pytest.mark.parametrize("name", ["int4-g32", "int8-ch"])
@pytest.mark.parametrize("amx_from_rows", [0, 1])
def test_bf16_calls_round_the_float32_result(name, amx_from_rows):
    """A bf16 call (the interleaved kernel reads and writes bf16 itself) gives the float32 call's result on the same
    values, bias included, rounded to nearest even: bit for bit."""
    from tokenmill.kernels.quant_linear import CPUQuantMatmul
    fmt = WeightFormat.parse(name)
    t = weights(fmt, 37, 160)
    kernel = CPUQuantMatmul(fmt, t["qweight"], t["scales"], t.get("mins"), torch.randn(37), amx_from_rows=amx_from_rows)
    for rows in (1, 5, 33, 261):
        x = (torch.randn(rows, 160) * 3).bfloat16()
        got = kernel(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, kernel(x.float()).bfloat16())
    # Ties: a bias that puts row 0's every output exactly halfway between two bf16 values (low 16 bits 0x8000), where
    # rounding half to even and half up part ways.
    x = (torch.randn(3, 160) * 3).bfloat16()
    plain = CPUQuantMatmul(fmt, t["qweight"], t["scales"], t.get("mins"), None, amx_from_rows=amx_from_rows)
    product = plain(x.float())[0]
    ties = ((product.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)
    kernel = CPUQuantMatmul(fmt, t["qweight"], t["scales"], t.get("mins"), ties - product, amx_from_rows=amx_from_rows)
    full = kernel(x.float())
    assert ((full[0].view(torch.int32) & 0xFFFF) == 0x8000).sum() >= 30  # most land on their tie exactly
    assert torch.equal(kernel(x), full.bfloat16())


def test_int8_activations_stay_within_half_a_step():
    x = torch.randn(5, 128) * torch.logspace(-3, 3, 5)[:, None]
    q = quantize_activations(x)
    step = x.view(5, 4, 32).abs().amax(-1, keepdim=True) / 127
    assert ((q - x).view(5, 4, 32).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(quantize_activations(torch.zeros(2, 32)), torch.zeros(2, 32))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_activation_codes_are_the_reference_rounding(dtype):
    """The C quantizer of x (kernels/cpu/quant_linear.c; an AVX-512 build, an AVX2 one and a plain loop) gives, bit for
    bit, round(x * (127 / amax)) half to even per 32-input block, amax / 127, that times the codes' sum, and the sum:
    blocks of every magnitude, zeros, and codes at exact rounding ties."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-4, 4, 7)[:, None]
    x[2, 32:64] = 0  # a zero block
    x[3, :32] = torch.arange(-16, 16) + 0.5  # with amax 127 (127 / amax = 1): every code a tie, k + 0.5
    x[3, 0] = 127
    x[4, 40] = 1e30
    x = x.to(dtype).contiguous()
    blocks = x.numel() // 32
    xq = torch.empty(x.shape, dtype=torch.int8)
    xd, xs = torch.empty(blocks), torch.empty(blocks)
    xsum = torch.empty(blocks, dtype=torch.int32)
    library().tm_quantize_blocks(x.data_ptr(), int(dtype == torch.bfloat16), 0, blocks, xq.data_ptr(), xd.data_ptr(),
                                 xs.data_ptr(), xsum.data_ptr())
    wide = x.float().view(-1, 32)
    amax = wide.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = (wide * inverse).round()
    assert ((wide * inverse) % 1 == 0.5).sum() >= 31  # the ties were met
    assert torch.equal(xq.view(-1, 32).float(), codes)
    assert torch.equal(xd, (amax / 127.0).view(-1))
    assert torch.equal(xsum, codes.sum(-1).int())
    assert torch.equal(xs, xd * xsum.float())


@pytest.mark.parametrize("name", ["int4-g32", "int4-g128", "int8-ch", "int8-g32"])
def test_round_to_nearest_is_within_half_a_step(name):
    fmt = WeightFormat.parse(name)
    w = torch.randn(16, 160)
    t = quantize(w, fmt)
    step = t["scales"].float().repeat_interleave(fmt.group(160), dim=1)[:, :160]
    err = (dequantize(fmt, t["qweight"], t["scales"], t.get("mins")) - w).abs()
    # Half a step of the stored (fp16) grid, plus what rounding the min to fp16 moves it by.
    slack = t["mins"].float().abs().repeat_interleave(fmt.group(160), dim=1)[:, :160] * 2**-10 if "mins" in t else 0
    assert (err <= step / 2 * (1 + 1e-3) + slack).all()


def test_fp8_per_channel_round_trip():
    fmt = WeightFormat.parse("fp8-ch")
    w = torch.randn(8, 64)
    t = quantize(w, fmt)
    assert t["qweight"].dtype == torch.float8_e4m3fn and t["scales"].shape == (8, 1)
    back = dequantize(fmt, t["qweight"], t["scales"], None)
    assert ((back - w).abs() <= w.abs() * 2**-4 + t["scales"] * 2**-9).all()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("name", ["int4-g32", "int4-g64", "int4-g128-zp", "int8-ch", "int8-g32", "int8-g64-zp"])
@pytest.mark.parametrize("rows", [16, 37])
def test_interleaved_layout_round_trips(name, rows):
    """The interleaved kernel's layout holds the same codes, scales and mins (37 rows: a padded last tile)."""
    fmt = WeightFormat.parse(name)
    t = weights(fmt, rows, 160)
    packed = repack_x16(fmt, t["qweight"], t["scales"], t.get("mins"))
    assert packed[0].shape == (-(-rows // 16), 5, 8, 32 if fmt.kind == "int4" else 64)
    for want, got in zip((t["qweight"], t["scales"], t.get("mins")), unpack_x16(fmt, *packed, rows)):
        assert (want is None and got is None) or (torch.equal(want, got) and want.dtype == got.dtype)
    # byte 4i + c of step s in block b: row i's input 32b + 4s + c (int4: rows 8.. in the high nibbles)
    codes = unpack_int4(t["qweight"]) if fmt.kind == "int4" else t["qweight"].to(torch.int16) + 128
    b, s, i, c = 3, 5, 2, 1
    byte = int(packed[0][0, b, s, 4 * i + c])
    assert (byte & 0x0F if fmt.kind == "int4" else byte) == int(codes[i, 32 * b + 4 * s + c])
    if fmt.kind == "int4":
        assert byte >> 4 == int(codes[i + 8, 32 * b + 4 * s + c])


@needs_kernels
@pytest.mark.parametrize("name", ["int4-g32", "int8-g32"])
def test_kernel_over_a_layer_held_interleaved(name):
    """A layer that holds its weight repacked (repacked_rows) computes what the canonical tensors do."""
    from tokenmill.kernels.cpu_native import x16_available
    from tokenmill.kernels.quant_linear import CPUQuantMatmul
    if not x16_available():
        pytest.skip("this host's build has neither AVX-512 VNNI nor AVX2")
    fmt = WeightFormat.parse(name)
    t = weights(fmt, 37, 160)
    x = torch.randn(6, 160)
    held = CPUQuantMatmul(fmt, *repack_x16(fmt, t["qweight"], t["scales"], t.get("mins")), repacked_rows=37)
    ref = quant_linear_reference(x, fmt, t["qweight"], t["scales"], t.get("mins"), int8_activations=True)
    torch.testing.assert_close(held(x), ref, rtol=1e-4, atol=5e-4)


def bf16_product(x: torch.Tensor, fmt: WeightFormat, t: dict[str, torch.Tensor], bias: torch.Tensor | None
                 ) -> torch.Tensor:
    """The AMX build's definition: x and the dequantized weight each rounded to bf16, products summed in float64."""
    w = dequantize(fmt, t["qweight"], t["scales"], t.get("mins")).bfloat16().double()
    out = x.bfloat16().double() @ w.t()
    return (out + bias.double() if bias is not None else out).float()


needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX here (or no kernels): the integer build ran above")


@needs_amx
@pytest.mark.parametrize("name", [n for n in FORMATS if not n.startswith("fp8")])
@pytest.mark.parametrize("rows", [1, 16, 17, 32, 45])
def test_amx_build_matches_its_definition(name, rows):
    """Rows past 16 and 32 (a second A tile, a partial chunk), 37 outputs (a partial tile), short last groups."""
    from tokenmill.kernels.quant_linear import CPUQuantMatmul
    fmt = WeightFormat.parse(name)
    t = weights(fmt, 37, 160)
    x, bias = torch.randn(rows, 160) * 3, torch.randn(37)
    kernel = CPUQuantMatmul(fmt, t["qweight"], t["scales"], t.get("mins"), bias, amx_from_rows=1)
    want = bf16_product(x, fmt, t, bias)
    torch.testing.assert_close(kernel(x), want, rtol=1e-5, atol=1e-4)  # float32 sums in another order


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_build_over_several_panels_of_rows(dtype):
    """2,048 inputs: x's rows go in panels of 256 (the blocked codes of a panel fill 1 MiB), so 300 rows make a full
    panel and a part of one; 37 outputs: a pair of weight tiles and one alone; bf16 in and out as a bf16 model
    calls it."""
    from tokenmill.kernels.quant_linear import CPUQuantMatmul
    fmt = WeightFormat.parse("int4-g32")
    t = weights(fmt, 37, 2048)
    x, bias = (torch.randn(300, 2048) * 3).to(dtype), torch.randn(37)
    kernel = CPUQuantMatmul(fmt, t["qweight"], t["scales"], t["mins"], bias, amx_from_rows=1)
    want = bf16_product(x.float(), fmt, t, bias)
    got = kernel(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want if dtype == torch.float32 else want.bfloat16().float(),
                               rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=2e-3)


@needs_amx
def test_a_layer_takes_the_amx_build_from_its_threshold():
    """Below ``amx_from_rows`` the integer build (int8 activations), from it the AMX one, over the same buffers."""
    from tokenmill.kernels.backend import KernelChoice
    from tokenmill.models.layers.linear import QuantLinear
    fmt = WeightFormat.parse("int4-g32")
    t = weights(fmt, 48, 576)
    layer = QuantLinear(576, 48, bias=False, fmt=fmt, amx_from_rows=8)
    for name in ("qweight", "scales", "mins"):
        getattr(layer, name).copy_(t[name])
    layer.kernels = KernelChoice(backend="cpu")
    layer.prepare_cpu()
    for rows in (7, 8, 40):
        x = torch.randn(rows, 576)
        if rows < 8:
            want = quant_linear_reference(x, fmt, t["qweight"], t["scales"], t["mins"], int8_activations=True)
            torch.testing.assert_close(layer.run(x), want, rtol=1e-4, atol=5e-4)
        else:
            torch.testing.assert_close(layer.run(x), bf16_product(x, fmt, t, None), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.skipif(x16_register_rows() != 16, reason="no AVX-512 VNNI build here: the tests above ran the AVX2 one")
def test_the_avx2_build_on_an_avx512_host():
    """The kernel tests again against the library built without AVX-512 (the build an AVX2-only host gets), and the
    layer stack's float32 tests (the dtype such hosts settle: decoder.c over this build's kernels)."""
    env = {**os.environ, EXTRA_FLAGS_ENV: "-mno-avx512f"}
    rows = subprocess.run([sys.executable, "-c", "from tokenmill.kernels.cpu_native import x16_register_rows as r; "
                           "print(r())"], env=env, capture_output=True, text=True, timeout=300)
    assert rows.stdout.strip() == "8", rows.stderr[-2000:]
    stack = os.path.join(os.path.dirname(__file__), os.pardir, "models", "test_cpu_stack.py")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, stack, "-k",
                            "kernel_matches_reference or held_interleaved or other_activation or bf16_calls or "
                           "gguf_blocks or symmetric or activation_codes or thread_count or float32_model"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout


@needs_kernels
@pytest.mark.skipif(library() is None or amx_available() or not library().tm_attention_bf16_dot(),
                    reason="the AMX tests ran natively above, or no AVX512-BF16 here for their stand-in build")
def test_the_amx_builds_on_stand_in_tiles():
    """On a host with AVX512-BF16 but no AMX, the AMX builds' tests (this kernel's, prefill attention's, the layer
    stack's over both) again against a library whose tile instructions are plain C (simd_common.h, -DTM_AMX_EMULATE):
    their blocking, layouts and edges are checked here too, where they would otherwise only be skipped."""
    env = {**os.environ, EXTRA_FLAGS_ENV: "-DTM_AMX_EMULATE"}
    check = subprocess.run([sys.executable, "-c", "from tokenmill.kernels.cpu_native import amx_available as a; "
                            "print(a())"], env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == "True", check.stderr[-2000:]
    prefill = os.path.join(os.path.dirname(__file__), "test_prefill_attention.py")
    stack = os.path.join(os.path.dirname(__file__), os.pardir, "models", "test_cpu_stack.py")  # decoder.c's calls
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, prefill, stack,
                            "-k", "amx and not stand_in"], env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout and " skipped" not in tests.stdout, \
        tests.stdout[-3000:]


@needs_kernels
def test_a_layer_gives_its_own_layout_back_to_another_backend():
    """A layer repacked for the CPU kernel holds the format's own tensors again when it leaves that kernel, and
    computes the reference's product both ways."""
    from tokenmill.kernels.backend import KernelChoice
    from tokenmill.models.layers.linear import QuantLinear
    fmt = WeightFormat.parse("int4-g32")
    t = weights(fmt, 40, 160)
    layer = QuantLinear(160, 40, bias=False, fmt=fmt)
    for name in ("qweight", "scales", "mins"):
        getattr(layer, name).copy_(t[name])
    x = torch.randn(3, 160)
    ref = quant_linear_reference(x, fmt, t["qweight"], t["scales"], t["mins"], int8_activations=True)
    layer.kernels = KernelChoice(backend="cpu")
    layer.prepare_cpu()
    torch.testing.assert_close(layer.run(x), ref, rtol=1e-4, atol=5e-4)
    for want, got in zip((t["qweight"], t["scales"], t["mins"]), layer.canonical()):
        assert torch.equal(want, got.to(want.dtype))
    layer.kernels = KernelChoice(backend="torch")
    layer.prepare_cpu()
    assert not layer.x16 and torch.equal(layer.qweight, t["qweight"])
    torch.testing.assert_close(layer.run(x), quant_linear_reference(x, fmt, t["qweight"], t["scales"], t["mins"]),
                               rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 32])
def test_an_lm_heads_logits_are_float32_from_bf16_hidden_states(rows):
    """A quantized LM head (as the default model's int8 one) given a bf16 model's hidden states: its logits are the
    kernel's float32 products (DecoderLM.compute_logits through QuantLinear.run(float32=True)), not rounded to bf16 (steps
    of 0.125 at |logit| 16-32, which tied the best candidates and put logprobs on that grid)."""
    from tokenmill.kernels.backend import KernelChoice
    from tokenmill.models.layers.linear import QuantLinear
    fmt = WeightFormat.parse("int8-g32")
    t = weights(fmt, 300, 160)
    t["scales"] *= 40  # logits of |16| and more, where a bf16 step is 0.125 or coarser
    layer = QuantLinear(160, 300, bias=False, fmt=fmt)
    for name in ("qweight", "scales"):
        getattr(layer, name).copy_(t[name])
    layer.kernels = KernelChoice(backend="cpu")
    layer.prepare_cpu()
    hidden = torch.randn(rows, 160).bfloat16()
    ref = quant_linear_reference(hidden.float(), fmt, t["qweight"], t["scales"], None, int8_activations=True)
    assert ref.abs().max() > 16
    logits = layer.run(hidden, float32=True)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=5e-3)
    assert not torch.equal(logits, logits.bfloat16().float())  # off the bf16 grid: a float32 result


def test_int4_packing_round_trips_in_gguf_block_order():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 32)
    assert torch.equal(packed[:, 0] & 0x0F, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 16])
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_map_onto_the_formats_bit_for_bit(type_name):
    """gguf's own quantizer writes the blocks, gguf's own dequantizer is the truth: the format's reference
    dequantization of the same bytes (no re-quantization) equals it exactly."""
    from gguf import GGMLQuantizationType, dequantize as gguf_dequantize, quantize as gguf_quantize

    qtype = GGMLQuantizationType[type_name]
    w = (np.random.default_rng(0).standard_normal((24, 256)) * 0.05).astype(np.float32)
    blocks = gguf_quantize(w, qtype)
    ours = dequantize_pieces(GGUF_KEPT_TYPES[type_name], gguf_quantized_pieces(blocks, type_name))
    assert torch.equal(ours, torch.from_numpy(gguf_dequantize(blocks, qtype)))  # the loader reads the file so


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_kernel_on_gguf_blocks(type_name):
    """gguf's own blocks (the default model's formats) through the kernel, past one chunk of rows too: it agrees with
    the reference on the same bytes."""
    from gguf import GGMLQuantizationType, quantize as gguf_quantize

    w = (np.random.default_rng(1).standard_normal((37, 256)) * 0.05).astype(np.float32)
    pieces = gguf_quantized_pieces(gguf_quantize(w, GGMLQuantizationType[type_name]), type_name)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in pieces.items()}
    fmt = WeightFormat.parse(GGUF_KEPT_TYPES[type_name])
    for rows in (1, 9, 131):
        x = torch.randn(rows, 256) * 3
        ref = quant_linear_reference(x, fmt, t["qweight"], t["scales"], t.get("mins"), int8_activations=True)
        got = quant_linear_cpu(x, fmt, t["qweight"], t["scales"], t.get("mins"))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("name", ["int4-g32", "int4-g64", "int8-ch", "int8-g64-zp"])
@pytest.mark.parametrize("rows", [1, 5, 17, 131])
def test_symmetric_weights_take_the_zero_point_off_in_integers(name, rows):
    """int4 whose every min is -8 * scale (GGUF's Q4_0) and int8 whose mins are absent or 0 leave out the min term
    (the interleaved kernel subtracts offset * the x codes' sum in integers): the reference's products either way,
    and one min off by a step sends the weight back to the general form."""
    from tokenmill.kernels.quant_linear import CPUQuantMatmul
    fmt = WeightFormat.parse(name)
    t = weights(fmt, 37, 160, seed=rows)
    if fmt.kind == "int4":
        t["mins"] = (t["scales"].float() * -8).to(t["mins"].dtype)
    elif t.get("mins") is not None:
        t["mins"].zero_()
    x = torch.randn(rows, 160) * 3
    bias = torch.randn(37)
    variants = [(t.get("mins"), 1)]
    if fmt.kind == "int4":  # one group's min a step away from -8 * scale: the general form, the same answer
        moved = t["mins"].clone()
        moved[3, 1] -= t["scales"][3, 1]
        variants.append((moved, 0))
    for mins, symmetric in variants:
        kernel = CPUQuantMatmul(fmt, t["qweight"], t["scales"], mins, bias)
        if x16_register_rows():
            assert kernel._weight.symmetric == symmetric
        ref = quant_linear_reference(x, fmt, t["qweight"], t["scales"], mins, bias, int8_activations=True)
        torch.testing.assert_close(kernel(x), ref, rtol=1e-4, atol=5e-4)


@pytest.mark.parametrize("name,expected", [("int4-g32", ("int4", 32, True, False)),
                                           ("int4-g128-zp", ("int4", 128, True, True)),
                                           ("int8-ch", ("int8", 0, False, False)),
                                           ("int8-g64-zp", ("int8", 64, True, True)), ("fp8-ch", ("fp8", 0, False, False))])
def test_format_names_parse(name, expected):
    fmt = WeightFormat.parse(name)
    assert (fmt.kind, fmt.group_size, fmt.has_min, fmt.min_f32) == expected and fmt.name == name


@pytest.mark.parametrize("name", ["int3-g32", "int4-g48", "int4", "fp8-ch-zp", "int4-gx"])
def test_bad_format_names_are_refused(name):
    with pytest.raises(ValueError, match="format"):
        WeightFormat.parse(name)


def test_fp8_w8a8_matches_its_definition():
    """The GPU path's math, run through torch._scaled_mm on this CPU: per-token fp8 activations times fp8 weights."""
    from tokenmill.kernels.quant_linear import fp8_w8a8_linear
    from tokenmill.kernels.kv_write import FP8_MAX

    fmt = WeightFormat.parse("fp8-ch")
    t = quantize(torch.randn(32, 64), fmt)
    x = torch.randn(4, 64)
    x_scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    x_deq = (x / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    expected = x_deq @ dequantize(fmt, t["qweight"], t["scales"], None).T
    torch.testing.assert_close(fp8_w8a8_linear(x, t["qweight"], t["scales"], None), expected, rtol=1e-5, atol=1e-4)
