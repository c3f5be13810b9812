"""SamplingParams: what one request asks of the sampler and of the stop checks.

Validation happens at construction; an invalid value raises ``ValueError`` whose message starts with the
parameter's name, so the server can map it to an OpenAI error with ``param`` set.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from tokenmill.structured.spec import GrammarSpec


POOLING_MODES = (None, "last", "mean", "cls")
# What the engine's per-row arrays hold (engine/input_batch.py: int64): every integer parameter stays within it.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _normal(value: float) -> float:
    """``value``, or 0.0 for a subnormal."""
    return 0.0 if 0 < abs(value) < sys.float_info.min else value


def _int64(value: int | None) -> bool:
    return value is None or INT64_MIN <= value <= INT64_MAX


class SamplingParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 = only the sampled token's)
    # Logprobs of the prompt's own tokens (vLLM's prompt_logprobs): each one's and this many top candidates, from
    # the prefill; such a request computes its whole prompt (no prefix-cache hit skips positions).
    prompt_logprobs: int | None = None
    # Embeddings: the prompt's final hidden states pooled (``last`` token, ``mean`` of all, ``cls``: the first),
    # returned with the request's first output (it asks for one token and ends there).
    pooling: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text instead of being cut
    grammar: GrammarSpec | None = None  # structured outputs: every output token keeps the text inside this grammar

    def __post_init__(self) -> None:
        # A subnormal reads as 0 in a process that flushes them (the C kernels' -ffast-math sets FTZ/DAZ): it is 0
        # here too, so that the API process and the engine judge a value alike.
        for name in _FLOAT_FIELDS:
            if isinstance(value := getattr(self, name), float):
                setattr(self, name, _normal(value))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): _normal(float(v)) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", 0 <= self.top_k <= INT64_MAX, "must be -1, 0 (disabled) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("seed", _int64(self.seed), f"must be in [{INT64_MIN}, {INT64_MAX}]"),
            ("max_tokens", self.max_tokens is None or 1 <= self.max_tokens <= INT64_MAX, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= INT64_MAX, "must be >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("pooling", self.pooling in POOLING_MODES, f"must be one of {', '.join(map(str, POOLING_MODES))}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
             "must be non-negative token ids"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamError(param, message)
        for token, bias in (self.logit_bias or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamError("logit_bias", "values must be in [-100, 100]")
            if not 0 <= token <= INT64_MAX:
                raise SamplingParamError("logit_bias", f"token id {token} is outside the vocabulary")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary."""
        for tok in list((self.logit_bias or {}).keys()) + self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                param = "logit_bias" if tok in (self.logit_bias or {}) else "stop_token_ids"
                raise SamplingParamError(param, f"token id {tok} is outside the vocabulary [0, {vocab_size})")
