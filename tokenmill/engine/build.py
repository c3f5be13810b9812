"""Build an engine's model runner from the settled choices (engine/settle.py): the model on its device, its weights
read straight into the compute dtype, the KV cache sized from the memory budget, the compiled layer stack or the
CUDA graphs, the proposer. Rank 0 (the engine core) and the worker ranks build the same way, each over its shard.
This is where the settled thread count is applied, once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.distributed.group import TensorParallel
from tokenmill.engine.cuda_graphs import DecodeGraphs
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.settle import Settled
from tokenmill.engine.start import start_stage
from tokenmill.engine.warmup import compile_and_warm_up
from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.cpu_attention import set_prefetch_target, set_prefill_kernel
from tokenmill.models.cpu_stack import CPUDecoderStack
from tokenmill.kernels.cpu_linear import pack_linears
from tokenmill.kvcache.cache import KVCache
from tokenmill.models.config import ModelConfig
from tokenmill.models.families import TEMPLATE_STOP_TOKENS
from tokenmill.models.layers.linear import LinearPlan, QuantLinear, quantize_linears
from tokenmill.models.loader import SKIP, Checkpoint, ModelLoadError, open_checkpoint
from tokenmill.models.quant_methods import CHECKPOINT_METHODS, has_input_order
from tokenmill.models.quantization import candidate_formats
from tokenmill.models.quantized_checkpoints import convert
from tokenmill.models.registry import model_class_for
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.runtime import keep_freed_memory_in_heap
from tokenmill.speculative.mtp import MTPDrafter
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.speculative.proposer import Proposer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    kv_cache: KVCache
    device: torch.device
    max_model_len: int


def open_model(config: EngineConfig) -> tuple[Checkpoint, Tokenizer, ModelConfig]:
    checkpoint = open_checkpoint(config.model)
    # Before the tokenizer (transformers' own config checks are less clear) and any weight: an unknown family or an
    # unsupported field is one error naming it.
    try:
        architecture = ModelConfig.from_hf(checkpoint.hf_config, checkpoint.generation_config).architecture
    except (KeyError, ValueError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ModelLoadError(f"cannot serve the model at {checkpoint.path}: {what}") from None
    tokenizer = Tokenizer.of_checkpoint(checkpoint, config.tokenizer_cache_dir)
    stops = tokenizer.ids_of_tokens(TEMPLATE_STOP_TOKENS.get(architecture, ()))
    return checkpoint, tokenizer, ModelConfig.from_hf(checkpoint.hf_config, checkpoint.generation_config,
                                                      tokenizer.eos_token_id, stops)


def build_runner(config: EngineConfig, settled: Settled, checkpoint: Checkpoint, model_config: ModelConfig,
                 tp: TensorParallel = TensorParallel()) -> tuple[ModelRunner, LoadedModel]:
    """This rank's runner over its model and KV cache, ready to serve (compiled and warmed up, graphs captured)."""
    if settled.device == "cpu":
        keep_freed_memory_in_heap()
    if settled.num_threads:
        torch.set_num_threads(settled.num_threads)
    if settled.kernel_backend == "cpu":
        set_prefetch_target(settled.attention_prefetch)
        set_prefill_kernel(settled.prefill_attention)
    with start_stage("loading the weights and sizing the KV cache",
                     "--quantization int4 or int8 holds the weights in fewer bytes, a smaller --kv-cache-memory "
                     "holds fewer KV blocks"):
        loaded = load_model_and_cache(checkpoint, model_config, config, settled, tp)
    with start_stage("running the model's first steps", "--kernel-backend torch runs the PyTorch references in "
                     "place of the C kernels" if settled.kernel_backend == "cpu" else None):
        if settled.execution == "compiled":
            compile_and_warm_up(loaded.model, loaded.kv_cache, config.compile_cache_dir)
        elif settled.device == "cpu" and (config.enforce_eager or settled.tensor_parallel_size > 1):
            log.info("model runs eagerly (%s)", "enforce_eager" if config.enforce_eager else
                     "tensor-parallel ranks run eagerly")
    if settled.kernel_backend == "cpu" and config.cpu_layer_stack:
        # after warm-up: the compiled graph's steps ran
        with start_stage("building the layer stack in one C call", "--no-cpu-layer-stack runs the layers from Python"):
            loaded.model.cpu_stack = CPUDecoderStack.build(loaded.model)
    # After the start-up timings, compile and warm-up, which populating beside them would disturb.
    with start_stage("populating the KV cache", "--kv-cache-populate lazy leaves it to the first requests"):
        loaded.kv_cache.populate(config.kv_cache_populate, torch.get_num_threads())
    graphs = None
    if settled.execution == "cuda_graphs":
        with start_stage("capturing CUDA graphs", "--enforce-eager runs without them"):
            graphs = DecodeGraphs(loaded.model, loaded.kv_cache, config.max_num_seqs, loaded.max_model_len)
            graphs.capture()
    with start_stage(f"preparing the {settled.speculative_method} drafter", "--speculative-method off drafts nothing"):
        proposer = make_proposer(config, settled, loaded, tp)
    runner = ModelRunner(loaded.model, loaded.kv_cache, loaded.device, config.max_num_seqs, loaded.max_model_len,
                         model_config.eos_token_ids, config.seed, proposer, graphs,
                         c_kernels=settled.kernel_backend == "cpu")
    return runner, loaded


