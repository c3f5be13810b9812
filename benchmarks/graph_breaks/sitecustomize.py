"""Start-up hook of benchmarks/moe_execution.py's "compiled-graph-breaks" variant (on PYTHONPATH only there): the
routed experts run outside the compiled graph through graph breaks (``torch._dynamo.disable``, the decoder compiled
without ``fullgraph``) instead of as one opaque op. A measured alternative, never shipped."""

import os

if os.environ.get("TOKENMILL_MOE_GRAPH_BREAKS") == "1":
    import torch

    import tokenmill.kernels.moe_op as moe_op
    import tokenmill.models.compile as compile_module
    import tokenmill.models.layers.moe as moe_layer

    moe_layer.routed_experts = torch._dynamo.disable(moe_op._routed_experts)

    def _init(self, model):
        self._compiled = torch.compile(model.decoder, fullgraph=False)
        self.sealed = False
    compile_module.CompiledDecoder.__init__ = _init
