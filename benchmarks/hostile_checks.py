"""What benchmarks/hostile_inputs.py holds a response to (``judge``: status, error shape, strict JSON, a stream's
terminal and error events), the /health poller, and the summary it prints."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from live_serve import alive

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
