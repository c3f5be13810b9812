"""Kernels: for each op family, the PyTorch reference (the spec, and the CPU path) and the dispatch.

Triton kernels for CUDA arrive beside their references; until one exists for an op, the dispatch runs the
reference on every device.
"""
