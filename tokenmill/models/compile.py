"""torch.compile of a decoder's layer stack (``DecoderLM.decoder``) for the CPU.

What is compiled: embeddings, norms, projections, RoPE, residual adds and the MLP of every layer, in one graph per
shape class; attention stays one opaque op per layer (kernels/attention_op.py), run eagerly inside the graph.
Inductor fuses the elementwise work that eager PyTorch dispatches op by op (~20 small ops per layer per step).

Shape classes ("buckets"): the token count T is the only input dimension that varies. It is marked dynamic from 2
up, so one graph serves every T >= 2 and a second, specialized graph serves T = 1 (a lone decode). engine/warmup.py runs
both, so serving never compiles; past warm-up a call that would need a new graph runs eagerly instead
(``eager_on_recompile``) rather than stalling every request behind a compile, and only the guards that choose
between the two graphs are evaluated (``skip_guard_eval_unsafe``: torch's name for "warmed up on every input kind").

Artifacts: inductor's FX-graph and AOT caches live in ``cache_dir``, in a subdirectory per vector ISA inductor generates
code for, so a restart reuses the generated code (dynamo still traces, which takes seconds, not minutes). Inductor's
cache key leaves that ISA out: a process held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``) and an AVX-512 one sharing a
directory loaded each other's graphs, and the 8-lane code run as the 16-lane build's corrupted the heap (a tiny
float32 model, 2026-12-07); a cache volume moved between hosts of different ISAs would do the same.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path

import torch

# The two shape classes: a lone decode (specialized graph) and any other token count (one dynamic graph).
WARM_UP_TOKENS = (1, 2)


def code_isa() -> str:
    """The vector ISA inductor generates this process's CPU code for ("avx512-avx512-vnni", "avx2", "scalar"...), as
    it picks it (the host's, or less where ATEN_CPU_CAPABILITY says so)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
        name = str(isa) if isa else "scalar"
    except (ImportError, AttributeError):  # a torch that moved it: torch's own dispatch level says as much
        name = torch.backends.cpu.get_cpu_capability()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "scalar"


def use_cache_dir(cache_dir: str | os.PathLike) -> Path:
    """Point inductor's on-disk caches at ``cache_dir``'s subdirectory for this process's vector ISA (created), before
    anything compiles; returns it."""
    path = Path(cache_dir).expanduser() / f"isa-{code_isa()}"
    path.mkdir(parents=True, exist_ok=True)
    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)  # read by inductor's cache lookups, in this process only
    inductor_config.fx_graph_cache = True
    return path


def own_code(method):
    """``method`` bound to a copy of its function with a code object of its own. Dynamo keeps its graphs, and counts
    recompiles against ``recompile_limit`` (8), per code object: models of other shapes compiled in one process
    through the one ``DecoderLM.decoder`` code (a fleet with --no-engine-process, restarts, a test session) added
    their graphs to one list, and the seventh tiny model of a test failed with FailOnRecompileLimitHit even though
    the earlier ones were gone. Each model's own code object, and its graphs, go with its model."""
    function = method.__func__
    code = function.__code__.replace(co_name=f"{function.__name__}_{id(method.__self__):x}")
    copy = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


class CompiledDecoder:
    """``model.decoder`` compiled; calls mark T dynamic (T >= 2) and never compile once ``sealed``."""

    def __init__(self, model: torch.nn.Module):
        self._compiled = torch.compile(own_code(model.decoder), fullgraph=True)
        self.sealed = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] >= 2:
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        if not self.sealed:
            if input_ids.shape[0] == 1:  # a lone decode's elementwise work is a few hundred values: one thread
                import torch._inductor.config as inductor_config
                with inductor_config.patch({"cpp.threads": 1}):
                    return self._compiled(input_ids, positions)
            return self._compiled(input_ids, positions)
        # Sealed: warm-up compiled both shape classes, so only the guards that tell those two graphs apart (T == 1 or
        # not) are evaluated. The others (every parameter's: ~0.7 ms a step at 2 cores, 3-5% of a lone decode) check
        # what the engine fixes before warm-up (dtypes, devices, the parameters, inference mode); a call that broke
        # one of them would not be caught, so nothing may change those after sealing.
        with torch.compiler.set_stance("eager_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(input_ids, positions)

