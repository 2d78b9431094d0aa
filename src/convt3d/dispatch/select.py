"""The dispatcher: one pass over the registered engines per call. A named backend runs or raises with its reasons;
"auto" decides from memory, the disk cache, a measurement against PyTorch's own call, else the heuristic, keeping ours
only where it beats PyTorch beyond the noise; unsupported input falls back to PyTorch here, and only here."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from . import cache, distributed, first_call
from .timing import lowest_spread
from ..core.call import EXACT_GRADE, PRECISIONS, Call, resolve_precision, signature_text
from .registry import ENGINES, HYBRID
from ..core.errors import BackendUnavailableError
from ..core.params import ConvT3dParams
from ..core.flags import at_flags_as_they_are, cudnn_conv_tf32, device_name
from .heuristic import HOST_BOUND_S, TINY_FLOOR_S, floors, heuristic
from .steady import BACKEND_ENV, Direct, Repeat, steady_key
from ..core.memo import memo

BACKENDS = ("auto", "triton", "torch", "conv3d")

@dataclass(frozen=True)
class Decision:
    """The engine that runs a call; ``candidate`` is its name in ``ENGINES`` (HYBRID where ``ours_backward``).
    ``precision_class``: how PyTorch's own TF32-allowed float32 call computes ("fp32": ours run at exact grade)."""

    engine: str  # "triton", "conv3d" or "torch"
    precision: str  # "tf32" | "tf32x3" | "ieee" (meaningful for float32 only)
    reason: str
    ours_backward: bool = False  # engine "torch" recorded with convt3d's backward (HYBRID)
    source: str = ""  # "requested", "only", "rule", "cache", "measured", "heuristic" or "network"
    candidate: str = ""
    precision_class: str = ""

    def __post_init__(self):
        if not self.candidate:
            object.__setattr__(self, "candidate", HYBRID if self.ours_backward else self.engine)


@dataclass
class Pass:
    """What the dispatcher did with one call (``explain`` prints it)."""

    backend: str
    reasons: dict[str, list[str]] = field(default_factory=dict)  # engine -> why it cannot run ([]: it can)
    skipped: dict[str, str] = field(default_factory=dict)  # engines auto does not time, and why
    decision: Decision | None = None
    error: str | None = None  # a named backend that cannot run the call


def resolve_backend_name(backend: str | None) -> str:
    if backend is None:
        env = os.environ.get(BACKEND_ENV) or "auto"
        if env not in BACKENDS:
            raise ValueError(f"environment variable {BACKEND_ENV}={env!r} is not a backend; expected one of {BACKENDS}")
        return env
    if not isinstance(backend, str):
        raise TypeError(f"conv_transpose3d(): argument 'backend' must be str or None, not {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}; expected one of {BACKENDS}")
    return backend


# ---- measuring on or off ----------------------------------------------------------------------------
_benchmark: bool | None = None  # None: the default, measure on CUDA


def set_benchmark(enabled: bool | None) -> None:
    """Measure "auto" decisions (True, or None: the default) or decide by the heuristic alone
    (False: no first-call timing). Decisions already measured are reused in every mode."""
    global _benchmark
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_benchmark(): argument 'enabled' must be bool or None, not {type(enabled).__name__}")
    _benchmark = enabled


def benchmark_enabled() -> bool:
    """Whether "auto" measures new signatures (the default)."""
    return True if _benchmark is None else _benchmark


@contextlib.contextmanager
def benchmark(enabled: bool | None) -> Iterator[None]:
    """``set_benchmark(enabled)`` for the duration of a block (``convt3d.tune`` uses it)."""
    old = _benchmark
    set_benchmark(enabled)
    try:
        yield
    finally:
        set_benchmark(old)


