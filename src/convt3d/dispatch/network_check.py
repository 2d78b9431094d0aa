"""The network check of ``convt3d.tune``: a layer's decision can still slow its network, so the whole model
is timed against PyTorch for every layer and the signatures that slow it are reverted (``dispatch.override``)."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import nn

from . import select as dispatch
from .timing import gpu_ms

# The network check's smallest margin, below dispatch.NOISE_MARGIN: a layer's gain is a small part of a model's.
NETWORK_MARGIN = 0.01


def network_check(groups: Sequence[str], measure: Callable[[frozenset], float],
                  margin: float = NETWORK_MARGIN) -> tuple[frozenset, dict]:
    """(signatures to revert to PyTorch, times in ms) so that the model, timed by ``measure(reverted)``, is not
    slower than with PyTorch for every layer. The two ends are timed in two rounds of opposite order; unless
    ours win by more than ``margin`` and the rounds' spread, groups are reverted one at a time in the order
    given, each kept reverted where that gains more than ``margin``, and a result that still does not win
    reverts every group (ties go to PyTorch, as in "auto")."""
    none, every = frozenset(), frozenset(groups)
    rounds: dict[frozenset, list[float]] = {none: [], every: []}
    for order in ((none, every), (every, none)):
        for subset in order:
            rounds[subset].append(measure(subset))
    ours, theirs = min(rounds[none]), min(rounds[every])
    m = max(margin, *(max(v) / min(v) - 1.0 for v in rounds.values()))
    times = {"convt3d_ms": ours, "torch_ms": theirs, "margin": m}
    if ours * (1.0 + m) < theirs:
        return none, dict(times, final_ms=ours)
    current, current_ms = none, ours
    for g in groups:
        trial = current | {g}
        t = measure(trial) if trial != every else theirs
        if t * (1.0 + margin) < current_ms:
            current, current_ms = trial, t
    if not current_ms * (1.0 + m) < theirs:
        current, current_ms = every, theirs
    return current, dict(times, final_ms=current_ms)


def _time_model(fn: Callable[[], object]) -> float:
    """ms per run of ``fn`` (do_bench median of at least ~8 runs)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est_ms = (time.perf_counter() - t0) * 1e3
    return gpu_ms(fn, warmup=max(25.0, 2 * est_ms), rep=max(100.0, 8 * est_ms))


def check_network(report, layers_by_sig: dict[str, list[nn.Module]], run: Callable[[], object],
                  device: torch.device, bar, timer: Callable[[Callable[[], object]], float] = _time_model) -> None:
    """:func:`network_check` of the model (``run``), applied in this process, in the cache and to
    ``report`` (a ``TuneReport``); ``layers_by_sig``: the "auto" layers per call signature."""
    decided = {e["signature"]: e for e in report.entries}
    groups = [sig for sig in layers_by_sig if sig in decided and decided[sig]["engine"] != "torch"]
    if not groups:
        return

    def gain(sig: str) -> float:
        t = decided[sig].get("timings_ms") or {}
        ours = min((v for k, v in t.items() if k != "torch"), default=None)
        return (t["torch"] / ours) if ours and "torch" in t else float("inf")

    groups.sort(key=gain)

    def measure(reverted: frozenset) -> float:
        bar.status(f"network check: {len(reverted)} of {len(groups)} signature(s) on PyTorch")
        saved = []
        try:
            for sig in reverted:
                for m in layers_by_sig[sig]:
                    saved.append((m, m.backend))
                    m.backend = "torch"
            return timer(run)
        finally:
            for m, b in reversed(saved):
                m.backend = b

    reverted, times = network_check(groups, measure)
    reverted = [sig for sig in groups if sig in reverted]
    why = (f"convt3d.tune's network check reverted this layer to PyTorch: the model took {times['convt3d_ms']:.4g} ms "
           f"with convt3d's choices and {times['final_ms']:.4g} ms with this layer on PyTorch (every layer on "
           f"PyTorch: {times['torch_ms']:.4g} ms)")
    for sig in reverted:
        dispatch.override(sig, "torch", why, device, detail=dict(times))
        decided[sig].update(engine="torch", source="network check", reason=why)
    report.network = dict(times, reverted=reverted, checked=list(groups))


def layer_signature(module: nn.Module, args: tuple) -> str | None:
    """The persistent signature of a patched layer's call (as dispatch keys it), or None."""
    from ..core.call import autocast_inputs, make_call

    try:
        x, w, b = autocast_inputs(args[0], module.weight, module.bias)
        size = args[1] if len(args) > 1 else None
        op = module._output_padding(x, size, module.stride, module.padding, module.kernel_size, 3, module.dilation)
        return make_call(x, w, b, module.stride, module.padding, op, module.groups, module.dilation,
                         module.precision, autograd=True).text
    except Exception:  # noqa: BLE001 -- the call itself reports its errors; here it is only not checked
        return None
