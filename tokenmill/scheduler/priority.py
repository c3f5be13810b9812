"""Request priorities: interactive work first, batch work on the capacity it leaves (pure Python).

A request's ``priority`` is a small integer, lower first: ``INTERACTIVE`` (0, the default) or ``BATCH`` (1: a key
whose policy says batch, or OpenAI's ``service_tier: "flex"``). The scheduler keeps both of its queues ordered by it:
- ``running`` by (priority, admission order), so the budget goes to interactive requests first and a preemption,
  which takes the back of ``running``, takes batch work first;
- ``waiting`` by (priority, arrival), a preempted request first of its priority (it keeps its place).
While a request of a higher priority (a lower number) is waiting or still in its prompt, the running requests of lower
priority sit the step out (keeping their blocks): its prefill runs alone, so its time to first token does not grow
with the batch load; batch decodes resume the step after. Such a request may take the seat or the KV blocks of the
lowest-priority running request (a preemption) to be admitted, never those of its own priority.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from tokenmill.scheduler.request import Request

INTERACTIVE, BATCH = 0, 1
PRIORITIES = {"interactive": INTERACTIVE, "batch": BATCH}


def insert_by_priority(queue: list[Request] | deque[Request], request: Request, first: bool = False) -> None:
    """Put ``request`` after every request of its priority (``first``: before them) and before every lower one."""
    position = next((i for i, other in enumerate(queue)
                     if other.priority > request.priority or (first and other.priority == request.priority)),
                    len(queue))
    queue.insert(position, request)


def yielding_above(running: list[Request], waiting: Iterable[Request], blocked: frozenset[str] | set[str]
                   ) -> int | None:
    """The priority whose prefill makes lower-priority running requests sit this step out: the highest priority of a
    waiting request or of a running one still in its prompt, when some running request has a lower priority; None
    when nothing yields."""
    prefilling = [r.priority for r in running if r.num_tokens - r.num_computed_tokens > 1 and
                  r.request_id not in blocked]
    queued = [r.priority for r in waiting if r.request_id not in blocked]
    if not prefilling and not queued:
        return None
    top = min(prefilling + queued)
    return top if any(r.priority > top for r in running) else None