# ---- the in-process memory ---------------------------------------------------------------------------
_settled: dict[tuple, Decision] = memo("dispatch.select.settled")  # measured, read from the disk cache, one candidate, or a rule
_guessed: dict[tuple, Decision] = memo("dispatch.select.guessed")  # heuristic decisions (replaced once a call can measure)
_named: dict[tuple, Decision] = memo("dispatch.select.named")  # named backends that can run a signature
_timings: dict[tuple, dict[str, float]] = memo("dispatch.select.timings")  # measured ms per engine (explain)
_classes: dict[tuple, str] = memo("dispatch.select.classes")  # PyTorch's precision class per signature
_texts: dict[tuple, str] = memo("dispatch.select.texts")  # the persistent signature of each settled key (override)
# Keys settled while an engine was still compiling -> first_call.generation() then: decided again
# once it has grown (an engine became ready), and kept off the steady path meanwhile.
_provisional: dict[tuple, int] = memo("dispatch.select.provisional")
_listeners: list[Callable[[str, dict], None]] = []


def clear_decisions() -> None:
    """Forget this process's decisions (not the disk cache)."""
    for decisions in (_settled, _guessed, _named, _timings, _classes, _texts, _provisional):
        decisions.clear()
    _forget_steady()
    ENGINES["triton"].forget()


@contextlib.contextmanager
def listening(callback: Callable[[str, dict], None]) -> Iterator[None]:
    """Call ``callback(event, info)`` on "decision" (every auto decision) and "measure" (a
    candidate about to be timed) events for the duration of a block (``convt3d.tune``)."""
    _listeners.append(callback)
    try:
        yield
    finally:
        _listeners.remove(callback)


def _notify(event: str, **info) -> None:
    for cb in list(_listeners):
        cb(event, info)


def cached_timings(call: Call) -> dict[str, float] | None:
    """Measured ms per engine for this call signature (this process or the disk cache), or None."""
    if call.key in _timings:
        return dict(_timings[call.key])
    if call.device.type != "cuda":
        return None
    entry = cache.load_decision(device_name(call.device), call.text)
    return None if entry is None else dict(entry.get("timings_ms", {}))


# ---- the pass ------------------------------------------------------------------------------------
def select(call: Call, backend: str | None = None, *, measure: bool = True) -> Decision:
    """The engine that runs ``call``; a signature seen before is answered with one lookup."""
    name = resolve_backend_name(backend)
    if name == "auto":
        d = _settled.get(call.key)
        if d is not None and call.key in _provisional and _provisional[call.key] != first_call.generation():
            d = None  # decided without an engine that has become ready for some signature since
        if d is None and call.device.type == "cuda" and not _can_measure(measure):
            d = _guessed.get(call.key)  # a guess stands until a call can measure
        return d if d is not None else _auto(call, measure, None)
    d = _named.get((call.key, name, call.requested))
    return d if d is not None else _run_named(call, name, None)


def explain_pass(call: Call, backend: str | None = None) -> Pass:
    """The pass :func:`select` makes for ``call``, recorded, with nothing timed."""
    name = resolve_backend_name(backend)
    record = Pass(name)
    try:
        record.decision = _auto(call, False, record) if name == "auto" else _run_named(call, name, record)
    except BackendUnavailableError as exc:
        record.error = str(exc)
    if not record.reasons:  # auto decided before asking the engines (CPU, dtype): ask them for the report
        _reasons(call, record)
    return record


def _reasons(call: Call, record: Pass | None) -> dict[str, list[str]]:
    reasons = {name: engine.not_supported_reasons(call) for name, engine in ENGINES.items()
               if name != HYBRID or call.training}
    if record is not None:
        record.reasons = reasons
    return reasons


def _run_named(call: Call, name: str, record: Pass | None) -> Decision:
    engine = ENGINES[name]
    why = _reasons(call, record)[name] if record is not None else engine.not_supported_reasons(call)
    why = engine.precision_reasons(call) + why
    if why:
        raise BackendUnavailableError(f"backend={name!r} cannot run this call: " + "; ".join(why))
    d = Decision(name, engine.precision(call), f"backend={name!r} requested", source="requested")
    if record is None:
        _named[(call.key, name, call.requested)] = d
    return d


def _decision(name: str, call: Call, reason: str, source: str) -> Decision:
    return Decision("torch" if name == HYBRID else name, ENGINES[name].precision(call), reason,
                    ours_backward=name == HYBRID, source=source)


