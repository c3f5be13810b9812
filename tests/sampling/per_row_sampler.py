"""Turn each sampling request's logits row into a token, and record logprobs when asked.

Randomness: every seeded request owns a ``torch.Generator`` seeded with its seed and draws its noise from it
alone, one vector per step, so its tokens do not depend on which other requests share the batch. Unseeded
requests share the engine's generator. A token is drawn with the exponential race
``argmax(probs / E), E ~ Exp(1)``, which samples exactly from ``probs``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.sampling.params import SamplingParams
from tests.sampling.per_row_processors import apply_logit_bias, apply_penalties, ban_tokens, filter_top_k_top_p_min_p


class SamplingRequest(Protocol):
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    sampler_state: object
    logprobs: list


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def _generator_for(self, request: SamplingRequest) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        if request.sampler_state is None:
            request.sampler_state = torch.Generator().manual_seed(seed)
        return request.sampler_state

    def _process(self, row: torch.Tensor, request: SamplingRequest) -> None:
        params = request.sampling_params
        apply_penalties(row, params, request.prompt_token_ids, request.output_token_ids)
        if params.logit_bias:
            apply_logit_bias(row, params.logit_bias)
        if len(request.output_token_ids) < params.min_tokens:
            eos = [] if params.ignore_eos or request.eos_token_id is None else [request.eos_token_id]
            ban_tokens(row, eos + params.stop_token_ids)

    def sample(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> list[int]:
        """logits [S, V] float32 (one row per request, modified in place) -> S token ids."""
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = logits.log_softmax(-1)  # logprobs are the model's own, before any processing
        tokens = []
        for i, request in enumerate(requests):
            params, row = request.sampling_params, logits[i]
            self._process(row, request)
            if params.greedy:
                token = int(row.argmax())
            else:
                filtered = filter_top_k_top_p_min_p(row / params.temperature, params.top_k, params.top_p,
                                                    params.min_p)
                probs = filtered.softmax(-1)
                # Noise is drawn on the CPU so that a seed means the same tokens on every device.
                noise = torch.empty(probs.shape).exponential_(generator=self._generator_for(request))
                noise = noise.to(probs.device)
                token = int((probs / noise).argmax())
            tokens.append(token)
            if raw_logprobs is not None and params.logprobs is not None:
                request.logprobs.append(_logprob_entry(raw_logprobs[i], token, params.logprobs))
        return tokens


def _logprob_entry(logprobs: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = logprobs.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token]), top
