"""The batched sampler: one vectorized pass over the step's logits [S, V], whatever mix of parameters the rows have.

Order (each stage skipped when no row uses it): logprobs of the raw logits -> repetition, frequency and presence
penalties -> logit_bias -> min_tokens bans -> grammar masks (structured outputs) -> greedy rows take the argmax; the others divide by their temperature,
filter top-k, then min-p, then top-p, and draw with the exponential race ``argmax(probs / E), E ~ Exp(1)``, which
samples exactly from ``probs``.

Randomness: unseeded rows share the sampler's generator (one [rows, V] draw). A seeded row draws its noise on the
CPU from a generator seeded with (its seed, its output index): its tokens depend on nothing else -- not the batch,
not the device, not a preemption in between. ``sample`` returns tensors; ``to_host`` makes the step's one
device-to-host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels.argmax import argmax_rows
from tokenmill.sampling.metadata import SamplingMetadata

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, output_index: int) -> int:
    """A 63-bit seed for one (request seed, output index) pair: splitmix64 of the pair, so nearby pairs differ."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] float32: the sampled tokens' logprobs (raw logits)
    top_ids: torch.Tensor | None = None  # [S, max_logprobs]
    top_logprobs: torch.Tensor | None = None  # [S, max_logprobs]


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata) -> None:
    """repetition_penalty (HF/CTRL: over prompt and output tokens) then OpenAI presence/frequency (output only)."""
    counts = m.output_counts
    seen = counts > 0
    rep = m.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen | m.prompt_mask, penalized, logits))
    logits -= m.frequency_penalty[:, None] * counts + m.presence_penalty[:, None] * seen


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [S, V]: rows[i] keeps only the tokens whose bit is set in bitmask[i] ([G, ceil(V/32)] int32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]  # [G, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def filter_top_k_top_p_min_p(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """[R, V] temperature-scaled logits -> the same with filtered-out entries at -inf (each row keeps its best)."""
    if m.top_k is not None:
        vocab = logits.shape[-1]
        k = torch.where(m.top_k > 0, m.top_k, vocab).clamp(max=vocab)  # [R]
        top = logits.topk(int(k.max()), dim=-1).values
        kth = top.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if m.min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < m.min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    if m.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = ((probs.cumsum(-1) - probs) >= m.top_p[:, None]) & (m.top_p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", c_kernels: bool = False):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.c_kernels = c_kernels  # the resolved kernel backend is the C kernels: greedy rows' argmax in C

    def sample(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        """logits [S, V] float32 (modified in place) -> SamplerOutput."""
        raw_logprobs = logits.log_softmax(-1) if m.max_logprobs is not None else None
        if m.output_counts is not None:
            apply_penalties(logits, m)
        if m.bias_rows is not None:
            logits.index_put_((m.bias_rows, m.bias_ids), m.bias_values, accumulate=True)
        if m.ban_rows is not None:
            logits[m.ban_rows, m.ban_ids] = float("-inf")
        if m.grammar_rows is not None:
            apply_grammar_bitmask(logits, m.grammar_rows, m.grammar_bitmask)
        tokens = argmax_rows(logits, self.c_kernels)
        if m.random_rows is not None:
            tokens[m.random_rows] = self._draw(logits[m.random_rows], m)
        out = SamplerOutput(tokens)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, tokens[:, None])[:, 0]
            if m.max_logprobs:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(m.max_logprobs, dim=-1)
        return out

    def _draw(self, logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        """Temperature, filters and the exponential race for the random rows (logits [R, V])."""
        sub = _rows_of(m, m.random_rows)
        logits = filter_top_k_top_p_min_p(logits / sub.temperature[:, None], sub)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for index, seed in m.seeded:
            cpu = torch.Generator().manual_seed(seed)
            noise[index] = torch.empty(probs.shape[-1]).exponential_(generator=cpu).to(probs.device)
        return (probs / noise).argmax(-1)


def _rows_of(m: SamplingMetadata, rows: torch.Tensor) -> SamplingMetadata:
    """The filter parameters of a subset of rows."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]
    return SamplingMetadata(temperature=m.temperature[rows], top_k=pick(m.top_k), top_p=pick(m.top_p),
                            min_p=pick(m.min_p))


def to_host(out: SamplerOutput, num_logprobs: list[int] | None
            ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
    """The step's single device-to-host copy: token ids and, for rows that asked, (logprob, top candidates)."""
    parts = [out.token_ids.double()[:, None]]
    if out.logprobs is not None:
        parts.append(out.logprobs.double()[:, None])
        if out.top_ids is not None:
            parts += [out.top_ids.double(), out.top_logprobs.double()]
    rows = torch.cat(parts, dim=1).cpu().tolist()
    tokens = [int(r[0]) for r in rows]
    if out.logprobs is None or num_logprobs is None:
        return tokens, [None] * len(tokens)
    k = out.top_ids.shape[1] if out.top_ids is not None else 0
    entries = []
    for r, n in zip(rows, num_logprobs):
        if n < 0:
            entries.append(None)
            continue
        top = [(int(t), v) for t, v in zip(r[2:2 + n], r[2 + k:2 + k + n])]
        entries.append((r[1], top))
    return tokens, entries
