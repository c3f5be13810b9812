"""Find a model and read its config and weights: a Hugging Face checkpoint directory or a GGUF file.

Both paths yield the same thing: an HF-style config dict and (HF tensor name, tensor) pairs, so model code
knows one naming scheme. GGUF tensors in Q4_0, Q4_1 and Q8_0 are also offered as they are stored, as the pieces of
kernels/quant_linear.py's int4 / int8 formats (``<name>.qweight``, ``.scales``, ``.mins`` beside ``<name>.weight``;
the config's ``quantization_config`` lists them); every other type, and the ``.weight`` of these, is dequantized
with the ``gguf`` package. llama.cpp's rotary permutation of Q/K rows is undone so that GGUF and safetensors weights
run the same code.

A model passes ``shard`` (name -> (dim, slice), None, or SKIP) and gets only what it runs (a GGUF weight it takes
only quantized is never dequantized): a tensor-parallel rank
its slice of each tensor, read lazily from safetensors (``get_slice``: only those bytes leave the file) or cut right
after dequantizing from GGUF; nothing at all of the tensors it skips. The host holds at most one tensor at a time.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from tokenmill.models.gguf_file import GGUFFile, read_gguf
from tokenmill.models.paths import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE,  # noqa: F401
                                   ModelLoadError, default_model_path, model_path, tokenizer_files)

# Checkpoint tensor name -> (dimension, slice) of it to load, None for the whole tensor, or SKIP: not read at all.
Shard = Callable[[str], "tuple[int, slice] | str | None"]
SKIP = "skip"


def _index(dim: int, part: slice) -> tuple[slice, ...]:
    return (slice(None),) * dim + (part,)


@dataclass
class Checkpoint:
    path: Path  # the directory or the .gguf file
    name: str  # what /v1/models calls it
    hf_config: dict[str, Any]
    weights: Callable[["Shard | None"], Iterator[tuple[str, torch.Tensor]]]
    # generation_config.json (HF directories), which may list more EOS ids than config.json.
    generation_config: dict[str, Any]
    # Where the tokenizer lives: a directory, plus the GGUF file name inside it when it comes from GGUF.
    tokenizer_dir: Path
    tokenizer_gguf_file: str | None = None


def open_checkpoint(model: str | None) -> Checkpoint:
    path = model_path(model)
    if path.is_file():
        return _open_gguf(path, name=DEFAULT_MODEL_NAME if model is None else path.stem)
    return _open_hf_dir(path)


# --- Hugging Face directory

def _open_hf_dir(path: Path) -> Checkpoint:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a model directory: it has no config.json")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")

    def weights(shard: Shard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in files:
            try:
                with safe_open(str(file), framework="pt") as fh:
                    for name in fh.keys():
                        cut = shard(name) if shard else None
                        if cut == SKIP:
                            continue
                        yield name, fh.get_tensor(name) if cut is None else fh.get_slice(name)[_index(*cut)]
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise ModelLoadError(f"cannot read weights from {file}: {exc}") from None

    generation_config = {}
    if (path / "generation_config.json").is_file():
        try:
            generation_config = json.loads((path / "generation_config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path / 'generation_config.json'} is not valid JSON: {exc}") from None
    return Checkpoint(path, path.name, hf_config, weights, generation_config, tokenizer_dir=path)


# --- GGUF file

_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def _gguf_config(reader: GGUFFile, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(_GGUF_ARCHITECTURES)})")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    config = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        # End of sequence and, where the file names it, end of turn: both end generation.
        "eos_token_id": [i for i in (_field(reader, "tokenizer.ggml.eos_token_id"),
                                     _field(reader, "tokenizer.ggml.eot_token_id")) if i is not None],
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": _field(reader, f"{arch}.rope.scaling.factor"),
                                  "original_max_position_embeddings":
                                      _field(reader, f"{arch}.rope.scaling.original_context_length")}
    return config


def hf_name_for_gguf(name: str) -> str:
    stem, _, kind = name.rpartition(".")  # kind: weight | bias
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in _GGUF_LAYER_NAMES:
            raise ModelLoadError(f"unexpected GGUF tensor {name}")
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    if stem not in _GGUF_GLOBAL_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {name}")
    return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved pairs -> HF's halves layout)."""
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


