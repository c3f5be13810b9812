"""What one tenant's work may take from another's, held to their rules in isolation (no model): the prepare threads
served round-robin among callers, a key charged at the edge before any work, the Responses store's per-key bounds,
and the grammar verdicts bounded in bytes."""

import threading

import pytest

from tokenmill.fair import FairExecutor, caller
from tokenmill.key_policy import KeyPolicy
from tokenmill.server.errors import APIError
from tokenmill.server.response_store import ResponseStore, stored_size
from tokenmill.server.tenants import Tenants
from tokenmill.structured.checker import GrammarChecker
from tokenmill.structured.spec import GrammarSpec


def _submit_as(executor: FairExecutor, who: str | None, fn, *args):
    token = caller.set(who)
    try:
        return executor.submit(fn, *args)
    finally:
        caller.reset(token)


def test_a_caller_with_many_jobs_queued_waits_its_turn_behind_one_with_few():
    """One worker; caller a queues 10 jobs, then b queues 2: b's first runs right after a's current job and its second
    after one more of a's (round-robin), not after all of a's."""
    executor, order, gate, running = FairExecutor(1), [], threading.Event(), threading.Event()

    def hold():
        running.set()
        gate.wait(timeout=10)
    blocker = _submit_as(executor, "a", hold)  # holds the worker while the queues fill
    assert running.wait(timeout=10)
    futures = [_submit_as(executor, "a", order.append, f"a{i}") for i in range(10)]
    futures += [_submit_as(executor, "b", order.append, f"b{i}") for i in range(2)]
    gate.set()
    for future in [blocker, *futures]:
        future.result(timeout=10)
    assert order[:4] == ["a0", "b0", "a1", "b1"] and order[4:] == [f"a{i}" for i in range(2, 10)], order
    assert executor.queued() == {}
    executor.shutdown()


