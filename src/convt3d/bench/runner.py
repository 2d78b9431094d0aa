"""GPU timing: one row per case, convt3d against PyTorch (cuDNN), in one process.

For each case, under ``torch.no_grad()`` (grad enabled for bwd/full) and the case's
``cudnn.allow_tf32`` flag:

1. first call of convt3d (wall clock, synchronised: includes Triton compile and autotuning), then
   the first call of PyTorch; the two outputs are compared (max abs difference) and freed;
2. steady-state time of each with ``triton.testing.do_bench`` (median; L2 flushed between calls),
   in rounds ordered convt3d, PyTorch, PyTorch, convt3d (repeated, up to ``MAX_ABBA`` times,
   until each side's two lowest medians agree within ``ROUND_SPREAD``), the lowest per side;
3. for an exact row, cuDNN's time at PyTorch's default flags too (reused from the default row of
   the same geometry when it was just measured): the accuracy bars compare against it;
4. floors and % of roofline from the measured ceilings (:mod:`.roofline`).

Modes (``--mode``): "fwd" times the forward; "bwd" the backward alone (``torch.autograd.grad`` of
a retained forward output for a fixed dY: dX, dW and db); "full" a training step (forward +
backward). A mode builds the two callables of a case and says how much work they do; the cuDNN
reference is ``F.conv_transpose3d`` with PyTorch's autograd under the same flags (its default,
non-deterministic cuDNN algorithm choice; convt3d's backward is deterministic).
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .roofline import Ceilings, cudnn_tf32, floors, peak_class, roofline_percent, tflops
from .stats import lowest_spread
from .suites import Case, Tensors, make_tensors

__all__ = ["TimingSettings", "CudaTimer", "Mode", "MODES", "PLANNED_MODES", "get_mode", "bench_budget", "run_cases",
           "ROUND_SPREAD"]


@dataclass(frozen=True)
class TimingSettings:
    # Short budgets because GPU time is scarce: the repetitions still give a short kernel hundreds
    # of calls; slow calls (cuDNN on kb68 exact) get min_reps timed calls instead.
    warmup_ms: float = 10.0
    rep_ms: float = 60.0
    min_reps: int = 5
    seed: int = 0


def bench_budget(estimate_ms: float, settings: TimingSettings) -> tuple[float, float]:
    """(warmup, rep) in ms for do_bench, so that at least ``min_reps`` calls are timed.

    do_bench times int(rep / its own estimate) calls (at least 1) after int(warmup / estimate)
    warm-up calls; +0.5 keeps the integer division from rounding down to min_reps - 1.
    """
    warmup = max(settings.warmup_ms, estimate_ms)
    rep = max(settings.rep_ms, (settings.min_reps + 0.5) * estimate_ms)
    return warmup, rep


def event_seconds(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``fn`` between two CUDA events on the current
    stream (no synchronisation before: the caller decides whether the block starts idle)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / calls


class CudaTimer:
    """Wall-clock first calls and do_bench steady-state times on the current CUDA device."""

    def __init__(self, settings: TimingSettings):
        self.settings = settings

    def first_call(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
        """(output, seconds) of one synchronised call: for a new shape, Triton compile + tuning."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    def steady(self, fn: Callable[[], torch.Tensor]) -> float:
        """Median seconds per call (L2 flushed between calls), at least min_reps timed calls."""
        import triton.testing

        _, estimate = self.first_call(fn)  # a warm call sizes the budget
        warmup, rep = bench_budget(estimate * 1e3, self.settings)
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3

    def paired(self, fn_a: Callable[[], object], fn_b: Callable[[], object], pairs: int) -> tuple[list, list]:
        """Seconds per call of ``fn_a`` and of ``fn_b`` in ``pairs`` pairs of blocks timed back to
        back, the order alternating (a b, b a, ...) so that a drift within a pair falls on both.
        A block is ``steps`` synchronised calls between two CUDA events, no L2 flush (as a model is
        called in a loop), ``steps`` sized from a warm call so that a block lasts
        PAIRED_BLOCK_MS; it starts from an idle GPU, so a host-bound call's gaps are in it."""
        _, est_a = self.first_call(fn_a)
        _, est_b = self.first_call(fn_b)
        steps = max(1, math.ceil(PAIRED_BLOCK_MS * 1e-3 / max(est_a, est_b, 1e-6)))
        times: dict[int, list[float]] = {0: [], 1: []}
        for i in range(pairs):
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                fn = (fn_a, fn_b)[side]
                torch.cuda.synchronize()
                times[side].append(event_seconds(fn, steps))
        return times[0], times[1]

    def release(self) -> None:
        torch.cuda.empty_cache()


