"""Speculative decoding: draft proposers behind one interface (proposer.py), run by the model runner after each step's
sampling. ngram.py drafts from token ids; mtp.py drafts with the model's own multi-token-prediction module.
Verification lives in the runner (engine/runner.py) and the scheduler's update_from_output (scheduler/scheduler.py).
This package imports nothing above it (kernels' metadata and the KV cache are below)."""
