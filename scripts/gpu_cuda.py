"""The CUDA C++ engine's kernel variants on the GPU: build, then per KernelBench problem the
correctness and the time of every variant, in one call.

Run on the GPU machine (the first use builds the extension, ~60-75 s; TORCH_EXTENSIONS_DIR keeps
the build for later processes):

    PYTHONPATH=src python3 scripts/gpu_cuda.py [--problem 77[,58,61,...]] [--rep 200] [--variants g64,g32,p8c16]
    PYTHONPATH=src python3 scripts/gpu_cuda.py --problem 77 --variants g64k32,g64r   # halo window vs the default

Prints the build seconds (first use in this process: compile, or load from the torch extensions
cache); then per problem and variant (phase_kernel tiles with both inner loops, gemm_kernel tiles)
the max abs error against float64 and allclose(atol=rtol=1e-4), the do_bench median (us) with
TFLOP/s of useful work, and cuDNN (TF32 off and default) on the same input for scale. The
default variant (``choose_variant``) is marked with '*'.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton.testing

from convt3d import cuda_engine as E
from convt3d.kernelbench.problems import parse_ids
from convt3d.validate import check_call


def _variants(selected: str | None) -> list[tuple[str, bool]]:
    """(variant, hreuse) pairs to time: gemm tiles first, then phase tiles with both inner loops."""
    names = [v for v in E.variant_names() if v != "direct"]
    if selected:
        wanted = [v.strip() for v in selected.split(",") if v.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {names}")
        names = [v for v in names if v in wanted]
    gemm = [(v, False) for v in names if v in E.GEMM_VARIANTS]
    phase = [(v, h) for v in names if v in E.VARIANTS for h in (False, True)]
    return gemm + phase


def run_problem(problem, args) -> None:
    torch.manual_seed(0)
    layer = torch.nn.ConvTranspose3d(**problem.layer_args(), device="cuda")
    x = torch.rand(*problem.input_shape, device="cuda")
    w = layer.weight.detach()
    b = None if layer.bias is None else layer.bias.detach()
    cargs = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    params, _ = check_call(x, w, b, *cargs)
    default = E.choose_variant(params)
    print(f"\nproblem {problem.id}: {problem.describe()}; {torch.cuda.get_device_name()}")
    print(params.describe())
    print(f"default variant {default}; hreuse applies {E.hreuse_applies(params)}; "
          f"gemm plan {E.launch_plan(params, 'g64', False)}")
    for name in E.HALO_VARIANTS:  # the window variants run their plain tile where halo_layout refuses
        print(f"{name} plan {E.launch_plan(params, name, False)}")

    t0 = time.perf_counter()
    y = E.forward(x, w, b, params)
    torch.cuda.synchronize()
    print(f"first call {time.perf_counter() - t0:.1f} s, build_seconds() = {E.build_seconds():.1f} s")
    ref = F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), *cargs)
    del y

    flops = params.useful_flops
    rows = []
    for name, hreuse in _variants(args.variants):
        yv = E.forward(x, w, b, params, variant=name, hreuse=hreuse)
        torch.cuda.synchronize()
        err = (yv.double() - ref).abs().max().item()
        ok = torch.allclose(yv.double(), ref, atol=1e-4, rtol=1e-4)
        again = torch.equal(yv, E.forward(x, w, b, params, variant=name, hreuse=hreuse))
        del yv
        ms = triton.testing.do_bench(lambda: E.forward(x, w, b, params, variant=name, hreuse=hreuse),
                                     warmup=25, rep=args.rep, return_mode="median")
        rows.append((name, hreuse, ms, ok))
        mark = "*" if name == default and (name in E.GEMM_VARIANTS or hreuse == E.hreuse_applies(params)) else " "
        print(f" {mark}{name:6s} hreuse={int(hreuse)}  {ms * 1e3:9.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s  "
              f"max abs err {err:.2e}  allclose(1e-4) {ok}  bitwise-repeatable {again}", flush=True)
    del ref
    for tf32 in (False, True):
        torch.backends.cudnn.allow_tf32 = tf32
        ms = triton.testing.do_bench(lambda: F.conv_transpose3d(x, w, b, *cargs), warmup=10, rep=args.rep,
                                     return_mode="median")
        print(f"  cuDNN tf32={tf32}: {ms * 1e3:9.1f} us")
    torch.backends.cudnn.allow_tf32 = True
    out = torch.empty(params.out_shape, device="cuda")
    ms = triton.testing.do_bench(lambda: out.zero_(), warmup=10, rep=50, return_mode="median")
    print(f"  output zero_() (memory floor): {ms * 1e3:9.1f} us")
    del out
    good = [r for r in rows if r[3]]
    if good:
        best = min(good, key=lambda r: r[2])
        print(f"best correct: {best[0]} hreuse={int(best[1])} at {best[2] * 1e3:.1f} us "
              f"({flops / best[2] / 1e9:.1f} TFLOP/s)")
    bad = [f"{r[0]}/hreuse={int(r[1])}" for r in rows if not r[3]]
    if bad:
        print(f"NOT allclose: {', '.join(bad)}")
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", default="77", help="KernelBench problem ids, comma-separated (default 77)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms of timing per variant)")
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all but direct)")
    args = ap.parse_args()
    for problem in parse_ids(args.problem):
        run_problem(problem, args)


if __name__ == "__main__":
    main()
