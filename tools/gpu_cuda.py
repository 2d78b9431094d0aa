"""The CUDA C++ engines on the GPU, one sub-command each; the first use of an engine builds its
extension (TORCH_EXTENSIONS_DIR keeps the build for later processes).

``variants`` -- the forward engine's kernel variants (``cuda_engine``), per KernelBench problem:
the build seconds, then per variant (gemm_kernel tiles, and phase_kernel tiles with both inner
loops) the max abs error against float64, allclose(atol=rtol=1e-4), whether a second call is
bitwise equal, the do_bench median (us) with TFLOP/s of useful work, and cuDNN (TF32 off and
default) and ``zero_()`` of the output (the memory floor) on the same input for scale. The
default variant (``choose_variant``) is marked with '*'. Options: ``--problem`` (KernelBench ids,
default 77), ``--rep`` (do_bench ms per variant), ``--variants`` (names, default all but direct).

``head`` -- the output-head kernel (``cuda_head``): correctness against float64 on ``--cases``
generated geometries, then its kernel time per offered tile against cuDNN on the head rows
(layers suite and the heads sweep). Correctness: each geometry at fp32 (TF32), bf16 and fp16,
channels-last, NCDHW and a strided view, with and without bias, every offered tile up to
``--tiles``; the output is poisoned with NaN first. A case passes when its error (max |y - ref|
/ max |ref|, ref in float64) is within twice cuDNN's own at the same dtype and flags, or within
the dtype's rounding floor where cuDNN happens to be closer than that. Timing:
``triton.testing.do_bench`` medians (L2 flushed before each call), kernel alone on a packed
weight, the public ``cuda_head.forward`` (weight packing included), and ``F.conv_transpose3d``
at default flags, in one process. ``--profile ROW:DTYPE:JN:CONFIG:BD:BH:BW`` only launches one
plan three times, for ncu. Exits 1 if a correctness case fails.

Run on the GPU machine:

    PYTHONPATH=src python3 tools/gpu_cuda.py variants --problem 77,58,61 [--rep 200] [--variants g64,g32,p8c16]
    PYTHONPATH=src python3 tools/gpu_cuda.py head --json $OUT/cuda_head.json [--rows head_gan_64to1 --cases 10]
    ncu --section SourceCounters -k regex:head_shuffle -c 1 -o rep \\
        python3 tools/gpu_cuda.py head --profile head_gan_64to1:fp32:2:6:4:4:8
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

from convt3d.engines.cuda import gemm as E
from convt3d.engines.cuda import head as ch
from convt3d.bench.suites import HEAD_SWEEP, LAYERS
from convt3d.kernelbench.problems import parse_ids
from convt3d.core.params import ConvT3dParams
from convt3d.core.validate import check_call


# ---- the forward engine's variants (``variants``) ----------------------------------------------
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


# ---- the output-head kernel (``head``) ----------------------------------------------------------
# The memory floor's copy rate: the H200's device-to-device copy, read + write bytes per second.
COPY_BW = 4.24e12
# Relative error a head output may always have, per dtype: its rounding floor where cuDNN
# happens to be closer than that.
FLOOR_REL = {torch.float32: 2e-3, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _params(batch, cin, cout, groups, size, k, s, p, op):
    return ConvT3dParams.create(batch, cin, cout, groups, size, k, s, p, op, (1, 1, 1))


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "cl":
        return x.contiguous(memory_format=torch.channels_last_3d)
    if layout == "strided":  # every other width element of a wider tensor
        wide = torch.empty(*x.shape[:4], 2 * x.shape[4], dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x.contiguous()


def correctness(count: int, tiles: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    tried = 0
    while tried < count:
        k = tuple(rng.choice([1, 2, 3, 4, 5]) for _ in range(3))
        s = tuple(rng.choice([1, 2, 2, 3]) for _ in range(3))
        p = tuple(rng.randint(0, k[i] - 1) for i in range(3))
        op = tuple(rng.randint(0, s[i] - 1) for i in range(3))
        groups = rng.choice([1, 1, 1, 2, 3])
        cog = rng.randint(1, 15)
        cin = groups * rng.choice([1, 3, 8, 16, 17, 32, 40, 64, 72])
        batch = rng.randint(1, 3)
        size = tuple(rng.randint(1, 13) for _ in range(3))
        try:
            params = _params(batch, cin, cog * groups, groups, size, k, s, p, op)
        except Exception:
            continue
        if min(params.out_size) <= 0 or ch.unsupported_reason(params, torch.bfloat16, "tf32") is not None:
            continue
        tried += 1
        x64 = torch.randn(batch, cin, *size, dtype=torch.float64, device="cuda")
        w64 = torch.randn(cin, cog, *k, dtype=torch.float64, device="cuda")
        b64 = torch.randn(cog * groups, dtype=torch.float64, device="cuda") if rng.random() < 0.6 else None
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x0, w = x64.to(dtype), w64.to(dtype)
            b = b64.to(dtype) if b64 is not None else None
            ref = F.conv_transpose3d(x0.double(), w.double(), b.double() if b is not None else None, s, p, op, groups)
            scale = ref.abs().max().item() or 1.0
            cud = F.conv_transpose3d(x0, w, b, s, p, op, groups)
            e_cudnn = (cud.double() - ref).abs().max().item() / scale
            layout = rng.choice(["ncdhw", "cl", "strided"])
            x = _layout(x0, layout)
            for jn, cfg, box in ch.offers(params, dtype, tiles):
                hp = ch.plan(params, dtype, cfg, box, jn=jn)
                y = ch._output(x, w, params).fill_(float("nan"))
                ch._launch(x, ch.pack_weight(w, params, hp), b, y, hp)
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(y).all())
                e = (y.double() - ref).abs().max().item() / scale if finite else float("inf")
                ok = finite and e <= max(2 * e_cudnn, FLOOR_REL[dtype])
                rows.append(dict(params=params.describe(), dtype=str(dtype), layout=layout, bias=b is not None,
                                 config=cfg, box=box, jn=jn, err=e, err_cudnn=e_cudnn, ok=ok))
                if not ok:
                    print(f"FAIL {params.describe()} {dtype} {layout} cfg {cfg} box {box} jn {jn}: err {e:.3g} "
                          f"cuDNN {e_cudnn:.3g}", flush=True)
    return rows


def _row_params(g) -> ConvT3dParams:
    return ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel, g.stride,
                                g.padding, g.output_padding, g.dilation)


def _row_tensors(g, dtype: torch.dtype, layout: str):
    """A suite row's input (in ``layout``), weight and bias, from a fixed seed."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _layout(torch.randn(g.batch, g.in_channels, *g.in_size, device="cuda", generator=gen).to(dtype), layout)
    w = (torch.randn(g.weight_shape, device="cuda", generator=gen) * 0.05).to(dtype)
    b = torch.randn(g.out_channels, device="cuda", generator=gen).to(dtype) if g.bias else None
    return x, w, b


