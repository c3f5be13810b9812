"""Start-up measurements that decide something (a CPU's compute dtype, its thread count), made to survive a busy
neighbour core.

``compare`` times two ways of doing the same work in interleaved rounds: A then B, then B then A, and so on. A round
gives one ratio, time(B) / time(A) (the geometric mean over the round's cases, so every case weighs the same). Rounds
go on until two consecutive ones agree within ``tolerance`` (the larger ratio at most 1 + tolerance times the
smaller), and their geometric mean is the verdict. A neighbour busy for a whole round slows A and B alike (they run
within milliseconds of each other), so it moves the ratio less than the times; a neighbour that comes and goes makes
rounds disagree, and more rounds are run. When no two consecutive rounds agree within ``budget_s`` seconds the
machine is too noisy to tell: the verdict is None and the caller falls back to the hardware's known answer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

Clock = Callable[[], float]
Work = Callable[[], object]

# Each timing covers at least this long (a case is repeated to fill it): a single small GEMM takes microseconds,
# below the timer's and the scheduler's noise.
MIN_TIMING_S = 0.002


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
            tolerance: float = 0.10, max_rounds: int = 16, reps: Sequence[int] | None = None) -> Comparison:
    """Interleaved rounds over ``cases`` (pairs of A and B doing the same work, warmed up by the caller), each pair
    timed over ``reps[i]`` calls (default one), until two consecutive rounds agree or ``budget_s`` is spent."""
    reps = list(reps) if reps is not None else [1] * len(cases)
    start = clock()
    ratios: list[float] = []
    while len(ratios) < max_rounds:
        a_first = len(ratios) % 2 == 0
        logs = []
        for (a, b), n in zip(cases, reps):
            first, second = (a, b) if a_first else (b, a)
            t_first, t_second = _timed(first, n, clock), _timed(second, n, clock)
            t_a, t_b = (t_first, t_second) if a_first else (t_second, t_first)
            logs.append(math.log(t_b / t_a))
        ratios.append(math.exp(sum(logs) / len(logs)))
        if len(ratios) >= 2 and agree(ratios[-2], ratios[-1], tolerance):
            return Comparison(math.sqrt(ratios[-2] * ratios[-1]), tuple(ratios), clock() - start)
        if clock() - start > budget_s:
            break
    return Comparison(None, tuple(ratios), clock() - start)