def build_rank_runner(config: EngineConfig, settled: Settled, tp: TensorParallel) -> ModelRunner:
    """A worker rank's runner over its shard of the model (engine/ranks.py)."""
    checkpoint, _, model_config = open_model(config)
    return build_runner(config, settled, checkpoint, model_config, tp)[0]


def make_proposer(config: EngineConfig, settled: Settled, loaded: LoadedModel, tp: TensorParallel
                  ) -> Proposer | None:
    """MTP drafts on every rank (its forward pass is the model's, collectives included); n-gram drafts on rank 0 only
    (the other ranks' drafts would be dropped: only rank 0 reports)."""
    if settled.speculative_method == "mtp":
        return MTPDrafter(config.num_speculative_tokens, loaded.model, loaded.kv_cache)
    if settled.speculative_method == "ngram" and tp.rank == 0:
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    return None


def kernel_choice(config: EngineConfig, settled: Settled) -> KernelChoice:
    tuner = None
    if settled.kernel_backend == "triton" and config.kernel_tuning == "autotune":
        from tokenmill.kernels.triton.moe_config import MoETuner

        tuner = MoETuner(Path(config.kernel_cache_dir).expanduser())
    log.info("kernel backend: %s%s", settled.kernel_backend, " (autotuned MoE configs)" if tuner else "")
    return KernelChoice(settled.kernel_backend, tuner)


def checkpoint_weights(checkpoint: Checkpoint, model: torch.nn.Module, model_config: ModelConfig):
    """The checkpoint's tensors this rank's model reads: a quantized checkpoint's layers converted to the layers'
    pieces (models/quantized_checkpoints.py); a GGUF file's pieces or dense weights, whichever each layer holds."""
    quant = model_config.quantization
    if quant is not None and quant.method in CHECKPOINT_METHODS:
        modules = [part for parts in model.linear_sources().values() for part in parts if quant.format_of(part)]
        converted = convert(checkpoint.weights(model.weight_shard), quant.config, modules)
        return ((name, tensor) for name, tensor in converted if model.takes(name))
    return checkpoint.weights(lambda name: model.weight_shard(name) if model.takes(name) else SKIP)


def quantization_plan(model: torch.nn.Module, model_config: ModelConfig, mode: str, group_size: int, table: tuple
                      ) -> dict[str, LinearPlan]:
    """The settled table applied to the model's candidates: each layer's format, dense and AMX thresholds; a
    candidate whose shape measured dense at every row count (threshold 1) stays dense."""
    thresholds = {(out, inp, fmt): (t, amx) for out, inp, fmt, t, amx in table}
    ordered = model_config.quantization is not None and has_input_order(model_config.quantization.config)
    plan = {}
    for path, (fmt, at_load) in candidate_formats(model, model_config, mode, group_size).items():
        layer = model.get_submodule(path)
        threshold, amx_from = thresholds.get((layer.out_features, layer.in_features, fmt), (1, 0))
        if threshold != 1:
            plan[path] = LinearPlan(fmt, threshold, at_load, input_order=ordered and not at_load,
                                    amx_from_rows=amx_from)
    return plan


@dataclass(frozen=True)
class KVBudget:
    """The KV cache's bytes, and for error messages the setting that bounds them and how it came out."""
    bytes: int
    setting: str  # "kv_cache_memory" or "gpu_memory_utilization"
    detail: str