def _auto(call: Call, measure: bool, record: Pass | None) -> Decision:
    generation = first_call.generation()  # read before the engines are asked whether they are ready
    unready: list[str] = []
    d = _auto_choose(call, measure, record, unready)
    if record is None:
        if unready and d.source in ("measured", "cache"):
            _provisional[call.key] = generation
        else:
            _provisional.pop(call.key, None)
    if _listeners:
        _notify("decision", signature=call.text, decision=d, timings=_timings.get(call.key))
    return d


def _auto_choose(call: Call, measure: bool, record: Pass | None, unready: list[str]) -> Decision:
    if call.device.type != "cuda":
        return _settle(call, _decision("torch", call, "auto: CPU tensors use PyTorch", "rule"), record)
    if call.dtype not in ENGINES["triton"].dtypes:
        return _settle(call, _decision("torch", call, f"auto: dtype {call.dtype} is not run by our engines", "rule"),
                       record)
    klass = _pytorchs_class(call, measure, record)
    if klass == "fp32":
        # PyTorch's own call computes it in full fp32: ours run at exact grade, never lowering the user's numerics.
        exact = dataclasses.replace(call, precision=EXACT_GRADE)
        d = _auto_choose(exact, measure, record, unready)
        d = dataclasses.replace(d, precision_class="fp32", reason=d.reason + f"; PyTorch's own call computes this "
                                f"TF32-allowed call in full fp32, so it runs at exact grade ({EXACT_GRADE})")
        return d if d.source == "heuristic" else _settle(call, d, record)
    reasons = _reasons(call, record)
    # Engines that can run the call but that auto does not time yet (still compiling), and why.
    checks = {name: getattr(ENGINES[name], "not_ready", None) for name, why in reasons.items() if not why}
    found = {name: check(call) for name, check in checks.items() if check is not None}
    skipped = {name: why for name, why in found.items() if why is not None}
    unready.extend(skipped)
    if record is not None:
        record.skipped = skipped
    cands = [n for n, why in reasons.items() if not why and n not in skipped]
    if torch.compiler.is_compiling() and _without_data(call.x):
        # Traced with fake or meta tensors (torch.export): nothing to time, so the heuristic alone.
        engine, why = heuristic(call.params, call.dtype, call.precision, call.bias is not None,
                                tuple(c for c in cands if c in ("triton", "torch")) or ("torch",))
        return _decision(engine, call, f"auto (heuristic, traced): {why}", "heuristic")
    if len(cands) == 1 and not skipped:  # else measured: the others' compiles start there
        d = _decision(cands[0], call, f"auto: only {cands[0]} can run this call ("
                      + "; ".join(f"{k}: {'; '.join(v) if v else skipped.get(k)}" for k, v in reasons.items()
                                  if k != cands[0]) + ")", "only")
        return _settle(call, d, record)
    tiny = max(floors(call.params, call.dtype, call.precision, call.bias is not None)[:2]) < TINY_FLOOR_S
    gpu = device_name(call.device)
    measuring = _can_measure(measure) and record is None

    def cached_or_new() -> dict:
        """The disk cache's entry, else measured now (and saved), else without measuring the heuristic's."""
        if measuring:
            return _cached_or_measured(call, cands, gpu, tiny, tuple(skipped))
        entry = _cached_entry(call, cands, gpu)
        if entry is not None:
            return entry
        engine, why = heuristic(call.params, call.dtype, call.precision, call.bias is not None, tuple(cands),
                                call.training)
        return {"engine": engine, "source": "heuristic", "why": why}

    # One decision every rank takes from rank 0, with the Triton tunings it measured (explain asks no one).
    if record is not None:
        entry = cached_or_new()
    elif measuring:
        entry = distributed.agree_with_tuning(cached_or_new, "auto|" + call.text, tuner=ENGINES["triton"].tuner)
    else:
        entry = distributed.agree(cached_or_new, "auto-guess|" + call.text)
    if entry["engine"] not in cands:  # rank 0 could run an engine this rank cannot
        with distributed.local():
            entry = cached_or_new()
    if entry["source"] == "heuristic":
        d = _decision(entry["engine"], call, f"auto (heuristic): {entry['why']}", "heuristic")
        if record is None:
            _guessed[call.key] = d
        return d
    if not entry.get("unready"):  # decided with every engine that could run it, or needing none: final
        unready.clear()
    return _settle(call, _from_entry(call, entry), record)


