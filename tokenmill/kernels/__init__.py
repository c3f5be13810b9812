"""Kernels: for each op family, the PyTorch reference (the spec, and the CPU path) and the dispatch between it and
the Triton kernel in ``kernels/triton/`` (picked per model by ``kernels/backend.py``: Triton on CUDA)."""