# A block of the paired timing lasts at least this long: long enough to amortise the start of a
# block from an idle GPU (the first kernel waits for the host) to a fraction of a percent, short
# enough to keep a 21-pair mode of a short forward within seconds of timing; a step longer than
# it (the U-Nets' training steps) is one call per block.
PAIRED_BLOCK_MS = 40.0


# ---- modes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    name: str
    description: str
    # (case, tensors, backend) -> (convt3d callable, PyTorch callable); each returns a tensor
    # (fwd) or the tuple of gradients (bwd, full), compared element-wise by the row logic.
    build: Callable[[Case, Tensors, str], tuple[Callable[[], object], Callable[[], object]]]
    # (params, element size, has bias) -> (useful FLOP, bytes that must move)
    work: Callable[[object, int, bool], tuple[int, int]]
    needs_grad: bool = False  # the callables run under torch.enable_grad()


def _build_fwd(case: Case, t: Tensors, backend: str):
    import convt3d

    args = case.geometry.conv_args()

    def ours() -> torch.Tensor:
        return convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend=backend, precision=None)

    def theirs() -> torch.Tensor:
        return F.conv_transpose3d(t.x, t.w, t.b, *args)

    return ours, theirs


def _work_fwd(params, element_size: int, has_bias: bool) -> tuple[int, int]:
    return params.useful_flops, params.min_bytes(element_size, has_bias)


def _grad_leaves(t: Tensors) -> list[torch.Tensor]:
    """Fresh leaves (same values and layouts) that require grad: input, weight, bias."""
    return [v.detach().requires_grad_() for v in (t.x, t.w, t.b) if v is not None]


def _upstream_grad(case: Case, t: Tensors) -> torch.Tensor:
    """dY: a fixed random tensor shaped (and laid out) like the output, from the case's seed."""
    with torch.no_grad():
        y = F.conv_transpose3d(t.x, t.w, t.b, *case.geometry.conv_args())
    gen = torch.Generator(device=y.device)
    gen.manual_seed(1 + case.geometry.batch)
    g = torch.randn(y.shape, generator=gen, device=y.device, dtype=torch.float32).to(y.dtype)
    return g.contiguous(memory_format=torch.channels_last_3d) if case.layout == "cl" else g


def _build_bwd(case: Case, t: Tensors, backend: str):
    """Backward only: each engine's forward runs once here with its graph retained; the timed
    call is ``torch.autograd.grad`` of that output (dX, dW and db when there is a bias)."""
    import convt3d

    args = case.geometry.conv_args()
    g = _upstream_grad(case, t)
    ours_in, ref_in = _grad_leaves(t), _grad_leaves(t)
    with torch.enable_grad():
        y_ours = convt3d.conv_transpose3d(*ours_in[:2], ours_in[2] if len(ours_in) > 2 else None, *args,
                                          backend=backend, precision=None)
        y_ref = F.conv_transpose3d(*ref_in[:2], ref_in[2] if len(ref_in) > 2 else None, *args)

    def ours():
        return torch.autograd.grad(y_ours, ours_in, g, retain_graph=True)

    def theirs():
        return torch.autograd.grad(y_ref, ref_in, g, retain_graph=True)

    return ours, theirs


def _build_full(case: Case, t: Tensors, backend: str):
    """A training step of the layer: forward, then dX, dW (and db) for a fixed dY."""
    import convt3d

    args = case.geometry.conv_args()
    g = _upstream_grad(case, t)
    ours_in, ref_in = _grad_leaves(t), _grad_leaves(t)

    def ours():
        y = convt3d.conv_transpose3d(*ours_in[:2], ours_in[2] if len(ours_in) > 2 else None, *args,
                                     backend=backend, precision=None)
        return torch.autograd.grad(y, ours_in, g)

    def theirs():
        y = F.conv_transpose3d(*ref_in[:2], ref_in[2] if len(ref_in) > 2 else None, *args)
        return torch.autograd.grad(y, ref_in, g)

    return ours, theirs