def _pytorchs_class(call: Call, measure: bool, record: Pass | None) -> str | None:
    """How PyTorch's own call of a flag-following TF32 float32 call computes, "fp32" or "tf32"
    (memory, the disk cache, else measured once by rank 0), or None where it cannot be known here."""
    if call.dtype != torch.float32 or call.precision != "tf32" or call.requested is not None:
        return None
    klass = _classes.get(call.key)
    if klass is not None:
        return klass
    gpu = device_name(call.device)
    klass = cache.load_precision_class(gpu, call.text)
    if klass is None:
        if record is not None or not _can_measure(measure) or _without_data(call.x):
            return None

        def measured() -> str:
            found = ENGINES["torch"].precision_class(call)
            cache.save_precision_class(gpu, call.text, found)
            return found

        klass = distributed.agree(measured, "class|" + call.text)
    _classes[call.key] = klass
    return klass


def _without_data(t) -> bool:
    """A tensor whose values do not exist: a FakeTensor (export's tracing) or on the meta device."""
    return isinstance(t, torch._subclasses.FakeTensor) or getattr(t, "is_meta", False)


def _settle(call: Call, d: Decision, record: Pass | None) -> Decision:
    if record is None:
        _settled[call.key] = d
        _texts[call.key] = call.text
    return d


def override(signature: str, engine: str, why: str, device: torch.device, detail: dict | None = None) -> int:
    """Replace the decision of a call signature (its text) by ``engine`` in this process and, on CUDA,
    in the disk cache (``convt3d.tune``'s network check). Returns how many in-process decisions it replaced."""
    if engine not in ENGINES:
        raise ValueError(f"override(): engine {engine!r} is not one of {tuple(ENGINES)}")
    _forget_steady()
    replaced = 0
    for key, text in list(_texts.items()):
        if text == signature and key in _settled:
            _settled[key] = Decision("torch" if engine == HYBRID else engine, _settled[key].precision, why,
                                     ours_backward=engine == HYBRID, source="network")
            replaced += 1
    if device.type == "cuda":
        gpu = device_name(device)
        old_entry = cache.load_decision(gpu, signature) or {}
        entry = {"engine": engine, "timings_ms": dict(old_entry.get("timings_ms", {})), "network": why}
        if detail:
            entry["network_ms"] = detail
        if old_entry.get("engine"):
            entry["replaced"] = old_entry["engine"]
        cache.save_decision(gpu, signature, entry)
    return replaced


def _can_measure(measure: bool) -> bool:
    return measure and benchmark_enabled() and not _capturing()


def _capturing() -> bool:
    """A CUDA graph is being captured on the current stream (then nothing may be timed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---- measuring ------------------------------------------------------------------------------------
# The smallest margin by which convt3d must beat PyTorch (ties go to PyTorch), above do_bench's run-to-run spread.
NOISE_MARGIN = 0.03
# Two rounds, more while a candidate's two lowest differ by more than the noise margin (their
# spread becomes the margin, and on a busy host would keep PyTorch where ours is faster).
MEASURE_ROUNDS = 2
MAX_MEASURE_ROUNDS = 4


def _measure(call: Call, cands: list[str], label: str
             ) -> tuple[dict[str, list[float]], dict[str, str], dict[str, list[float]]]:
    """(ms per round, failures, host ms per round) per candidate on the call's tensors, rounds in alternating
    orders so drift falls on every candidate; a candidate that raises is left out."""
    runs: dict[str, list[float]] = {}
    hosts: dict[str, list[float]] = {}
    failed: dict[str, str] = {}
    for r in range(MAX_MEASURE_ROUNDS):
        if r >= MEASURE_ROUNDS and all(lowest_spread(v) <= NOISE_MARGIN for v in runs.values()):
            break
        for name in (cands if r % 2 == 0 else cands[::-1]):
            if name in failed:
                continue
            _notify("measure", signature=label, engine=name)
            try:
                t = ENGINES[name].time(call)
            except Exception as exc:  # noqa: BLE001 -- any engine failure just removes the candidate
                failed[name] = f"{type(exc).__name__}: {exc}"[:300]
                runs.pop(name, None)
                hosts.pop(name, None)
                if len(failed) == len(cands):
                    raise
                continue
            runs.setdefault(name, []).append(t.ms)
            hosts.setdefault(name, []).append(t.host_ms)
    return runs, failed, hosts


def host_extra(hosts: dict[str, list[float]] | None, name: str) -> float:
    """The host ms per call that ``name`` costs beyond PyTorch's (0 where either was not read)."""
    if not hosts or not hosts.get(name) or not hosts.get("torch"):
        return 0.0
    return max(0.0, min(hosts[name]) - min(hosts["torch"]))


