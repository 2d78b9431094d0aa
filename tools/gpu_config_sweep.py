"""Tile and launch configurations of the Triton forward engine, timed one by one on the GPU.

Per bench case (the same tensors as ``convt3d bench``): cuDNN at the engine precision's TF32 flag
and ``zero_()`` of the output (the call's write floor); then per configuration ``Launch.run(config)``
-- every kernel of the call, as the tuner times it -- by do_bench (``--graph``: CUDA-graph replay,
without the host's launch cost), its compile seconds, TFLOP/s, max abs error against float64 and
the main kernel's registers, spills, shared memory, MMA kind and TMA use; ``--kernels``: the
per-kernel breakdown of the best configuration and the tuner's own choice. Configurations: the
engine's candidates (``--candidates``, the default), variants of the first one (``--set
KEY=VALUE[,...]`` of ``Config`` fields, e.g. ``BLOCK_M=256,num_warps=8``, ``tma=False``, one variant
each; a BLOCK_M override re-derives BLOCK_W).

    PYTHONPATH=src python3 tools/gpu_config_sweep.py kb77 --precision tf32 --set num_stages=4 --kernels
    PYTHONPATH=src python3 tools/gpu_config_sweep.py kb61,kb73 --precision tf32x3 --set BLOCK_M=256,num_warps=8
    PYTHONPATH=src python3 tools/gpu_config_sweep.py head_gan_64to1 --dtype bf16 --layout cl --candidates --graph
    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/gpu_config_sweep.py kb77 --set num_stages=4   # script check

Prints one JSON line per measurement (``--json FILE`` also writes them as one list); a configuration
that fails to compile or launch prints an ``error`` line and the sweep goes on. Without a GPU the
interpreter runs the bench's reduced shapes: a check of the script, its times mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses as dc
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from convt3d.engines.triton import engine as E
from convt3d.bench import suites
from convt3d.core.validate import check_call
from convt3d.engines.triton.configs import block_w, tuning_log
from convt3d.engines.triton.sites import interpreter_active

# Above this many output elements the float64 reference is skipped (host/GPU memory and time).
REF_MAX_ELEMENTS = 6e8
ROWS: list[dict] = []


def emit(**kw) -> None:
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


GRAPH = False  # --graph: time by CUDA-graph replay


def bench_us(fn, rep: int) -> float:
    if not torch.cuda.is_available():  # the interpreter check: one call, wall time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    if GRAPH:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def compiler_facts(handle) -> dict:
    """Registers, spills, shared memory, MMA kind and TMA use of a compiled Triton kernel."""
    if handle is None:
        return {}
    try:
        ptx = handle.asm["ptx"]
        mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "fma")
        return {"regs": handle.n_regs, "spills": handle.n_spills, "smem": handle.metadata.shared, "mma": mma,
                "tma": "cp.async.bulk.tensor" in ptx}
    except Exception as exc:  # noqa: BLE001 -- facts are optional
        return {"facts_error": repr(exc)[:200]}


def parse_set(text: str) -> dict:
    """``"BLOCK_M=256,num_warps=8,tma=False"`` -> overrides with Config's field types."""
    types = {f.name: f.type for f in dc.fields(E.Config)}
    out = {}
    for item in filter(None, text.split(",")):
        key, _, raw = item.partition("=")
        if key not in types:
            raise SystemExit(f"--set: {key!r} is not a Config field; fields: {', '.join(types)}")
        consts = {"True": True, "False": False, "None": None}
        out[key] = consts[raw] if raw in consts else int(raw) if raw.lstrip("-").isdigit() else raw
    return out


def variant(base: E.Config, params, overrides: dict) -> E.Config:
    cfg = dc.replace(base, **overrides)
    if "BLOCK_M" in overrides and "BLOCK_W" not in overrides:
        if cfg.flat:
            cfg = dc.replace(cfg, BLOCK_W=cfg.BLOCK_M)
        else:
            hw = tuple(max(ph.axes[i].size for ph in params.phases if not ph.empty) for i in (1, 2))
            cfg = dc.replace(cfg, BLOCK_W=block_w(hw, cfg.BLOCK_M))
    return cfg


def configs_for(launch, params, args) -> list[E.Config]:
    cands = list(launch.configs)
    out = cands if args.candidates or not args.set else []
    return list(dict.fromkeys(out + [variant(cands[0], params, parse_set(s)) for s in args.set]))


