"""Offline API: ``LLM(model).generate(prompts, SamplingParams)``, in the spirit of vLLM's."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from tokenmill.config import load_config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import PromptError, make_engine_requests
from tokenmill.sampling.params import SamplingParams
from tokenmill.structured.grammar import build_grammar


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
    # Per prompt token (the first None): (its logprob, top candidates, its rank); None unless prompt_logprobs.
    prompt_logprobs: list | None = None
    embedding: list[float] | None = None  # the prompt's pooled final hidden states (SamplingParams.pooling), raw
    error: str | None = None  # finish_reason "error": why the engine refused it (its grammar over budget, say)


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


def uuid_hex() -> str:
    return uuid.uuid4().hex


class LLM:
    """The engine core in the caller's thread: no server, no second process."""

    def __init__(self, model: str | None = None, config_file: str | None = None, **config: Any):
        self.engine = EngineCore(load_config(config_file, model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker ranks (tensor parallelism); also done at interpreter exit."""
        self.engine.close()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Validate and queue one request of one choice (ValueError naming the problem) of ``priority`` (0
        interactive, 1 batch: scheduler/priority.py); step ``self.engine`` to run it."""
        if params.n != 1:
            raise ValueError("add_request queues one choice: use generate() for n > 1")
        return self._add([prompt_token_ids], params, (lambda: request_id) if request_id else uuid_hex, priority)[0]

    def _add(self, prompts: list[list[int]], params: SamplingParams, new_id=None, priority: int = 0) -> list[str]:
        """Validate, then queue ``params.n`` requests per prompt (make_engine_requests, as the server does)."""
        if params.grammar is not None:
            build_grammar(params.grammar)  # GrammarError (a ValueError) for a grammar that describes none
        try:
            requests = make_engine_requests(self.engine.info, prompts, params, time.monotonic(),
                                            new_id=new_id or uuid_hex, priority=priority)
        except PromptError as exc:
            raise exc.cause from None
        for request in requests:
            self.engine.add_request(request)
        return [r.request_id for r in requests]

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
            for index, request_id in enumerate(self._add([ids], params)):
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
                if out.prompt_logprobs is not None:
                    completion.prompt_logprobs = out.prompt_logprobs
                if out.embedding is not None:
                    completion.embedding = out.embedding
                if out.finished:
                    completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
                    completion.error = out.error
        return results

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             params: SamplingParams | None = None) -> list[GenerationResult]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.tokenizer.apply_chat_template(list(c)) for c in conversations], params)