def pick(runs: dict[str, list[float]], hosts: dict[str, list[float]] | None = None) -> tuple[str, float]:
    """(winner, margin): our fastest, charged its host time beyond PyTorch's, wins only by more than the larger
    of ``NOISE_MARGIN`` and either one's spread of its two lowest rounds (a noisy measurement keeps PyTorch)."""
    best = {k: min(v) for k, v in runs.items() if v}
    spread = {k: lowest_spread(v) for k, v in runs.items() if v}
    if "torch" not in best:  # PyTorch failed (e.g. out of memory): the fastest of ours
        winner = min(best, key=best.get)
        return winner, spread[winner]
    cost = {k: v + host_extra(hosts, k) for k, v in best.items() if k != "torch"}
    if not cost:
        return "torch", spread["torch"]
    challenger = min(cost, key=cost.get)
    margin = max(NOISE_MARGIN, spread[challenger], spread["torch"])
    return (challenger if cost[challenger] * (1.0 + margin) < best["torch"] else "torch"), margin


def _cached_entry(call: Call, cands: list[str], gpu: str) -> dict | None:
    """The disk cache's decision for this signature, if it names an engine that can run the call."""
    entry = cache.load_decision(gpu, call.text)
    if entry is None or entry.get("engine") not in cands:
        return None
    if any(name in cands for name in entry.get("unready", ())):
        return None  # measured while an engine was still compiling, which can run now
    return dict(entry, source="cache")


def _cached_or_measured(call: Call, cands: list[str], gpu: str, tiny: bool = False, unready: tuple = ()) -> dict:
    """A new signature's entry from the disk cache, else measured now and saved. ``tiny``: PyTorch's call is
    timed first, and below ``HOST_BOUND_S`` alone; ``unready``: engines still compiling (measured later)."""
    entry = _cached_entry(call, cands, gpu)
    if entry is not None:
        if entry.get("unready"):  # start compiling what they still need, off the call's path (dispatch.first_call)
            for name in unready:
                ENGINES[name].make_ready(call)
        return entry
    _say_first_call(cands, unready)
    if tiny and "torch" in cands:
        runs, failed, _ = _measure(call, ["torch"], call.text)
        t = min(runs["torch"]) * 1e-3
        if t < HOST_BOUND_S:
            entry = {"engine": "torch", "timings_ms": {"torch": t * 1e3}, "rounds_ms": runs, "margin": 0.0,
                     "failed": failed, "candidates": ["torch"], "unready": [], "why": f"tiny layer: PyTorch's call "
                     f"takes {t * 1e6:.3g} us < {HOST_BOUND_S * 1e6:.0f} us, less than our engines' host time; the "
                     "others were not timed"}
    if entry is None:
        for name in unready:
            ENGINES[name].make_ready(call)
        runs, failed, hosts = _measure(call, cands, call.text)
        winner, margin = pick(runs, hosts=hosts)
        entry = {"engine": winner, "timings_ms": {k: min(v) for k, v in runs.items()}, "rounds_ms": runs,
                 "margin": margin, "failed": failed, "candidates": cands, "unready": list(unready),
                 "host_ms": {k: min(v) for k, v in hosts.items() if v}, "host_rounds_ms": hosts}
    cache.save_decision(gpu, call.text, entry)
    return dict(entry, source="measured")


_said: list[bool] = []


