"""The load of benchmarks/soak.py: closed-loop workers per tenant, tenant b's bursts and slow readers, and the
record of what each request got (counts by tenant, kind and status; tenant a's TTFT per phase; errors).

One asyncio loop, one httpx.AsyncClient; slow readers are raw sockets with a 4 KiB receive buffer and a 1 KiB
StreamReader limit, read 100 bytes a second, so that the bytes they have not read stay in the server.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from urllib.parse import urlsplit

import httpx

GAUGES = ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc",
          "tokenmill:admission_saturation")
KINDS = (("chat_stream", 5), ("chat", 2), ("abort", 1), ("structured", 1), ("embeddings", 1), ("responses", 1))
TOPICS = ("the sea", "a lighthouse", "bread", "the moon", "a red bicycle", "winter", "a library", "bees", "rain",
          "a mountain village", "trains", "an old clock", "tea", "a fox", "the desert", "music")
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
THINK_S = {"a": (0.5, 1.5), "b": (0.1, 0.5)}
BURST_STOP = [".", "!", "?", "\n"]  # a burst promises 1800 tokens each but ends at its first sentence


class Run:
    def __init__(self, root: str, keys: dict, workers: int, seed: int = 0):
        self.root, self.keys, self.workers, self.seed = root, keys, workers, seed
        self.client: httpx.AsyncClient | None = None
        self.model = ""
        self.start = time.monotonic()
        self.phase, self.phases = "warmup", []
        self.ttft: dict[str, list[float]] = {"baseline": [], "slow_readers": []}
        self.counts: dict[str, dict[str, dict[str, int]]] = {}  # tenant -> kind -> status -> requests
        self.by_phase: dict[str, dict[str, dict[str, int]]] = {}  # phase -> tenant -> status -> requests
        self.errors: list[dict] = []
        self.structured_json = {"valid": 0, "invalid": 0}
        self.ttft_censored: dict[str, list[float]] = {"baseline": [], "slow_readers": []}
        self.embeddings = {"enabled": True, "probe_status": None, "probe_body": None}
        self.slow_streams = {"started": 0, "ended": 0, "bytes_read": 0, "statuses": {}}
        self.burst_log: list[dict] = []
        self.series: list[dict] = []
        self.stopping = False

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def now(self) -> float:
        return round(time.monotonic() - self.start, 2)

    def headers(self, tenant: str) -> dict:
        key = self.keys.get(tenant)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def count(self, tenant: str, kind: str, status) -> None:
        kinds = self.counts.setdefault(tenant, {})
        statuses = kinds.setdefault(kind, {})
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        phase = self.by_phase.setdefault(self.phase, {}).setdefault(tenant, {})
        phase[str(status)] = phase.get(str(status), 0) + 1

    def error(self, tenant: str, kind: str, what: str) -> None:
        self.errors.append({"t": self.now(), "phase": self.phase, "tenant": tenant, "kind": kind, "what": what[:500]})

    def settle(self, tenant: str, kind: str, response: httpx.Response, text: str = "") -> bool:
        """Count a response; True when it is a 200. Anything but 200 and 429 is an error."""
        self.count(tenant, kind, response.status_code)
        if response.status_code not in (200, 429):
            self.error(tenant, kind, f"{response.status_code}: {text[:300]}")
        return response.status_code == 200

    def begin_phase(self, phase: str, round_index: int) -> None:
        self.end_phase()
        self.phase = phase
        self.phases.append({"phase": phase, "round": round_index, "start_s": self.now(), "end_s": None})

    def end_phase(self) -> None:
        if self.phases and self.phases[-1]["end_s"] is None:
            self.phases[-1]["end_s"] = self.now()
        self.phase = "stopping"

    def body(self, rng: random.Random, **extra) -> dict:
        prompt = f"Write two sentences about {rng.choice(TOPICS)} (note {rng.randrange(10**6)})."
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}], **extra}

    # -- requests ----------------------------------------------------------------------------------------------
    async def probe_embeddings(self) -> None:
        r = await self.client.post(self.root + "/v1/embeddings", headers=self.headers("a"),
                                   json={"model": self.model, "input": "warm-up"})
        self.embeddings.update(probe_status=r.status_code, probe_body=r.text[:300] if r.status_code != 200 else None)
        if r.status_code == 400:  # a generative model that refuses embeddings: left out of the mix
            self.embeddings["enabled"] = False
        await self.client.post(self.root + "/v1/chat/completions", headers=self.headers("a"),
                               json={"model": self.model, "messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 4})

    async def chat_stream(self, tenant: str, rng: random.Random, phase: str) -> None:
        start, first = time.monotonic(), []
        try:
            await self._chat_stream(tenant, rng, first)
        except asyncio.CancelledError:  # the run ended first: the wait so far is a lower bound of its TTFT
            if tenant == "a" and not first and phase in self.ttft:
                self.ttft_censored[phase].append(time.monotonic() - start)
            raise
        if tenant == "a" and first and phase in self.ttft:
            self.ttft[phase].append(first[0] - start)

    async def _chat_stream(self, tenant: str, rng: random.Random, first: list[float]) -> None:
        """Appends to ``first`` the time of the first chunk with content."""
        done = False
        async with self.client.stream("POST", self.root + "/v1/chat/completions", headers=self.headers(tenant),
                                      json=self.body(rng, max_tokens=32, stream=True)) as r:
            if r.status_code != 200:
                self.settle(tenant, "chat_stream", r, (await r.aread()).decode(errors="replace"))
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and (not first or '"error"' in line):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error(tenant, "chat_stream", f"error event: {line[:300]}")
                    elif any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                        first.append(time.monotonic())
        self.count(tenant, "chat_stream", 200 if done else "200-unterminated")
        if not done:
            self.error(tenant, "chat_stream", "stream ended without [DONE]")

    async def chat(self, tenant: str, rng: random.Random, phase: str) -> None:
        r = await self.client.post(self.root + "/v1/chat/completions", headers=self.headers(tenant),
                                   json=self.body(rng, max_tokens=32))
        self.settle(tenant, "chat", r, r.text)

    async def abort(self, tenant: str, rng: random.Random, phase: str) -> None:
        """A stream the client closes after three chunks (the server must abort it and free what it held)."""
        async with self.client.stream("POST", self.root + "/v1/chat/completions", headers=self.headers(tenant),
                                      json=self.body(rng, max_tokens=200, ignore_eos=True, stream=True)) as r:
            if r.status_code != 200:
                self.settle(tenant, "abort", r, (await r.aread()).decode(errors="replace"))
                return
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        self.count(tenant, "abort", 200)

    async def structured(self, tenant: str, rng: random.Random, phase: str) -> None:
        body = self.body(rng, max_tokens=64, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        body["messages"][0]["content"] = f"Invent a person living near {rng.choice(TOPICS)}; answer in JSON."
        r = await self.client.post(self.root + "/v1/chat/completions", headers=self.headers(tenant), json=body)
        if self.settle(tenant, "structured", r, r.text):
            try:
                json.loads(r.json()["choices"][0]["message"]["content"])
                self.structured_json["valid"] += 1
            except (ValueError, KeyError, TypeError):
                self.structured_json["invalid"] += 1

    async def embeddings_request(self, tenant: str, rng: random.Random, phase: str) -> None:
        r = await self.client.post(self.root + "/v1/embeddings", headers=self.headers(tenant),
                                   json={"model": self.model, "input": [f"about {rng.choice(TOPICS)}", "and more"]})
        self.settle(tenant, "embeddings", r, r.text)

    async def responses(self, tenant: str, rng: random.Random, phase: str) -> None:
        """store=true, then GET of the stored response, then a follow-up with previous_response_id."""
        url, headers = self.root + "/v1/responses", self.headers(tenant)
        r = await self.client.post(url, headers=headers, json={
            "model": self.model, "input": self.body(rng)["messages"][0]["content"], "store": True,
            "max_output_tokens": 24})
        if not self.settle(tenant, "responses", r, r.text):
            return
        response_id = r.json()["id"]
        got = await self.client.get(f"{url}/{response_id}", headers=headers)
        if self.settle(tenant, "responses_get", got, got.text) and got.json().get("id") != response_id:
            self.error(tenant, "responses_get", f"asked for {response_id}, got {got.text[:200]}")
        follow = await self.client.post(url, headers=headers, json={
            "model": self.model, "input": "And then?", "previous_response_id": response_id, "store": True,
            "max_output_tokens": 24})
        self.settle(tenant, "responses_followup", follow, follow.text)

    # -- the loops ---------------------------------------------------------------------------------------------
    async def worker(self, tenant: str, index: int) -> None:
        rng = random.Random(f"{self.seed}-{tenant}-{index}")
        names = [name for name, weight in KINDS for _ in range(weight)]
        await asyncio.sleep(rng.random())
        while not self.stopping:
            kind = rng.choice(names)
            if kind == "embeddings" and not self.embeddings["enabled"]:
                continue
            call = self.embeddings_request if kind == "embeddings" else getattr(self, kind)
            try:
                await call(tenant, rng, self.phase)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a transport error or a malformed answer, counted
                self.count(tenant, kind, type(exc).__name__)
                self.error(tenant, kind, repr(exc))
            await asyncio.sleep(rng.uniform(*THINK_S[tenant]))

    async def ttft_probe(self, period: float) -> None:
        """Tenant a's open-loop TTFT sample: a streamed chat every ``period`` s, each on its own task (a stalled
        one does not delay the next), in both phases alike."""
        rng = random.Random(f"{self.seed}-probe")
        pending: set[asyncio.Task] = set()

        async def one(phase: str) -> None:
            try:
                await self.chat_stream("a", rng, phase)
            except Exception as exc:  # noqa: BLE001 - a transport error or a malformed answer, counted
                self.count("a", "chat_stream", type(exc).__name__)
                self.error("a", "chat_stream", repr(exc))
        try:
            while not self.stopping:
                task = asyncio.create_task(one(self.phase))
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(period)
        finally:
            for task in list(pending):
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def bursts(self, period: float, size: int) -> None:
        """Every ``period`` s, ``size`` concurrent whole chat requests from tenant b promising 1800 tokens each
        (stopping at the first sentence, so that what they cost is their promise, not their work): over the
        admission limit on purpose, so 429s are expected (counted, not errors)."""
        rng = random.Random(f"{self.seed}-burst")
        pending: set[asyncio.Task] = set()

        async def one() -> int | str:
            try:
                r = await self.client.post(self.root + "/v1/chat/completions", headers=self.headers("b"),
                                           json=self.body(rng, max_tokens=1800, stop=BURST_STOP))
                self.count("b", "burst", r.status_code)
                if r.status_code == 429 and "retry-after" not in r.headers:
                    self.error("b", "burst", "429 without Retry-After")
                elif r.status_code not in (200, 429):
                    self.error("b", "burst", f"{r.status_code}: {r.text[:300]}")
                return r.status_code
            except Exception as exc:  # noqa: BLE001 - a transport error or a malformed answer, counted
                self.count("b", "burst", type(exc).__name__)
                self.error("b", "burst", repr(exc))
                return type(exc).__name__
        try:
            while not self.stopping:
                await asyncio.sleep(period)
                entry = {"t": self.now(), "phase": self.phase, "statuses": None}
                self.burst_log.append(entry)
                tasks = [asyncio.create_task(one()) for _ in range(size)]
                pending.update(tasks)
                done = asyncio.gather(*tasks)

                def record(fut, entry=entry, tasks=tasks):
                    pending.difference_update(tasks)
                    if not fut.cancelled() and fut.exception() is None:  # else cut off by the end of the run
                        entry["statuses"] = {str(s): fut.result().count(s) for s in set(fut.result())}
                done.add_done_callback(record)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def slow_reader(self, index: int, slow: bool = True) -> None:
        """Tenant b's stream of n=16 x 300 tokens, read at ~100 bytes/s (``slow``) or as fast as it comes; once per
        phase (a refused one tries again a second later), so that both phases give the engine the same work and
        differ only in how fast it is read."""
        url = urlsplit(self.root)
        body = json.dumps({"model": self.model, "n": 16, "max_tokens": 300, "stream": True, "messages": [
            {"role": "user", "content": f"Tell a long story about {TOPICS[index % len(TOPICS)]}."}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        for name, value in self.headers("b").items():
            head += f"{name}: {value}\r\n"
        request = (head + "\r\n").encode() + body
        loop = asyncio.get_running_loop()
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            writer = None
            try:
                await loop.sock_connect(sock, (url.hostname, url.port or 80))
                reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
                writer.write(request)
                await writer.drain()
                self.slow_streams["started"] += 1
                status, first = None, b""
                while True:
                    chunk = await reader.read(100 if slow else 1 << 16)
                    if not chunk:
                        break
                    self.slow_streams["bytes_read"] += len(chunk)
                    if status is None:
                        first += chunk
                        if b"\r\n" in first:
                            status = first.split(b"\r\n", 1)[0].split(b" ")[1].decode()
                            self.count("b", "slow_reader", status)
                            self.slow_streams["statuses"][status] = self.slow_streams["statuses"].get(status, 0) + 1
                    if slow:
                        await asyncio.sleep(1.0)
                self.slow_streams["ended"] += 1
                if status == "200":
                    await asyncio.Event().wait()  # one stream a phase: idle until the phase ends
            except OSError as exc:
                self.count("b", "slow_reader", type(exc).__name__)
                self.error("b", "slow_reader", repr(exc))
                await asyncio.sleep(1.0)
            finally:
                if writer is not None:
                    writer.close()
                else:
                    sock.close()
            await asyncio.sleep(1.0)  # a refused one (429) tries again a second later