# GGUF block types kept as they are: (format, bytes of the fp16 scale and min fields before the codes).
GGUF_KEPT_TYPES = {"Q4_0": "int4-g32", "Q4_1": "int4-g32", "Q8_0": "int8-g32"}


def gguf_quantized_pieces(blocks: np.ndarray, type_name: str) -> dict[str, np.ndarray]:
    """A Q4_0 / Q4_1 / Q8_0 tensor's raw blocks (uint8 [rows, bytes]) -> the int4 / int8 format's tensors, bytes
    unchanged: Q4_0 (d, 16 code bytes; x = d * (q - 8)) -> scale d, min -8 d (exact in fp16); Q4_1 (d, m, 16 code
    bytes; x = d * q + m) -> scale d, min m; Q8_0 (d, 32 int8 codes; x = d * q) -> scale d."""
    rows = blocks.shape[0]
    header = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[type_name]
    b = blocks.reshape(rows, -1, header + (32 if type_name == "Q8_0" else 16))  # [rows, K / 32, block bytes]
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]
    codes = np.ascontiguousarray(b[..., header:]).reshape(rows, -1)
    if type_name == "Q8_0":
        return {"qweight": codes.view(np.int8), "scales": d}
    mins = -8 * d if type_name == "Q4_0" else np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
    return {"qweight": codes, "scales": d, "mins": mins}


def dequantize_pieces(fmt_name: str, pieces: dict[str, np.ndarray]) -> torch.Tensor:
    """A kept GGUF tensor's pieces (``gguf_quantized_pieces``) -> its weight, float32."""
    from tokenmill.kernels.quant_linear import WeightFormat, dequantize

    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in pieces.items()}
    return dequantize(WeightFormat.parse(fmt_name), tensors["qweight"], tensors["scales"], tensors.get("mins"))


def _open_gguf(path: Path, name: str) -> Checkpoint:
    from gguf import dequantize

    try:
        reader = read_gguf(path)
    except Exception as exc:  # a corrupt file fails in many ways (ValueError, OSError, struct and numpy errors)
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from None
    config = _gguf_config(reader, path)
    permute_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    llama_layout = config["architectures"][0] == "LlamaForCausalLM"

    def arrays(tensor: Any) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
        name = hf_name_for_gguf(tensor.name)
        if tensor.tensor_type.name not in GGUF_KEPT_TYPES:
            yield name, lambda: dequantize(tensor.data, tensor.tensor_type)
        else:
            stem = name.removesuffix(".weight")
            pieces = functools.cache(lambda: gguf_quantized_pieces(tensor.data, tensor.tensor_type.name))
            # The same values as gguf's dequantize (tests/kernels/test_quant_linear.py checks them bit for bit), in
            # torch's vector ops: 0.6 s instead of 1.3 s for SmolLM2's file.
            yield name, lambda: dequantize_pieces(GGUF_KEPT_TYPES[tensor.tensor_type.name], pieces()).numpy()
            for piece in ("qweight", "scales", "mins"):
                if piece != "mins" or tensor.tensor_type.name != "Q8_0":
                    yield f"{stem}.{piece}", lambda piece=piece: pieces()[piece]

    def weights(shard: Shard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            part = tensor.name.split(".")[-2]
            for name, read in arrays(tensor):
                cut = shard(name) if shard else None
                if cut == SKIP:
                    continue
                array = read()
                if llama_layout and part in permute_heads:
                    array = unpermute_rotary_rows(array, permute_heads[part])
                if cut is not None:
                    array = array[_index(*cut)]
                dtype = array.dtype if name.endswith((".qweight", ".scales", ".mins")) else np.float32
                # Never a view of the file's map (a copy then); arrays made while reading are taken as they are.
                mapped = np.may_share_memory(array, reader.data)
                yield name, torch.from_numpy(np.array(array, dtype) if mapped else np.ascontiguousarray(array, dtype))

    formats = {f"{hf_name_for_gguf(t.name).removesuffix('.weight')}": GGUF_KEPT_TYPES[t.tensor_type.name]
               for t in reader.tensors if t.tensor_type.name in GGUF_KEPT_TYPES}
    if formats:
        config["quantization_config"] = {"quant_method": "gguf", "formats": formats}
    return Checkpoint(path, name, config, weights, {}, tokenizer_dir=path.parent, tokenizer_gguf_file=path.name)