def timing(names: list[str], dtypes, layouts, tiles: int, budget_s: float, stage_variants=(None,)) -> list[dict]:
    geos = [g for g in LAYERS + HEAD_SWEEP if g.name in names or (names == ["all"] and (
        g.name.startswith("head_") or g.name.startswith("sweep")))]
    out = []
    t_end = time.perf_counter() + budget_s
    for g in geos:
        params = _row_params(g)
        for dtype in dtypes:
            why = ch.unsupported_reason(params, dtype, "tf32")
            if why is not None:
                print(f"{g.name} {dtype}: not taken ({why})", flush=True)
                continue
            for layout in layouts:
                if time.perf_counter() > t_end:
                    print("time budget spent", flush=True)
                    return out
                x, w, b = _row_tensors(g, dtype, layout)
                args = (g.stride, g.padding, g.output_padding, g.groups, g.dilation)
                ref = F.conv_transpose3d(x, w, b, *args)
                ms_cudnn = triton.testing.do_bench(lambda: F.conv_transpose3d(x, w, b, *args), return_mode="median")
                best = None
                per_tile = []
                for jn, cfg, box, st in [(jn, c, bx, st) for jn, c, bx in ch.offers(params, dtype, tiles)
                                         for st in stage_variants]:
                    hp = ch.plan(params, dtype, cfg, box, stages=st, jn=jn)
                    if hp.meta[31] > ch.SMEM_LIMIT or (
                            st is not None and st == ch.plan(params, dtype, cfg, box, jn=jn).stages):
                        continue
                    wp = ch.pack_weight(w, params, hp)
                    y = ch._output(x, w, params)
                    ms = triton.testing.do_bench(lambda: ch._launch(x, wp, b, y, hp), return_mode="median")
                    diff = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    per_tile.append((cfg, box, hp.stages, ms * 1e3, diff, jn))
                    if best is None or ms < best[0]:
                        best = (ms, cfg, box, diff, hp.stages, jn)
                ch.clear()
                ch.forward(x, w, b, params, "tf32")  # first call: the tile choice
                ms_api = triton.testing.do_bench(lambda: ch.forward(x, w, b, params, "tf32"), return_mode="median")
                floor_us = params.min_bytes(x.element_size(), b is not None) / COPY_BW * 1e6
                row = dict(name=g.name, dtype=str(dtype).replace("torch.", ""), layout=layout,
                           cudnn_us=ms_cudnn * 1e3, kernel_us=best[0] * 1e3, api_us=ms_api * 1e3,
                           best_config=best[1], best_box=best[2], best_stages=best[4], best_jn=best[5],
                           rel_diff_vs_cudnn=best[3], floor_us=floor_us, api_jn=ch.choose_tile(x, w, b, params).jn,
                           tiles=per_tile)
                out.append(row)
                print(f"{g.name:28s} {row['dtype']:8s} {layout:6s} cuDNN {row['cudnn_us']:8.1f}  kernel "
                      f"{row['kernel_us']:7.1f} ({ms_cudnn / best[0]:5.2f}x, {100 * floor_us / row['kernel_us']:4.0f}% "
                      f"of floor {floor_us:5.1f})  api {row['api_us']:7.1f} ({ms_cudnn * 1e3 / row['api_us']:5.2f}x)  "
                      f"cfg {best[1]} box {best[2]} stages {best[4]} jn {best[5]} diff {best[3]:.2g}", flush=True)
                by_jn = {}
                for t in per_tile:
                    by_jn[t[5]] = min(by_jn.get(t[5], float("inf")), t[3])
                print("    best kernel us by variant: " + ", ".join(f"jn {k}: {v:.1f}" for k, v in sorted(by_jn.items())),
                      flush=True)
    return out


