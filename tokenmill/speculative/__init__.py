"""Speculative decoding: draft proposers (pure Python over token ids). Verification lives in the runner
(engine/runner.py) and the scheduler's update (scheduler/scheduler.py)."""
