"""The parts of a training step, per layers-suite case, on the GPU: the measurements behind
convt3d.engines.triton.backward's choices (cuDNN or Triton for dX, cuDNN for dW, db with cuDNN's call).

Per case, at bf16 channels_last_3d and fp32 NCDHW default precision (TF32 on), do_bench medians
(L2 flushed), in us, of:
  fwd      convt3d forward, cuDNN forward
  dX       cuDNN (convolution_backward, input mask only), deterministic and default algorithms;
           convt3d's Triton kernels for every candidate configuration: the general one
           (kernels/dgrad_bwd.py) and, on output heads, the head kernels (head_backward)
  dW       cuDNN deterministic / default algorithms; convt3d's Triton kernels for every candidate
           configuration (kernels/wgrad_bwd.py, and the head kernels on output heads)
  db       sum of dY
  full     convt3d training step (forward + backward, the backward's own timed choice) vs
           F.conv_transpose3d + autograd (PyTorch's default flags)
With --accuracy, also the max abs error against float64 of dX and dW from cuDNN and from each
Triton configuration (the 2x-cuDNN error budget).
With --profile, instead: where one step's time goes -- do_bench of the whole step, of the
forward with autograd recording and of the backward alone; host time per call (50 calls
enqueued) of each; db by other reductions than cuDNN's; and torch.profiler tables (by CUDA time,
by CPU time) of five steps.

Run on the GPU machine:

    PYTHONPATH=src python3 tools/gpu_training.py [--case gan_k4s2p1,...] [--json FILE] [--accuracy]
    PYTHONPATH=src python3 tools/gpu_training.py --profile --case nnunet_128_64,monai_unet_k3

Prints one line per case (the best Triton tile of dX and dW, the step's speedup and the
backward's choices) and the full step's geometric mean; --json (default $OUT/gpu_training.json)
holds every timing. CONVT3D_BWD_INPUT=cudnn|triton forces the dX implementation of the step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import convt3d  # noqa: E402
from convt3d.engines.triton import backward as B  # noqa: E402
from convt3d.engines.triton import head_backward as HB  # noqa: E402
from convt3d.bench import suites  # noqa: E402
from convt3d.dispatch.select import cudnn_conv_tf32  # noqa: E402
from convt3d.core.validate import check_call  # noqa: E402


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3  # us


def conv_bwd(dy, x, w, params, mask, deterministic: bool, tf32: bool):
    old = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = deterministic
    try:
        with cudnn_conv_tf32(tf32):
            return torch.ops.aten.convolution_backward(
                dy, x, w, None, list(params.stride), list(params.padding), list(params.dilation), True,
                list(params.output_padding), params.groups, mask)
    finally:
        torch.backends.cudnn.deterministic = old


def dx_candidates(params, dtype, device, prec) -> tuple:
    """Every Triton dX configuration of the layer: the general kernel's, then the head kernels'."""
    return B.dgrad_candidates(params, dtype, device, prec) + (
        HB.dgrad_candidates(params, dtype, device) if HB.supports(params) else ())


def dw_candidates(params, dtype, device) -> tuple:
    """Every Triton dW configuration of the layer: the head kernels', then the general kernel's."""
    return (HB.wgrad_candidates(params, dtype, device) if HB.supports(params) else ()) + B.wgrad_candidates(
        params, dtype, device)


def run_case(case, accuracy: bool) -> dict:
    t = suites.make_tensors(case, "cuda", 0)
    g = case.geometry
    params, _ = check_call(t.x, t.w, t.b, *g.conv_args())
    prec, tf32 = "tf32", True  # default flags: TF32 on for fp32 (16-bit ignores the precision)
    row = {"case": case.name, "dtype": case.dtype, "layout": case.layout}
    with torch.no_grad():
        y = F.conv_transpose3d(t.x, t.w, t.b, *g.conv_args())
    dy = torch.randn_like(y)
    del y
    row["fwd_convt3d_us"] = bench(lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *g.conv_args()))
    row["fwd_cudnn_us"] = bench(lambda: F.conv_transpose3d(t.x, t.w, t.b, *g.conv_args()))
    for det in (True, False):
        tag = "det" if det else "default"
        row[f"dx_cudnn_{tag}_us"] = bench(lambda: conv_bwd(dy, t.x, t.w, params, [True, False, False], det, tf32))
        row[f"dw_cudnn_{tag}_us"] = bench(lambda: conv_bwd(dy, t.x, t.w, params, [False, True, False], det, tf32))
    row["db_us"] = bench(lambda: dy.sum(dim=(0, 2, 3, 4), dtype=torch.float32))
    row["dw_triton_us"] = {}
    for cfg in dw_candidates(params, t.x.dtype, t.x.device):
        try:
            row["dw_triton_us"][cfg.short()] = bench(lambda: B.wgrad_triton(dy, t.x, params, prec, t.w.dtype, cfg))
        except Exception as exc:  # noqa: BLE001 -- report and go on
            row["dw_triton_us"][cfg.short()] = f"{type(exc).__name__}: {exc}"[:300]
    # dX: dY as autograd hands it over (channels_last_3d for a cl input, NCDHW otherwise -- then the
    # timed call includes the NDHWC copy, TF32-rounding for fp32), dX in the input's layout.
    fx = B.grad_formats(t.x, t.w)[0]
    row["dx_triton_us"] = {}
    for cfg in dx_candidates(params, t.w.dtype, t.x.device, prec):
        try:
            row["dx_triton_us"][cfg.short()] = bench(
                lambda: B.dgrad_triton(dy, t.w, params, prec, t.x.dtype, cfg, fx))
        except Exception as exc:  # noqa: BLE001 -- report and go on
            row["dx_triton_us"][cfg.short()] = f"{type(exc).__name__}: {exc}"[:300]

    if accuracy:
        ref = torch.ops.aten.convolution_backward(
            dy.double(), t.x.double(), t.w.double(), None, list(params.stride), list(params.padding),
            list(params.dilation), True, list(params.output_padding), params.groups, [True, True, False])
        cud = conv_bwd(dy, t.x, t.w, params, [True, True, False], False, tf32)
        row["dx_err_cudnn"] = (cud[0].double() - ref[0]).abs().max().item()
        row["dw_err_cudnn"] = (cud[1].double() - ref[1]).abs().max().item()
        row["dw_scale"] = ref[1].abs().max().item()
        row["dx_scale"] = ref[0].abs().max().item()
        row["dx_err_triton"] = {}
        for cfg in dx_candidates(params, t.w.dtype, t.x.device, prec):
            gx = B.dgrad_triton(dy, t.w, params, prec, t.x.dtype, cfg, fx)
            row["dx_err_triton"][cfg.short()] = (gx.double() - ref[0]).abs().max().item()
            del gx
        row["dw_err_triton"] = {}
        for cfg in dw_candidates(params, t.x.dtype, t.x.device):
            gw = B.wgrad_triton(dy, t.x, params, prec, t.w.dtype, cfg)
            row["dw_err_triton"][cfg.short()] = (gw.double() - ref[1]).abs().max().item()
        del ref, cud

    # Full training step: convt3d (its backward tunes on the first call) vs nn.
    leaves = [v.detach().requires_grad_() for v in (t.x, t.w, t.b) if v is not None]
    bias = leaves[2] if len(leaves) > 2 else None

    def ours():
        out = convt3d.conv_transpose3d(leaves[0], leaves[1], bias, *g.conv_args())
        return torch.autograd.grad(out, leaves, dy)

    def theirs():
        out = F.conv_transpose3d(leaves[0], leaves[1], bias, *g.conv_args())
        return torch.autograd.grad(out, leaves, dy)

    row["full_convt3d_us"] = bench(ours)
    row["full_cudnn_us"] = bench(theirs)
    row["full_speedup"] = row["full_cudnn_us"] / row["full_convt3d_us"]
    rec = [c for k, c in B.choices().items() if k[3] == params and k[1] == t.x.dtype]
    if rec:
        row["bwd_choice"] = {"impl": rec[-1].impl, "config": rec[-1].config.short() if rec[-1].config else None,
                             "timings_ms": rec[-1].timings_ms}
    rec = [c for k, c in B.dgrad_choices().items() if k[3] == params and k[1] == t.x.dtype]
    if rec:
        row["bwd_choice_dx"] = {"impl": rec[-1].impl, "config": rec[-1].config.short() if rec[-1].config else None,
                                "timings_ms": rec[-1].timings_ms}
    return row


def host_us(fn, n: int = 50) -> float:
    """Host us per call: n calls enqueued without synchronising, timed on the CPU."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def profile_case(case) -> None:
    t = suites.make_tensors(case, "cuda", 0)
    args = case.geometry.conv_args()
    leaves = [v.detach().requires_grad_() for v in (t.x, t.w, t.b) if v is not None]
    bias = leaves[2] if len(leaves) > 2 else None
    with torch.no_grad():
        dy = torch.randn_like(F.conv_transpose3d(t.x, t.w, t.b, *args))

    def ours():
        return torch.autograd.grad(convt3d.conv_transpose3d(leaves[0], leaves[1], bias, *args), leaves, dy)

    def theirs():
        return torch.autograd.grad(F.conv_transpose3d(leaves[0], leaves[1], bias, *args), leaves, dy)

    def ours_fwd():
        return convt3d.conv_transpose3d(leaves[0], leaves[1], bias, *args)

    y = ours_fwd()

    def ours_bwd():
        return torch.autograd.grad(y, leaves, dy, retain_graph=True)

    print(f"== {case.label}: step ours {bench(ours):.1f} cudnn {bench(theirs):.1f}  fwd(grad) {bench(ours_fwd):.1f}"
          f"  bwd {bench(ours_bwd):.1f} us;  host: step {host_us(ours):.1f} cudnn {host_us(theirs):.1f}"
          f" fwd {host_us(ours_fwd):.1f} bwd {host_us(ours_bwd):.1f} us", flush=True)
    c = dy.shape[1]
    db = {"sum(0,2,3,4)": lambda: dy.sum(dim=(0, 2, 3, 4), dtype=torch.float32)}
    if dy.stride(1) == 1:
        db["rows[M,C].sum(0)"] = lambda: dy.permute(0, 2, 3, 4, 1).reshape(-1, c).sum(0, dtype=torch.float32)
        db["ones @ rows[M,C]"] = lambda: (torch.ones(1, dy.numel() // c, device="cuda", dtype=dy.dtype)
                                         @ dy.permute(0, 2, 3, 4, 1).reshape(-1, c))
    else:
        db["view[N,C,S].sum((0,2))"] = lambda: dy.view(dy.shape[0], c, -1).sum((0, 2), dtype=torch.float32)
        db["view[N,C,S].sum(2).sum(0)"] = lambda: dy.view(dy.shape[0], c, -1).sum(2, dtype=torch.float32).sum(0)
    print("   db: " + ", ".join(f"{k} {bench(f):.1f}" for k, f in db.items())
          + f" us ({dy.numel() * dy.element_size() / 1e6:.1f} MB)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ours()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default=None)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_training.json"))
    p.add_argument("--accuracy", action="store_true")
    p.add_argument("--profile", action="store_true", help="where one step's time goes (see the docstring)")
    args = p.parse_args()
    names = args.case.split(",") if args.case else None
    cases = [c for c in suites.select("layers", names)
             if (c.dtype, c.layout) in (("bf16", "cl"), ("fp32", "ncdhw"))]
    if args.profile:
        for case in cases:
            profile_case(case)
            torch.cuda.empty_cache()
        return 0
    rows = []
    for case in cases:
        try:
            row = run_case(case, args.accuracy)
        except Exception as exc:  # noqa: BLE001
            row = {"case": case.name, "dtype": case.dtype, "layout": case.layout, "error": repr(exc)[:500]}
        rows.append(row)
        best_tr = min((v for v in row.get("dw_triton_us", {}).values() if isinstance(v, float)), default=math.nan)
        best_dx = min((v for v in row.get("dx_triton_us", {}).values() if isinstance(v, float)), default=math.nan)
        print(f"{case.label:<36} fwd {row.get('fwd_convt3d_us', math.nan):8.1f}/{row.get('fwd_cudnn_us', math.nan):8.1f}"
              f"  dX det {row.get('dx_cudnn_det_us', math.nan):8.1f} dflt {row.get('dx_cudnn_default_us', math.nan):8.1f}"
              f" triton {best_dx:8.1f}"
              f"  dW det {row.get('dw_cudnn_det_us', math.nan):8.1f} dflt {row.get('dw_cudnn_default_us', math.nan):8.1f}"
              f" triton {best_tr:8.1f}  full {row.get('full_convt3d_us', math.nan):8.1f}/"
              f"{row.get('full_cudnn_us', math.nan):8.1f} = {row.get('full_speedup', math.nan):.2f}x"
              f"  dX {row.get('bwd_choice_dx', {}).get('impl', '')} dW {row.get('bwd_choice', {}).get('impl', '')}"
              f" {row.get('error', '')}", flush=True)
        torch.cuda.empty_cache()
    sp = [r["full_speedup"] for r in rows if "full_speedup" in r]
    if sp:
        print(f"full step: geomean {math.exp(sum(map(math.log, sp)) / len(sp)):.2f}x, min {min(sp):.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
