"""The one way convt3d times GPU work: the GPU median of back-to-back calls (``gpu_ms``), the host
time per call (``host_ms``), both for a candidate (``time_call``), and how rounds are read."""
from __future__ import annotations

import math
import time
from typing import Callable, NamedTuple

import torch

# do_bench budget of one timing: a short layer gets hundreds of timed calls, a long one at least one.
MEASURE_WARMUP_MS = 5.0
MEASURE_REP_MS = 25.0
# Calls enqueued to read a host time per call: up to HOST_CALLS, fewer where they would take more
# than HOST_REP_MS of GPU time (a layer of milliseconds is not decided by its host time).
HOST_CALLS = 10
HOST_REP_MS = 5.0


class Timing(NamedTuple):
    """One timing round of a candidate: ``ms``, the GPU median of back-to-back calls, and ``host_ms``,
    the host time per call enqueued without synchronising (where a network waits on the GPU, they add up)."""

    ms: float
    host_ms: float


def gpu_ms(fn: Callable[[], object], warmup: float = MEASURE_WARMUP_MS, rep: float = MEASURE_REP_MS) -> float:
    """The median ms of ``fn`` on the GPU (``triton.testing.do_bench``); ``fn`` ran once before."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def host_ms(fn: Callable[[], object], gpu: float, rounds: int = 2, least: int = 2) -> float:
    """Host ms per call of ``fn`` (at least ``least`` calls enqueued without synchronising), the lowest
    of ``rounds`` rounds: one Python-timed round moves with the host's other work."""
    n = max(least, min(HOST_CALLS, int(HOST_REP_MS / gpu))) if gpu > 0 else HOST_CALLS
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    best = math.inf
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    sync()
    return best


def time_call(fn: Callable[[], object], first: Callable[[], object] | None = None) -> Timing:
    """A candidate's Timing: ``first`` (else ``fn``) runs once (compiles, tunes, builds), then it is timed."""
    (first or fn)()
    ms = gpu_ms(fn)
    return Timing(ms, host_ms(fn, ms, rounds=1, least=1))


def lowest_spread(times: list[float]) -> float:
    """How far the second-lowest time is above the lowest (0.0 for one): disturbances only slow a GPU
    call, so the lowest round is the estimate, trusted once a second one comes close."""
    low = sorted(times)[:2]
    return low[-1] / low[0] - 1.0
