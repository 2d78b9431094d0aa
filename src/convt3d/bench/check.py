"""Without CUDA: the Triton kernels through Triton's interpreter at reduced sizes, against float64.
The bar is the project's: at most twice a CPU stand-in for cuDNN's own error (fp32 tf32: TF32
arithmetic emulated in float64; fp32 tf32x3 and bf16: PyTorch's CPU convolution), and never below
one unit of the dtype's epsilon times the largest |output|."""
from __future__ import annotations

import math
import multiprocessing
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable

import torch
import torch.nn.functional as F

import convt3d
from ..dispatch.select import decide
from .roofline import cudnn_tf32
from .suites import Case, make_tensors, reduced_for_interpreter

# The interpreter checks the engine, whatever --backend says.
CHECK_BACKEND = "triton"


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value as cuDNN rounds (tensor cores would truncate); inf and NaN kept."""
    rounded = ((t.view(torch.int32) + 0x1000) & -8192).view(torch.float32)
    return torch.where(t.abs() < float("inf"), rounded, t)


def failure_entry(exc: BaseException, **fields) -> dict:
    """A failure of the bench's JSON: ``fields`` (case, dtype, ...), the error in one line, a short traceback."""
    return dict(fields, error=f"{type(exc).__name__}: {exc}",
                traceback="".join(traceback.format_exception(exc, limit=6)))


def check_case(case: Case, seed: int = 0) -> dict:
    """The row of one reduced case through the interpreter, ``ok``: within the bar, right shape, dtype and layout."""
    g = reduced_for_interpreter(case.geometry)
    t = make_tensors(case, "cpu", seed, geometry=g)
    args = g.conv_args()
    t0 = time.perf_counter()
    with torch.no_grad(), cudnn_tf32(case.allow_tf32):
        d = decide(t.x, CHECK_BACKEND, None)
        ours = convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend=CHECK_BACKEND, precision=None)
        seconds = time.perf_counter() - t0
        b64 = t.b.double() if t.b is not None else None
        exact = F.conv_transpose3d(t.x.double(), t.w.double(), b64, *args)
        if case.dtype == "fp32" and case.precision == "tf32":
            stand_in = F.conv_transpose3d(round_tf32(t.x).double(), round_tf32(t.w).double(), b64, *args).float()
        else:
            stand_in = F.conv_transpose3d(t.x, t.w, t.b, *args)
    engine = f"{d.engine} {d.precision}" if case.dtype == "fp32" else d.engine
    err = (ours.double() - exact).abs().max().item()
    ref_err = (stand_in.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    bar = max(2 * ref_err, torch.finfo(case.torch_dtype).eps * scale)
    # The output is dense in the input's layout, as PyTorch's is on CUDA (PyTorch's own CPU output
    # is no reference: at batch 1 with a bias it comes back contiguous for a channels-last input).
    fmt = torch.channels_last_3d if case.layout == "cl" else torch.contiguous_format
    layout_ok = (tuple(ours.shape) == (g.batch, g.out_channels) + g.out_size() and ours.dtype == case.torch_dtype
                 and ours.is_contiguous(memory_format=fmt))
    return {"case": case.name, "suite": case.suite, "dtype": case.dtype, "layout": case.layout,
            "precision": case.precision, "backend": CHECK_BACKEND, "engine": engine,
            "reduced_geometry": dict(g.as_dict(), out_size=list(g.out_size())), "max_abs_err": err,
            "ref_max_abs_err": ref_err, "bar": bar, "max_abs_out": scale, "layout_ok": layout_ok,
            "ok": layout_ok and err <= bar, "seconds": seconds}


def case_failure(case: Case, exc: BaseException) -> dict:
    """The failure entry of a bench case."""
    return failure_entry(exc, case=case.name, dtype=case.dtype, layout=case.layout, precision=case.precision)


def _check_one(case: Case, seed: int) -> tuple[dict | None, dict | None]:
    try:
        return check_case(case, seed), None
    except Exception as exc:  # noqa: BLE001 -- report every case, not just the first failure
        return None, case_failure(case, exc)


def run_checks(cases: list[Case], seed: int = 0, status: Callable[[str], None] = lambda _msg: None,
               advance: Callable[[], None] = lambda: None, jobs: int = 1) -> tuple[list[dict], list[dict]]:
    """(rows, failures) of every case, checked on ``jobs`` processes (the interpreter is pure Python), longest first."""
    results: list[tuple[dict | None, dict | None]] = [(None, None)] * len(cases)
    if jobs <= 1 or len(cases) <= 1:
        for i, case in enumerate(cases):
            status(f"{case.label}: interpreter")
            results[i] = _check_one(case, seed)
            advance()
    else:
        # spawn, not fork: forking a process whose torch/triton thread pools are live can hang. The
        # children inherit TRITON_INTERPRET=1 and sys.path, and run on one thread each: the interpreter
        # runs Python on one core. A program walks every tap of every phase.
        order = sorted(range(len(cases)), key=lambda i: -cases[i].geometry.groups * math.prod(cases[i].geometry.kernel))
        status(f"interpreter: {len(cases)} cases on {jobs} processes")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=torch.set_num_threads, initargs=(1,)) as pool:
            futures = {pool.submit(_check_one, cases[i], seed): i for i in order}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    results[i] = fut.result()
                except Exception as exc:  # noqa: BLE001 -- a worker that died takes only its case down
                    results[i] = (None, case_failure(cases[i], exc))
                status(f"{cases[i].label}: done")
                advance()
    return [r for r, _ in results if r is not None], [f for _, f in results if f is not None]
