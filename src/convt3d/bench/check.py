"""Without CUDA: correctness of the Triton kernels through Triton's interpreter, at reduced sizes.

Each case of the suites is shrunk (``suites.reduced_for_interpreter``: batch 1, <= 16 channels
per group, ~2 input positions per dimension; kernel, stride, padding, dilation, output_padding
and groups kept) and run with ``backend="triton"`` on CPU tensors, which executes the very same
kernel functions in Triton's interpreter. The result is compared against float64 PyTorch on the
same (rounded) inputs.

The bar is the project's accuracy bar -- at most 2x the reference implementation's own error against
float64 -- with CPU stand-ins for cuDNN, since cuDNN is not here:

* fp32 "default" (TF32): a TF32 convolution emulated in float64 (inputs and weights rounded to
  TF32 the way tensor-core kernels do: nearest, ties away; exact accumulation; fp32 output);
* fp32 "exact": PyTorch's own fp32 CPU convolution;
* bf16: PyTorch's own bf16 CPU convolution.

To keep a zero reference error (possible on tiny cases) from demanding bit-exactness, the bar
never goes below one unit of the output dtype's epsilon times the largest |output|.
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .roofline import cudnn_tf32
from .suites import Case, make_tensors, reduced_for_interpreter

__all__ = ["round_to_tf32", "check_case", "run_checks"]

# The interpreter checks the engine, whatever --backend says.
CHECK_BACKEND = "triton"


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value (10 mantissa bits; ties away from zero), inf/NaN kept."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_tf32 expects float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & -8192).view(torch.float32).reshape(x.shape)
    return torch.where(torch.isfinite(x), rounded, x)


def _reference_stand_in(case: Case, x, w, b, args) -> torch.Tensor:
    if case.dtype == "fp32" and case.precision == "default":
        bb = b.double() if b is not None else None
        return F.conv_transpose3d(round_to_tf32(x).double(), round_to_tf32(w).double(), bb, *args).float()
    return F.conv_transpose3d(x, w, b, *args)


@dataclass(frozen=True)
class CheckRow:
    case: Case
    geometry: object  # the reduced Geometry
    engine: str
    max_abs_err: float
    ref_max_abs_err: float
    bar: float
    max_abs_out: float
    layout_ok: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.layout_ok and self.max_abs_err <= self.bar

    def as_dict(self) -> dict:
        g = self.geometry
        return {
            "case": self.case.name, "suite": self.case.suite, "dtype": self.case.dtype, "layout": self.case.layout,
            "precision": self.case.precision, "backend": CHECK_BACKEND, "engine": self.engine,
            "reduced_geometry": {"batch": g.batch, "in_channels": g.in_channels, "out_channels": g.out_channels,
                                 "in_size": list(g.in_size), "out_size": list(g.out_size()),
                                 "kernel": list(g.kernel), "stride": list(g.stride), "padding": list(g.padding),
                                 "output_padding": list(g.output_padding), "dilation": list(g.dilation),
                                 "groups": g.groups, "bias": g.bias},
            "max_abs_err": self.max_abs_err, "ref_max_abs_err": self.ref_max_abs_err, "bar": self.bar,
            "max_abs_out": self.max_abs_out, "layout_ok": self.layout_ok, "ok": self.ok, "seconds": self.seconds,
        }


def check_case(case: Case, seed: int = 0) -> CheckRow:
    """Run one reduced case through the interpreter and measure its error (see module docstring)."""
    import convt3d
    from convt3d.dispatch.select import decide

    g = reduced_for_interpreter(case.geometry)
    t = make_tensors(case, "cpu", seed, geometry=g)
    args = g.conv_args()
    t0 = time.perf_counter()
    with torch.no_grad(), cudnn_tf32(case.allow_tf32):
        d = decide(t.x, CHECK_BACKEND, None)
        ours = convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend=CHECK_BACKEND, precision=None)
        seconds = time.perf_counter() - t0
        exact = F.conv_transpose3d(t.x.double(), t.w.double(), t.b.double() if t.b is not None else None, *args)
        stand_in = _reference_stand_in(case, t.x, t.w, t.b, args)
        same_dtype = F.conv_transpose3d(t.x, t.w, t.b, *args)  # PyTorch's output shape and dtype
    engine = f"{d.engine} {d.precision}" if case.dtype == "fp32" else d.engine
    err = (ours.double() - exact).abs().max().item()
    ref_err = (stand_in.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    bar = max(2 * ref_err, torch.finfo(case.torch_dtype).eps * scale)
    # The output layout follows the input's, as PyTorch does on CUDA. PyTorch's own CPU output is
    # no reference here: at batch 1 with a bias it comes back contiguous for a channels_last_3d
    # input. A tensor with one channel (an output head) is dense in both layouts at once, so the
    # test is that the output is dense in the input's layout.
    fmt = torch.channels_last_3d if case.layout == "cl" else torch.contiguous_format
    layout_ok = (ours.shape == same_dtype.shape and ours.dtype == same_dtype.dtype
                 and ours.is_contiguous(memory_format=fmt))
    return CheckRow(case, g, engine, err, ref_err, bar, scale, layout_ok, seconds)


def _failure(case: Case, exc: BaseException) -> dict:
    return {"case": case.name, "dtype": case.dtype, "layout": case.layout, "precision": case.precision,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc, limit=6))}


def _check_one(case: Case, seed: int) -> tuple[CheckRow | None, dict | None]:
    try:
        return check_case(case, seed), None
    except Exception as exc:  # noqa: BLE001 -- report every case, not just the first failure
        return None, _failure(case, exc)


def _worker_init() -> None:
    # The interpreter runs Python on one core; torch's own thread pool would only oversubscribe.
    torch.set_num_threads(1)


def interpreter_cost(case: Case) -> int:
    """Relative interpreter time: every program walks every tap of every phase, and the taps of
    all phases together are kD*kH*kW; programs scale with groups (one spatial tile at these sizes)."""
    return case.geometry.groups * math.prod(case.geometry.kernel)


def run_checks(cases: list[Case], seed: int = 0, status: Callable[[str], None] | None = None,
               advance: Callable[[], None] | None = None, jobs: int = 1) -> tuple[list[CheckRow], list[dict]]:
    """Check every case, on ``jobs`` processes; returns (rows, failures) in the order of ``cases``.

    A case that raises becomes a failure entry. The interpreter is pure Python (every program x
    tap iteration of the GEMM kernel is slow, a suite takes minutes on one core), so cases run in
    parallel worker processes, longest first.
    """
    say = status or (lambda _msg: None)
    step = advance or (lambda: None)
    results: list[tuple[CheckRow | None, dict | None]] = [(None, None)] * len(cases)
    if jobs <= 1 or len(cases) <= 1:
        for i, case in enumerate(cases):
            say(f"{case.label}: interpreter")
            results[i] = _check_one(case, seed)
            step()
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn, not fork: forking a process whose torch/triton state (thread pools) is live can hang.
        # Children inherit TRITON_INTERPRET=1 through the environment and sys.path from us.
        order = sorted(range(len(cases)), key=lambda i: -interpreter_cost(cases[i]))
        say(f"interpreter: {len(cases)} cases on {jobs} processes")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_worker_init) as pool:
            futures = {pool.submit(_check_one, cases[i], seed): i for i in order}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    results[i] = fut.result()
                except Exception as exc:  # noqa: BLE001 -- a worker that died takes only its case down
                    results[i] = (None, _failure(cases[i], exc))
                say(f"{cases[i].label}: done")
                step()
    rows = [r for r, _ in results if r is not None]
    failures = [f for _, f in results if f is not None]
    return rows, failures
