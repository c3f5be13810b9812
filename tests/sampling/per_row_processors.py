"""Logit processors applied before sampling, each in place on one row ``logits[V]`` (float32)."""

from __future__ import annotations

import torch

from tokenmill.sampling.params import SamplingParams


def apply_penalties(row: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
    """repetition_penalty (HF/CTRL: over prompt and output tokens) then OpenAI presence/frequency (output only)."""
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids = torch.tensor(output_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=row.device)
    row[ids] += torch.tensor(list(bias.values()), dtype=row.dtype, device=row.device)


def ban_tokens(row: torch.Tensor, token_ids: list[int]) -> None:
    if token_ids:
        row[torch.tensor(token_ids, dtype=torch.long, device=row.device)] = float("-inf")


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """[V] temperature-scaled logits -> the same with filtered-out entries at -inf (at least one survives)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