def test_fair_executor_runs_on_several_workers_and_hands_back_errors():
    executor = FairExecutor(2)
    started, release = threading.Barrier(3), threading.Event()

    def meet():
        started.wait(timeout=10)
        release.wait(timeout=10)
        return threading.current_thread().name
    two = [_submit_as(executor, who, meet) for who in ("a", "b")]
    started.wait(timeout=10)  # both run at once: two workers
    release.set()
    assert len({f.result(timeout=10) for f in two}) == 2
    failing = _submit_as(executor, "a", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    executor.shutdown(cancel_futures=True)
    with pytest.raises(RuntimeError):
        executor.submit(print)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_request_is_taken_at_the_edge_and_refused_ones_count():
    """rpm 2: two requests enter (whatever becomes of them later, a 400 say); the third is a 429 before any work;
    an empty token bucket refuses at the edge too; max_concurrent caps requests open at once."""
    clock = Clock()
    tenants = Tenants([KeyPolicy(name="a", key="k", rpm=2, tpm=100, max_concurrent=3)], clock)
    tenants.enter("a")
    tenants.enter("a")
    with pytest.raises(APIError) as refused:
        tenants.enter("a")
    assert refused.value.status == 429 and refused.value.type == "requests"
    assert refused.value.headers["Retry-After"] == "30"  # one request a 30 s at 2 a minute
    clock.now += 30
    tenants.charge("a", 100)  # the promise empties the token bucket
    with pytest.raises(APIError) as refused:
        tenants.enter("a")
    assert refused.value.type == "tokens" and "TPM" in refused.value.message
    clock.now += 60
    tenants.enter("a")
    with pytest.raises(APIError) as refused:  # three open: the fourth waits for one to leave
        clock.now += 60
        tenants.enter("a")
    assert refused.value.code == "concurrency_limit_exceeded" and refused.value.headers["Retry-After"] == "1"
    tenants.leave("a")
    tenants.enter("a")
    tenants.enter(None)  # a server without keys, or a key without a policy: nothing is metered
    tenants.enter("unlisted")


def test_prefix_cache_scopes_are_private_unless_keys_share_a_group():
    tenants = Tenants([KeyPolicy(name="a", key="k1", cache_group="team"), KeyPolicy(name="b", key="k2",
                                                                                   cache_group="team"),
                       KeyPolicy(name="c", key="k3")])
    assert tenants.cache_scope("a") == tenants.cache_scope("b") == "group:team"
    assert tenants.cache_scope("c") == "key:c" != tenants.cache_scope("from-a-key-file")
    assert tenants.cache_scope(None) is None
    assert tenants.cache_scope("team") != tenants.cache_scope("a")  # a key named like a group is not in it


def _response(n: int, padding: int = 0) -> dict:
    return {"id": f"resp_{n:03d}", "output": [{"text": "x" * padding}]}  # one size whatever n


def test_one_key_cannot_push_out_another_keys_responses():
    """The issue's probe at the store: an admin response, then a tenant storing many large ones."""
    one = stored_size(_response(0, 1000), [])
    store = ResponseStore(max_count=20, max_bytes=10 * one, max_count_per_key=10, max_bytes_per_key=6 * one,
                          max_item_bytes=2 * one)
    assert store.put("admin", _response(0, 1000), [])
    for n in range(1, 40):
        store.put("tenant-a", _response(n, 1000), [])
    assert store.get("admin", "resp_000") is not None  # the tenant stays within its own share
    tenant = [n for n in range(1, 40) if store.get("tenant-a", f"resp_{n:03d}") is not None]
    assert tenant == list(range(34, 40))  # its own least recently used went first
    assert store.bytes == 7 * one and len(store) == 7
    assert not store.put("tenant-a", _response(99, 3000), [])  # over the item bound: answered, not kept


def test_past_the_servers_bound_the_key_holding_the_most_gives_way():
    one = stored_size(_response(0, 100), [])
    store = ResponseStore(max_count=4, max_bytes=10**6, max_count_per_key=3)
    for key, n in (("a", 0), ("b", 1), ("b", 2), ("b", 3)):
        store.put(key, _response(n, 100), [])
    store.put("a", _response(4, 100), [])  # five kept > four: b holds the most
    assert [store.get("b", f"resp_{n:03d}") is not None for n in (1, 2, 3)] == [False, True, True]
    assert store.get("a", "resp_000") is not None and store.get("a", "resp_004") is not None
    assert store.bytes == 4 * one
    assert store.delete("a", "resp_000") and not store.delete("a", "resp_000") and len(store) == 3


def test_grammar_verdicts_are_bounded_by_the_bytes_of_their_text():
    checker = GrammarChecker("{}", [], timeout_s=1, max_bytes=10**6, cache_bytes=1000)
    specs = [GrammarSpec("regex", f"{i}" + "a" * 299) for i in range(5)]
    for spec in specs:
        checker._remember(spec, None)
        assert checker._cached_bytes <= 1000
    assert list(checker._verdicts) == specs[2:]  # three of 300 bytes fit in 1,000; the oldest went first
    checker._remember(GrammarSpec("regex", "b" * 1001), None)  # larger than the whole cache: not kept
    assert list(checker._verdicts) == specs[2:] and checker._cached_bytes == 900


def test_the_grammar_checker_runs_under_an_address_space_limit(smollm_llm):
    """The checker child sets RLIMIT_AS to what it holds once ready plus ``memory_bytes``: a grammar that needs more
    fails there (its check answers "exhausted the checker's memory") instead of growing the host's memory."""
    import resource

    import xgrammar as xgr

    tokenizer = smollm_llm.tokenizer.hf
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    checker = GrammarChecker(info.serialize_json(), [0], timeout_s=60, max_bytes=10**9, memory_bytes=512 * 2**20)
    try:
        checker.check(GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'))
        pid = checker._idle[0].process.pid
        with open(f"/proc/{pid}/limits") as fh:
            line = next(row for row in fh if row.startswith("Max address space"))
        soft = int(line.split()[3])
        with open(f"/proc/{pid}/statm") as fh:
            size = int(fh.read().split()[0]) * resource.getpagesize()
        assert 0 < soft - size <= 512 * 2**20, (soft, size)  # what is left of the budget after one check
        assert soft - size > 256 * 2**20
    finally:
        checker.close()