def kv_budget(config: EngineConfig, device: torch.device) -> KVBudget:
    """KV cache bytes: kv_cache_memory where set; else 2 GiB on a CPU, and on a GPU its gpu_memory_utilization share
    less what is in use now (the weights are loaded: every other process's and engine's memory counts as used)."""
    if config.kv_cache_memory is not None or device.type != "cuda":
        size = config.cpu_kv_cache_memory  # the setting, or the CPU's default
        return KVBudget(size, "kv_cache_memory", f"kv_cache_memory={_size(size)}")
    free, total = torch.cuda.mem_get_info(device)
    share, used = int(total * config.gpu_memory_utilization), total - free
    return KVBudget(share - used, "gpu_memory_utilization",
                    f"gpu_memory_utilization={config.gpu_memory_utilization} of {_size(total)}, {_size(used)} of "
                    f"it in use by the weights, other engines and other processes")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def load_model_and_cache(checkpoint: Checkpoint, model_config: ModelConfig, config: EngineConfig, settled: Settled,
                         tp: TensorParallel = TensorParallel()) -> LoadedModel:
    """This rank's model (its shard of every weight, read straight into the compute dtype on its device) and KV
    cache; with several ranks, every rank gets the same number of blocks (the smallest any rank's memory allows)."""
    device = tp.device if tp.size > 1 else torch.device(settled.device)
    kernels = kernel_choice(config, settled)
    try:
        model_cls = model_class_for(model_config)
        extra = {"mtp": True} if settled.speculative_method == "mtp" else {}
        if tp.size > 1:  # settle checked that the model splits
            extra["tp"] = tp
        with torch.device("meta"):
            model = model_cls(model_config, kernels=kernels, **extra)
            quantized = quantize_linears(model, quantization_plan(model, model_config, config.quantization,
                                                                  config.quantization_group_size,
                                                                  settled.quant_layouts))
            model.use_kernels(kernels)  # the quantized layers too
        # Materialized on the device in the compute dtype; each checkpoint tensor is converted as it is copied in.
        model.cast_parameters(settled.torch_dtype).to_empty(device=device)
        model.move_rotary(device)
        model.load_weights(checkpoint_weights(checkpoint, model, model_config))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"cannot build the model from {checkpoint.path}: {exc}") from None
    model.eval()
    if quantized:
        log.info("linear layers: %d of them quantized (%s)", quantized, ", ".join(sorted(
            {f"{m.fmt.name}{'' if m.dense_from_rows is None else f' below {m.dense_from_rows} rows'}"
             for m in model.modules() if isinstance(m, QuantLinear)})))
    if device.type == "cpu":
        packed = pack_linears(model, {(out, inp): t for out, inp, t in settled.linear_layouts},
                              skip=model.unpacked_linears)
        log.info("linear layers: %d of them packed for oneDNN", packed)

    spec = model.kv_cache_spec(settled.kv_cache_dtype, config.block_size)
    budget = kv_budget(config, device)
    num_blocks = tp.min(spec.num_blocks_for(budget.bytes) - 1)  # less the cache's null block
    if num_blocks < 1:
        raise ConfigError(f"no room for a single KV block ({spec.bytes_per_block} bytes, and one more for the null "
                          f"block; {budget.detail}): raise {budget.setting}")
    # The longest request the blocks hold (any length up to the positions when every layer has a window).
    capacity = spec.groups.max_tokens_for(num_blocks, spec.block_size, limit=model.max_position,
                                          chunk=config.max_num_batched_tokens)
    max_model_len = config.max_model_len or model.max_position
    if max_model_len > model.max_position:
        raise ConfigError(f"max_model_len={max_model_len} is beyond the model's {model.max_position} positions")
    if capacity < max_model_len:
        if config.max_model_len:
            raise ConfigError(f"the KV cache holds {capacity} tokens ({spec.bytes_per_token} bytes each; "
                              f"{budget.detail}), fewer than max_model_len={max_model_len}: raise {budget.setting}"
                              f"{' or set kv_cache_memory' if budget.setting != 'kv_cache_memory' else ''}, or "
                              f"lower max_model_len")
        max_model_len = capacity
        log.warning("max_model_len lowered to %d: the KV cache holds no more", capacity)
    return LoadedModel(model, KVCache(spec, num_blocks, device), device, max_model_len)
