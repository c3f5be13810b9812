"""The judging half of benchmarks/hostile_inputs.py: what a response must look like (``judge``), the campaign's
record of every response and failure, the /health poller, and what happens when the engine dies (the case is
recorded, our own server restarted, the killing mutation named by replaying it alone, then skipped)."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field

import httpx

import hostile_cases as hc
from live_serve import alive, engine_pid, log_tail

LIMIT = 2048  # bytes of a request or response kept in the report
SERVER_SIDE = ("5xx", "transport", "stream server error", "engine death")


@dataclass
class Outcome:
    status: int | None
    headers: dict = field(default_factory=dict)
    text: str = ""
    error: str | None = None  # timeout / connection: ...
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return str(self.status) if self.status is not None else (self.error or "?").split(":")[0]


def _no_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json(text: str):
    return json.loads(text, parse_constant=_no_constant)


def error_shape(text: str, anthropic: bool) -> str | None:
    """None when ``text`` is the API's error body, else what is wrong with it."""
    try:
        body = strict_json(text)
    except ValueError as exc:
        return f"error body not strict JSON ({exc})"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return "no error.message"
    if anthropic:
        if body.get("type") != "error" or set(error) != {"type", "message"}:
            return f"not Anthropic's shape (keys {sorted(body)}, error keys {sorted(error)})"
    elif set(error) != {"message", "type", "param", "code"}:
        return f"not OpenAI's shape (error keys {sorted(error)})"
    return None


def sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if name is not None or data:
            events.append((name, "\n".join(data)))
    return events


def stream_problems(path: str, text: str) -> list[tuple[str, str]]:
    """A stream must end with its terminal event and carry an error as the API's error event."""
    api = "anthropic" if path.startswith("/v1/messages") else "responses" if path.startswith("/v1/responses") \
        else "openai"
    problems, terminal = [], False
    for name, data in sse_events(text):
        if api == "openai" and data == "[DONE]":
            terminal = True
            continue
        try:
            obj = strict_json(data)
        except ValueError as exc:
            problems.append(("stream not JSON", f"{exc}: {data[:200]}"))
            continue
        kind = obj.get("type") if isinstance(obj, dict) else None
        error = None
        if api == "openai" and isinstance(obj, dict) and "error" in obj:
            error = ("openai", data)
        elif api == "anthropic" and (name == "error" or kind == "error"):
            error = ("anthropic", data)
        elif api == "anthropic" and kind == "message_stop":
            terminal = True
        elif api == "responses" and kind in ("response.completed", "response.incomplete"):
            terminal = True
        elif api == "responses" and kind == "response.failed":
            terminal = True
            err = (obj.get("response") or {}).get("error") or {}
            if not isinstance(err.get("message"), str) or "code" not in err:
                problems.append(("stream error shape", f"response.failed without error.code/message: {data[:300]}"))
            elif err.get("code") in ("server_error", "engine_failed", "internal_error"):
                problems.append(("stream server error", data[:LIMIT]))
        elif api == "responses" and kind == "error":
            terminal = True
            if not isinstance(obj.get("message"), str):
                problems.append(("stream error shape", data[:300]))
        if error is not None:
            terminal = True
            shape = error_shape(error[1], error[0] == "anthropic")
            if shape:
                problems.append(("stream error shape", f"{shape}: {data[:300]}"))
            elif _server_error(strict_json(error[1])):
                problems.append(("stream server error", data[:LIMIT]))
    if not terminal:
        problems.append(("stream unterminated", text[-300:]))
    return problems


def _server_error(body: dict) -> bool:
    error = body["error"]
    return error.get("type") in ("server_error", "api_error") or error.get("code") == "engine_failed"


