"""Start-up measurements that decide something (a CPU's compute dtype, its thread count), made to survive a busy
neighbour core.

``compare`` times two ways of doing the same work in interleaved rounds: A then B, then B then A, and so on. A round
gives one ratio, time(B) / time(A) (the geometric mean over the round's cases, so every case weighs the same). Rounds
go on until two consecutive ones agree within ``tolerance`` (the larger ratio at most 1 + tolerance times the
smaller), and their geometric mean is the verdict. A neighbour busy for a whole round slows A and B alike (they run
within milliseconds of each other), so it moves the ratio less than the times; a neighbour that comes and goes makes
rounds disagree, and more rounds are run. When no two consecutive rounds agree within ``budget_s`` seconds the
machine is too noisy to tell: the verdict is None and the caller falls back to the hardware's known answer.

That holds where a neighbour slows A and B alike. It does not for thread counts: a busy neighbour core stalls every
parallel region of the run that uses all cores (its threads wait at each barrier for the one that was preempted) and
barely touches the run that leaves that core out. There ``estimate="best"`` compares each case's fastest time of A
with its fastest of B over the rounds so far (the least disturbed timing of each: a neighbour only ever adds time),
and rounds go on, BEST_MIN_ROUNDS at least, until that running estimate holds from one round to the next.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

Clock = Callable[[], float]
Work = Callable[[], object]

# Each timing covers at least this long (a case is repeated to fill it): a single small GEMM takes microseconds,
# below the timer's and the scheduler's noise.
MIN_TIMING_S = 0.002
# Rounds the "best" estimate takes at least: a neighbour busy through the first two would otherwise decide it.
BEST_MIN_ROUNDS = 4


@dataclass(frozen=True)
class Comparison:
    """time(B) / time(A) as the rounds measured it; ``ratio`` None when no two consecutive rounds agreed."""
    ratio: float | None
    rounds: tuple[float, ...]
    seconds: float

    def describe(self) -> str:
        shown = ", ".join(f"{r:.2f}" for r in self.rounds)
        if self.ratio is None:
            return f"rounds {shown}: no two consecutive rounds agreed in {self.seconds:.1f} s"
        return f"{self.ratio:.2f} (rounds {shown}; the last two agree)"


def agree(x: float, y: float, tolerance: float) -> bool:
    return max(x, y) <= (1 + tolerance) * min(x, y)


def repetitions(work: Work, clock: Clock = time.perf_counter) -> int:
    """How many calls of ``work`` (already warmed up) fill MIN_TIMING_S."""
    start = clock()
    work()
    return max(1, math.ceil(MIN_TIMING_S / max(clock() - start, 1e-9)))


def _timed(work: Work, reps: int, clock: Clock) -> float:
    start = clock()
    for _ in range(reps):
        work()
    return max(clock() - start, 1e-12)


def compare(cases: Sequence[tuple[Work, Work]], clock: Clock = time.perf_counter, budget_s: float = 2.0,
            tolerance: float = 0.10, max_rounds: int = 16, reps: Sequence[int] | None = None,
            estimate: Literal["rounds", "best"] = "rounds") -> Comparison:
    """Interleaved rounds over ``cases`` (pairs of A and B doing the same work, warmed up by the caller), each pair
    timed over ``reps[i]`` calls (default one), until two consecutive rounds agree or ``budget_s`` is spent.
    ``estimate``: each round's own ratio ("rounds"), or the ratio of the fastest times so far ("best"; see the top
    of this file); the rounds reported are those estimates."""
    reps = list(reps) if reps is not None else [1] * len(cases)
    fastest = [[math.inf, math.inf] for _ in cases]  # per case: A's and B's least time so far
    start = clock()
    ratios: list[float] = []
    while len(ratios) < max_rounds:
        a_first = len(ratios) % 2 == 0
        logs = []
        for (a, b), n, least in zip(cases, reps, fastest):
            first, second = (a, b) if a_first else (b, a)
            t_first, t_second = _timed(first, n, clock), _timed(second, n, clock)
            t_a, t_b = (t_first, t_second) if a_first else (t_second, t_first)
            least[0], least[1] = min(least[0], t_a), min(least[1], t_b)
            logs.append(math.log(least[1] / least[0]) if estimate == "best" else math.log(t_b / t_a))
        ratios.append(math.exp(sum(logs) / len(logs)))
        enough = len(ratios) >= (BEST_MIN_ROUNDS if estimate == "best" else 2)
        if enough and agree(ratios[-2], ratios[-1], tolerance):
            return Comparison(math.sqrt(ratios[-2] * ratios[-1]), tuple(ratios), clock() - start)
        if clock() - start > budget_s:
            break
    return Comparison(None, tuple(ratios), clock() - start)
