"""The engine core: the step loop.

One step: schedule (passing over requests whose grammar is still being prepared) -> the grammars' masks for the
scheduled requests -> broadcast both to the worker ranks -> execute (the model, sampling, the proposer's drafts) ->
the reporters read the kept tokens (detokenizers: text and stop strings; grammars: completion and the drafts they
accept) -> the scheduler applies everything in ``update_from_output`` -> emit one output per request that changed.

A failure stays in its request: anything that fails while adding one request, setting its row, computing it (found by
bisection: engine/isolation.py), reading its output or building it ends that request with finish_reason "error" and
the engine steps on; only a fault no request explains raises out of ``step``.

It takes plain-data requests (``EngineRequest``) and returns plain-data outputs (``StepOutputs``), so it runs the same
in the caller's thread (``LLM``, tests) and in its own process (``tokenmill serve``, engine/process.py).
"""

from __future__ import annotations

import atexit
import logging
import time

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.distributed.group import TensorParallel
from tokenmill.engine.build import build_runner, open_model
from tokenmill.engine.checks import OutputChecks
from tokenmill.engine.grammar import GrammarService, grace_for
from tokenmill.engine.isolation import StepIsolation, error_code, error_output, failure_message, log_failure
from tokenmill.engine.messages import EngineInfo, EngineRequest, EngineStats, RequestOutput, StepOutputs
from tokenmill.engine.ranks import WorkerRanks
from tokenmill.engine.settle import settle
from tokenmill.engine.start import MEASUREMENTS_AVOIDED, start_stage
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.kvcache.prefix import scoped_salt
from tokenmill.models.pooling import read_pooling
from tokenmill.runtime import resident_memory_bytes
from tokenmill.scheduler.output import RunnerOutput
from tokenmill.scheduler.request import Request
from tokenmill.scheduler.scheduler import DuplicateRequestError, RequestUpdate, Scheduler
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.structured.matchers import GrammarMatchers

log = logging.getLogger(__name__)

# When every unfinished request waits for its grammar, the loop sleeps on the grammar jobs this long at most, so that
# new requests and aborts are still taken up promptly.
IDLE_WAIT_S = 0.01
# Weight of the newest step in the running mean of the model's time per step (the grammars' grace is a fraction of it).
STEP_TIME_WEIGHT = 0.1


