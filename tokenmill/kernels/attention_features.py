"""What one attention layer adds to plain causal softmax attention, as parameters of the one attention op (every
backend honours them; the layers only pass them on):

- ``window``: a sliding window of ``window`` keys. The query at position p sees keys p - window < j <= p (the
  query's own key included), transformers' ``sliding_window`` semantics; 0: no window.
- ``softcap``: scores (already scaled) become ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2's
  attention logit soft-capping); 0: none.
- ``sinks``: a learned logit per query head [Hq] that joins every softmax's denominator and nothing else (gpt-oss):
  ``p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))``. Equivalently the plain output times
  ``sigmoid(lse - sink)``, with lse the plain softmax's log-sum-exp, which is how the split kernels apply it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionFeatures:
    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None  # [Hq] float32

    @property
    def plain(self) -> bool:
        return not self.window and not self.softcap and self.sinks is None

    def first_key(self, query_pos: int) -> int:
        """The first position the query at ``query_pos`` sees."""
        return max(0, query_pos - self.window + 1) if self.window else 0


PLAIN = AttentionFeatures()


def capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """scores [..., H, L, N] (masked = -inf) -> probabilities over N; ``sinks`` [H] join the denominator only."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """A plain softmax attention's output [N, H, D] and log-sum-exp [N, H] -> the output with the sinks."""
    if sinks is None:
        return out
    return out * torch.sigmoid(lse - sinks.float())[..., None]
