"""Prompt logprobs (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` + ``logprobs``): in each step, for the rows that ask,
the logprob of every prompt token the step's positions predict. The logits at position p give token p + 1, so a
step that computes prompt positions [s, e) yields the entries of prompt tokens s + 1 .. min(e, L - 1) (L prompt
tokens; token 0 has none). Logits are made [CHUNK, vocab] at a time, never [L, vocab] for a long prompt."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.engine.input_batch import InputBatch, StepInputs
from tokenmill.scheduler.output import PromptLogprob

CHUNK = 256  # positions whose logits exist at once


def prompt_logprobs(model: torch.nn.Module, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor
                    ) -> dict[str, tuple[int, list[PromptLogprob]]]:
    rows, positions = inputs.token_rows, inputs.token_positions
    asks = batch.num_prompt_logprobs[rows] >= 0
    if not asks.any():
        return {}
    asks &= positions + 1 < batch.num_prompt_tokens[rows]  # the next token is still a prompt token
    indices = np.nonzero(asks)[0]
    if not len(indices):
        return {}
    rows, positions = rows[indices], positions[indices]
    targets = batch.token_ids[rows, positions + 1].astype(np.int64)
    entries: list[PromptLogprob] = []
    for start in range(0, len(indices), CHUNK):
        part = slice(start, start + CHUNK)
        logits = model.compute_logits(hidden[torch.as_tensor(indices[part], device=hidden.device)]).float()
        logprobs = logits.log_softmax(-1)
        target = torch.as_tensor(targets[part], device=logprobs.device)[:, None]
        own = logprobs.gather(1, target)
        ranks = (logprobs > own).sum(1) + 1
        k = int(batch.num_prompt_logprobs[rows[part]].max())
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        own, ranks = own[:, 0].tolist(), ranks.tolist()
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for i, row in enumerate(rows[part].tolist()):
            n = int(batch.num_prompt_logprobs[row])
            entries.append((own[i], list(zip(top_ids[i][:n], top_values[i][:n])), ranks[i]))
    out: dict[str, tuple[int, list[PromptLogprob]]] = {}
    for row in dict.fromkeys(rows.tolist()):  # a row's positions are contiguous and in order in the flat batch
        mine = np.nonzero(rows == row)[0]
        out[batch.request_id(row)] = (int(positions[mine[0]]) + 1, [entries[i] for i in mine])
    return out
