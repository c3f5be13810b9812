"""What every decoder model shares: the layer loop, the logits, the move to a device, the weight check.

A model subclass keeps its ``config`` (models/config.py), builds ``embed_tokens``, ``layers`` (each called as
``layer(x, positions)``; attention reaches the step's metadata and cache through kernels/attention_op.py), ``norm``,
``lm_head`` and ``rotary``, and provides ``load_weights``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.attention_op import attention_context
from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.cpu_linear import linear_table
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheDtype, KVCacheSpec
from tokenmill.models.config import ModelConfig
from tokenmill.models.layers.linear import QUANT_BUFFERS, QuantLinear
from tokenmill.models.layers.logits import logits_with_exact_top
from tokenmill.models.layers.vocab import vocab_rows


def mlp_sources(index: int, mlp: nn.Module) -> dict[str, tuple[str, ...]]:
    """For a model's ``linear_sources``: layer ``index``'s fused gate/up and down projections (a dense MLP's, or an
    MoE's shared experts'; none for an MoE without them) -> the checkpoint modules each is made of, in row order."""
    owner = "mlp.shared_experts" if hasattr(mlp, "shared_experts") else "mlp"
    if owner != "mlp" and mlp.shared_experts is None:
        return {}
    ckpt = f"model.layers.{index}.{owner}"
    return {f"layers.{index}.{owner}.gate_up_proj": (f"{ckpt}.gate_proj", f"{ckpt}.up_proj"),
            f"layers.{index}.{owner}.down_proj": (f"{ckpt}.down_proj",)}


class DecoderLM(nn.Module):
    # Parameter-name suffixes kept in float32 whatever the compute dtype.
    fp32_params: tuple[str, ...] = ()
    # Names of nn.Linear children whose weight the model reads as a tensor: never swapped for a packed layer
    # (kernels/cpu_linear.py).
    unpacked_linears: tuple[str, ...] = ()
    # The PackedLinear layers, numbered (kernels/cpu_linear.py pack_linears sets it on a CPU).
    packed_linears: tuple = ()
    config: ModelConfig
    # ``decoder`` as compiled by models/compile.py, or None (eager).
    compiled_decoder = None
    # The layer stack as one C call (models/cpu_stack.py), or None; takes the steps it can, before the above.
    cpu_stack = None
    # This rank's place when the model is split across tensor-parallel ranks (a model that splits sets its own).
    tp = TensorParallel()

    @classmethod
    def compile_blocker(cls, config: ModelConfig) -> str | None:
        """Why ``decoder`` cannot trace into one graph for torch.compile (models/compile.py) for ``config``; None where
        it can. Whatever varies with the step's data runs inside opaque ops (kernels/attention_op.py, moe_op.py)."""
        return None

    @property
    def max_position(self) -> int:
        return self.config.max_position

    def kv_cache_spec(self, dtype: KVCacheDtype, block_size: int) -> KVCacheSpec:
        return self.config.kv_cache_spec(dtype, block_size, self.tp.size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        if self.cpu_stack is not None:
            hidden = self.cpu_stack.run(input_ids, positions, meta, kv_cache)
            if hidden is not None:
                return hidden
        with attention_context(meta, kv_cache.data, kv_cache.scales, kv_cache.group_of_layer), \
                linear_table(self.packed_linears):
            if self.compiled_decoder is not None:
                return self.compiled_decoder(input_ids, positions)
            return self.decoder(input_ids, positions)

    def decoder(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer stack, run inside an attention context: [T] ids, [T] positions -> [T, hidden]."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden] (a family that scales its embeddings overrides this)."""
        return self.embed_tokens(input_ids)

    def weight_shard(self, name: str) -> tuple[int, slice] | None:
        """The (dimension, slice) of checkpoint tensor ``name`` this tensor-parallel rank loads (None: all of it).
        A model that splits across ranks overrides this; one that does not is served by one rank only."""
        return None

    def use_kernels(self, choice: KernelChoice) -> None:
        """Point every layer that calls kernels (those with a ``kernels`` attribute) at ``choice``."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = choice

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> float32 logits [S, vocab] (every rank's vocabulary shard gathered); a quantized head's
        C kernel computes them in float32 (QuantLinear.run's ``float32``)."""
        if isinstance(self.lm_head, QuantLinear):
            logits = self.lm_head.run(hidden, float32=True).float()
        else:
            logits = logits_with_exact_top(hidden, self.lm_head.weight, self.lm_head)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last(logits)[:, :self.config.vocab_size]
        cap = self.config.style.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def cast_parameters(self, dtype: torch.dtype) -> "DecoderLM":
        """Give every parameter the compute ``dtype``, except fp8 weights (kept fp8: ``Module.to`` would widen them)
        and ``fp32_params`` (kept float32). On the meta device this is free: the worker casts first, then
        materializes on the target device and loads each checkpoint tensor straight into its final dtype, so no
        float32 copy of the model ever exists."""
        for name, param in self.named_parameters():
            target = torch.float32 if self.fp32_params and name.endswith(self.fp32_params) else dtype
            if param.dtype != torch.float8_e4m3fn and param.dtype != target:
                param.data = param.data.to(target)
        return self

    def to_device(self, device: torch.device | str, dtype: torch.dtype) -> "DecoderLM":
        """Move a materialized model: ``cast_parameters(dtype)``, then the device (rotary tables included)."""
        self.cast_parameters(dtype).to(device)
        self.move_rotary(device)
        return self

    def move_rotary(self, device: torch.device | str) -> None:
        """The cos/sin tables (not module state) to ``device``: ``rotaries`` where a model has several."""
        for rotary in getattr(self, "rotaries", (self.rotary,)):
            rotary.to(device)

    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor ``name`` -> (this model's tensor name, first row in a fused tensor or None); a model
        that fuses or renames overrides it (llama.py). None: not kept."""
        return name.removeprefix("model."), None

    def takes(self, name: str) -> bool:
        """Whether this model reads checkpoint tensor ``name``: a quantized piece only for a layer that holds it as
        it is, a full-precision weight only for a layer that keeps it (or rounds it at load)."""
        stem, _, leaf = name.rpartition(".")
        if leaf not in ("weight", *QUANT_BUFFERS):
            return True
        target = self.weight_target(name)
        if target is None:
            return True
        path = target[0].rpartition(".")[0]
        try:
            module = self.get_submodule(path)
        except AttributeError:
            return leaf == "weight"
        if leaf in QUANT_BUFFERS:
            return isinstance(module, QuantLinear) and not module.quantize_at_load
        return not isinstance(module, QuantLinear) or module.weight is not None or module.quantize_at_load

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as held: every parameter and quantized buffer, each storage once (a tied
        head counts once), and a weight kernels/cpu_linear.py holds packed only at its logical size (a packed copy
        beside a kept plain one is not counted)."""
        seen, total = set(), sum(m.packed_only_bytes() for m in self.modules() if hasattr(m, "packed_only_bytes"))
        tensors = [p for _, p in self.named_parameters(remove_duplicate=False)]
        tensors += [b for n, b in self.named_buffers() if n.rpartition(".")[2] in QUANT_BUFFERS]
        for t in tensors:
            if t.device.type != "meta" and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def loadable_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint fills: every parameter's data and every quantized layer's buffers, by name."""
        tensors = {name: param.data for name, param in self.named_parameters()}
        tensors.update((name, buf) for name, buf in self.named_buffers() if name.rpartition(".")[2] in QUANT_BUFFERS)
        return tensors

    def tied_head_target(self, name: str) -> str:
        """A tied embedding's quantized pieces fill a quantized LM head (the embedding itself keeps its dense rows)."""
        stem, _, leaf = name.rpartition(".")
        if stem == "embed_tokens" and leaf in QUANT_BUFFERS and self.config.tie_word_embeddings:
            return f"lm_head.{leaf}"
        return name

    def copy_quantized(self, name: str, offset: int | None, tensor: torch.Tensor, filled: dict[str, int]) -> bool:
        """Copy a tensor aimed at a QuantLinear (models/layers/linear.py): its pieces as they are; a full-precision
        weight into the dense copy where it keeps one and, where it quantizes at load, rounded into its buffers.
        False when ``name`` is not a quantized layer's weight or piece (the caller copies it as a parameter)."""
        path, _, leaf = name.rpartition(".")
        try:
            module = self.get_submodule(path) if path else None
        except AttributeError:  # not a module of this model: the caller's "unexpected weight"
            return False
        if not isinstance(module, QuantLinear) or leaf not in ("weight", *QUANT_BUFFERS):
            return False
        if leaf == "input_perm":  # one per layer: every part of a fused layer must bring the same
            if filled.get(name) and not torch.equal(module.input_perm, tensor.to(module.input_perm.dtype)):
                raise ValueError(f"{name}: the parts of this fused layer order their inputs differently")
            module.input_perm.copy_(tensor)
            filled[name] = tensor.numel()
            return True
        rows = slice(None) if offset is None else slice(offset, offset + tensor.shape[0])
        if leaf in QUANT_BUFFERS:
            self.copy_weight(name, getattr(module, leaf)[rows], tensor, filled)
            return True
        if module.weight is None and not module.quantize_at_load:
            raise ValueError(f"unexpected full-precision weight {name!r}: the layer is stored quantized")
        if module.weight is not None:
            self.copy_weight(name, module.weight.data[rows], tensor, filled)
        if module.quantize_at_load:
            for buffer, count in module.load_dense(tensor.float(), offset or 0).items():
                filled[f"{path}.{buffer}"] = filled.get(f"{path}.{buffer}", 0) + count
        return True

    @staticmethod
    def copy_weight(name: str, dst: torch.Tensor, tensor: torch.Tensor, filled: dict[str, int]) -> None:
        """Copy checkpoint ``tensor`` into parameter ``name``'s view ``dst`` and count the elements filled; a rank's
        embedding or LM head shard may hold more rows than the checkpoint slice (its zeroed padding counts too)."""
        if name in ("embed_tokens.weight", "lm_head.weight"):
            dst, padding = vocab_rows(dst, tensor)
            filled[name] = filled.get(name, 0) + padding
        if dst.shape != tensor.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)
        filled[name] = filled.get(name, 0) + tensor.numel()

    def finish_loading(self, filled: dict[str, int], tie_word_embeddings: bool) -> None:
        """Tie the head if asked (a quantized head keeps its own pieces; rounded from the embedding where it quantizes
        at load), then require every parameter and quantized buffer to have been filled exactly once."""
        head = self.lm_head
        if tie_word_embeddings and (not isinstance(head, QuantLinear) or head.weight is not None):
            head.weight = self.embed_tokens.weight
            filled["lm_head.weight"] = head.weight.numel()
        if tie_word_embeddings and isinstance(head, QuantLinear) and head.quantize_at_load:
            for buffer, count in head.load_dense(self.embed_tokens.weight.float()).items():
                filled[f"lm_head.{buffer}"] = count
        expected = [(n, p.numel()) for n, p in self.named_parameters(remove_duplicate=False)]
        expected += [(n, b.numel()) for n, b in self.named_buffers() if n.rpartition(".")[2] in QUANT_BUFFERS]
        missing = [n for n, numel in expected if filled.get(n, 0) != numel]
        if missing:
            raise ValueError(f"checkpoint does not fill these weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.drop_identity_order()
