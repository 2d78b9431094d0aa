"""GPU timing: one row per case, convt3d against PyTorch (cuDNN) in one process, each side's time
the lowest do_bench median of rounds in A B B A order (a clock drift cancels; the host's swings
only add time), with floors and % of roofline (:mod:`.roofline`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import convt3d
from ..core.validate import check_call
from ..dispatch.select import HYBRID, decide
from ..dispatch.timing import gpu_ms
from ..engines.triton import backward
from .check import case_failure
from .roofline import Ceilings, cudnn_tf32, floors, peak_class, roofline_percent, tflops
from .stats import lowest_spread
from .suites import Case, Tensors, make_tensors


@dataclass(frozen=True)
class TimingSettings:
    # Short budgets still give a short kernel hundreds of calls; slow calls get min_reps instead.
    warmup_ms: float = 10.0
    rep_ms: float = 60.0
    min_reps: int = 5
    seed: int = 0


def bench_budget(estimate_ms: float, settings: TimingSettings) -> tuple[float, float]:
    """(warmup, rep) in ms for do_bench, so that at least ``min_reps`` calls are timed (+0.5 keeps
    do_bench's integer division from rounding down to min_reps - 1)."""
    return max(settings.warmup_ms, estimate_ms), max(settings.rep_ms, (settings.min_reps + 0.5) * estimate_ms)


# A block of the paired timing lasts at least this long, to amortise its start from an idle GPU;
# a step longer than it is one call per block.
PAIRED_BLOCK_MS = 40.0


class CudaTimer:
    """First calls by wall clock, steady times by do_bench; without CUDA (the networks' CPU check), first calls only."""

    def __init__(self, settings: TimingSettings):
        self.settings = settings
        self.sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    def first_call(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
        """(output, seconds) of one synchronised call: for a new shape, Triton compile + tuning."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def steady(self, fn: Callable[[], torch.Tensor]) -> float:
        """Median seconds per call (L2 flushed between calls), at least min_reps timed calls."""
        _, estimate = self.first_call(fn)  # a warm call sizes the budget
        return gpu_ms(fn, *bench_budget(estimate * 1e3, self.settings)) * 1e-3

    def paired(self, fn_a: Callable[[], object], fn_b: Callable[[], object], pairs: int) -> tuple[list, list]:
        """Seconds per call of ``fn_a`` and ``fn_b`` in ``pairs`` pairs of blocks timed back to back,
        the order alternating so that a drift within a pair falls on both. A block is calls between
        two CUDA events, without L2 flush (as a model is called in a loop), from an idle GPU."""
        estimate = max(self.first_call(fn_a)[1], self.first_call(fn_b)[1], 1e-6)
        steps = max(1, math.ceil(PAIRED_BLOCK_MS * 1e-3 / estimate))
        times: tuple[list[float], list[float]] = ([], [])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(pairs):
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                torch.cuda.synchronize()
                start.record()
                for _ in range(steps):
                    (fn_a, fn_b)[side]()
                end.record()
                end.synchronize()
                times[side].append(start.elapsed_time(end) * 1e-3 / steps)
        return times

    def release(self) -> None:
        torch.cuda.empty_cache()


# ---- modes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """fwd: the forward; bwd: dX, dW, db of a retained forward; full: a training step, forward and backward."""

    name: str

    @property
    def needs_grad(self) -> bool:
        """Whether the callables run under torch.enable_grad()."""
        return self.name != "fwd"

    def build(self, case: Case, t: Tensors, backend: str) -> tuple[Callable[[], object], Callable[[], object]]:
        """(convt3d callable, PyTorch callable), named ``ours`` and ``theirs``: each returns the output
        (fwd) or the gradients of fresh leaves of the same values and layouts for a fixed random dY laid
        out like the output; bwd runs each forward once here with its graph retained."""
        args = case.geometry.conv_args()

        def ours_fwd(x, w, b=None):
            return convt3d.conv_transpose3d(x, w, b, *args, backend=backend, precision=None)

        def ref_fwd(x, w, b=None):
            return F.conv_transpose3d(x, w, b, *args)

        if self.name == "fwd":
            def ours() -> torch.Tensor:
                return ours_fwd(t.x, t.w, t.b)

            def theirs() -> torch.Tensor:
                return ref_fwd(t.x, t.w, t.b)

            return ours, theirs
        with torch.no_grad():
            y = F.conv_transpose3d(t.x, t.w, t.b, *args)
        gen = torch.Generator(device=y.device).manual_seed(1 + case.geometry.batch)
        g = torch.randn(y.shape, generator=gen, device=y.device, dtype=torch.float32).to(y.dtype)
        if case.layout == "cl":
            g = g.contiguous(memory_format=torch.channels_last_3d)
        ours_in, ref_in = ([v.detach().requires_grad_() for v in (t.x, t.w, t.b) if v is not None] for _ in range(2))
        retain = self.name == "bwd"
        if retain:
            with torch.enable_grad():
                y_ours, y_ref = ours_fwd(*ours_in), ref_fwd(*ref_in)

        def ours():
            return torch.autograd.grad(y_ours if retain else ours_fwd(*ours_in), ours_in, g, retain_graph=retain)

        def theirs():
            return torch.autograd.grad(y_ref if retain else ref_fwd(*ref_in), ref_in, g, retain_graph=retain)

        return ours, theirs

    def work(self, params, element_size: int, has_bias: bool) -> tuple[int, int]:
        """(useful FLOP, bytes that must move): dX and dW each do the forward's useful multiply-adds; the
        backward reads dY, X and W and writes dX, dW and db."""
        fwd_flop, fwd_bytes = params.useful_flops, params.min_bytes(element_size, has_bias)
        if self.name == "fwd":
            return fwd_flop, fwd_bytes
        n_in = params.batch * params.in_channels * math.prod(params.in_size)
        n_w = params.in_channels * params.out_channels_per_group * math.prod(params.kernel_size)
        n_out = params.batch * params.out_channels * math.prod(params.out_size)
        n_b = params.out_channels if has_bias else 0
        flop, nbytes = 2 * params.useful_flops, element_size * (n_out + 2 * n_in + 2 * n_w + n_b)
        return (flop, nbytes) if self.name == "bwd" else (flop + fwd_flop, nbytes + fwd_bytes)


MODES: dict[str, Mode] = {name: Mode(name) for name in ("fwd", "bwd", "full")}


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; expected one of {tuple(MODES)}")
    return MODES[name]


# ---- one row --------------------------------------------------------------------------------------
def max_abs_diff(a, b) -> tuple[float, float]:
    """(max |a - b|, max |b|) in fp32; of gradients, the pair of largest ratio, lest a big dX hide a small dW error."""
    if isinstance(a, (tuple, list)):
        pairs = [max_abs_diff(x, y) for x, y in zip(a, b)]
        return max(pairs, key=lambda p: p[0] / p[1] if p[1] else (math.inf if p[0] else 0.0))
    return (a.float() - b.float()).abs_().max().item(), b.float().abs().max().item()


def _is_cl(y) -> bool:
    y = y[0] if isinstance(y, (tuple, list)) else y  # gradients: dX's layout
    return y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous()


def _bwd_choice(params, dtype: torch.dtype) -> str:
    """The dX and dW implementations convt3d's backward chose here (the latest), with reasons."""
    parts = []
    for what, table in (("dX", backward.dgrad_choices()), ("dW", backward.choices())):
        found = [c for k, c in table.items() if k[3] == params and k[1] == dtype]
        if found:
            c = found[-1]
            parts.append(f"{what} {c.impl}" + (f" {c.config.short()}" if c.config else "") + f" ({c.reason})")
    return "; ".join(parts)


# More A B B A rounds, up to MAX_ABBA, while a side's two lowest medians differ by more than
# ROUND_SPREAD: training steps of small layers swing with the host within one row.
MAX_ABBA = 3
ROUND_SPREAD = 0.02


def _run_row(case: Case, t: Tensors, mode: Mode, backend: str, ceilings: Ceilings, timer,
             default_cudnn_s: dict[tuple, float], status: Callable[[str], None]) -> dict:
    params, _ = check_call(t.x, t.w, t.b, *case.geometry.conv_args())
    flop, nbytes = mode.work(params, t.x.element_size(), t.b is not None)
    row = {"case": case.name, "suite": case.suite, "dtype": case.dtype, "layout": case.layout,
           "precision": case.precision, "cudnn_allow_tf32": case.allow_tf32, "mode": mode.name, "backend": backend,
           "input": case.input_dist, "geometry": case.geometry.as_dict(), "useful_flop": flop, "min_bytes": nbytes,
           "out_shape": list(params.out_shape)}

    with cudnn_tf32(case.allow_tf32):
        # Built under the row's flag: precision=None resolves from it, for the saved backward too.
        ours, theirs = mode.build(case, t, backend)
        status(f"{case.label}: convt3d first call (compile + tune)")
        y_ours, first_ours = timer.first_call(ours)
        # The dispatcher's pick, asked after the first call so that a decision that call measured is reported.
        d = decide(t.x, backend, None, params, weight=t.w, bias=t.b, measure=False, training=mode.needs_grad)
        row["engine"] = HYBRID if mode.needs_grad and d.ours_backward else d.engine
        if case.dtype == "fp32" and d.engine == "triton":
            row["engine"] = f"triton {d.precision}"
        row["engine_reason"] = d.reason
        if mode.needs_grad:
            row["bwd_choice"] = "" if row["engine"] == "torch" else _bwd_choice(params, t.x.dtype)
        status(f"{case.label}: PyTorch first call")
        y_ref, first_ref = timer.first_call(theirs)
        diff, scale = max_abs_diff(y_ours, y_ref)
        layout_matches = _is_cl(y_ours) == _is_cl(y_ref)
        del y_ours, y_ref
        status(f"{case.label}: timing convt3d, PyTorch, PyTorch, convt3d")
        times = {"convt3d": [], "torch": []}
        for _ in range(MAX_ABBA):
            times["convt3d"].append(timer.steady(ours))
            times["torch"].extend([timer.steady(theirs), timer.steady(theirs)])
            times["convt3d"].append(timer.steady(ours))
            if max(lowest_spread(v) for v in times.values()) <= ROUND_SPREAD:
                break
        ours_s, ref_s = min(times["convt3d"]), min(times["torch"])
        row["round_us"] = {k: [s * 1e6 for s in v] for k, v in times.items()}

    row.update(first_call_s=first_ours, torch_first_call_s=first_ref, convt3d_us=ours_s * 1e6,
               torch_us=ref_s * 1e6, speedup=ref_s / ours_s, max_abs_diff_vs_torch=diff, max_abs_torch=scale,
               output_layout_matches=layout_matches)

    key = (case.geometry, case.dtype, case.layout)
    if case.allow_tf32:
        default_cudnn_s[key] = ref_s
    else:
        reused = key in default_cudnn_s
        if not reused:
            status(f"{case.label}: timing PyTorch at default flags")
            with cudnn_tf32(True):
                default_cudnn_s[key] = timer.steady(theirs)
        row.update(torch_default_flags_us=default_cudnn_s[key] * 1e6,
                   speedup_vs_default_flags=default_cudnn_s[key] / ours_s, torch_default_flags_reused=reused)

    peak = peak_class(case.dtype, "tf32" if case.allow_tf32 else "exact")  # core.roofline's peak classes
    mem_s, comp_s = floors(flop, nbytes, ceilings, peak)
    # The row's result as soon as it is known: a run cut by a time limit keeps what it measured.
    status(f"{case.label}: {row['engine']}: convt3d {ours_s * 1e6:.1f} us, cuDNN {ref_s * 1e6:.1f} us, "
           f"{ref_s / ours_s:.2f}x, memory floor {mem_s * 1e6:.1f} us, first call {first_ours:.2f} s")
    row.update(peak_class=peak, peak_flops_per_s=ceilings.peak(peak), mem_floor_us=mem_s * 1e6,
               compute_floor_us=comp_s * 1e6, bound="memory" if mem_s >= comp_s else "compute",
               tflops=tflops(flop, ours_s), torch_tflops=tflops(flop, ref_s),
               roofline_pct=roofline_percent(ours_s, mem_s, comp_s),
               torch_roofline_pct=roofline_percent(ref_s, mem_s, comp_s))
    return row


def run_cases(cases: list[Case], mode_name: str, backend: str, ceilings: Ceilings, settings: TimingSettings,
              status: Callable[[str], None] = lambda _msg: None, advance: Callable[[], None] = lambda: None,
              device: str = "cuda", timer=None) -> tuple[list[dict], list[dict]]:
    """(rows, failures) of every case timed; ``device`` and ``timer`` let tests drive the row logic on the CPU."""
    mode = get_mode(mode_name)
    timer = timer if timer is not None else CudaTimer(settings)
    rows, failures, default_cudnn_s = [], [], {}  # default_cudnn_s: cuDNN's default-flag seconds per tensors key
    tensors, tensors_key = None, None
    with torch.set_grad_enabled(mode.needs_grad):
        for case in cases:
            key = (case.geometry, case.dtype, case.layout)
            try:
                if key != tensors_key:
                    tensors, tensors_key = None, None  # free the previous case's tensors first
                    timer.release()
                    status(f"{case.label}: making inputs")
                    tensors, tensors_key = make_tensors(case, device, settings.seed), key
                rows.append(_run_row(case, tensors, mode, backend, ceilings, timer, default_cudnn_s, status))
            except Exception as exc:  # noqa: BLE001 -- one case's failure must not hide the others
                failures.append(case_failure(case, exc))
                tensors, tensors_key = None, None
                timer.release()
            advance()
    return rows, failures
