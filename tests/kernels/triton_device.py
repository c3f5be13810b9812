"""Where the Triton kernel tests run: on CUDA when a GPU is there and the interpreter is off, otherwise on CPU
tensors through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 unless told otherwise)."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton kernels are tested where triton installs (Linux)")

from tokenmill.kernels.triton.common import dot, interpreting  # noqa: E402

INTERPRETED = interpreting(dot)
DEVICE = torch.device("cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda")
if DEVICE.type == "cpu" and not INTERPRETED:
    pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)