class EngineCore:
    def __init__(self, config: EngineConfig):
        if config.rank:
            raise ConfigError(f"rank {config.rank} of a multi-node launch runs no engine core: start it with "
                              f"`tokenmill serve`, which joins rank 0")
        with start_stage(f"reading the model at {config.model}"):
            checkpoint, self.tokenizer, self.model_config = open_model(config)
        with start_stage("the start-up measurements", MEASUREMENTS_AVOIDED):
            self.config, self.settled = config, settle(config, self.model_config)
        self.ranks = None  # worker ranks 1..N-1 under tensor parallelism
        if self.settled.tensor_parallel_size > 1:
            with start_stage("starting the tensor-parallel ranks", "--tensor-parallel-size 1 runs one rank"):
                self.ranks = WorkerRanks(config, self.settled)
            atexit.register(self.close)
        try:
            self.runner, loaded = build_runner(config, self.settled, checkpoint, self.model_config,
                                               self.ranks.tp if self.ranks else TensorParallel())
        except BaseException:
            failed = self.ranks.failed_rank() if self.ranks else None  # a worker's own error: in its log
            if self.ranks is not None:
                self.ranks.close(graceful=False)
            if failed is not None:
                raise failed from None
            raise
        proposer = self.runner.proposer
        spec = loaded.kv_cache.spec
        kv = KVCacheManager(loaded.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching, spec.groups)
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   proposer.num_lookahead_tokens if proposer else 0)
        vocab_size, eos = self.model_config.vocab_size, list(self.model_config.eos_token_ids)
        compiler = GrammarCompiler(self.tokenizer.hf, vocab_size, eos, cache_max_bytes=config.grammar_max_bytes)
        matchers = GrammarMatchers(compiler, vocab_size, self.tokenizer, eos)
        self.grammars = GrammarService(matchers, config.grammar_timeout, config.grammar_max_bytes)
        self.checks = OutputChecks(self.tokenizer, self.grammars)
        self.isolation = StepIsolation(self.runner)
        self._failed_adds: list[RequestOutput] = []  # failed as they were added: answered by the next step
        self.num_aborted_total = 0
        self.num_decode_steps_total, self.decode_step_seconds_total = 0, 0.0
        self._step_seconds = 0.0  # running mean of a step's execution
        self._engine_seconds: dict[str, float] = {}  # request id -> its share of the steps' time, until it finishes
        self._rss, self._rss_time = 0, float("-inf")  # read at most once a second, not every step
        self.info = EngineInfo(
            model_name=config.served_model_name or checkpoint.name, max_model_len=loaded.max_model_len,
            vocab_size=vocab_size, kv_capacity_tokens=kv.capacity_tokens, kv_bytes_per_token=spec.bytes_per_token,
            device=str(loaded.device), dtype=self.settled.dtype, eos_token_ids=eos,
            weight_bytes=loaded.model.weight_bytes(), kv_groups=spec.groups, kv_block_size=spec.block_size,
            hidden_size=loaded.model.config.hidden_size, pooling=read_pooling(checkpoint.path),
            execution="compiled" if loaded.model.compiled_decoder is not None else
            "cuda_graphs" if self.runner.graphs is not None else "eager")
        groups = spec.groups
        log.info("engine ready: model=%s device=%s dtype=%s execution=%s kv=%s blocks=%d (%d tokens, %d bytes/token)%s",
                 self.info.model_name, loaded.device, self.settled.dtype, self.info.execution, spec.dtype,
                 kv.pool.num_blocks,
                 kv.capacity_tokens, spec.bytes_per_token,
                 "" if groups.num_groups == 1 else f"; {groups.num_groups} KV groups of {groups.group_size} layers, "
                 f"windows {sorted(set(groups.windows))}")

    # --- requests
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; its grammar, if any, compiles off the step loop. A duplicate id raises
        DuplicateRequestError (a ValueError) and changes nothing; any other failure ends this request alone: the next
        step answers it with finish_reason "error"."""
        request_id, queued = request.request_id, False
        try:
            self.scheduler.add_request(Request(
                request_id, list(request.prompt_token_ids), request.params, max_tokens=request.max_tokens,
                eos_token_ids=self.model_config.eos_token_ids, arrival_time=request.arrival_time,
                cache_salt=scoped_salt(request.cache_scope, request.cache_salt),
                priority=request.priority))
            queued = True
            self.checks.add(request)
        except DuplicateRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request's own
            log_failure(request_id, "being added", exc)
            if queued:  # else the id may be another request's
                self.scheduler.fail(request_id, failure_message(request_id))
                self.checks.remove(request_id)
            self._failed_adds.append(error_output(request_id, len(request.prompt_token_ids or ())))

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        self.checks.remove(request_id)
        self._engine_seconds.pop(request_id, None)
        if request is None:
            return None
        self.num_aborted_total += 1
        return RequestOutput(request_id, [], "", request.num_prompt_tokens, request.num_output_tokens,
                             finished=True, finish_reason="abort", first_scheduled_time=request.first_scheduled_time)

    def close(self) -> None:
        """Stop the worker ranks, if any, and the grammar threads (idempotent; also at interpreter exit)."""
        if self.ranks is not None:
            self.ranks.close()
        if hasattr(self, "grammars"):
            self.grammars.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._failed_adds)

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
        grace = grace_for(self._step_seconds)
        self.grammars.wait(grace)  # grammars that compile quickly join this very step
        out = self.scheduler.schedule(self.grammars.busy)
        grammar = self.grammars.masks(out)
        if self.ranks is not None:
            self.ranks.broadcast_step(out, grammar)
        executed = time.perf_counter()
        # Under tensor parallelism the ranks run the same step in lockstep: it is never retried in parts.
        result, failed = (self.runner.execute(out, grammar), []) if self.ranks else self.isolation.execute(out, grammar)
        if not out.is_empty:
            seconds = time.perf_counter() - executed
            self._step_seconds += STEP_TIME_WEIGHT * (seconds - self._step_seconds)
        reports = self.checks.report(self.scheduler.kept_tokens(result), result.drafts, grace)
        for request_id in failed:  # pinned on a request by engine/isolation.py
            reports.errors[request_id] = failure_message(request_id)
        now = time.monotonic()
        updates = self.scheduler.update_from_output(out, result, reports, now)
        outputs, self._failed_adds = self._failed_adds, []
        outputs += [self._output_or_error(update, result, reports.texts.get(update.request.request_id, ""), now)
                    for update in updates]
        if out.is_empty and not updates and self.grammars.pending:
            self.grammars.wait_any(IDLE_WAIT_S)  # every request waits for its grammar: nothing to spin for
        if not out.is_empty and out.total_num_scheduled_tokens == len(out.num_scheduled_tokens):  # pure decode
            self.num_decode_steps_total += 1
            self.decode_step_seconds_total += time.perf_counter() - start
        self._share_step_time(out.num_scheduled_tokens, out.total_num_scheduled_tokens, time.perf_counter() - start)
        for output in outputs:
            output.engine_seconds = (self._engine_seconds.pop if output.finished else self._engine_seconds.get)(
                output.request_id, 0.0)
        return StepOutputs(outputs, self.stats())

    def _share_step_time(self, num_tokens: dict[str, int], total: int, seconds: float) -> None:
        """Each request's share of the step's wall time, by the tokens computed for it."""
        for request_id, n in num_tokens.items():
            self._engine_seconds[request_id] = self._engine_seconds.get(request_id, 0.0) + seconds * n / total

    def _output_or_error(self, update: RequestUpdate, result: RunnerOutput, text: str, now: float) -> RequestOutput:
        try:
            return self._output(update, result, text, now)
        except Exception as exc:  # noqa: BLE001 - the request's own: it ends here
            request = update.request
            log_failure(request.request_id, "building its output", exc)
            self.scheduler.fail(request.request_id, failure_message(request.request_id))
            self.checks.remove(request.request_id)
            return error_output(request.request_id, request.num_prompt_tokens, request.num_output_tokens,
                                request.first_scheduled_time)

    def _output(self, update: RequestUpdate, result: RunnerOutput, text: str, now: float) -> RequestOutput:
        request, tokens = update.request, update.new_token_ids
        first = bool(tokens) and request.num_output_tokens == len(tokens)  # the request's first output with tokens
        if request.is_finished:
            self.checks.remove(request.request_id)
        return RequestOutput(request.request_id, tokens, text, request.num_prompt_tokens,
                             request.num_output_tokens, finished=request.is_finished,
                             num_cached_tokens=request.num_cached_tokens,
                             finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                             new_logprobs=result.logprobs.get(request.request_id, [])[:len(tokens)],
                             prompt_logprobs=request.prompt_logprobs if first else None,
                             embedding=request.embedding if first else None,
                             first_scheduled_time=request.first_scheduled_time, token_time=now, error=request.error,
                             error_code=error_code(request.request_id, request.error))