def _work_bwd(params, element_size: int, has_bias: bool) -> tuple[int, int]:
    """dX and dW each do the forward's useful multiply-adds. Bytes: read dY, X and W, write dX
    and dW (and db)."""
    n_in = params.batch * params.in_channels * math.prod(params.in_size)
    n_w = params.in_channels * params.out_channels_per_group * math.prod(params.kernel_size)
    n_out = params.batch * params.out_channels * math.prod(params.out_size)
    return 2 * params.useful_flops, element_size * (n_out + 2 * n_in + 2 * n_w + (params.out_channels if has_bias
                                                                                   else 0))


def _work_full(params, element_size: int, has_bias: bool) -> tuple[int, int]:
    f_flop, f_bytes = _work_fwd(params, element_size, has_bias)
    b_flop, b_bytes = _work_bwd(params, element_size, has_bias)
    return f_flop + b_flop, f_bytes + b_bytes


MODES: dict[str, Mode] = {
    "fwd": Mode("fwd", "forward only", _build_fwd, _work_fwd),
    "bwd": Mode("bwd", "backward only (dX, dW, db of a retained forward)", _build_bwd, _work_bwd, True),
    "full": Mode("full", "training step: forward + backward", _build_full, _work_full, True),
}
# Modes accepted by --mode that do not run yet (none today; kept for future plug-ins).
PLANNED_MODES: dict[str, str] = {}


def get_mode(name: str) -> Mode:
    if name in MODES:
        return MODES[name]
    if name in PLANNED_MODES:
        raise NotImplementedError(f"--mode {name}: {PLANNED_MODES[name]}")
    raise ValueError(f"unknown mode {name!r}; expected one of {tuple(MODES) + tuple(PLANNED_MODES)}")


# ---- one row --------------------------------------------------------------------------------------
def _engine_of(case: Case, t: Tensors, backend: str, training: bool = False) -> tuple[str, str]:
    """(engine label, reason) that convt3d's dispatcher picks for this call, e.g. 'triton tf32x3';
    for a training step of the torch engine with convt3d's backward, 'torch+bwd'. Asked after the
    first call, so that a decision measured by that call (benchmark mode) is the one reported."""
    from convt3d.dispatch.select import HYBRID, decide
    from convt3d.core.validate import check_call

    params, _ = check_call(t.x, t.w, t.b, *case.geometry.conv_args())
    d = decide(t.x, backend, None, params, weight=t.w, bias=t.b, measure=False, training=training)
    label = HYBRID if training and d.ours_backward else d.engine
    if case.dtype == "fp32" and d.engine == "triton":
        label = f"{d.engine} {d.precision}"
    return label, d.reason


def _max_abs_diff(a, b) -> tuple[float, float]:
    """(max |a - b|, max |b|), computed in fp32 (ordered so 1 GB outputs need one temporary); for
    tuples of gradients, the largest ratio's pair, so that a small dW error is not hidden by a
    large dX scale."""
    if isinstance(a, (tuple, list)):
        pairs = [_max_abs_diff(x, y) for x, y in zip(a, b)]
        return max(pairs, key=lambda p: p[0] / p[1] if p[1] else (math.inf if p[0] else 0.0))
    diff = (a.float() - b.float()).abs_().max().item()
    scale = b.float().abs().max().item()
    return diff, scale


def _is_cl(y) -> bool:
    y = y[0] if isinstance(y, (tuple, list)) else y  # gradients: dX's layout
    return y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous()


