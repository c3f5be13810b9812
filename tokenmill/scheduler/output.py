"""The plain data of one engine step, in the order it flows: the scheduler's ``SchedulerOutput`` and the grammars'
``GrammarOutput`` go to the runner (and to the worker ranks), the runner's ``RunnerOutput`` and the reporters'
``OutputReports`` come back to the scheduler's ``update_from_output``. Plain data: ids, token ids, block ids, counts
-- never a Request object -- so the runner keeps its own per-row state and needs only the diff.

``SchedulerOutput`` is the only contract between the scheduler and the model runner.

Per step the runner learns:
- ``new_requests``: requests entering its batch (first scheduled, or resumed after a preemption: then their tokens
  include the outputs so far, all recomputed);
- ``running``: for requests already in its batch, the blocks added this step (per KV group: kvcache/groups.py), the
  length of the block tables after them (shorter than the runner's plus the new ones when blocks that held only
  rejected drafts were released), per group the first block it still holds (a window group's blocks before it went
  back to the pool: their entries are the null block) and how many tokens are computed;
- ``num_scheduled_tokens``: tokens to compute now per request, in the step's order (new and running alike);
- ``spec_token_ids``: draft tokens per decoding request, verified this step: they follow its known tokens and count
  in its ``num_scheduled_tokens`` (1 + drafts);
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
    block_tables: list[list[int]]  # per KV group (null-block entries behind a window)
    num_computed_tokens: int


@dataclass
class RunningRequestData:
    request_id: str
    new_block_ids: list[list[int]]  # per KV group: the last len(new_block_ids[g]) of its num_blocks blocks
    num_computed_tokens: int
    num_blocks: int
    live_from: list[int]  # per KV group: entries before it are the null block


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    running: list[RunningRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class GrammarOutput:
    """For each scheduled constrained request, the tokens its grammar allows at each position it samples at: a numpy
    int32 bitmask [1 + its scheduled drafts, ceil(V / 32)] (structured/matchers.py's layout). Made by the engine's
    grammars after scheduling, next to the SchedulerOutput (the scheduler itself never imports numpy)."""
    bitmasks: dict[str, Any] = field(default_factory=dict)


# Per token: (logprob of the sampled token, [(token id, logprob)] top candidates).
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# A prompt token's: its logprob, the top candidates, and its rank among all tokens (1 = the most likely).
PromptLogprob = tuple[float, list[tuple[int, float]], int]


@dataclass
class RunnerOutput:
    """What the runner returns of one step, for the requests that sampled."""
    sampled: dict[str, list[int]] = field(default_factory=dict)  # accepted drafts, then one token of its own
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per sampled token, if asked
    drafts: dict[str, list[int]] = field(default_factory=dict)  # the proposer's drafts for the next step
    # Prompt logprobs computed this step, per request that asked: (the first prompt index they are of, entries).
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    # Embeddings: per pooling request, the step's part of its pooled hidden state (a sum of vectors, how many).
    pooled: dict[str, tuple[list[float], int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Kept:
    """A request's sampled tokens up to and including the first that a token stop (EOS, a stop token id, max_tokens)
    ends it at; ``finishing``: one did."""
    token_ids: list[int]
    finishing: bool


@dataclass(frozen=True)
class Stop:
    """A reporter's finding in a request's kept tokens of the step: it ends after kept token ``index``, stopped by
    the stop string ``reason``, or (``reason`` None) because its grammar's output is complete."""
    index: int
    reason: str | None = None


@dataclass
class OutputReports:
    """What the detokenizers and grammar matchers found in a step's kept tokens. They report; the scheduler applies.
    ``stops``: a stop string or a complete grammar output inside this step's kept tokens; ``drafts``: for a
    constrained request, the drafts its grammar accepts (replacing the proposer's); ``completed``: requests whose
    grammar, checked after an earlier step (its work ran late), found the output complete; ``errors``: requests to end
    with an error (a grammar over its time or size budget); ``texts``: the text each request's kept tokens add (for
    the engine's outputs; the scheduler does not read it)."""
    stops: dict[str, Stop] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
