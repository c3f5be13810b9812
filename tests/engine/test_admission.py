"""Admission control's Retry-After: the seconds until a refused promise fits, at the measured drain rate."""

from tokenmill.engine.admission import Admission


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_retry_after_follows_the_drain_rate():
    clock = Clock()
    admission = Admission(limit=1000, window=10.0, clock=clock)
    assert admission.reserve({"a": 600, "b": 400})
    assert not admission.reserve({"c": 500})
    assert admission.retry_after(500) == 1  # nothing has drained yet: no rate to go by
    clock.now += 10.0
    admission.release(["a"])  # 600 tokens drained over 10 s: 60 tokens/s
    assert admission.drain_rate() == 60.0
    assert admission.reserve({"c": 500})
    assert not admission.reserve({"d": 700})
    assert admission.retry_after(700) == 10  # (900 + 700 - 1000) / 60 = 10 s
    clock.now += 20.0  # the release has left the window
    assert admission.drain_rate() == 0.0 and admission.retry_after(700) == 1
    admission.release(["b", "b", "c"])  # idempotent
    assert admission.promised_tokens == 0


def test_retry_after_is_capped():
    clock = Clock()
    admission = Admission(limit=100, window=10.0, max_retry_after=60, clock=clock)
    admission.reserve({"a": 100, "b": 1})
    clock.now += 10.0
    admission.release(["b"])  # 0.1 token/s
    admission.reserve({"c": 1})
    assert admission.retry_after(10_000) == 60
