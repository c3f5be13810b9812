"""SamplingMetadata: the sampling parameters of the S rows that sample in a step, as tensors (built by the runner's
persistent batch from its per-row arrays; the sampler reads nothing else). Optional fields are None when no row of
the step uses them, so a greedy batch pays for none of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [S] float32; 0 = greedy
    # The rows that draw (temperature > 0), [R] on the device; None when every row is greedy.
    random_rows: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # [S] int64; 0 = off
    top_p: torch.Tensor | None = None  # [S] float32; 1 = off
    min_p: torch.Tensor | None = None  # [S] float32; 0 = off
    # Penalties: all three or none; output_counts [S, V] counts each token among the outputs so far, prompt_mask
    # [S, V] marks the prompt's tokens (repetition penalty looks at both, as HF's does).
    presence_penalty: torch.Tensor | None = None  # [S]
    frequency_penalty: torch.Tensor | None = None  # [S]
    repetition_penalty: torch.Tensor | None = None  # [S]
    output_counts: torch.Tensor | None = None  # [S, V] int32
    prompt_mask: torch.Tensor | None = None  # [S, V] bool
    # logit_bias as coordinates: logits[bias_rows[i], bias_ids[i]] += bias_values[i].
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Tokens banned this step (EOS and stop token ids of rows still short of min_tokens): logits[ban_rows, ban_ids].
    ban_rows: torch.Tensor | None = None
    ban_ids: torch.Tensor | None = None
    # Structured outputs: row grammar_rows[i] may only take the tokens set in grammar_bitmask[i] ([G, ceil(V/32)]
    # int32, xgrammar's layout: bit t % 32 of word t // 32).
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Random rows with their own seed: (index into random_rows, seed of this step); their noise depends on nothing
    # else.
    seeded: tuple[tuple[int, int], ...] = ()
    # Top logprobs per row (-1: none asked); max_logprobs = the largest, None when no row asks.
    num_logprobs: list[int] | None = None
    max_logprobs: int | None = None