def kernels_of(fn, n: int = 5) -> dict[str, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {ev.key[:48]: round(ev.device_time_total / n, 1) for ev in prof.key_averages()
            if ev.device_type == torch.autograd.DeviceType.CUDA}


def run_case(case, prec: str, args) -> None:
    g = case.geometry
    if torch.cuda.is_available():
        t = suites.make_tensors(case, "cuda")
    else:
        g = suites.reduced_for_interpreter(g)
        t = suites.make_tensors(case, "cpu", geometry=g)
    cargs = g.conv_args()
    params, _ = check_call(t.x, t.w, t.b, *cargs)
    tf32 = prec == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32  # cuDNN at the engine's precision: TF32 only for "tf32"
    t_cudnn = bench_us(lambda: F.conv_transpose3d(t.x, t.w, t.b, *cargs), args.rep)
    torch.backends.cudnn.allow_tf32 = True
    ref = None
    if math.prod(params.out_shape) < REF_MAX_ELEMENTS:
        ref = F.conv_transpose3d(t.x.double(), t.w.double(), None if t.b is None else t.b.double(), *cargs)
    launch = E.prepare(t.x, t.w, t.b, params, prec)
    t_zero = bench_us(lambda: launch.y.zero_(), args.rep)
    emit(what="case", case=case.label, precision=prec, cudnn_us=round(t_cudnn, 1), zero_output_us=round(t_zero, 1),
         useful_gflop=round(params.useful_flops / 1e9, 2), candidates=len(launch.configs))
    best = None
    for cfg in configs_for(launch, params, args):
        try:
            launch.y.fill_(float("nan"))  # a config that leaves elements unwritten shows as a NaN error
            t0 = time.perf_counter()
            handle = launch.run(cfg)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            err = None if ref is None else (launch.y.double() - ref).abs().max().item()
            us = bench_us(lambda: launch.run(cfg), args.rep)
            emit(what="config", case=case.label, precision=prec, config=cfg.short(), us=round(us, 1),
                 vs_cudnn=round(t_cudnn / us, 2), tflops=round(params.useful_flops / us / 1e6, 1),
                 compile_s=round(compile_s, 2), err=err, **compiler_facts(handle))
            if best is None or us < best[0]:
                best = (us, cfg)
        except Exception as exc:  # noqa: BLE001 -- a probe: record and go on
            emit(what="config", case=case.label, precision=prec, config=cfg.short(), error=repr(exc)[:400])
    if args.kernels and best is not None and torch.cuda.is_available():
        cfg = best[1]
        emit(what="kernels", case=case.label, precision=prec, config=cfg.short(),
             kernels_us=kernels_of(lambda: E.forward(t.x, t.w, t.b, params, prec, config=cfg)))
        E.forward(t.x, t.w, t.b, params, prec)  # the tuner's own choice (first call of the signature)
        rec = tuning_log().get(launch.tune_key)
        if rec is not None:
            emit(what="tuned", case=case.label, precision=prec, config=rec.config.short(),
                 seconds=round(rec.seconds, 2), timings_ms=rec.timings_ms)
    del t, ref, launch
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", help="comma-separated bench case names (kb77, aniso_122, ...)")
    ap.add_argument("--precision", default="tf32", choices=E.PRECISIONS, help="engine precision (fp32 inputs)")
    ap.add_argument("--dtype", default="fp32", choices=tuple(suites.DTYPES))
    ap.add_argument("--layout", default="ncdhw", choices=suites.LAYOUTS)
    ap.add_argument("--candidates", action="store_true", help="time the engine's candidate list")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=V[,KEY=V]",
                    help="one variant of the first candidate per --set")
    ap.add_argument("--kernels", action="store_true", help="per-kernel breakdown of the best config, tuner choice")
    ap.add_argument("--rep", type=int, default=60, help="do_bench budget per timing (ms)")
    ap.add_argument("--graph", action="store_true",
                    help="time by CUDA-graph replay (kernel time without the host's launch cost)")
    ap.add_argument("--json", default=None, help="also write every row to this file")
    args = ap.parse_args(argv)
    global GRAPH
    GRAPH = args.graph
    if not torch.cuda.is_available() and not interpreter_active():
        print("needs a CUDA device (or TRITON_INTERPRET=1 for a check through the interpreter)", file=sys.stderr)
        return 2
    names = args.cases.split(",")
    cases = suites.select("all", names, dtypes=[args.dtype], layouts=[args.layout], precisions=["default"])
    emit(what="env", gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "interpreter",
         torch=torch.__version__, triton=triton.__version__, cudnn=torch.backends.cudnn.version())
    try:
        for case in cases:
            run_case(case, args.precision, args)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ROWS, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
