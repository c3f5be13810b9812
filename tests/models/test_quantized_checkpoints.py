"""Quantized checkpoints as shipped (compressed-tensors, AWQ, GPTQ), loaded without a full-precision copy: each is
written from a tiny random Llama by the format's own published layout (compressed-tensors' own packer), and served
greedy tokens and logits must equal transformers' on the same weights: the compressed-tensors W4A16 and FP8
checkpoints loaded by transformers itself (it decompresses with the compressed-tensors library), the others (its
int8 one did not load in this transformers; AWQ and GPTQ need autoawq / gptqmodel) as a dense checkpoint of the
weights the test quantized them from, dequantized by each format's formula. The engine runs the PyTorch reference here (weight-only); the C kernel is held to that reference
in tests/kernels/test_quant_linear.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_greedy
from tests.helpers import prefill_logits
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM
from tokenmill.config import ConfigError
from tokenmill.models.layers.linear import QuantLinear
from tokenmill.models.loader import ModelLoadError

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_int4(w: torch.Tensor, symmetric: bool):
    """Round to nearest, groups of GROUP: codes 0..15, integer zeros, fp16 scales (w ~= (q - z) * s)."""
    g = w.view(w.shape[0], -1, GROUP)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-6).half()
        zero = torch.full_like(scale, 8, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half()
        zero = (-lo / scale.float()).round().clamp(0, 15).to(torch.int32)
    q = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.int32)
    deq = ((q - zero[..., None]).float() * scale.float()[..., None]).view_as(w)
    return q.view_as(w), zero, scale, deq  # q [out, in], zero / scale [out, groups], deq [out, in]


def pack_sequential(values: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols] of 4-bit values -> int32 [rows, cols / 8], value j of a word at bits 4j."""
    v = values.view(values.shape[0], -1, 8).to(torch.int64)
    words = sum(v[..., j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits, as int32


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AWQ's GEMM order: word slot j holds column AWQ_ORDER[j] of each group of eight columns."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    v = values.view(values.shape[0], -1, 8)[:, :, list(order)]
    return pack_sequential(v.reshape(values.shape[0], -1))


def activation_order(module: str, width: int) -> torch.Tensor:
    """The order a GPTQ quantizer with activation order would visit a layer's inputs in (by its Hessian's diagonal,
    which layers reading the same input share: q/k/v, gate/up): a random permutation, one per input."""
    shared = module.rpartition(".")[0] + {"k_proj": ".q_proj", "v_proj": ".q_proj", "up_proj": ".gate_proj"}.get(
        module.rpartition(".")[2], "." + module.rpartition(".")[2])
    seed = sum(map(ord, shared)) * 131 + width
    return torch.randperm(width, generator=torch.Generator().manual_seed(seed))


def rtn_int4_ordered(w: torch.Tensor, symmetric: bool, order: torch.Tensor):
    """rtn_int4 over groups of inputs taken in ``order`` (group g: inputs order[g * GROUP:(g + 1) * GROUP]), returned
    in input order with g_idx [in] (the group of each input), as GPTQ's desc_act / actorder=group store them."""
    q, zero, scale, deq = rtn_int4(w[:, order].contiguous(), symmetric)
    position = order.argsort()  # where each input sits in the order
    return q[:, position], zero, scale, deq[:, position], (position // GROUP).to(torch.int32)


def quantized_state(hf_model, method: str):
    """(state dict in ``method``'s layout, the dense state dict of the weights it encodes)."""
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    dense, out = dict(state), {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rpartition(".")[2] in LINEARS):
            out[name] = w
            continue
        if method in ("gptq-desc", "ct-w4a16-group"):  # groups in activation order
            q, zero, scale, dense[name], g_idx = rtn_int4_ordered(w, True, activation_order(module, w.shape[1]))
            if method == "ct-w4a16-group":
                from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

                out[f"{module}.weight_packed"] = pack_to_int32((q - 8).to(torch.int8), 4)
                out[f"{module}.weight_scale"] = scale
                out[f"{module}.weight_shape"] = torch.tensor(w.shape)
                out[f"{module}.weight_g_idx"] = g_idx
            else:
                out[f"{module}.qweight"] = pack_sequential(q).T.contiguous()
                out[f"{module}.qzeros"] = pack_sequential((zero - 1).T.contiguous())
                out[f"{module}.scales"] = scale.T.contiguous()
                out[f"{module}.g_idx"] = g_idx
            continue
        if method == "ct-w8a16":  # int8 per channel, symmetric
            scale = (w.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8).half().float()
            q = (w / scale).round().clamp(-127, 127).to(torch.int8)
            out[f"{module}.weight"], out[f"{module}.weight_scale"] = q, scale.half()
            dense[name] = q.float() * scale
            continue
        if method == "ct-fp8":
            scale = (w.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-8)
            q = (w / scale).to(torch.float8_e4m3fn)
            out[f"{module}.weight"], out[f"{module}.weight_scale"] = q, scale
            dense[name] = q.float() * scale
            continue
        q, zero, scale, deq = rtn_int4(w, symmetric=method in ("ct-w4a16", "gptq"))
        dense[name] = deq
        if method == "ct-w4a16":
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            out[f"{module}.weight_packed"] = pack_to_int32((q - 8).to(torch.int8), 4)
            out[f"{module}.weight_scale"] = scale
            out[f"{module}.weight_shape"] = torch.tensor(w.shape)
        elif method == "awq":
            out[f"{module}.qweight"] = pack_awq(q.T.contiguous())
            out[f"{module}.qzeros"] = pack_awq(zero.T.contiguous())
            out[f"{module}.scales"] = scale.T.contiguous()
        else:  # gptq, zeros stored minus one
            out[f"{module}.qweight"] = pack_sequential(q).T.contiguous()
            out[f"{module}.qzeros"] = pack_sequential((zero - 1).T.contiguous())
            out[f"{module}.scales"] = scale.T.contiguous()
            out[f"{module}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
    return out, dense


CONFIGS = {
    "ct-w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                     "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
                 "ignore": ["lm_head"]},
    "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                   "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}},
               "ignore": ["lm_head"]},
    "ct-w8a16": {"quant_method": "compressed-tensors", "format": "int-quantized",
                 "quantization_status": "compressed",
                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                     "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}},
                 "ignore": ["lm_head"]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
    "gptq-desc": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True},
}
CONFIGS["ct-w4a16-group"] = json.loads(json.dumps(CONFIGS["ct-w4a16"]))
CONFIGS["ct-w4a16-group"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"


def write_quantized(path, smollm_llm, method):
    hf = make_llama_checkpoint(path, smollm_llm)
    quantized, dense = quantized_state(hf, method)
    (path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = CONFIGS[method]
    (path / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(dense)
    return hf


@pytest.mark.parametrize("method", list(CONFIGS))
def test_quantized_checkpoint_serves_like_transformers(tmp_path, smollm_llm, method):
    hf = write_quantized(tmp_path, smollm_llm, method)
    if method in ("ct-w4a16", "ct-fp8"):  # transformers reads these itself, through compressed-tensors
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB",
              kernel_backend="torch", quantization="auto")
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * model.config.num_layers  # every linear but the full-precision head
    assert not any(m.weight is not None for m in quantized)  # no full-precision copy
    assert all((m.input_perm is not None) == (method in ("gptq-desc", "ct-w4a16-group")) for m in quantized)
    ids = torch.randint(0, 1000, (40,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, llm.engine.runner.kv_cache, ids), ref, atol=2e-4, rtol=2e-4)
    from tokenmill import SamplingParams

    ours = llm.generate([ids[:12]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(hf, ids[:12], 12)


def test_fp8_dynamic_checkpoint_serves_close_to_transformers(tmp_path, smollm_llm):
    """llm-compressor's FP8_DYNAMIC scheme: fp8 weights and per-token dynamic fp8 activations. transformers emulates
    the activations' rounding; a CPU serves the weights only (W8A8 runs on GPUs with fp8), so the logits agree to the
    activations' fp8 step, not bit for bit."""
    import transformers

    write_quantized(tmp_path, smollm_llm, "ct-fp8")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB", quantization="auto")
    ids = torch.randint(0, 1000, (40,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = prefill_logits(llm.engine.runner.model, llm.engine.runner.kv_cache, ids)
    assert (ours - ref).abs().max() < 0.1 and (ours - ref).abs().mean() < 0.01


def rewrite_tensors(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_activation_order_checkpoint_errors_name_the_tensor(tmp_path, smollm_llm):
    """A fused layer's parts must order their inputs alike (they read one input); every group must hold GROUP inputs;
    a g_idx out of input order under desc_act=false is not silently read in input order."""
    write_quantized(tmp_path, smollm_llm, "gptq-desc")
    k_idx = "model.layers.0.self_attn.k_proj.g_idx"
    original = load_file(str(tmp_path / "model.safetensors"))[k_idx]
    rewrite_tensors(tmp_path, lambda t: t.update({k_idx: original.flip(0).contiguous()}))
    with pytest.raises(ModelLoadError, match="order their inputs differently"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization="auto")
    rewrite_tensors(tmp_path, lambda t: t.update({k_idx: torch.zeros_like(original)}))
    with pytest.raises(ModelLoadError, match="k_proj.g_idx does not put 32 inputs in every group"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization="auto")
    rewrite_tensors(tmp_path, lambda t: t.update({k_idx: original}))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"\.g_idx groups the inputs in activation order, but the config does "):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization="auto")


def test_malformed_quantized_tensor_names_it(tmp_path, smollm_llm):
    write_quantized(tmp_path, smollm_llm, "awq")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.qzeros"
    tensors[name] = tensors[name][:1].contiguous()  # one group of zeros where the layer has three
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj.qzeros"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization="auto")


def test_a_quantized_checkpoint_cannot_be_asked_for_full_precision(tmp_path, smollm_llm):
    write_quantized(tmp_path, smollm_llm, "awq")
    with pytest.raises(ConfigError, match="stored quantized"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization="none")


@pytest.mark.parametrize("quant,match", [({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
                                         ({"quant_method": "bitsandbytes"}, "bitsandbytes")])
def test_unsupported_quantization_is_refused_before_loading(tmp_path, smollm_llm, quant, match):
    make_llama_checkpoint(tmp_path, smollm_llm)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelLoadError, ConfigError, ValueError), match=match):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", quantization="auto")


@pytest.mark.parametrize("actorder,ordered", [(None, False), ("weight", False), ("static", False), ("group", True),
                                              ("dynamic", True), (True, True)])
def test_compressed_tensors_actorder_values(actorder, ordered):
    """compressed-tensors' actorder: weight/static only changed the quantizer's visiting order (consecutive groups, no
    g_idx), group/dynamic/True store a weight_g_idx per layer; a value it never defined is refused."""
    from tokenmill.models.quant_methods import has_input_order, linear_format

    quant = json.loads(json.dumps(CONFIGS["ct-w4a16"]))
    quant["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    assert linear_format(quant) == ("pack-quantized", "int4-g32-zp") and has_input_order(quant) == ordered
    quant["config_groups"]["group_0"]["weights"]["actorder"] = "columns"
    with pytest.raises(ValueError, match="actorder 'columns' is not supported"):
        linear_format(quant)
    channel = json.loads(json.dumps(CONFIGS["ct-w8a16"]))
    channel["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(ValueError, match="pack-quantized group weights"):
        linear_format(channel)
