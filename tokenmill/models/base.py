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
from tokenmill.models.layers.logits import logits_with_exact_top
from tokenmill.models.layers.vocab import vocab_rows


class DecoderLM(nn.Module):
    # Parameter-name suffixes kept in float32 whatever the compute dtype.
    fp32_params: tuple[str, ...] = ()
    # Whether ``decoder`` traces into one graph for torch.compile (models/compile.py).
    compilable: bool = True
    # Names of nn.Linear children whose weight the model reads as a tensor: never swapped for a packed layer
    # (kernels/cpu_linear.py).
    unpacked_linears: tuple[str, ...] = ()
    # The PackedLinear layers, numbered (kernels/cpu_linear.py pack_linears sets it on a CPU).
    packed_linears: tuple = ()
    config: ModelConfig
    # ``decoder`` as compiled by models/compile.py, or None (eager).
    compiled_decoder = None
    # This rank's place when the model is split across tensor-parallel ranks (a model that splits sets its own).
    tp = TensorParallel()

    @property
    def max_position(self) -> int:
        return self.config.max_position

    def kv_cache_spec(self, dtype: KVCacheDtype, block_size: int) -> KVCacheSpec:
        return self.config.kv_cache_spec(dtype, block_size, self.tp.size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        with attention_context(meta, kv_cache.data, kv_cache.scales), linear_table(self.packed_linears):
            if self.compiled_decoder is not None:
                return self.compiled_decoder(input_ids, positions)
            return self.decoder(input_ids, positions)

    def decoder(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer stack, run inside an attention context: [T] ids, [T] positions -> [T, hidden]."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)

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
        """hidden [S, hidden] -> float32 logits [S, vocab] (every rank's vocabulary shard gathered)."""
        logits = logits_with_exact_top(hidden, self.lm_head.weight, self.lm_head)
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size] if self.tp.size > 1 else logits

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
        self.rotary.to(device)
        return self

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
        """Tie the head if asked, then require every parameter to have been filled exactly once."""
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            filled["lm_head.weight"] = self.lm_head.weight.numel()
        missing = [n for n, p in self.named_parameters(remove_duplicate=False) if filled.get(n, 0) != p.numel()]
        if missing:
            raise ValueError(f"checkpoint does not fill these weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
