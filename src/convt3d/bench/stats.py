"""How repeated timings are read.

Rounds of one call (``lowest_spread``): a GPU call's time only grows with disturbances (a swing of
the host, another process, a clock drop), so the lowest round is the estimate; it is trusted once a
second round comes close to it, and one round thrown off by a disturbance does not widen the
spread the way max/min would. Used by the bench's layer rounds and by "auto"'s measurement
(``convt3d.dispatch.select``).

Paired blocks of two calls (``paired_ratio``): where both sides are host-bound on a host whose
speed swings between seconds, the lowest round of each side is a race between two lucky draws.
Blocks of the two sides timed back to back share the host's state of that moment, so the ratio
of each pair cancels the swing, and the median of the pairs' ratios is the estimate, its quartiles
the noise band. Used by the networks suite.
"""
from __future__ import annotations

import statistics

__all__ = ["lowest_spread", "paired_ratio"]


def lowest_spread(times: list[float]) -> float:
    """How far the second-lowest time is above the lowest (0.0 for a single time)."""
    low = sorted(times)[:2]
    return low[-1] / low[0] - 1.0


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of the per-pair ratios a[i] / b[i]; a single pair
    gives its ratio three times."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio: expected two equal-length non-empty lists, got {len(a)} and {len(b)}")
    ratios = [x / y for x, y in zip(a, b)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(ratios), q1, q3
