"""Offline API: ``LLM(model).generate(prompts, SamplingParams)``, in the spirit of vLLM's."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from tokenmill.config import load_config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineRequest, validate_request
from tokenmill.sampling.params import SamplingParams


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per token: (logprob of the chosen token, [(token id, logprob)] top candidates); None unless asked.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]

    # The first completion's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs


Prompt = str | list[int]


class LLM:
    """The engine core in the caller's thread: no server, no second process."""

    def __init__(self, model: str | None = None, config_file: str | None = None, **config: Any):
        self.engine = EngineCore(load_config(config_file, model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker ranks (tensor parallelism); also done at interpreter exit."""
        self.engine.close()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
                    ) -> str:
        """Validate and queue one request (ValueError naming the problem); step ``self.engine`` to run it."""
        max_tokens = validate_request(self.engine.info, prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        self.engine.add_request(EngineRequest(request_id, list(prompt_token_ids), params, max_tokens,
                                              time.monotonic()))
        return request_id

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """One result per prompt, in order. A prompt is a string or a list of token ids; ``params`` is one for all
        prompts or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        per_prompt = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        results, pending = [], {}
        for prompt, params in zip(prompts, per_prompt):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            result = GenerationResult(prompt if isinstance(prompt, str) else None, ids, [])
            for index in range(params.n):
                request_id = self.add_request(ids, _choice_params(params, index))
                completion = Completion(index, logprobs=[] if params.logprobs is not None else None)
                result.outputs.append(completion)
                pending[request_id] = completion
            results.append(result)
        while self.engine.has_unfinished():
            for out in self.engine.step().outputs:
                completion = pending[out.request_id]
                completion.text += out.delta_text
                completion.token_ids.extend(out.new_token_ids)
                completion.num_cached_tokens = out.num_cached_tokens
                if completion.logprobs is not None:
                    completion.logprobs.extend(out.new_logprobs)
                if out.finished:
                    completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        return results

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             params: SamplingParams | None = None) -> list[GenerationResult]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.tokenizer.apply_chat_template(list(c)) for c in conversations], params)


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n choices of one prompt are separate requests; seeded ones get distinct, reproducible seeds."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
