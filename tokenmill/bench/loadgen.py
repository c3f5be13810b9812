"""Streaming load against any OpenAI-compatible endpoint, one concurrency level at a time.

Prompts: random token ids of exact length, sent as token-id prompts to /v1/completions (vLLM, llama.cpp's
server and tokenmill accept them); the same behind one shared random prefix (``--dataset shared-prefix``, the shape
of a chat service's system prompt); or a JSONL file of {"prompt": ...} lines. For the chat endpoint, token ids
are turned into text with the model's tokenizer, so lengths are approximate there. Every request asks for
exactly ``output_len`` tokens (``ignore_eos``, and ``min_tokens`` where accepted) with usage reported in the
last chunk; a server that reports none has its streamed chunks counted instead, and the report says so.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from tokenmill.bench.stats import RequestResult


@dataclass
class LoadSpec:
    base_url: str
    model: str
    api_key: str | None
    endpoint: str  # "completions" | "chat"
    output_len: int
    timeout: float = 600.0
    temperature: float = 0.0


def random_prompts(count: int, length: int, vocab_size: int, seed: int | None) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    return [[rng.randrange(1000, vocab_size) for _ in range(length)] for _ in range(count)]


def shared_prefix_prompts(count: int, prefix_len: int, length: int, vocab_size: int, seed: int | None
                          ) -> list[list[int]]:
    """The chat-with-a-system-prompt shape: one random ``prefix_len``-token prefix shared by every prompt, then a
    different random question, ``length`` tokens in all. A prefix cache computes the prefix once."""
    if not 0 < prefix_len < length:
        raise ValueError(f"the shared prefix ({prefix_len} tokens) must be shorter than the prompt ({length})")
    prefix = random_prompts(1, prefix_len, vocab_size, seed)[0]
    questions = random_prompts(count, length - prefix_len, vocab_size, None if seed is None else seed + 1)
    return [prefix + q for q in questions]


def dataset_prompts(path: str, count: int) -> list[Any]:
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no prompts")
    return [rows[i % len(rows)]["prompt"] for i in range(count)]


def _body(spec: LoadSpec, prompt: Any, detokenize: Callable[[list[int]], str] | None) -> tuple[str, dict]:
    common = {"model": spec.model, "max_tokens": spec.output_len, "stream": True, "temperature": spec.temperature,
              "ignore_eos": True, "min_tokens": spec.output_len, "stream_options": {"include_usage": True}}
    if spec.endpoint == "chat":
        text = detokenize(prompt) if isinstance(prompt, list) and detokenize else str(prompt)
        return "/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    return "/completions", {**common, "prompt": prompt}


def error_message(body: str) -> str:
    """An OpenAI error body's message, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


def normalize_base_url(url: str) -> str:
    """``http://host:port``, ``.../`` and ``.../v1`` all mean the OpenAI API root ``http://host:port/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _chunk_text(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def one_request(client: httpx.AsyncClient, spec: LoadSpec, prompt: Any,
                      detokenize: Callable[[list[int]], str] | None) -> RequestResult:
    path, body = _body(spec, prompt, detokenize)
    start = time.perf_counter()
    result = RequestResult(start=start, end=start, ok=False)
    usage = None
    try:
        async with client.stream("POST", spec.base_url.rstrip("/") + path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error, result.detail = f"HTTP {response.status_code}", error_message(response.text)
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error, result.detail = "stream error", str(event["error"].get("message", event["error"]))
                    return result
                if _chunk_text(event):
                    result.chunk_times.append(time.perf_counter())
                usage = event.get("usage") or usage
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error, result.detail = type(exc).__name__, str(exc)
    finally:
        result.end = time.perf_counter()
    if usage:
        result.prompt_tokens, result.output_tokens = usage.get("prompt_tokens", 0), usage["completion_tokens"]
    else:
        result.usage_reported = False
        result.prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
        result.output_tokens = len(result.chunk_times)
    return result


async def run_level(spec: LoadSpec, prompts: list[Any], concurrency: int, max_seconds: float | None,
                    detokenize: Callable[[list[int]], str] | None = None,
                    on_done: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
    """Keep ``concurrency`` requests in flight until the prompts run out (or ``max_seconds`` pass: no new
    requests start after that; those in flight finish)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []
    deadline = time.perf_counter() + max_seconds if max_seconds else None
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=spec.timeout, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty() and (deadline is None or time.perf_counter() < deadline):
                result = await one_request(client, spec, queue.get_nowait(), detokenize)
                results.append(result)
                if on_done:
                    on_done(result)
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return results


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape_metrics(base_url: str, api_key: str | None = None) -> dict[str, float] | None:
    """A server's /metrics as {name: value summed over label sets}; None when it has none."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(root + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
    return values
