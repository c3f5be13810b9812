"""The model runner: SchedulerOutput (a diff) -> persistent batch -> one flattened forward pass -> one batched
sampling pass -> the sampled tokens, copied to the host once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.input_batch import InputBatch
from tokenmill.engine.messages import TokenLogprobs
from tokenmill.kvcache.cache import KVCache
from tokenmill.sampling.sampler import Sampler, to_host
from tokenmill.scheduler.output import SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> token, for the requests that sampled
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # for those that asked


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...], seed: int = 0):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.batch = InputBatch(max_num_seqs, max_model_len, kv_cache.spec.block_size, kv_cache.null_block,
                                model.config.vocab_size, eos_token_ids, self.device)
        self.sampler = Sampler(seed, self.device)

    def update_batch(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_ids + out.preempted_ids:
            self.batch.remove(request_id)
        for new in out.new_requests:
            self.batch.add(new)
        for running in out.running:
            self.batch.update(running)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.update_batch(out)
        if out.is_empty:
            return RunnerOutput()
        inputs = self.batch.prepare(out.num_scheduled_tokens)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attention, self.kv_cache)
        rows = inputs.sample_rows
        if not len(rows):
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        meta = self.batch.sampling_metadata(rows)
        tokens, logprobs = to_host(self.sampler.sample(logits, meta), meta.num_logprobs)
        self.batch.append_sampled(rows, tokens)
        request_ids = [self.batch.request_id(r) for r in rows.tolist()]
        return RunnerOutput(dict(zip(request_ids, tokens)),
                            {rid: lp for rid, lp in zip(request_ids, logprobs) if lp is not None})