def profile(spec: str) -> None:
    """Launch one plan three times on a channels-last input, for a profiler: ``spec`` is
    ROW:DTYPE:JN:CONFIG:BD:BH:BW (a layers or heads-sweep row; fp32 or bf16; the width shifts taken
    as columns, 1 for the plain variant; the configuration and the M box)."""
    name, dt, jn, cfg, bd, bh, bw = spec.split(":")
    g = next(g for g in LAYERS + HEAD_SWEEP if g.name == name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
    params = _row_params(g)
    x, w, b = _row_tensors(g, dtype, "cl")
    hp = ch.plan(params, dtype, int(cfg), (int(bd), int(bh), int(bw)), jn=int(jn))
    wp, y = ch.pack_weight(w, params, hp), ch._output(x, w, params)
    for _ in range(3):
        ch._launch(x, wp, b, y, hp)
    torch.cuda.synchronize()
    print(f"{name} {dt} jn {hp.jn} config {hp.config} box {hp.box} stages {hp.stages} smem {hp.meta[31]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("variants", help="the forward engine's kernel variants per KernelBench problem")
    sp.add_argument("--problem", default="77", help="KernelBench problem ids, comma-separated (default 77)")
    sp.add_argument("--rep", type=int, default=200, help="do_bench rep (ms of timing per variant)")
    sp.add_argument("--variants", default=None, help="comma-separated variant names (default: all but direct)")
    sp = sub.add_parser("head", help="the output-head kernel: correctness, then time per offered tile")
    sp.add_argument("--json", default=None, help="write every correctness case and timing here")
    sp.add_argument("--cases", type=int, default=40, help="generated geometries for the correctness check")
    sp.add_argument("--tiles", type=int, default=3, help="offered tiles checked / timed per case and variant")
    sp.add_argument("--rows", default="all", help="comma-separated layer names, or 'all' head and sweep rows")
    sp.add_argument("--dtypes", default="fp32,bf16")
    sp.add_argument("--layouts", default="ncdhw,cl")
    sp.add_argument("--budget", type=float, default=300.0, help="seconds for the timing part")
    sp.add_argument("--seed", type=int, default=1)
    sp.add_argument("--stages", default="default",
                    help="stage counts timed per tile: 'default' (the plan's), or e.g. 'default,1,2'")
    sp.add_argument("--profile", default=None, metavar="ROW:DTYPE:JN:CONFIG:BD:BH:BW",
                    help="only launch this one plan three times (for ncu)")
    args = ap.parse_args(argv)
    if args.cmd == "variants":
        for problem in parse_ids(args.problem):
            run_problem(problem, args)
        return 0
    return head_main(args)


def head_main(args) -> int:
    if args.profile:
        profile(args.profile)
        return 0
    t0 = time.perf_counter()
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        ch.load_library(dtype=dt)
        print(f"library {dt}: build/load {ch.build_seconds(dt):.1f} s", flush=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
          flush=True)
    rows = correctness(args.cases, args.tiles, args.seed) if args.cases else []
    bad = [r for r in rows if not r["ok"]]
    worst = max((r["err"] / max(r["err_cudnn"], 1e-30) for r in rows), default=0.0)
    print(f"correctness: {len(rows) - len(bad)} of {len(rows)} passed; worst error / cuDNN's {worst:.2f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    timed = timing(args.rows.split(","), [dt[d] for d in args.dtypes.split(",")], args.layouts.split(","),
                   args.tiles, args.budget,
                   tuple(None if v == "default" else int(v) for v in args.stages.split(",")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           cudnn=torch.backends.cudnn.version(), correctness=rows, timing=timed), f, indent=1,
                      default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