def _bwd_choice(params, dtype: torch.dtype) -> str:
    """The dX and dW implementations convt3d's backward chose for this geometry and dtype (e.g.
    'dX triton ...; dW cudnn (...)'), from this process's choices (the latest if several)."""
    from convt3d.engines.triton import backward

    parts = []
    for what, table in (("dX", backward.dgrad_choices()), ("dW", backward.choices())):
        found = [c for k, c in table.items() if k[3] == params and k[1] == dtype]
        if found:
            c = found[-1]
            parts.append(f"{what} {c.impl}" + (f" {c.config.short()}" if c.config else "") + f" ({c.reason})")
    return "; ".join(parts)


def _tuner_record(params, dtype: torch.dtype) -> dict:
    """The Triton tuner's choice and per-candidate times (ms) for this geometry and dtype, from
    this process's tuning log (the latest if several): which tile the row ran, and how close
    the others came."""
    from convt3d.engines.triton import engine as triton_engine

    recs = [r for k, r in triton_engine.tuning_log().items() if k[-1] == params and k[1] == dtype]
    if not recs:
        return {}
    return {"tuner_choice": recs[-1].config.short(), "tuner_ms": dict(recs[-1].timings_ms)}


# More A B B A pairs until each side's two lowest medians agree within ROUND_SPREAD. Training
# steps of small layers swing with the host by a third or more within one row, while GPU-bound
# rows agree within 0.5%.
MAX_ABBA = 3
ROUND_SPREAD = 0.02


def _run_row(case: Case, t: Tensors, mode: Mode, backend: str, ceilings: Ceilings, timer,
             default_cudnn_s: dict[tuple, float], status: Callable[[str], None]) -> dict:
    from convt3d.core.validate import check_call

    g = case.geometry
    params, _ = check_call(t.x, t.w, t.b, *g.conv_args())
    flop, nbytes = mode.work(params, t.x.element_size(), t.b is not None)
    row = _row_head(case, mode, backend)
    row.update(useful_flop=flop, min_bytes=nbytes, out_shape=list(params.out_shape))

    with cudnn_tf32(case.allow_tf32):
        # Built under the row's flag: bwd runs each forward here, and precision=None resolves
        # (for the saved backward too) from the flag at that moment.
        ours, theirs = mode.build(case, t, backend)
        status(f"{case.label}: convt3d first call (compile + tune)")
        y_ours, first_ours = timer.first_call(ours)
        row["engine"], row["engine_reason"] = _engine_of(case, t, backend, mode.needs_grad)
        row.update(_tuner_record(params, t.x.dtype))
        if mode.needs_grad:
            # PyTorch's engine with its own backward: no convt3d choice to report.
            row["bwd_choice"] = "" if row["engine"] == "torch" else _bwd_choice(params, t.x.dtype)
        status(f"{case.label}: PyTorch first call")
        y_ref, first_ref = timer.first_call(theirs)
        diff, scale = _max_abs_diff(y_ours, y_ref)
        out_cl_ours, out_cl_ref = _is_cl(y_ours), _is_cl(y_ref)
        del y_ours, y_ref
        # Rounds in A B B A order -- one such pair, more until each side's two lowest agree -- and
        # each side's time the lowest of its medians: a drift of the clocks over the row cancels,
        # and the host's swings, which only add time, are left out.
        status(f"{case.label}: timing convt3d, PyTorch, PyTorch, convt3d")
        times = {"convt3d": [], "torch": []}
        for _ in range(MAX_ABBA):
            times["convt3d"].append(timer.steady(ours))
            times["torch"].extend([timer.steady(theirs), timer.steady(theirs)])
            times["convt3d"].append(timer.steady(ours))
            if max(lowest_spread(v) for v in times.values()) <= ROUND_SPREAD:
                break
        ours_s, ref_s = min(times["convt3d"]), min(times["torch"])
        row["round_us"] = {k: [t * 1e6 for t in v] for k, v in times.items()}

    row.update(first_call_s=first_ours, torch_first_call_s=first_ref, convt3d_us=ours_s * 1e6,
               torch_us=ref_s * 1e6, speedup=ref_s / ours_s, max_abs_diff_vs_torch=diff, max_abs_torch=scale,
               output_layout_matches=out_cl_ours == out_cl_ref)

    key = _default_key(case)
    if case.allow_tf32:
        default_cudnn_s[key] = ref_s
    else:
        reused = key in default_cudnn_s
        if not reused:
            status(f"{case.label}: timing PyTorch at default flags")
            with cudnn_tf32(True):
                default_cudnn_s[key] = timer.steady(theirs)
        row.update(torch_default_flags_us=default_cudnn_s[key] * 1e6,
                   speedup_vs_default_flags=default_cudnn_s[key] / ours_s,
                   torch_default_flags_reused=reused)

    peak = peak_class(case.dtype, case.precision)
    mem_s, comp_s = floors(flop, nbytes, ceilings, peak)
    # The row's result as soon as it is known: a run cut by a time limit keeps what it measured.
    status(f"{case.label}: {row['engine']}: convt3d {ours_s * 1e6:.1f} us, cuDNN {ref_s * 1e6:.1f} us, "
           f"{ref_s / ours_s:.2f}x, memory floor {mem_s * 1e6:.1f} us, first call {first_ours:.2f} s"
           + (f"; tuner: {row['tuner_choice']} of {len(row['tuner_ms'])}" if row.get("tuner_ms") else ""))
    row.update(peak_class=peak, peak_flops_per_s=ceilings.peak(peak), mem_floor_us=mem_s * 1e6,
               compute_floor_us=comp_s * 1e6, bound="memory" if mem_s >= comp_s else "compute",
               tflops=tflops(flop, ours_s), torch_tflops=tflops(flop, ref_s),
               roofline_pct=roofline_percent(ours_s, mem_s, comp_s),
               torch_roofline_pct=roofline_percent(ref_s, mem_s, comp_s))
    return row


