"""Embeddings from the prefill: for each row that pools (sampling_params.pooling), the step's part of its pooled final
hidden state, as a sum of vectors and their count, which the scheduler adds up over the prompt's chunks. ``last``
reads the prompt's last position, ``cls`` its first, ``mean`` every prompt position (never an output's)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.engine.input_batch import InputBatch, StepInputs
from tokenmill.sampling.params import POOLING_MODES

LAST, MEAN, CLS = (POOLING_MODES.index(mode) for mode in ("last", "mean", "cls"))


def pooled_states(batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, tuple[list[float], int]]:
    rows, positions = inputs.token_rows, inputs.token_positions
    modes = batch.pooling[rows]
    if not modes.any():
        return {}
    prompt = batch.num_prompt_tokens[rows]
    read = ((modes == MEAN) & (positions < prompt)) | ((modes == LAST) & (positions == prompt - 1)) | \
        ((modes == CLS) & (positions == 0))
    out: dict[str, tuple[list[float], int]] = {}
    for row in dict.fromkeys(rows[read].tolist()):
        mine = np.nonzero(read & (rows == row))[0]
        total = hidden[torch.as_tensor(mine, device=hidden.device)].float().sum(0)
        out[batch.request_id(row)] = (total.cpu().tolist(), len(mine))
    return out
