"""GPU script for the CUDA engine (issue 6): build, correctness on KernelBench 77, and the time of
every tile variant x inner loop on it, in one call.

    python scripts/gpu_cuda.py [--problem 77] [--rep 200]

Prints the build seconds (first use in this process: compile, or load from the torch extensions
cache), max abs error against float64 and allclose(1e-4), then a table of do_bench medians (ms)
with TFLOP/s of useful work, and cuDNN (TF32 off and default) on the same input for scale.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton.testing

from convt3d import cuda_engine as E
from convt3d.kernelbench.problems import by_id
from convt3d.validate import check_call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", type=int, default=77)
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms of timing per variant)")
    args = ap.parse_args()
    problem = by_id(args.problem)
    torch.manual_seed(0)
    layer = torch.nn.ConvTranspose3d(**problem.layer_args(), device="cuda")
    x = torch.rand(*problem.input_shape, device="cuda")
    w = layer.weight.detach()
    b = None if layer.bias is None else layer.bias.detach()
    cargs = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    params, _ = check_call(x, w, b, *cargs)
    print(f"problem {problem.id}: {problem.describe()}; {torch.cuda.get_device_name()}")
    print(params.describe())

    t0 = time.perf_counter()
    y = E.forward(x, w, b, params)
    torch.cuda.synchronize()
    print(f"first call {time.perf_counter() - t0:.1f} s, build_seconds() = {E.build_seconds():.1f} s; "
          f"default variant {E.choose_variant(params)}, hreuse {E.hreuse_applies(params)}")
    ref = F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), *cargs)
    err = (y.double() - ref).abs().max().item()
    print(f"max abs err vs float64 {err:.3e}; allclose(1e-4): {torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4)}")
    del ref

    flops = params.useful_flops
    rows = []
    for name in E.VARIANTS:
        if name == "direct":
            continue
        for hreuse in (False, True):
            yv = E.forward(x, w, b, params, variant=name, hreuse=hreuse)
            ok = torch.equal(yv, y) or torch.allclose(yv, y, atol=1e-5, rtol=1e-5)
            ms = triton.testing.do_bench(lambda: E.forward(x, w, b, params, variant=name, hreuse=hreuse),
                                         warmup=25, rep=args.rep, return_mode="median")
            rows.append((name, hreuse, ms, ok))
            print(f"  {name:8s} hreuse={int(hreuse)}  {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s  "
                  f"agrees={ok}", flush=True)
    for tf32 in (False, True):
        torch.backends.cudnn.allow_tf32 = tf32
        ms = triton.testing.do_bench(lambda: F.conv_transpose3d(x, w, b, *cargs), warmup=10, rep=args.rep,
                                     return_mode="median")
        print(f"  cuDNN tf32={tf32}: {ms * 1e3:8.1f} us")
    ms = triton.testing.do_bench(lambda: torch.empty_like(y).zero_(), warmup=10, rep=50, return_mode="median")
    print(f"  output zero_() (memory floor): {ms * 1e3:8.1f} us")
    best = min(rows, key=lambda r: r[2])
    print(f"best: {best[0]} hreuse={best[1]} at {best[2] * 1e3:.1f} us")


if __name__ == "__main__":
    main()
