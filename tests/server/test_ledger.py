"""The usage ledger: per key x model x hour in SQLite. Unit: batching, hours, filters, cost, a reopened file. Live:
the totals of /v1/usage equal the clients' own `usage` sums (openai's parsing) per key, a refused request counts as an
error; after a SIGKILL mid-load and
a restart on the same file, every request that finished more than a second before the kill is in it and none that
never ran; filters, CSV, the admin key, and the per-key Prometheus series."""

import csv
import io
import signal
import sqlite3
import threading
import time

import httpx
import openai
import pytest

from tests.live_server import MODEL, start_server, stop_server
from tokenmill.server import ledger as ledger_module
from tokenmill.server.ledger import Usage, UsageLedger


def test_batches_hours_filters_and_cost(tmp_path):
    now = [7200.0 * 100 + 10]
    ledger = UsageLedger(tmp_path / "u.db", hourly_cost=3.6, clock=lambda: now[0])
    ledger.record("a", "m1", Usage(1, 10, 4, 5, 0, 2.0))
    ledger.record("a", "m1", Usage(1, 20, 0, 7, 1, 1.0))
    ledger.record(None, "m2", Usage(1, 3, 0, 1, 0, 0.5))
    now[0] += 3600
    ledger.record("a", "m1", Usage(1, 1, 0, 1, 0, 0.25))
    assert ledger.query() == []  # nothing written before the writer's next flush
    ledger.close()
    reopened = UsageLedger(tmp_path / "u.db", hourly_cost=3.6)
    rows = reopened.query()
    first = {"hour": 720000, "hour_utc": time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(720000)), "key": "a",
             "model": "m1", "requests": 2, "prompt_tokens": 30, "cached_tokens": 4, "completion_tokens": 12,
             "errors": 1, "engine_seconds": 3.0, "cost_usd": pytest.approx(3.0 / 3600 * 3.6)}
    assert rows[1] == first and [(r["hour"], r["key"], r["model"]) for r in rows] == [  # by hour, key, model
        (720000, "", "m2"), (720000, "a", "m1"), (723600, "a", "m1")]
    assert [r["model"] for r in reopened.query(key="")] == ["m2"]
    assert [r["hour"] for r in reopened.query(model="m1", start=720000 + 3599)] == [720000, 723600]
    assert [r["hour"] for r in reopened.query(start=720000 + 3600)] == [723600]
    assert [r["hour"] for r in reopened.query(end=720000 + 3600)] == [720000, 720000]
    unpriced = UsageLedger(tmp_path / "u.db")
    assert unpriced.query()[0]["cost_usd"] is None  # no hourly cost: no price
    unpriced.close()
    assert sqlite3.connect(tmp_path / "u.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    reopened.close()


def test_a_failed_write_is_kept_for_the_next(tmp_path, monkeypatch):
    ledger = UsageLedger(tmp_path / "u.db")
    ledger.record("a", "m", Usage(1, 1, 0, 1, 0, 0.0))
    broken = ledger._connect
    monkeypatch.setattr(ledger, "_connect", lambda: (_ for _ in ()).throw(sqlite3.OperationalError("disk full")))
    ledger.flush()
    monkeypatch.setattr(ledger, "_connect", broken)
    ledger.record("a", "m", Usage(1, 1, 0, 1, 0, 0.0))
    ledger.close()
    assert ledger.query()[0]["requests"] == 2


KEYS = """
hourly_cost = 7.2
[[keys]]
name = "admin"
key = "sk-admin"
admin = true
[[keys]]
name = "team-a"
key = "sk-a"
[[keys]]
name = "team-b"
key = "sk-b"
"""


def _ask(client, results, stop, prompts):
    i = 0
    while not stop.is_set():
        try:
            answer = client.completions.create(model=MODEL, prompt=prompts[i % len(prompts)], max_tokens=3 + i % 5)
        except openai.APIConnectionError:  # the server was killed under it
            return
        results.append((time.monotonic(), answer.usage))
        i += 1


def _sums(results, before=float("inf")):
    done = [u for t, u in results if t < before]
    return {"requests": len(done), "prompt_tokens": sum(u.prompt_tokens for u in done),
            "completion_tokens": sum(u.completion_tokens for u in done)}


def _totals(server, key):
    body = httpx.get(server.base_url + "/usage", params={"key": key, "model": MODEL},
                     headers={"Authorization": "Bearer sk-admin"}, timeout=30).json()
    return {k: body["totals"][k] for k in ("requests", "prompt_tokens", "completion_tokens")}, body


def test_live_ledger_survives_a_kill(tmp_path):
    db = tmp_path / "usage.sqlite3"
    (tmp_path / "keys.toml").write_text(KEYS)
    flags = ("--config", str(tmp_path / "keys.toml"), "--usage-db", str(db),  # the flag beats the tests' variable
             "--metrics-per-key")
    server = start_server(tmp_path, *flags)
    prompts = ["Hello there", "Name three colors.", "What is 2 + 2?"]
    clients = {k: openai.OpenAI(base_url=server.base_url, api_key=f"sk-{k[-1]}", max_retries=0)
               for k in ("team-a", "team-b")}
    try:
        results = {k: [] for k in clients}
        for key, client in clients.items():  # a few requests each, then the ledger equals the clients' sums
            for i in range(3 if key == "team-a" else 2):
                answer = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=4)
                results[key].append((time.monotonic(), answer.usage))
        for key in clients:
            totals, body = _totals(server, key)
            assert totals == _sums(results[key]), key
            assert body["totals"]["errors"] == 0 and body["totals"]["engine_seconds"] > 0
            assert body["totals"]["cost_usd"] == pytest.approx(body["totals"]["engine_seconds"] / 3600 * 7.2)

        # a refused request is a request and an error of its key and model
        with pytest.raises(openai.BadRequestError):
            clients["team-b"].completions.create(model=MODEL, prompt="Hi", max_tokens=100000)
        refused = httpx.get(server.base_url + "/usage", headers={"Authorization": "Bearer sk-b"}).json()["totals"]
        assert (refused["requests"], refused["errors"]) == (3, 1)

        # the key's own usage only; an admin's of anyone; CSV
        own = httpx.get(server.base_url + "/usage", headers={"Authorization": "Bearer sk-a"}).json()
        assert {row["key"] for row in own["data"]} == {"team-a"}
        assert httpx.get(server.base_url + "/usage", params={"key": "team-b"},
                         headers={"Authorization": "Bearer sk-a"}).status_code == 403
        text = httpx.get(server.base_url + "/usage", params={"format": "csv"},
                         headers={"Authorization": "Bearer sk-admin"}).text
        rows = list(csv.DictReader(io.StringIO(text)))
        assert {r["key"] for r in rows} == {"team-a", "team-b"} and sum(int(r["requests"]) for r in rows) == 6
        assert httpx.get(server.base_url + "/usage", params={"start": "2999-01-01T00:00:00Z"},
                         headers={"Authorization": "Bearer sk-admin"}).json()["data"] == []
        assert httpx.get(server.base_url + "/usage", params={"start": "yesterday"},
                         headers={"Authorization": "Bearer sk-admin"}).status_code == 400
        metrics = server.metrics_text()
        assert f'tokenmill:key_requests_total{{key_name="team-a",model_name="{MODEL}",outcome="ok"}} 3.0' in metrics
        assert f'tokenmill:key_time_to_first_token_seconds_count{{key_name="team-b",model_name="{MODEL}"}} 2.0' \
            in metrics

        # load from both keys, then SIGKILL mid-load
        stop = threading.Event()
        askers = [threading.Thread(target=_ask, args=(c, results[k], stop, prompts), daemon=True)
                  for k, c in clients.items()]
        for asker in askers:
            asker.start()
        time.sleep(6)
        server.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        server.process.wait(10)
        stop.set()
        for asker in askers:
            asker.join(10)
    finally:
        stop_server(server)

    restarted = start_server(tmp_path, *flags)
    try:
        for key in clients:
            totals, _ = _totals(restarted, key)
            floor, ceiling = _sums(results[key], killed - ledger_module.FLUSH_S - 0.5), _sums(results[key])
            if key == "team-b":  # its refused request
                floor["requests"] += 1
                ceiling["requests"] += 1
            assert floor["requests"] > 3, "the load ran"
            # Every request finished a second before the kill is in; none that never ran. The one request in flight
            # at the kill may be in without its client having read the answer.
            in_flight = {"requests": 1, "prompt_tokens": 16, "completion_tokens": 8}
            for name in totals:
                assert floor[name] <= totals[name] <= ceiling[name] + in_flight[name], (key, name)
    finally:
        stop_server(restarted)
