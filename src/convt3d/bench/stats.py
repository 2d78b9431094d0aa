"""How repeated timings are read: the lowest of the rounds, confirmed by the next lowest.

A GPU call's time only grows with disturbances (a swing of the host, another process, a clock
drop), so the lowest round is the estimate; it is trusted once a second round comes close to it,
and one round thrown off by a disturbance does not widen the spread the way max/min would. Used by
the bench's rounds and by "auto"'s measurement (``convt3d.dispatch``).
"""
from __future__ import annotations

__all__ = ["lowest_spread"]


def lowest_spread(times: list[float]) -> float:
    """How far the second-lowest time is above the lowest (0.0 for a single time)."""
    low = sorted(times)[:2]
    return low[-1] / low[0] - 1.0
