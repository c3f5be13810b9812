"""The step loop: schedule -> run the model -> sample -> update requests -> detokenize -> report deltas."""

from __future__ import annotations

import logging
import time
import uuid

import torch

from tokenmill.config import EngineConfig
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.models.loader import open_checkpoint
from tokenmill.models.runner import ModelRunner
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.models.worker import load_model_and_cache
from tokenmill.runtime import keep_freed_memory_in_heap
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.sampler import Sampler
from tokenmill.scheduler.detokenizer import IncrementalDetokenizer
from tokenmill.scheduler.outputs import RequestOutput
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """prompt + max_tokens do not fit the model length."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.resolved_device() == "cpu":
            keep_freed_memory_in_heap()
        checkpoint = open_checkpoint(config.model)
        self.model_name = checkpoint.name
        self.tokenizer = Tokenizer(checkpoint)
        loaded = load_model_and_cache(checkpoint, config)
        self.kv_spec = loaded.kv_cache.spec
        self.max_model_len = loaded.max_model_len
        self.vocab_size = checkpoint.hf_config["vocab_size"]
        self.runner = ModelRunner(loaded.model, loaded.kv_cache, loaded.device)
        kv = KVCacheManager(loaded.kv_cache.num_blocks, config.block_size)
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        log.info("engine ready: model=%s device=%s dtype=%s kv=%s blocks=%d (%d tokens, %d bytes/token)",
                 self.model_name, loaded.device, loaded.dtype, self.kv_spec.dtype, kv.pool.num_blocks,
                 kv.capacity_tokens, self.kv_spec.bytes_per_token)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_spec.bytes_per_token

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     arrival_time: float | None = None) -> Request:
        """Validate a request without queueing it (safe from any thread).

        Raises ValueError (ContextLengthError, SamplingParamError) on bad input. ``max_tokens=None`` means up to
        the model length.
        """
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        if not all(0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        params.validate_for_vocab(self.vocab_size)
        room = self.max_model_len - len(prompt_token_ids)
        wanted = params.max_tokens if params.max_tokens is not None else room
        if room < 1 or wanted > room:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_token_ids) + wanted} tokens ({len(prompt_token_ids)} in the prompt, {wanted} for "
                f"the completion). Please reduce the prompt or the completion length.")
        return Request(request_id or uuid.uuid4().hex, list(prompt_token_ids), params, max_tokens=wanted,
                       eos_token_id=self.tokenizer.eos_token_id,
                       arrival_time=arrival_time if arrival_time is not None else time.monotonic())

    def add(self, request: Request) -> None:
        """Queue a request made by ``make_request``; call from the thread that steps the engine."""
        self.scheduler.add_request(request)
        params = request.sampling_params
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None) -> Request:
        request = self.make_request(prompt_token_ids, params, request_id, arrival_time)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        self._detokenizers.pop(request_id, None)
        if request is None:
            return None
        return RequestOutput(request_id, [], "", request.num_prompt_tokens, request.num_output_tokens,
                             finished=True, finish_reason="abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        logits, sampling = self.runner.execute(out)
        tokens = self.sampler.sample(logits, sampling) if sampling else []
        sampled = {r.request_id: t for r, t in zip(sampling, tokens)}
        self.scheduler.update(out, sampled)
        now = time.monotonic()
        outputs = []
        for request in sampling:
            if request.first_token_time is None:
                request.first_token_time = now
            outputs.append(self._report(request, sampled[request.request_id]))
        return outputs

    def _report(self, request: Request, token: int) -> RequestOutput:
        detok = self._detokenizers[request.request_id]
        delta = detok.update([token], finished=request.is_finished)
        if detok.stopped_by is not None and not request.is_finished:
            request.stop_reason = detok.stopped_by
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            del self._detokenizers[request.request_id]
        logprobs = request.logprobs[-1:] if request.sampling_params.logprobs is not None else []
        return RequestOutput(request.request_id, [token], delta, request.num_prompt_tokens,
                             request.num_output_tokens, finished=request.is_finished,
                             finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                             new_logprobs=logprobs)
