"""Admission control's Retry-After: the seconds until a refused promise fits, at the measured drain rate; and a
reservation is given back once."""

from tokenmill.server.admission import Admission


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_retry_after_follows_the_drain_rate():
    clock = Clock()
    admission = Admission(limit=1000, window=10.0, clock=clock)
    a, b = admission.reserve(600), admission.reserve(400)
    assert a and b
    assert not admission.reserve(500)
    assert admission.retry_after(500) == 1  # nothing has drained yet: no rate to go by
    clock.now += 10.0
    a.release()  # 600 tokens drained over 10 s: 60 tokens/s
    assert admission.drain_rate() == 60.0
    c = admission.reserve(500)
    assert c
    assert not admission.reserve(700)
    assert admission.retry_after(700) == 10  # (900 + 700 - 1000) / 60 = 10 s
    clock.now += 20.0  # the release has left the window
    assert admission.drain_rate() == 0.0 and admission.retry_after(700) == 1
    for reservation in (b, b, c):  # a second release changes nothing
        reservation.release()
    assert admission.promised_tokens == 0 and admission.num_reserved == 0
    assert admission.drain_rate() == 900 / 10.0  # b and c, each counted once


def test_retry_after_is_capped():
    clock = Clock()
    admission = Admission(limit=101, window=10.0, max_retry_after=60, clock=clock)
    assert admission.reserve(100)
    b = admission.reserve(1)
    clock.now += 10.0
    b.release()  # 0.1 token/s
    assert admission.retry_after(10_000) == 60


def test_an_idle_server_admits_any_promise():
    admission = Admission(limit=10)
    big = admission.reserve(1000)
    assert big and admission.saturation == 100.0 and not admission.reserve(1)
    big.release()
    assert admission.reserve(1000)


def test_promises_count_what_a_windowed_request_holds():
    """gpt-oss-like layers (window 8, full) in blocks of 4: a 100-token request holds 25 blocks of the full group and
    the 2 blocks of positions 92..99 in the window group, 108 pool tokens, not 2 x 100."""
    from tokenmill.engine.messages import EngineInfo
    from tokenmill.kvcache.groups import KVGroups

    groups = KVGroups.for_layers([8, 0, 8, 0])
    info = EngineInfo("m", 128, 10, kv_capacity_tokens=220, kv_bytes_per_token=1, device="cpu", dtype="fp32",
                      kv_groups=groups, kv_block_size=4)
    assert (groups.num_groups, info.kv_tokens_held(100)) == (2, (25 + 2) * 4)
    admission = Admission(limit=info.kv_capacity_tokens, kv_tokens=info.kv_tokens_held)
    assert admission.reserve(admission.kv_tokens(100)) and admission.reserve(admission.kv_tokens(100))
    assert EngineInfo("m", 128, 10, 220, 1, "cpu", "fp32").kv_tokens_held(100) == 100  # one full group: the tokens


def test_batch_work_is_refused_first():
    """Batch promises fit within half the limit; interactive ones use all of it; an idle server admits anything."""
    admission = Admission(limit=1000)
    first = admission.reserve(400, batch=True)
    assert first and not admission.reserve(101, batch=True)  # 400 + 101 > 500
    assert admission.reserve(100, batch=True)
    assert admission.reserve(500)  # interactive: up to the whole limit
    assert not admission.reserve(1)
    lone = Admission(limit=1000)
    assert lone.reserve(900, batch=True)  # nothing else reserved: admitted whatever its size
