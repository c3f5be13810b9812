"""Tensor parallelism on PyTorch's own runtime (gloo on CPUs, NCCL on GPUs): group.py holds one rank's place and the
collectives a sharded model calls. The engine's worker ranks live in engine/ranks.py."""
