"""The runner's persistent batch: one row per request the runner knows, per-row arrays updated by the scheduler's diffs.

A row holds the request's tokens (prompt + sampled so far), its computed count, its block-table row and its sampling
parameters; a step reads the scheduled rows with vectorized gathers, so it allocates no per-request Python structure
beyond the diff. Rows are reused through a free list; row order means nothing (the step's order is the scheduler's).

Invariants: ``token_ids[r, :num_tokens[r]]`` are row r's known tokens, followed during a step by its
``num_drafts[r]`` draft tokens (speculative decoding); ``block_table[r, g, :num_blocks[r]]`` its blocks in KV group
g (kvcache/groups.py; the rest, and a window group's blocks behind its window, point at the null block);
``output_counts[r]`` (when row r is penalized) counts its sampled tokens.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.sampling.metadata import SamplingMetadata
from tokenmill.sampling.params import POOLING_MODES
from tokenmill.sampling.sampler import step_seed
from tokenmill.scheduler.output import NewRequestData, RunningRequestData


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    sample_rows: np.ndarray  # batch rows that sample, in step order
    num_samples: np.ndarray  # per sampling row: 1 + its drafts (a token is sampled after each draft too)
    # Per sampled position P (row-major over sample_rows): its row, its draft offset, its index in the flat batch.
    position_rows: np.ndarray  # [P]
    position_offsets: np.ndarray  # [P]: 0 = after the known tokens, j = after j drafts
    logits_indices: torch.Tensor  # [P]
    token_rows: np.ndarray  # [T] each token's row
    token_positions: np.ndarray  # [T] each token's position (host copy of ``positions``)
    last_indices: np.ndarray  # per sampling row: the flat index of its last token


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, null_block: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], device: torch.device, num_kv_groups: int = 1):
        self.max_num_reqs, self.block_size, self.vocab_size = max_num_reqs, block_size, vocab_size
        self.null_block, self.device = null_block, torch.device(device)
        self.eos_token_ids = np.array(eos_token_ids, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._request_ids: list[str | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs))  # a heap: new requests take the lowest free row
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_drafts = np.zeros(max_num_reqs, dtype=np.int64)  # this step's drafts, after the known tokens
        self.block_table = np.full((max_num_reqs, num_kv_groups, -(-max_model_len // block_size)), null_block,
                                   dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Sampling parameters per row.
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.penalized = np.zeros(max_num_reqs, dtype=bool)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: the row asks for none
        self.pooling = np.zeros(max_num_reqs, dtype=np.int64)  # POOLING_MODES index; 0: none
        self.seed = np.zeros(max_num_reqs, dtype=np.int64)
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (token ids, values)
        self.min_tokens_bans: dict[int, np.ndarray] = {}  # row -> EOS ids + stop token ids
        self.output_counts: torch.Tensor | None = None  # [max_num_reqs, V] int32, made on the first penalized row
        self.prompt_mask: torch.Tensor | None = None  # [max_num_reqs, V] bool

    # --- diffs from the scheduler
    def add(self, new: NewRequestData) -> None:
        row = heapq.heappop(self._free_rows)
        self.row_of[new.request_id] = row
        self._request_ids[row] = new.request_id
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row], self.num_prompt_tokens[row] = n, new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        self.block_table[row] = self.null_block
        for g, table in enumerate(new.block_tables):
            self.block_table[row, g, :len(table)] = table
        self.num_blocks[row] = len(new.block_tables[0]) if new.block_tables else 0
        self._set_sampling(row, new)

    def update(self, running: RunningRequestData) -> None:
        row = self.row_of[running.request_id]
        end = running.num_blocks
        tables = self.block_table[row]
        tables[:, end:self.num_blocks[row]] = self.null_block  # released blocks, if any
        for g, (added, live_from) in enumerate(zip(running.new_block_ids, running.live_from)):
            tables[g, end - len(added):end] = added
            tables[g, :live_from] = self.null_block  # behind the group's window: back in the pool
        self.num_blocks[row] = end
        self.num_computed[row] = running.num_computed_tokens

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return  # never scheduled (aborted while waiting), or already dropped on preemption
        self._request_ids[row] = None
        self.bias.pop(row, None)
        self.min_tokens_bans.pop(row, None)
        heapq.heappush(self._free_rows, row)

    def request_id(self, row: int) -> str:
        return self._request_ids[row]

    def _set_sampling(self, row: int, new: NewRequestData) -> None:
        p = new.params
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = \
            p.temperature, p.top_k, p.top_p, p.min_p
        self.presence[row], self.frequency[row] = p.presence_penalty, p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.penalized[row] = p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.pooling[row] = POOLING_MODES.index(p.pooling)
        self.seeded[row], self.seed[row] = p.seed is not None, p.seed or 0
        if p.logit_bias:
            self.bias[row] = (np.array(list(p.logit_bias), dtype=np.int64),
                              np.array(list(p.logit_bias.values()), dtype=np.float32))
        if p.min_tokens:
            # vLLM and transformers ban every EOS id and stop token id until min_tokens, whatever ignore_eos says.
            self.min_tokens_bans[row] = np.unique(np.concatenate([self.eos_token_ids,
                                                                  np.array(p.stop_token_ids, dtype=np.int64)]))
        if self.penalized[row]:
            self._fill_penalty_state(row, new)

    def _fill_penalty_state(self, row: int, new: NewRequestData) -> None:
        if self.output_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        prompt = torch.tensor(new.token_ids[:new.num_prompt_tokens], dtype=torch.long, device=self.device)
        outputs = torch.tensor(new.token_ids[new.num_prompt_tokens:], dtype=torch.long, device=self.device)
        self.prompt_mask[row].zero_().index_fill_(0, prompt, True)
        self.output_counts[row].zero_().index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))

    # --- one step
    def set_drafts(self, spec_token_ids: dict[str, list[int]]) -> None:
        """This step's draft tokens go right after each row's known tokens (every other row has none)."""
        self.num_drafts[:] = 0
        for request_id, drafts in spec_token_ids.items():
            row = self.row_of[request_id]
            start = self.num_tokens[row]
            self.token_ids[row, start:start + len(drafts)] = drafts
            self.num_drafts[row] = len(drafts)

    def drafts(self, row: int) -> list[int]:
        start = self.num_tokens[row]
        return self.token_ids[row, start:start + self.num_drafts[row]].tolist()

    def prepare(self, num_scheduled: dict[str, int]) -> StepInputs:
        """The flattened batch of the scheduled chunks, in the scheduler's order."""
        rows = np.fromiter((self.row_of[rid] for rid in num_scheduled), dtype=np.int64, count=len(num_scheduled))
        counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=len(num_scheduled))
        attention, token_rows, positions = self.attention(rows, counts, self.num_computed[rows])
        cu = np.cumsum(counts)
        samples = self.num_computed[rows] + counts == self.num_tokens[rows] + self.num_drafts[rows]
        sample_rows = rows[samples]
        num_samples = self.num_drafts[sample_rows] + 1
        offsets = np.arange(num_samples.sum()) - np.repeat(np.cumsum(num_samples) - num_samples, num_samples)
        last = cu[samples] - 1  # each sampling row's last token; its drafts' positions come before
        return StepInputs(
            input_ids=self._to_device(self.token_ids[token_rows, positions].astype(np.int64)),
            positions=self._to_device(positions), attention=attention, sample_rows=sample_rows,
            num_samples=num_samples, position_rows=np.repeat(sample_rows, num_samples), position_offsets=offsets,
            logits_indices=self._to_device(np.repeat(last - num_samples + 1, num_samples) + offsets),
            token_rows=token_rows, token_positions=positions, last_indices=last)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A fresh host array on the batch's device; on CUDA through pinned memory (torch's caching host allocator),
        copied without blocking the host: the step's inputs travel while it prepares the rest."""
        tensor = torch.from_numpy(array)
        return tensor.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else tensor

    def attention(self, rows: np.ndarray, counts: np.ndarray, starts: np.ndarray
                  ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
        """The layout of ``counts[i]`` new tokens of row ``rows[i]`` from position ``starts[i]`` on, flattened in that
        order (their slots must be allocated); also each token's row and position."""
        cu = np.cumsum(counts)
        ends = starts + counts
        token_rows = np.repeat(rows, counts)
        positions = np.arange(cu[-1]) - np.repeat(cu - counts, counts) + np.repeat(starts, counts)
        # [G, T]: each group's slot of each token.
        slot_mapping = (self.block_table[token_rows, :, positions // self.block_size] * self.block_size
                        + (positions % self.block_size)[:, None]).T
        width = int(self.num_blocks[rows].max())
        tables = self.block_table[rows, :, :width]  # [B, G, width]
        shared = dict(query_start_loc=[0, *cu.tolist()], seq_lens=ends.tolist(), block_size=self.block_size,
                      decode_indices=np.flatnonzero(counts == 1).tolist(),
                      prefill_indices=np.flatnonzero(counts > 1).tolist())
        groups = [AttentionMetadata(slot_mapping=self._to_device(np.ascontiguousarray(slot_mapping[g])),
                                    block_tables=self._to_device(np.ascontiguousarray(tables[:, g])), **shared)
                  for g in range(len(slot_mapping))]
        attention = groups[0] if len(groups) == 1 else dataclasses.replace(groups[0], groups=tuple(groups))
        return attention, token_rows, positions

    def num_slots(self, rows: np.ndarray) -> np.ndarray:
        """Positions each row's blocks can hold (the scheduler may have allocated past its scheduled tokens)."""
        return np.minimum(self.num_blocks[rows] * self.block_size, self.token_ids.shape[1])

    def sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None,
                          grammar_bitmasks: dict[str, np.ndarray] | None = None) -> SamplingMetadata:
        """The sampling parameters of the step's sampled positions as tensors: position i samples for row
        ``rows[i]`` after ``offsets[i]`` of its drafts (default 0), as if those drafts were already its outputs:
        its output index, min_tokens bans and penalty counts count them, so a verified draft is judged exactly as
        the token sampled without speculation would be. ``grammar_bitmasks``: request id -> the allowed tokens at
        each of its positions (offset j = row j of its bitmask)."""
        offsets = np.zeros(len(rows), dtype=np.int64) if offsets is None else offsets
        num_outputs = self.num_tokens[rows] - self.num_prompt_tokens[rows] + offsets
        t = self._to_device
        temperature = self.temperature[rows]
        random = np.flatnonzero(temperature > 0)
        m = SamplingMetadata(temperature=t(temperature), random_rows=t(random) if len(random) else None)
        if len(random):
            if (self.top_k[rows] > 0).any():
                m.top_k = t(self.top_k[rows])
            if (self.top_p[rows] < 1).any():
                m.top_p = t(self.top_p[rows])
            if (self.min_p[rows] > 0).any():
                m.min_p = t(self.min_p[rows])
            m.seeded = tuple((i, step_seed(int(self.seed[rows[r]]), int(num_outputs[r])))
                             for i, r in enumerate(random) if self.seeded[rows[r]])
        if self.penalized[rows].any():
            index = t(rows)
            m.presence_penalty, m.frequency_penalty = t(self.presence[rows]), t(self.frequency[rows])
            m.repetition_penalty = t(self.repetition[rows])
            m.output_counts, m.prompt_mask = self.output_counts[index], self.prompt_mask[index]
            self._count_drafts(rows, offsets, m.output_counts)
        self._sparse_terms(rows, num_outputs, m)
        if grammar_bitmasks:
            self._grammar_masks(rows, offsets, grammar_bitmasks, m)
        if (self.num_logprobs[rows] >= 0).any():
            m.num_logprobs = self.num_logprobs[rows].tolist()
            m.max_logprobs = max(m.num_logprobs)
        return m

    def _grammar_masks(self, rows: np.ndarray, offsets: np.ndarray, bitmasks: dict[str, np.ndarray],
                       m: SamplingMetadata) -> None:
        picked = [(i, bitmasks[rid][j]) for i, (r, j) in enumerate(zip(rows.tolist(), offsets.tolist()))
                  if (rid := self._request_ids[r]) in bitmasks]
        if picked:
            m.grammar_rows = torch.tensor([i for i, _ in picked], dtype=torch.long, device=self.device)
            m.grammar_bitmask = torch.from_numpy(np.stack([mask for _, mask in picked])).to(self.device)

    def _count_drafts(self, rows: np.ndarray, offsets: np.ndarray, counts: torch.Tensor) -> None:
        """Add to each position's output counts [P, V] the drafts before it."""
        pairs = [(i, t) for i, (r, j) in enumerate(zip(rows.tolist(), offsets.tolist())) if j and self.penalized[r]
                 for t in self.token_ids[r, self.num_tokens[r]:self.num_tokens[r] + j].tolist()]
        if pairs:
            index = torch.tensor(pairs, dtype=torch.long, device=self.device)
            counts.index_put_((index[:, 0], index[:, 1]), torch.ones(len(pairs), dtype=counts.dtype,
                                                                     device=self.device), accumulate=True)

    def _sparse_terms(self, rows: np.ndarray, num_outputs: np.ndarray, m: SamplingMetadata) -> None:
        """logit_bias and min_tokens bans of ``rows`` as coordinate lists (only rows that have them)."""
        bias = [(i, *self.bias[r]) for i, r in enumerate(rows.tolist()) if r in self.bias]
        if bias:
            m.bias_rows = torch.tensor(np.concatenate([np.full(len(ids), i) for i, ids, _ in bias]), device=self.device)
            m.bias_ids = torch.from_numpy(np.concatenate([ids for _, ids, _ in bias])).to(self.device)
            m.bias_values = torch.from_numpy(np.concatenate([v for _, _, v in bias])).to(self.device)
        short = num_outputs < self.min_tokens[rows]
        bans = [(i, self.min_tokens_bans[r]) for i, r in enumerate(rows.tolist()) if short[i] and r in
                self.min_tokens_bans]
        if bans:
            m.ban_rows = torch.tensor(np.concatenate([np.full(len(ids), i) for i, ids in bans]), device=self.device)
            m.ban_ids = torch.from_numpy(np.concatenate([ids for _, ids in bans])).to(self.device)

    def append_sampled(self, rows: np.ndarray, tokens: list[list[int]]) -> None:
        """Row rows[i]'s sampled tokens (accepted drafts, then one of its own) become its next known tokens (and
        count toward its penalties)."""
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        flat_rows = np.repeat(rows, counts)
        positions = np.repeat(self.num_tokens[rows], counts) + np.arange(counts.sum()) \
            - np.repeat(np.cumsum(counts) - counts, counts)
        values = np.fromiter((t for ts in tokens for t in ts), dtype=np.int64, count=int(counts.sum()))
        self.token_ids[flat_rows, positions] = values
        self.num_tokens[rows] += counts
        self._count_outputs(flat_rows, values, 1)

    def take_back(self, rows: np.ndarray, tokens: list[list[int]]) -> None:
        """Undo ``append_sampled(rows, tokens)`` (a step that failed after it is computed again): the rows are as
        before it (the tokens stay past ``num_tokens``, where nothing reads them)."""
        counts = np.array([len(t) for t in tokens], dtype=np.int64)
        self.num_tokens[rows] -= counts
        self._count_outputs(np.repeat(rows, counts), np.fromiter((t for ts in tokens for t in ts), dtype=np.int64,
                                                                 count=int(counts.sum())), -1)

    def _count_outputs(self, flat_rows: np.ndarray, values: np.ndarray, delta: int) -> None:
        penalized = self.penalized[flat_rows]
        if penalized.any():
            index = torch.from_numpy(flat_rows[penalized]).to(self.device)
            self.output_counts.index_put_((index, torch.from_numpy(values[penalized]).to(self.device)),
                                          torch.full((len(index),), delta, dtype=torch.int32, device=self.device),
                                          accumulate=True)
