"""The model runner: SchedulerOutput (a diff) -> persistent batch -> one flattened forward pass -> one batched
sampling pass -> the sampled tokens, copied to the host once.

Speculative decoding: a request with k drafts computes its last token and the drafts in one pass, and samples at
each of those k + 1 positions as if the drafts before it were its outputs. Its drafts are accepted while each equals
the token sampled before it; then the first token sampled after the accepted drafts ends the step's tokens. For
drafts proposed without a distribution (n-gram), this is the standard rejection rule: draft x is accepted with
probability p(x), and a rejection leaves a token drawn from p without x, renormalized. So outputs keep the target
distribution, and greedy or seeded requests get exactly the tokens they get without speculation.

Drafts for the next step come from the runner's proposer (speculative/proposer.py: n-gram or MTP), after sampling,
and go back in the output with the sampled tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.engine.cuda_graphs import DecodeGraphs
from tokenmill.engine.input_batch import InputBatch, StepInputs
from tokenmill.engine.pooling import pooled_states
from tokenmill.engine.prompt_logprobs import prompt_logprobs
from tokenmill.kvcache.cache import KVCache
from tokenmill.sampling.sampler import Sampler, to_host
from tokenmill.scheduler.output import GrammarOutput, RunnerOutput, SchedulerOutput
from tokenmill.speculative.proposer import DraftContext, Proposer


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], seed: int = 0, proposer: Proposer | None = None,
                 graphs: DecodeGraphs | None = None, c_kernels: bool = False):
        self.model = model
        self.proposer = proposer  # drafts for the next step (speculative/), or None
        self.graphs = graphs  # pure decode steps replay CUDA graphs (engine/cuda_graphs.py)
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.batch = InputBatch(max_num_seqs, max_model_len, kv_cache.spec.block_size, kv_cache.null_block,
                                model.config.vocab_size, eos_token_ids, self.device, kv_cache.spec.groups.num_groups)
        self.sampler = Sampler(seed, self.device, c_kernels)  # c_kernels: the resolved backend is kernels/cpu/'s

    @torch.inference_mode()
    def update_batch(self, out: SchedulerOutput) -> dict[str, Exception]:
        """Apply the scheduler's diff. A request whose row cannot be set (its sampling parameters overflow the
        batch's arrays, say) loses its row and is returned with its exception; every other row is as the diff says."""
        for request_id in out.finished_ids + out.preempted_ids:
            self.batch.remove(request_id)
        failed: dict[str, Exception] = {}
        for new in out.new_requests:
            try:
                self.batch.add(new)
            except Exception as exc:  # noqa: BLE001 - the request's own: engine/isolation.py ends it
                failed[new.request_id] = exc
        for running in out.running:
            try:
                self.batch.update(running)
            except Exception as exc:  # noqa: BLE001 - likewise
                failed[running.request_id] = exc
        for request_id in failed:
            self.batch.remove(request_id)
        return failed

    def execute(self, out: SchedulerOutput, grammar: GrammarOutput | None = None) -> RunnerOutput:
        """One step as a whole: any failure raises (worker ranks, and rank 0 under tensor parallelism, where every
        rank must run the same collectives; engine/isolation.py runs the two halves itself otherwise)."""
        failed = self.update_batch(out)
        if failed:
            raise next(iter(failed.values()))
        return self.compute(out.num_scheduled_tokens, out.spec_token_ids, grammar.bitmasks if grammar else {})

    @torch.inference_mode()
    def compute(self, num_scheduled: dict[str, int], spec_token_ids: dict[str, list[int]],
                bitmasks: dict) -> RunnerOutput:
        """The forward, sampling and drafting of ``num_scheduled`` (request id -> tokens, in step order: the step's
        requests or any subset of them, with their drafts and grammar bitmasks).

        Invariant: when it raises, every row of the batch is as before the call (drafts and sampled tokens past
        ``num_tokens`` are scratch; the KV slots written are the same positions' again, so a rerun writes the same
        values): a failed step can be computed again for a subset of its requests."""
        if not num_scheduled:
            return RunnerOutput()
        self.batch.set_drafts(spec_token_ids)
        inputs = self.batch.prepare(num_scheduled)
        hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attention) if self.graphs else None
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attention, self.kv_cache)
        rows = inputs.sample_rows
        result, accepted = self._sample(inputs, hidden, bitmasks) if len(rows) else (RunnerOutput(), [])
        if accepted:
            self.batch.append_sampled(rows, accepted)
        try:
            result.prompt_logprobs = prompt_logprobs(self.model, self.batch, inputs, hidden)
            result.pooled = pooled_states(self.batch, inputs, hidden)
            if self.proposer is not None:  # also when nothing sampled: a drafter's cache must see every position
                drafts = self.proposer.draft(self._draft_context(inputs, hidden, [len(k) for k in accepted]))
                result.drafts = dict(zip(result.sampled, drafts))
        except BaseException:
            if accepted:
                self.batch.take_back(rows, accepted)
            raise
        return result

    def _draft_context(self, inputs: StepInputs, hidden: torch.Tensor, kept: list[int]) -> DraftContext:
        rows, batch = inputs.sample_rows, self.batch

        def decode_layout(indices: np.ndarray, positions: np.ndarray):
            return batch.attention(rows[indices], np.ones(len(indices), dtype=np.int64), positions)[0]
        return DraftContext(
            rows=rows, num_kept=np.asarray(kept, dtype=np.int64), token_ids=batch.token_ids,
            num_tokens=batch.num_tokens[rows], positions=inputs.positions, token_rows=inputs.token_rows,
            token_positions=inputs.token_positions, attention=inputs.attention, hidden=hidden,
            last_indices=inputs.last_indices, num_samples=inputs.num_samples, num_slots=batch.num_slots(rows),
            decode_layout=decode_layout)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, bitmasks: dict
                ) -> tuple[RunnerOutput, list[list[int]]]:
        """Sample at every sampled position and accept drafts; also returns each sampling row's kept tokens (the
        caller appends them to the rows)."""
        rows = inputs.sample_rows
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        meta = self.batch.sampling_metadata(inputs.position_rows, inputs.position_offsets, bitmasks)
        tokens, logprobs = to_host(self.sampler.sample(logits, meta), meta.num_logprobs)
        result, accepted, start = RunnerOutput(), [], 0
        for row, n in zip(rows.tolist(), inputs.num_samples.tolist()):  # n = 1 + the row's drafts
            kept = accept(self.batch.drafts(row), tokens[start:start + n])
            accepted.append(kept)
            request_id = self.batch.request_id(row)
            result.sampled[request_id] = kept
            if logprobs[start] is not None:
                result.logprobs[request_id] = logprobs[start:start + len(kept)]
            start += n
        return result, accepted


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The step's tokens of one request: ``sampled[j]`` was sampled after drafts[:j]; drafts are kept while each
    equals the token sampled in its place, then the first token sampled after them ends the list."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return sampled[:j + 1]
    return sampled[:len(drafts) + 1]
