"""SchedulerOutput: the only contract between the scheduler and the model runner. Plain data: ids, token ids, block
ids, counts -- never a Request object -- so the runner keeps its own per-row state and needs only the diff.

Per step the runner learns:
- ``new_requests``: requests entering its batch (first scheduled, or resumed after a preemption: then their tokens
  include the outputs so far, all recomputed);
- ``running``: for requests already in its batch, the blocks added this step, the length of the block table after
  them (shorter than the runner's plus the new ones when blocks that held only rejected drafts were released) and
  how many tokens are computed;
- ``num_scheduled_tokens``: tokens to compute now per request, in the step's order (new and running alike);
- ``spec_token_ids``: draft tokens per decoding request, verified this step: they follow its known tokens and count
  in its ``num_scheduled_tokens`` (1 + drafts);
- ``grammar_bitmasks``: for each constrained request that samples this step, the tokens its grammar allows at each
  sampled position ([1 + drafts, ceil(V / 32)] int32 bitmask, structured/matchers.py);
- ``finished_ids`` / ``preempted_ids``: rows to drop (finished or aborted since the last step; preempted now).
A request samples in a step when its scheduled tokens reach the end of its known tokens (drafts included); the
runner appends the sampled tokens (accepted drafts, then one of its own) to its own row, the scheduler to its Request
-- the same tokens, so the two stay in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling.params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class RunningRequestData:
    request_id: str
    new_block_ids: list[int]  # the last len(new_block_ids) of its num_blocks blocks
    num_computed_tokens: int
    num_blocks: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    running: list[RunningRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # numpy arrays, filled by the engine core after scheduling (the scheduler itself never imports numpy).
    grammar_bitmasks: dict[str, Any] = field(default_factory=dict)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
