"""POST /v1/completions, streaming (SSE) and not. Choice index = prompt index * n + choice.

Prompt logprobs come from the prefill (engine/prompt_logprobs.py): with ``echo`` + ``logprobs`` the choice's logprobs
start with the prompt's tokens (OpenAI's legacy shape, how lm-evaluation-harness scores loglikelihoods), and vLLM's
``prompt_logprobs`` adds a per-choice list keyed by token id. A stream sends them with the choice's first chunk (the
echoed prompt waits for it)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from tokenmill.engine.messages import EngineRequest, RequestOutput
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.logprobs import completion_logprobs, echo_logprobs, vllm_prompt_logprobs
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving import ServerContext, make_requests, sampling_params
from tokenmill.server.tracker import Tracker
from tokenmill.server.structured import check, requested_grammar


async def _prompts(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [await ctx.client.encode(p) if isinstance(p, str) else list(p) for p in prompt]


async def prepare_completion(ctx: ServerContext, body: CompletionRequest, key_name: str | None,
                             arrival: float) -> Tracker:
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise bad_request("best_of other than n is not supported", param="best_of")
    prompts = await _prompts(ctx, body.prompt)
    params = sampling_params(body, body.max_tokens, body.logprobs)
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    if wanted:
        params = dataclasses.replace(params, prompt_logprobs=max(wanted))
    constraint = requested_grammar(body)
    if constraint is not None:
        await check(ctx, *constraint)
        params = dataclasses.replace(params, grammar=constraint[1])
    requests, reservation, charge = make_requests(ctx, prompts, params, "prompt", arrival, key_name, body.cache_salt,
                                                  body.service_tier)
    return Tracker(ctx, "completions", arrival, key_name, requests, reservation, charge,
                   grammar_param=constraint[0] if constraint else None)


async def _echo_prefixes(ctx: ServerContext, body: CompletionRequest, tracker: Tracker) -> list[str]:
    if not body.echo:
        return [""] * len(tracker.requests)
    return [await ctx.client.decode(r.prompt_token_ids, skip_special_tokens=True) for r in tracker.requests]


async def _prompt_parts(ctx: ServerContext, body: CompletionRequest, request: EngineRequest, out: RequestOutput
                        ) -> tuple[dict | None, list | None]:
    """The prompt's logprobs of a choice's first output: the echo part of ``logprobs``, and vLLM's list."""
    if out.prompt_logprobs is None:
        return None, None
    prompt, entries = request.prompt_token_ids, out.prompt_logprobs
    echo = await echo_logprobs(ctx.client, prompt, _top(entries, body.logprobs)) \
        if body.echo and body.logprobs is not None else None
    listed = await vllm_prompt_logprobs(ctx.client, prompt, _top(entries, body.prompt_logprobs)) \
        if body.prompt_logprobs is not None else None
    return echo, listed


def _top(entries: list, k: int) -> list:
    """The entries with ``k`` top candidates (the engine computed the larger of the two counts asked)."""
    return [e if e is None else (e[0], e[1][:k], e[2]) for e in entries]


async def completion_response(ctx: ServerContext, body: CompletionRequest, tracker: Tracker) -> dict[str, Any]:
    texts = await _echo_prefixes(ctx, body, tracker)
    logprobs = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in texts]
    prompt_logprobs: list[list | None] = [None] * len(texts)
    reasons: list[str | None] = [None] * len(texts)
    async for index, out in tracker.outputs():
        if out.prompt_logprobs is not None:
            echo, prompt_logprobs[index] = await _prompt_parts(ctx, body, tracker.requests[index], out)
            if echo is not None:
                logprobs[index] = echo
        if body.logprobs is not None:
            for key, values in (await completion_logprobs(ctx.client, out, len(texts[index]))).items():
                logprobs[index][key] += values
        texts[index] += out.delta_text
        reasons[index] = out.finish_reason
    choices = [{"index": i, "text": texts[i], "logprobs": logprobs[i] if body.logprobs is not None else None,
                "finish_reason": reasons[i]} for i in range(len(texts))]
    if body.prompt_logprobs is not None:
        for choice, listed in zip(choices, prompt_logprobs):
            choice["prompt_logprobs"] = listed
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name, "choices": choices, "usage": tracker.usage(body.n), "system_fingerprint": None}


async def completion_stream(ctx: ServerContext, body: CompletionRequest, tracker: Tracker) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name, "system_fingerprint": None}
    sent = [0] * len(tracker.requests)  # characters sent per choice, for text_offset

    def chunk(index: int, text: str, finish_reason: str | None, logprobs: dict | None, **extra: Any) -> str:
        payload = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason, **extra}]}
        if include_usage:
            payload["usage"] = None
        return json.dumps(payload)

    prefixes = await _echo_prefixes(ctx, body, tracker)
    waits = body.logprobs is not None or body.prompt_logprobs is not None  # for the prompt's logprobs
    for index, prefix in enumerate(prefixes):
        if prefix and not waits:
            sent[index] = len(prefix)
            yield chunk(index, prefix, None, None)
    try:
        async for index, out in tracker.outputs():
            if waits and out.prompt_logprobs is not None:  # the choice's first output: the prompt's part first
                echo, listed = await _prompt_parts(ctx, body, tracker.requests[index], out)
                extra = {"prompt_logprobs": listed} if body.prompt_logprobs is not None else {}
                if prefixes[index] or extra:
                    sent[index] = len(prefixes[index])
                    yield chunk(index, prefixes[index], None, echo, **extra)
            lps = await completion_logprobs(ctx.client, out, sent[index]) if body.logprobs is not None else None
            if out.delta_text or out.finished or lps:
                sent[index] += len(out.delta_text)
                yield chunk(index, out.delta_text, out.finish_reason if out.finished else None, lps)
    except APIError as exc:
        yield json.dumps(exc.body())
    if include_usage:
        yield json.dumps({**head, "choices": [], "usage": tracker.usage(body.n)})
    yield "[DONE]"
