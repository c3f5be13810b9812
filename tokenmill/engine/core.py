"""The engine core: the step loop. schedule -> run the model and sample -> update requests -> detokenize -> report.

It takes plain-data requests (``EngineRequest``) and returns plain-data outputs (``StepOutputs``), so it runs the same
in the caller's thread (``LLM``, tests) and in its own process (``tokenmill serve``, engine/process.py).
"""

from __future__ import annotations

import atexit
import logging
import time

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.distributed.group import TensorParallel
from tokenmill.engine.cuda_graphs import DecodeGraphs
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineInfo, EngineRequest, EngineStats, RequestOutput, StepOutputs
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.ranks import WorkerRanks, ranks_config
from tokenmill.engine.warmup import prepare_cpu
from tokenmill.engine.worker import LoadedModel, load_model_and_cache
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.models.config import ModelConfig
from tokenmill.models.loader import Checkpoint, open_checkpoint
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.runtime import keep_freed_memory_in_heap, resident_memory_bytes
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.speculative.mtp import MTPDrafter
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.structured.matchers import ZONE, GrammarMatchers

log = logging.getLogger(__name__)


def open_model(config: EngineConfig) -> tuple[Checkpoint, Tokenizer, ModelConfig]:
    checkpoint = open_checkpoint(config.model)
    tokenizer = Tokenizer.of_checkpoint(checkpoint, config.tokenizer_cache_dir)
    return checkpoint, tokenizer, ModelConfig.from_hf(checkpoint.hf_config, checkpoint.generation_config,
                                                      tokenizer.eos_token_id)


def make_runner(config: EngineConfig, loaded: LoadedModel, model_config: ModelConfig) -> ModelRunner:
    drafter = MTPDrafter(config.num_speculative_tokens) if config.speculative_method == "mtp" else None
    graphs = None
    # CUDA graphs: one GPU, the Triton kernels (the PyTorch references sync the host), not --enforce-eager.
    if loaded.device.type == "cuda" and loaded.kernel_backend == "triton" and not config.enforce_eager \
            and config.tensor_parallel_size == 1:
        graphs = DecodeGraphs(loaded.model, loaded.kv_cache, config.max_num_seqs, loaded.max_model_len)
        graphs.capture()
    return ModelRunner(loaded.model, loaded.kv_cache, loaded.device, config.max_num_seqs, loaded.max_model_len,
                       model_config.eos_token_ids, config.seed, drafter, graphs)


def build_rank_runner(config: EngineConfig, tp: TensorParallel) -> ModelRunner:
    """A worker rank's runner over its shard of the model (engine/ranks.py)."""
    torch.set_num_threads(config.num_threads or 1)
    checkpoint, _, model_config = open_model(config)
    return make_runner(config, load_model_and_cache(checkpoint, model_config, config, tp), model_config)