def _say_first_call(cands: list[str], unready: tuple = ()) -> None:
    """One line on stderr, once per process, before the first measurement of what a first call does."""
    if _said or (len(cands) < 2 and not unready):
        return
    _said.append(True)
    if unready:
        what = (f"timing {', '.join(cands)} on it now while the kernels of {', '.join(unready)} compile in "
                f"background processes, timed at a later call once compiled ({first_call.ENV}=wait waits for them)")
    else:
        what = f"compiling and timing {', '.join(cands)} on it once"
    print(f"convt3d: first call of a new layer signature: {what} (kept in {cache.cache_dir()}; "
          "convt3d.tune(model, x) does this ahead for a whole model)", file=sys.stderr)


def _from_entry(call: Call, entry: dict) -> Decision:
    _timings[call.key] = timings = {k: float(v) for k, v in entry.get("timings_ms", {}).items()}
    text = _timings_text(timings, entry["engine"], entry.get("host_ms"))
    if entry.get("network"):  # (from the cache file) convt3d.tune's network check replaced the layer's measurement
        return _decision(entry["engine"], call, f"auto (from the cache file): {entry['network']}", "cache")
    if entry["source"] == "cache":
        return _decision(entry["engine"], call, f"auto (measured earlier, from the cache file): {text}", "cache")
    kind = "training steps" if call.training else "calls"
    reason = (f"auto (measured {kind}): {entry['why']}" if entry.get("why") else
              f"auto (measured {kind}; convt3d must beat PyTorch by > {entry['margin'] * 100:.1f}%): {text}")
    if entry.get("failed"):
        reason += "; failed: " + "; ".join(f"{k}: {v}" for k, v in entry["failed"].items())
    return _decision(entry["engine"], call, reason, "measured")


def _timings_text(timings: dict[str, float], best: str, host_ms: dict[str, float] | None = None) -> str:
    def one(k: str, v: float) -> str:
        extra = host_extra({n: [h] for n, h in (host_ms or {}).items()}, k) if k != "torch" else 0.0
        return f"{k} {v:.4g} ms" + (f" (+{extra:.3g} ms host beyond torch's)" if extra > 0 else "")

    return ", ".join(one(k, v) for k, v in sorted(timings.items(), key=lambda kv: kv[1])) + f" -> {best}"


# ---- the steady path: a repeated call in one lookup -------------------------------------------------
@dataclass(frozen=True)
class Steady:
    """What a call's arguments led to before: geometry, precision, flags and settled decision. ``direct``: PyTorch's
    own op at the flags as they are (straight to ``F.conv_transpose3d``); ``run``: a repeated inference call's
    steady forward of (input, weight, bias) by one of our engines (``steady.Repeat``)."""

    decision: Decision
    params: ConvT3dParams
    precision: str
    training: bool
    unbatched: bool
    direct: bool
    run: Callable | None = None


_steady: dict[tuple, Steady] = memo("dispatch.select.steady")
# One memo per weight object, its latest signature: steady.Direct, or steady.Repeat for ours.
_direct: dict[int, Direct] = memo("dispatch.select.direct")
_STEADY_LIMIT = 4096


def steady(input, weight, bias, stride, padding, output_padding, groups, dilation, backend,
           precision) -> tuple[tuple | None, Steady | None]:
    """(its ``steady_key`` or None, its steady entry or None) for a repeated call; its weight's memo answers first."""
    if _listeners:  # a listener such as convt3d.tune waits for every decision
        return None, None
    args = (stride, padding, output_padding, groups, dilation)
    memo = _direct.get(id(weight))
    if memo is not None and memo.fits(input, weight, bias, args, backend, precision):
        return None, _DIRECT if type(memo) is Direct else memo.hit
    key = steady_key(input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision)
    hit = None if key is None else _steady.get(key)
    if hit is not None:
        if hit.direct:
            _keep(weight, Direct(input, weight, bias, args, backend, precision))
        elif not hit.training:
            _remember_repeat(input, weight, bias, args, backend, precision, hit)
    return key, hit


