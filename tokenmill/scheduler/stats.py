"""The scheduler's counters, read by the engine's stats after every step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Speculative decoding counters: drafts verified and accepted, in all and by draft position (0 = first);
    accepted / drafted at a position is the acceptance rate there."""
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens_total += num_drafts
        self.num_accepted_tokens_total += num_accepted
        for counts in (self.drafted_by_position, self.accepted_by_position):
            if len(counts) < num_drafts:
                counts += [0] * (num_drafts - len(counts))
        for position in range(num_drafts):
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    spec: SpecStats
