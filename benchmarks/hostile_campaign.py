"""The campaign of benchmarks/hostile_inputs.py: sends each case, records every response and failure, and handles
an engine death (the case is recorded, our own server restarted, the killing mutation named by replaying each
mutation alone, then skipped for the rest of the run)."""

from __future__ import annotations

import json
import re
import time

import httpx

import hostile_cases as hc
from hostile_checks import LIMIT, SERVER_SIDE, Monitor, Outcome, judge
from live_serve import alive, engine_pid, log_tail


class Campaign:
    def __init__(self, root: str, keys: list[str], server, server_log: str | None, wait_s: float,
                 max_restarts: int):
        self.root, self.keys, self.server, self.server_log = root, keys, server, server_log
        self.wait_s, self.max_restarts, self.restarts = wait_s, max_restarts, 0
        self.client = httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0))
        self.monitor = Monitor(root, self.headers(0), self.current_pid)
        self.model, self.engine_pid, self.stopped = "", None, False
        self.suspects: set[tuple[str, str]] = set()  # (operation, mutation) that killed the engine
        self.distinct: dict[tuple, dict] = {}
        self.report = {"operations": {}, "responses": [], "failure_count": 0, "failure_kinds": {}, "failures": [],
                       "distinct_failures": [], "deaths": [], "skipped_known_killers": 0, "total_cases": 0,
                       "replays": 0, "schemathesis_cases": 0, "own_cases": 0}

    def headers(self, index: int) -> dict:
        return {"Authorization": f"Bearer {self.keys[index % len(self.keys)]}"} if self.keys else {}

    def current_pid(self) -> int | None:
        return engine_pid(self.server.log_path if self.server is not None else self.server_log)

    def log_path(self):
        return self.server.log_path if self.server is not None else self.server_log

    def begin(self) -> None:
        models = self.client.get(self.root + "/v1/models", headers=self.headers(0))
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]
        self.engine_pid = self.current_pid()
        self.report.update({"model": self.model, "engine_pid_start": self.engine_pid})
        self.monitor.pid = self.engine_pid
        self.monitor.start()

    # -- sending -----------------------------------------------------------------------------------------------
    def send(self, built: hc.Built, key_index: int) -> Outcome:
        headers = self.headers(key_index)
        if built.body is not None:
            headers["content-type"] = "application/json"
        start = time.monotonic()
        try:
            with self.client.stream(built.method, self.root + built.path, content=built.body, headers=headers) as r:
                chunks, size = [], 0
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > 16 * 2**20:
                        break
                return Outcome(r.status_code, {k.lower(): v for k, v in r.headers.items()},
                               b"".join(chunks).decode("utf-8", "replace"), seconds=time.monotonic() - start)
        except httpx.TimeoutException as exc:
            return Outcome(None, error=f"timeout: {type(exc).__name__}")
        except httpx.HTTPError as exc:
            return Outcome(None, error=f"connection: {type(exc).__name__}: {exc}")

    def own_case(self, op: hc.Op, mutations: tuple, stream: bool, key_index: int) -> None:
        built = hc.build(op, self.model, mutations, stream)
        if any((op.name, atom) in self.suspects for atom in built.atoms):
            self.report["skipped_known_killers"] += 1
            return
        self.report["own_cases"] += 1
        out = self.send(built, key_index)
        self.observe("own", op.name, _request_text(built.method, built.path, built.body), out,
                     lambda: self._replays(op, mutations, stream, key_index), built.atoms)

    def schemathesis_case(self, name: str, mode: str, case) -> None:
        import requests
        self.report["schemathesis_cases"] += 1
        generated_auth = self.report["schemathesis_cases"] % 10 == 0
        headers = {}
        if not generated_auth:
            for header in list(case.headers or {}):
                if header.lower() in ("authorization", "x-api-key"):
                    del case.headers[header]
            headers = self.headers(self.report["schemathesis_cases"])
        body = json.dumps(case.body, default=str, allow_nan=True) if case.body is not None and \
            not isinstance(case.body, bytes) and type(case.body).__name__ != "NotSet" else ""
        request = f"{case.method} {case.formatted_path} query={case.query} headers={case.headers} ({mode})\n{body}"
        start = time.monotonic()
        try:
            r = case.call(base_url=self.root, headers=headers, timeout=120)
        except requests.Timeout as exc:
            out = Outcome(None, error=f"timeout: {type(exc).__name__}")
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
            out = Outcome(None, error=f"connection: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - what the client itself refused to send (bad header text, ...)
            self.record(name, "schemathesis", Outcome(None, error=f"unsent: {type(exc).__name__}"))
            return
        else:
            sent = r.request.body if r.request is not None else None
            if sent:
                request = f"{r.request.method} {r.request.url} ({mode})\n" + \
                    (sent.decode("utf-8", "replace") if isinstance(sent, bytes) else str(sent))
            out = Outcome(r.status_code, {k.lower(): (v[0] if isinstance(v, list) else v) for k, v in r.headers.items()},
                          r.text, seconds=time.monotonic() - start)
        self.observe("schemathesis", name, request, out, None)

    # -- judging -----------------------------------------------------------------------------------------------
    def record(self, op: str, source: str, out: Outcome) -> None:
        entry = self.report["operations"].setdefault(op, {"cases": 0, "statuses": {}, "schemathesis": 0, "own": 0})
        entry["cases"] += 1
        entry[source] += 1
        entry["statuses"][out.label] = entry["statuses"].get(out.label, 0) + 1
        self.report["responses"].append([op, out.label, source, round(out.seconds, 3)])
        self.report["total_cases"] += 1

    def observe(self, source: str, op: str, request: str, out: Outcome, replays, atoms=()) -> None:
        self.record(op, source, out)
        problems = judge(op.split()[1], out)
        serious = [p for p in problems if p[0] in SERVER_SIDE]
        if serious:
            problems += self._connection_after(out, probe=source == "own")
        dead = bool(serious or self.monitor.flag.is_set()) and not self.healthy()
        culprits = replays() if serious and replays is not None and not dead else None
        for kind, detail in problems:
            self.fail(op, source, kind, request, out, detail, culprits, atoms)
        if dead:
            self.on_death(op, source, request, out, replays, atoms)

    def fail(self, op, source, kind, request, out: Outcome, detail, culprits=None, atoms=()) -> None:
        report = self.report
        report["failure_count"] += 1
        key = f"{op} | {kind} | {out.label}"
        report["failure_kinds"][key] = report["failure_kinds"].get(key, 0) + 1
        entry = {"operation": op, "source": source, "kind": kind, "status": out.label, "detail": detail,
                 "request": request[:LIMIT], "response": (out.text or out.error or "")[:LIMIT],
                 "mutations": list(atoms), "culprits": culprits, "case": report["total_cases"]}
        if len(report["failures"]) < 50:
            report["failures"].append(entry)
        group = (op, kind, out.label, tuple(culprits or atoms) or (detail or "")[:100])
        if group in self.distinct:
            self.distinct[group]["count"] += 1
        elif len(self.distinct) < 200:
            self.distinct[group] = {**entry, "count": 1}
            report["distinct_failures"].append(self.distinct[group])

    def _connection_after(self, out: Outcome, probe: bool) -> list[tuple[str, str]]:
        """After a server-side failure: does the kept-alive connection still serve (uvicorn resets it when an
        exception escapes the app)? Then a fresh client, so that no later case inherits a dead connection."""
        problems = []
        if out.status is not None and probe:
            try:
                self.client.get(self.root + "/health", headers=self.headers(0), timeout=10)
            except httpx.HTTPError as exc:
                problems.append(("connection reset after 5xx", f"the next request on the same connection: {exc!r}"))
        self.client.close()
        self.client = httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0))
        return problems

    def healthy(self) -> bool:
        """/health 200 (on a new connection, twice before no) and the same engine process alive."""
        for attempt in range(3):
            try:
                status = httpx.get(self.root + "/health", headers=self.headers(0), timeout=10).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                break
            time.sleep(1.0)
        else:
            return False
        pid = self.current_pid()
        if self.engine_pid is not None and (pid != self.engine_pid or not alive(pid)):
            return False
        self.monitor.flag.clear()
        return True

    def _replays(self, op: hc.Op, mutations: tuple, stream: bool, key_index: int):
        """The mutations that alone give a server-side failure (each replayed once, alone); None for one mutation."""
        if len(mutations) < 2:
            return None
        culprits = []
        for m in mutations:
            built = hc.build(op, self.model, (m,), stream)
            self.report["replays"] += 1
            out = self.send(built, key_index)
            if any(p[0] in SERVER_SIDE for p in judge(op.path, out)):
                culprits.append(hc.describe(m))
            if not self.healthy():
                culprits.append(hc.describe(m))
                self.on_death(op.name, "own replay", _request_text(built.method, built.path, built.body), out, None,
                              [hc.describe(m)])
                if self.stopped:
                    break
        return sorted(set(culprits))

    def on_death(self, op: str, source: str, request: str, out: Outcome, replays, atoms=()) -> None:
        death = {"operation": op, "source": source, "case": self.report["total_cases"], "status": out.label,
                 "request": request[:LIMIT], "response": (out.text or out.error or "")[:LIMIT],
                 "atoms": list(atoms), "engine_pid": self.engine_pid, "pid_now": self.current_pid(), "health_events":
                 self.monitor.events[-3:], "log_tail": log_tail(self.log_path(), 60), "t": round(time.time(), 1)}
        causes = re.findall(r"the engine failed \((.*)\): exiting", death["log_tail"]) or \
            re.findall(r"^[\w.]*(?:Error|Exception)\b.*$", death["log_tail"], re.M)
        death["cause"] = causes[-1] if causes else None  # the engine's last exception in the server log
        self.report["deaths"].append(death)
        self.fail(op, source, "engine death", request, out, death["cause"] or "the engine died or /health stopped "
                  "answering 200", None, atoms)
        if not self.revive():
            self.stopped = True
            return
        death["culprits"] = replays() if replays is not None else None
        # What killed it is skipped from now on: the mutations that alone did, else every mutation of the case.
        self.suspects.update((op, a) for a in (death["culprits"] or atoms) if a != "stream=true")

    def revive(self) -> bool:
        self.monitor.paused = True
        try:
            if self.server is not None:
                if self.restarts >= self.max_restarts:
                    return False
                self.restarts += 1
                self.server.stop()
                self.server.start()
            else:
                deadline = time.monotonic() + self.wait_s
                while time.monotonic() < deadline:
                    self.engine_pid = self.current_pid()
                    if self.healthy():
                        break
                    time.sleep(2)
                else:
                    return False
            self.engine_pid = self.monitor.pid = self.current_pid()
            self.monitor.flag.clear()
            return True
        finally:
            self.monitor.paused = False

    def finish(self) -> None:
        final = {"health": None, "engine_pid_end": self.current_pid(), "chat_status": None, "chat_text": None}
        try:
            final["health"] = self.client.get(self.root + "/health", headers=self.headers(0)).status_code
            chat = self.client.post(self.root + "/v1/chat/completions", headers=self.headers(0), json={
                "model": self.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
            final["chat_status"] = chat.status_code
            final["chat_text"] = chat.json()["choices"][0]["message"]["content"] if chat.status_code == 200 \
                else chat.text[:500]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            final["error"] = repr(exc)
        final["same_engine_pid"] = final["engine_pid_end"] == self.report["engine_pid_start"] and \
            alive(final["engine_pid_end"])
        report = self.report
        report.update({"final": final, "engine_deaths": len(report["deaths"]), "server_restarts": self.restarts,
                       "health_polls": {"polls": self.monitor.polls, "not_ok": self.monitor.bad_polls,
                                        "events": self.monitor.events[:100]},
                       "stopped_early": self.stopped, "suspects": sorted(" / ".join(s) for s in self.suspects)})
        report["passed"] = (report["failure_count"] == 0 and not report["deaths"] and final["health"] == 200
                            and final["same_engine_pid"] and final["chat_status"] == 200)


def _request_text(method: str, path: str, body: bytes | None) -> str:
    return f"{method} {path}\n" + (body[:LIMIT].decode("utf-8", "replace") if body else "")