def _remember_repeat(input, weight, bias, args: tuple, backend, precision, hit: Steady) -> None:
    """Give the weight a ``steady.Repeat`` memo where the engine has a steady launcher for the call and the
    call needs nothing it lacks: plain tensors, no autocast, no gradient."""
    engine = ENGINES[hit.decision.candidate]
    if (type(input) is not torch.Tensor or not hasattr(engine, "steady_launcher")
            or torch.is_autocast_enabled(input.device.type)):
        return
    x = input.unsqueeze(0) if hit.unbatched else input
    launcher = engine.steady_launcher(x, weight, bias, hit.params, hit.precision)
    if launcher is None:
        return
    run, alive = launcher
    if hit.unbatched:
        def run(input, weight, bias, _run=run):
            return _run(input.unsqueeze(0), weight, bias).squeeze(0)
    _keep(weight, Repeat(input, weight, bias, args, backend, precision, alive,
                         Steady(hit.decision, hit.params, hit.precision, False, hit.unbatched, False, run)))


def _forget_steady() -> None:
    _steady.clear()
    _direct.clear()


def _keep(weight, memo: Direct) -> None:
    """Give the weight its memo (``steady.Direct``, or ``steady.Repeat`` for ours), all forgotten at the limit."""
    if len(_direct) >= _STEADY_LIMIT:
        _forget_steady()
    _direct[id(weight)] = memo


def remember(key: tuple | None, call: Call, d: Decision, given: tuple | None = None) -> None:
    """Keep a settled decision for the call's argument signature (not a guess, one made while an engine
    compiles, under graph capture or awaited by a listener); ``call`` as selected (its key is the one kept
    provisional), ``given``: ``steady.Direct``'s arguments."""
    if d.source == "heuristic" or _listeners or call.key in _provisional or (
            call.device.type == "cuda" and _capturing()):
        return
    is_direct = d.candidate == "torch" and at_flags_as_they_are(call.x, call.requested)
    if key is not None:
        if len(_steady) >= _STEADY_LIMIT:
            _forget_steady()
        _steady[key] = Steady(d, call.params, decided_call(call, d).precision, call.training, call.unbatched, is_direct)
    # A call without a key (a tensor subclass without __torch_function__) still gets the direct memo.
    if is_direct and given is not None:
        _keep(given[1], Direct(*given))


# What ``steady`` answers for a call its direct memo fits: only ``direct`` is read.
_DIRECT = Steady(Decision("torch", "", "the direct memo of its weight", source="steady"), None, "", False, False, True)


def precision_class_of(call: Call) -> str | None:
    """PyTorch's precision class of the call where known (memory or disk cache), never measured."""
    return _pytorchs_class(call, False, None)


def decided_call(call: Call, d: Decision) -> Call:
    """The call as its decision runs it: at exact grade where PyTorch's own call computes in full fp32."""
    if d.precision_class == "fp32" and call.precision == "tf32":
        return dataclasses.replace(call, precision=EXACT_GRADE)
    return call


# ---- the call-level entry for callers holding tensors and a geometry ------------------------------
def decide(input: torch.Tensor, backend: str | None, precision: str | None, params=None, *, weight=None, bias=None,
           measure: bool = True, training: bool = False) -> Decision:
    """:func:`select` for callers holding the tensors and the validated geometry; ``measure=False`` times nothing."""
    name = resolve_backend_name(backend)
    prec = resolve_precision(precision)
    if params is None or weight is None:  # a caller without the geometry: Triton where it can run
        if name == "auto" and (input.device.type != "cuda" or input.dtype not in ENGINES["triton"].dtypes):
            return Decision("torch", prec, "auto: PyTorch (CPU tensors, or a dtype our engines do not run)", source="rule")
        why = ("its check needs the weight and the geometry" if name == "conv3d"
               else None if name == "torch" else ENGINES["triton"].input_reason(input))
        if name != "auto" and why is not None:
            raise BackendUnavailableError(f"backend={name!r} cannot run this call: {why}")
        if name != "auto":
            return Decision(name, prec, f"backend={name!r} requested", source="requested")
        if why is not None:
            return Decision("torch", prec, f"auto: Triton engine unsupported here ({why})", source="rule")
        return Decision("triton", prec, "auto: CUDA float32/float16/bfloat16 use the Triton engine", source="rule")
    unbatched = input.dim() == 4
    x = input.unsqueeze(0) if unbatched else input
    return select(Call(x, weight, bias, params, prec, precision, training, unbatched), name, measure=measure)
