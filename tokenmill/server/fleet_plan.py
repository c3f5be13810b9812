"""The engine configs of a server's ``[[models]]``, fitted to the machine before anything loads.

- CPU cores: a model that does not set ``num_threads`` gets an even share of the cores among the models that can
  be loaded at once (those loaded at start-up, plus ``max_loaded_models`` on-demand ones), split among its
  tensor-parallel ranks, so that two engines do not fight over every core; a warning where the thread counts that
  are set ask for more than the cores.
- Memory: the models that can be loaded at once must fit (engine/footprint.py's estimate): in the machine's
  available memory on a CPU; on GPUs, the ``gpu_memory_utilization`` shares of the models on each GPU (``devices``)
  add up to at most 1. Where they do
  not, a ConfigError names the first model that does not fit and what it needs.
"""

from __future__ import annotations

import logging
import os

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.footprint import Footprint, available_host_bytes, footprint

log = logging.getLogger(__name__)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def model_configs(config: EngineConfig, available_bytes: int | None = None) -> list[EngineConfig]:
    specs = config.models
    concurrent = sum(s.load == "startup" for s in specs) + min(config.max_loaded_models,
                                                                 sum(s.load == "on_demand" for s in specs))
    threads = max(1, _cores() // max(1, concurrent))
    configs = []
    for spec in specs:
        shared = len(specs) > 1 and config.num_threads is None
        model_config = config.for_model(spec, **({"num_threads": threads} if shared else {}))
        if shared and model_config.tensor_parallel_size > 1:  # the model's share, split among its ranks
            model_config = config.for_model(spec, num_threads=max(1, threads // model_config.tensor_parallel_size))
        configs.append(model_config)
    at_once = check_memory(config, configs, available_host_bytes() if available_bytes is None else available_bytes)
    warn_oversubscribed(config, configs, at_once)
    return configs


def warn_oversubscribed(config: EngineConfig, configs: list[EngineConfig], at_once: list[tuple[str, Footprint]]
                        ) -> None:
    """A warning where the CPU models loaded at once ask for more threads than there are cores (a thread count set
    for every model, or per model): engines busy at the same time then take turns at every barrier of their thread
    pools. Measured in tests/server/test_many_models.py's fleet on 2 cores, both engines on 2 threads: 240 tokens of
    a tiny model took 19.6 s beside a busy SmolLM2, 0.9 s with the cores shared out."""
    by_name = {spec.name: model_config for spec, model_config in zip(config.models, configs)}
    cores = _cores()
    asked = [(name, (by_name[name].num_threads or cores) * by_name[name].tensor_parallel_size)
             for name, fp in at_once if fp.device == "cpu"]
    total = sum(threads for _, threads in asked)
    if len(asked) > 1 and total > cores:
        log.warning("the CPU models loaded at once ask for %d threads on %d cores (%s): engines busy at the same time "
                    "will take turns at every step; leave num_threads unset to share the cores out, or give each "
                    "model its share", total, cores, ", ".join(f"{name}: {threads}" for name, threads in asked))


def check_memory(config: EngineConfig, configs: list[EngineConfig], available_bytes: int
                 ) -> list[tuple[str, Footprint]]:
    """ConfigError naming the first model (start-up ones in order, then the largest on-demand ones) that does
    not fit; else the models loaded at once, with their footprints."""
    prints: list[tuple[str, Footprint]] = []
    for spec, model_config in zip(config.models, configs):
        try:
            prints.append((spec.name, footprint(model_config)))
        except Exception as exc:  # noqa: BLE001 - a missing or unreadable checkpoint is a config error here
            raise ConfigError(f"model {spec.name!r}: {exc}") from None
    loads = {spec.name: spec.load for spec in config.models}
    startup = [(n, f) for n, f in prints if loads[n] == "startup"]
    on_demand = sorted(((n, f) for n, f in prints if loads[n] == "on_demand"), key=lambda p: -p[1].host_bytes
                       - p[1].gpu_fraction)[:config.max_loaded_models]
    host_total, gpu_totals = 0, {}
    for name, fp in startup + on_demand:
        host_total += fp.host_bytes
        for gpu in fp.gpus:
            gpu_totals[gpu] = gpu_totals.get(gpu, 0.0) + fp.gpu_fraction
        if host_total > available_bytes:
            raise ConfigError(f"model {name!r} does not fit: the models loaded at once need ~{host_total / 2**30:.1f} "
                              f"GiB with it (weights at the compute dtype + kv_cache_memory), the machine has "
                              f"{available_bytes / 2**30:.1f} GiB available; lower kv_cache_memory, set dtype or "
                              f"quantization, or load it on demand")
        full = {gpu: total for gpu, total in gpu_totals.items() if total > 1.0 + 1e-9}
        if full:
            gpu, total = min(full.items())
            raise ConfigError(f"model {name!r} does not fit: the gpu_memory_utilization of the models loaded at "
                              f"once on GPU {gpu} adds up to {total:.2f} with it; give each a share (their sum at "
                              f"most 1) or other devices")
    log.info("models: %s; ~%.1f GiB of %.1f GiB available when all are loaded", ", ".join(n for n, _ in prints),
             host_total / 2**30, available_bytes / 2**30)
    return startup + on_demand
