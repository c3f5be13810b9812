"""POST /v1/embeddings: each input's prompt goes through the engine as a request that pools its final hidden states
in the prefill (engine/pooling.py: no sampling is read, the request ends after its prefill's one token and its KV
goes back) and comes back pooled as the checkpoint says (models/pooling.py), normalized where it normalizes, cut
to ``dimensions`` where it was trained for that, as floats or base64 (little-endian float32, OpenAI's encoding)."""

from __future__ import annotations

import base64
import math
from typing import Any, Literal

import numpy as np
from tokenmill.sampling.params import SamplingParams
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import Positive, Strict, TokenId
from tokenmill.server.serving import ServerContext, make_requests
from tokenmill.server.tracker import Tracker


class EmbeddingRequest(Strict):
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = None
    user: str | None = None


async def _inputs(ctx: ServerContext, value: Any) -> list[list[int]]:
    items = [value] if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)) else value
    if not items:
        raise bad_request("input must not be empty", param="input")
    if len(items) > ctx.config.max_embedding_inputs:
        raise bad_request(f"at most {ctx.config.max_embedding_inputs} inputs in one request, got {len(items)}",
                          param="input", code="limit_exceeded")
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = await ctx.client.encode(item)
        if not item:
            raise bad_request("an input must not be empty", param=f"input.{i}")
        prompts.append(list(item))
    return prompts


def _check_dimensions(ctx: ServerContext, dimensions: int | None) -> None:
    size, allowed = ctx.client.info.hidden_size, ctx.client.info.pooling.matryoshka
    if dimensions is None or dimensions == size:
        return
    if dimensions > size or not (allowed is True or dimensions in (allowed or ())):
        sizes = "any up to" if allowed is True else ", ".join(map(str, allowed)) + " or" if allowed else "only"
        raise bad_request(f"this model's embeddings have {size} dimensions; dimensions may be {sizes} {size}",
                          param="dimensions")


async def prepare_embeddings(ctx: ServerContext, body: EmbeddingRequest, key_name: str | None,
                             arrival: float) -> Tracker:
    if ctx.client.info.pooling.mode is None:
        raise bad_request(f"this model does not serve embeddings: {ctx.client.info.pooling.refusal}", param="model")
    _check_dimensions(ctx, body.dimensions)
    prompts = await _inputs(ctx, body.input)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=ctx.client.info.pooling.mode)
    requests, reservation, charge = make_requests(ctx, prompts, params, "input", arrival, key_name)
    return Tracker(ctx, "embeddings", arrival, key_name, requests, reservation, charge)


def _finish(ctx: ServerContext, vector: list[float], dimensions: int | None, encoding: str) -> list[float] | str:
    if dimensions is not None:
        vector = vector[:dimensions]
    if ctx.client.info.pooling.normalize:
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        vector = [v / norm for v in vector]
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def embeddings_response(ctx: ServerContext, body: EmbeddingRequest, tracker: Tracker) -> dict[str, Any]:
    vectors: list[list[float] | None] = [None] * len(tracker.requests)
    async for index, out in tracker.outputs():
        if out.embedding is not None:
            vectors[index] = out.embedding
    data = [{"object": "embedding", "index": i, "embedding": _finish(ctx, v, body.dimensions, body.encoding_format)}
            for i, v in enumerate(vectors) if v is not None]
    prompt = sum(len(r.prompt_token_ids) for r in tracker.requests)
    return {"object": "list", "data": data, "model": ctx.model_name,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