def _default_key(case: Case) -> tuple:
    return (case.geometry, case.dtype, case.layout)


def _row_head(case: Case, mode: Mode, backend: str) -> dict:
    g = case.geometry
    return {
        "case": case.name, "suite": case.suite, "dtype": case.dtype, "layout": case.layout,
        "precision": case.precision, "cudnn_allow_tf32": case.allow_tf32, "mode": mode.name, "backend": backend,
        "input": case.input_dist,
        "geometry": {"batch": g.batch, "in_channels": g.in_channels, "out_channels": g.out_channels,
                     "in_size": list(g.in_size), "kernel": list(g.kernel), "stride": list(g.stride),
                     "padding": list(g.padding), "output_padding": list(g.output_padding),
                     "dilation": list(g.dilation), "groups": g.groups, "bias": g.bias},
    }


def run_cases(cases: list[Case], mode_name: str, backend: str, ceilings: Ceilings, settings: TimingSettings,
              status: Callable[[str], None] | None = None, advance: Callable[[], None] | None = None,
              device: str = "cuda", timer=None) -> tuple[list[dict], list[dict]]:
    """Time every case; returns (rows, failures).

    ``device`` and ``timer`` (default: :class:`CudaTimer`) exist so the tests can drive the whole
    row logic on CPU with a fake timer; the bench itself times only on CUDA.
    A case that raises (an engine that cannot run it, out of memory) becomes a failure entry with
    the error, and the bench goes on with the next case.
    """
    mode = get_mode(mode_name)
    timer = timer if timer is not None else CudaTimer(settings)
    say = status or (lambda _msg: None)
    step = advance or (lambda: None)
    rows, failures = [], []
    default_cudnn_s: dict[tuple, float] = {}
    tensors, tensors_key = None, None
    with torch.set_grad_enabled(mode.needs_grad):
        for case in cases:
            key = _default_key(case)
            try:
                if key != tensors_key:
                    # Free the previous case's tensors first: kb68's output alone is 1.25 GB.
                    tensors, tensors_key = None, None
                    timer.release()
                    say(f"{case.label}: making inputs")
                    tensors = make_tensors(case, device, settings.seed)
                    tensors_key = key
                rows.append(_run_row(case, tensors, mode, backend, ceilings, timer, default_cudnn_s, say))
            except Exception as exc:  # noqa: BLE001 -- one case's failure must not hide the others
                failures.append({"case": case.name, "dtype": case.dtype, "layout": case.layout,
                                 "precision": case.precision, "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc(limit=6)})
                tensors, tensors_key = None, None
                timer.release()
            step()
    return rows, failures
