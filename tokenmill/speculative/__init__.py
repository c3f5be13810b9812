"""Speculative decoding: draft proposers. ngram.py drafts from token ids (pure Python + numpy, run by the engine core
after each step); mtp.py drafts with the model's own multi-token-prediction module (run by the runner inside the step).
Verification lives in the runner (engine/runner.py) and the scheduler's update (scheduler/scheduler.py)."""
