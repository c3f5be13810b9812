"""What the engine reports per request per step: deltas, so a stream can send them as they come."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    delta_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # The matched stop string or stop token id; None for EOS, length and abort.
    stop_reason: int | str | None = None
    # Per new token: (logprob of the sampled token, [(token id, logprob)] top candidates).
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
