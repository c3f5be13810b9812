"""Triton kernels for CUDA, one file per op family; each mirrors a PyTorch reference in ``tokenmill.kernels``.

Imported lazily by the dispatch functions, only when the Triton backend is chosen, so the CPU path never needs
triton. Under ``TRITON_INTERPRET=1`` (set before this package is imported) they run on CPU tensors through
Triton's interpreter: that is how they are tested here.
"""
