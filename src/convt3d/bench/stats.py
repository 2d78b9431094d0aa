"""How repeated timings are read: rounds of one call by their lowest (``lowest_spread``, shared with
"auto"), paired blocks of two calls by the median of the pairs' ratios, which cancels a host's swings."""
from __future__ import annotations

import statistics

from ..dispatch.timing import lowest_spread


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median, lower, upper quartile) of the per-pair ratios a[i] / b[i]; a single pair gives its ratio three times."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio: expected two equal-length non-empty lists, got {len(a)} and {len(b)}")
    ratios = [x / y for x, y in zip(a, b)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(ratios), q1, q3