def judge(path: str, out: Outcome) -> list[tuple[str, str]]:
    """(kind, detail) for everything wrong with one response."""
    if out.status is None:
        return [("transport", out.error or "")]
    anthropic = path.startswith("/v1/messages")
    if out.status >= 500:
        if out.status == 503 and "retry-after" in out.headers:  # overload: allowed
            shape = error_shape(out.text, anthropic)
            return [("error shape", shape)] if shape else []
        return [("5xx", out.text[:300])]
    if out.status >= 400:
        shape = error_shape(out.text, anthropic)
        return [("error shape", shape)] if shape else []
    content_type = out.headers.get("content-type", "")
    if "text/event-stream" in content_type:
        return stream_problems(path.split("?")[0], out.text)
    if "json" in content_type:
        try:
            strict_json(out.text)
        except ValueError as exc:
            return [("2xx body not strict JSON", f"{exc}")]
    return []


class Monitor(threading.Thread):
    """GET /health every ``interval`` s and the engine's pid: anything but 200 and the same live pid sets ``flag``."""

    def __init__(self, root: str, headers: dict, pid_source, interval: float = 3.0):
        super().__init__(daemon=True)
        self.root, self.headers, self.pid_source, self.interval = root, headers, pid_source, interval
        self.pid: int | None = None
        self.flag, self._stop, self.paused = threading.Event(), threading.Event(), False
        self.polls, self.bad_polls, self.events = 0, 0, []

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self.interval):
                if self.paused:
                    continue
                try:
                    status = client.get(self.root + "/health", headers=self.headers).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                now_pid = self.pid_source()
                problem = None
                if status != 200:
                    problem = f"/health {status}"
                elif self.pid is not None and (now_pid != self.pid or not alive(self.pid)):
                    problem = f"engine pid {self.pid} -> {now_pid} (alive: {alive(self.pid)})"
                self.polls += 1
                if problem and not self.paused:
                    self.bad_polls += 1
                    self.events.append({"t": round(time.time(), 1), "what": problem})
                    self.flag.set()

    def stop(self) -> None:
        self._stop.set()


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


def print_summary(report: dict, out: str) -> None:
    print(f"\nhostile inputs: {report['total_cases']} cases ({report['schemathesis_cases']} schemathesis, "
          f"{report['own_cases']} own, {report['replays']} replays, {report['skipped_known_killers']} skipped as "
          f"known engine killers) in {report['duration_s']} s; CPU flags {' '.join(report['cpu_flags'])}")
    for op, entry in sorted(report["operations"].items()):
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(entry["statuses"].items()))
        print(f"  {op:38s} {entry['cases']:5d}  {statuses}")
    print(f"failures: {report['failure_count']} (distinct, one line each: count, operation, kind, status, the "
          f"mutations or the request -> the response)")
    resets = 0
    for group in report["distinct_failures"]:
        if group["kind"] == "connection reset after 5xx":
            resets += group["count"]
            continue
        what = ", ".join(group["culprits"] or group["mutations"]) or group["request"].split("\n", 1)[-1][:120]
        answer = group["detail"] if group["kind"].startswith("stream") or group["kind"] in ("transport", "engine death") \
            else group["response"]
        print(f"  x{group['count']:<3d} {group['operation']} {group['kind']} {group['status']}: {what} -> "
              f"{(answer or '')[:140]}".replace("\n", " | "))
    if resets:
        print(f"  x{resets:<3d} the kept-alive connection was reset after a 5xx (the next request on it failed)")
    print(f"engine deaths: {report['engine_deaths']} (server restarts {report['server_restarts']}; /health not ok in "
          f"{report['health_polls']['not_ok']} of {report['health_polls']['polls']} polls)")
    for death in report["deaths"]:
        what = death.get("culprits") or death["atoms"] or death["request"].split("\n", 1)[-1][:200]
        print(f"  {death['operation']} ({death['source']}, case {death['case']}): {what} -> {death.get('cause')}")
    final = report["final"]
    print(f"final: /health {final['health']}, engine pid {report['engine_pid_start']} -> {final['engine_pid_end']} "
          f"(same: {final['same_engine_pid']}), chat {final['chat_status']}: {final['chat_text']!r}")
    print(f"{'PASS' if report['passed'] else 'FAIL'}; JSON in {out}")
