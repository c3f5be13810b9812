"""SchedulerOutput: the only contract between the scheduler and the model runner. Plain data: ids, token ids, block
ids, counts -- never a Request object -- so the runner keeps its own per-row state and needs only the diff.

Per step the runner learns:
- ``new_requests``: requests entering its batch (first scheduled, or resumed after a preemption: then their tokens
  include the outputs so far, all recomputed);
- ``running``: for requests already in its batch, the blocks added this step and how many tokens are computed;
- ``num_scheduled_tokens``: tokens to compute now per request, in the step's order (new and running alike);
- ``finished_ids`` / ``preempted_ids``: rows to drop (finished or aborted since the last step; preempted now).
A request samples in a step when its scheduled tokens reach the end of its known tokens; the runner appends the
sampled token to its own row, the scheduler to its Request -- the same token, so the two stay in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    running: list[RunningRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