class EngineCore:
    def __init__(self, config: EngineConfig):
        if config.resolved_device() == "cpu":
            keep_freed_memory_in_heap()
        checkpoint, self.tokenizer, self.model_config = open_model(config)
        self.ranks = None  # worker ranks 1..N-1 under tensor parallelism
        if config.rank:
            raise ConfigError(f"rank {config.rank} of a multi-node launch runs no engine core: start it with "
                              f"`tokenmill serve`, which joins rank 0")
        if config.tensor_parallel_size > 1:
            config = ranks_config(config, self.model_config)
            self.ranks = WorkerRanks(config)
            atexit.register(self.close)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        try:
            loaded = load_model_and_cache(checkpoint, self.model_config, config,
                                          self.ranks.tp if self.ranks else TensorParallel())
        except BaseException:
            failed = self.ranks.failed_rank() if self.ranks else None  # a worker's own error: in its log
            if self.ranks is not None:
                self.ranks.close(graceful=False)
            if failed is not None:
                raise failed from None
            raise
        if loaded.device.type == "cpu" and self.ranks is None:  # tensor-parallel ranks run eagerly
            prepare_cpu(loaded.model, loaded.kv_cache, config)
        # Drafts from token ids (n-gram: here, after each step) or from the model itself (MTP: the runner's).
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max) if config.speculative_method == "ngram" else None
        self.runner = make_runner(config, loaded, self.model_config)
        drafter = self.runner.drafter
        kv = KVCacheManager(loaded.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   drafter.num_lookahead_tokens if drafter else 0)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        vocab_size = self.model_config.vocab_size
        eos = list(self.model_config.eos_token_ids)
        self.grammars = GrammarMatchers(GrammarCompiler(self.tokenizer.hf, vocab_size, eos), vocab_size,
                                        self.tokenizer, eos)
        self.num_aborted_total = 0
        self.num_decode_steps_total, self.decode_step_seconds_total = 0, 0.0
        self._rss, self._rss_time = 0, float("-inf")  # read at most once a second, not every step
        spec = loaded.kv_cache.spec
        self.info = EngineInfo(
            model_name=config.served_model_name or checkpoint.name, max_model_len=loaded.max_model_len,
            vocab_size=self.model_config.vocab_size, kv_capacity_tokens=kv.capacity_tokens,
            kv_bytes_per_token=spec.bytes_per_token, device=str(loaded.device), dtype=str(loaded.dtype),
            eos_token_ids=list(self.model_config.eos_token_ids))
        log.info("engine ready: model=%s device=%s dtype=%s kv=%s blocks=%d (%d tokens, %d bytes/token)",
                 self.info.model_name, loaded.device, loaded.dtype, spec.dtype, kv.pool.num_blocks,
                 kv.capacity_tokens, spec.bytes_per_token)

    # --- requests
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; GrammarError (a ValueError) when its grammar does not compile, and nothing is queued."""
        params = request.params
        if params.grammar is not None:
            self.grammars.add(request.request_id, params.grammar)
        self.scheduler.add_request(Request(
            request.request_id, list(request.prompt_token_ids), params, max_tokens=request.max_tokens,
            eos_token_ids=self.model_config.eos_token_ids, arrival_time=request.arrival_time,
            cache_salt=request.cache_salt))
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens,
            params.include_stop_str_in_output)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        self._detokenizers.pop(request_id, None)
        self.grammars.remove(request_id)
        if request is None:
            return None
        self.num_aborted_total += 1
        return RequestOutput(request_id, [], "", request.num_prompt_tokens, request.num_output_tokens,
                             finished=True, finish_reason="abort", first_scheduled_time=request.first_scheduled_time)

    def close(self) -> None:
        """Stop the worker ranks, if any (idempotent; also at interpreter exit)."""
        if self.ranks is not None:
            self.ranks.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        now = time.monotonic()
        if now - self._rss_time > 1.0:
            self._rss, self._rss_time = resident_memory_bytes(), now
        return EngineStats(s.num_running, s.num_waiting, s.kv_cache_usage, s.num_preemptions_total,
                           self.num_aborted_total, self._rss, self.num_decode_steps_total,
                           self.decode_step_seconds_total, s.prefix_cache_queries_total, s.prefix_cache_hits_total,
                           s.spec.num_draft_tokens_total, s.spec.num_accepted_tokens_total,
                           list(s.spec.drafted_by_position), list(s.spec.accepted_by_position))

    # --- the step
    def step(self) -> StepOutputs:
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self._grammar_bitmasks(out)
        if self.ranks is not None:
            self.ranks.broadcast_step(out)
        result = self.runner.execute(out)
        if out.is_empty:
            return StepOutputs([], self.stats())
        scheduled = [self.scheduler.requests[rid] for rid in result.sampled]
        before = [request.num_output_tokens for request in scheduled]
        self.scheduler.update(out, result.sampled)
        self._advance_grammars(scheduled, before)
        now = time.monotonic()
        outputs = []
        for request, num_before in zip(scheduled, before):
            kept = request.num_output_tokens - num_before  # fewer than sampled when a token stop came first
            logprobs = result.logprobs.get(request.request_id)
            outputs.append(self._report(request, request.output_token_ids[num_before:],
                                        logprobs[:kept] if logprobs else [], now))
        if self.proposer is not None or self.runner.drafter is not None:
            self._propose(result.drafts)
        if out.total_num_scheduled_tokens == len(out.num_scheduled_tokens):  # a pure decode step
            self.num_decode_steps_total += 1
            self.decode_step_seconds_total += time.perf_counter() - start
        return StepOutputs(outputs, self.stats())

    def _propose(self, model_drafts: dict[str, list[int]]) -> None:
        """Drafts for every running request whose next step is a decode: the n-gram proposer's from its own tokens,
        or the ones the model's drafter made this step (the scheduler cuts them to the step's budget and the
        request's max_tokens; a grammar cuts them to what it accepts)."""
        for request in self.scheduler.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                drafts = self.proposer.propose(request.all_token_ids) if self.proposer is not None \
                    else model_drafts.get(request.request_id, [])
                if drafts and request.request_id in self.grammars:
                    near_end = request.max_tokens - request.num_output_tokens <= ZONE  # steering, not drafting
                    drafts = [] if near_end else self.grammars.valid_drafts(request.request_id, drafts)
                request.spec_token_ids = drafts

    # --- structured outputs
    def _grammar_bitmasks(self, out: SchedulerOutput) -> None:
        """The allowed tokens of each constrained request that samples this step, at each position it samples; near
        its max_tokens, the one token that steers it to a complete output in time (GrammarMatchers.steer)."""
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            if request_id not in self.grammars:
                continue
            request, drafts = self.scheduler.requests[request_id], out.spec_token_ids.get(request_id, [])
            if request.num_computed_tokens + num_tokens == request.num_tokens + len(drafts):
                steered = None if drafts else self.grammars.steer(
                    request_id, request.max_tokens - request.num_output_tokens, request.output_token_ids)
                out.grammar_bitmasks[request_id] = steered if steered is not None else \
                    self.grammars.bitmask(request_id, drafts)

    def _advance_grammars(self, scheduled: list[Request], before: list[int]) -> None:
        """Feed each constrained request's kept tokens to its matcher; a complete output finishes the request (also
        when ignore_eos let the grammar's stop token through)."""
        for request, num_before in zip(scheduled, before):
            rid = request.request_id
            if rid in self.grammars:
                complete = self.grammars.accept(rid, request.output_token_ids[num_before:])
                if complete and not request.is_finished:
                    self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    def _report(self, request: Request, tokens: list[int], logprobs: list, now: float) -> RequestOutput:
        """The step's output of one request; a stop string found after token i drops the tokens after it."""
        if request.first_token_time is None:
            request.first_token_time = now
        detok = self._detokenizers[request.request_id]
        delta = ""
        for i, token in enumerate(tokens):
            delta += detok.update([token], finished=request.is_finished and i == len(tokens) - 1)
            if detok.stopped_by is not None:
                request.stop_reason = detok.stopped_by
                request.truncate_output(request.num_output_tokens - (len(tokens) - i - 1))
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)  # a no-op if a token stop came too
                request.status = RequestStatus.FINISHED_STOPPED
                tokens, logprobs = tokens[:i + 1], logprobs[:i + 1]
                break
        if request.is_finished:
            del self._detokenizers[request.request_id]
            self.grammars.remove(request.request_id)
        return RequestOutput(request.request_id, tokens, delta, request.num_prompt_tokens,
                             request.num_output_tokens, finished=request.is_finished,
                             num_cached_tokens=request.num_cached_tokens,
                             finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                             new_logprobs=logprobs, first_scheduled_time=request.first_scheduled_time,
                             token_time=now)
