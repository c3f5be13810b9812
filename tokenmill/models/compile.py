"""torch.compile of a decoder's layer stack (``DecoderLM.decoder``) for the CPU.

What is compiled: embeddings, norms, projections, RoPE, residual adds and the MLP of every layer, in one graph per
shape class; attention stays one opaque op per layer (kernels/attention_op.py), run eagerly inside the graph.
Inductor fuses the elementwise work that eager PyTorch dispatches op by op (~20 small ops per layer per step).

Shape classes ("buckets"): the token count T is the only input dimension that varies. It is marked dynamic from 2
up, so one graph serves every T >= 2 and a second, specialized graph serves T = 1 (a lone decode). engine/warmup.py runs
both, so serving never compiles; past warm-up a call that would need a new graph runs eagerly instead
(``eager_on_recompile``) rather than stalling every request behind a compile, and only the guards that choose
between the two graphs are evaluated (``skip_guard_eval_unsafe``: torch's name for "warmed up on every input kind").

Artifacts: inductor's FX-graph and AOT caches live in ``cache_dir``, so a restart reuses the generated code (dynamo
still traces, which takes seconds, not minutes).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# The two shape classes: a lone decode (specialized graph) and any other token count (one dynamic graph).
WARM_UP_TOKENS = (1, 2)


def use_cache_dir(cache_dir: str | os.PathLike) -> Path:
    """Point inductor's on-disk caches at ``cache_dir`` (created), before anything compiles."""
    path = Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)  # read by inductor's cache lookups, in this process only
    inductor_config.fx_graph_cache = True
    return path


class CompiledDecoder:
    """``model.decoder`` compiled; calls mark T dynamic (T >= 2) and never compile once ``sealed``."""

    def __init__(self, model: torch.nn.Module):
        self._compiled = torch.compile(model.decoder, fullgraph=True)
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

