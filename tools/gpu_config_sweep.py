"""Tile and launch configurations of the Triton forward engine, timed one by one on the GPU.

Per bench case (the tensors of ``convt3d bench``): cuDNN at the engine precision's TF32 flag, then
per configuration ``Launch.run(config)`` -- every kernel of the call, as the tuner times it -- by
do_bench (``--graph``: CUDA-graph replay, without the host's launch cost), with its compile seconds,
max abs error against float64 and the main kernel's registers, spills, shared memory and MMA kind.
Configurations: the engine's candidates (``--candidates``, the default) and one variant of the
first candidate per ``--set KEY=VALUE[,...]`` of its fields (a BLOCK_M override re-derives BLOCK_W).
Prints one JSON line per measurement; a configuration that fails prints an ``error`` line and the
sweep goes on. Under TRITON_INTERPRET=1 it checks the script on the bench's reduced shapes.

    PYTHONPATH=src python3 tools/gpu_config_sweep.py kb61,kb73 --precision tf32x3 --set BLOCK_M=256,num_warps=8
    PYTHONPATH=src python3 tools/gpu_config_sweep.py head_gan_64to1 --dtype bf16 --layout cl --candidates --graph
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
import triton.testing

from convt3d.bench import suites
from convt3d.core.validate import check_call
from convt3d.engines.triton import engine as E
from convt3d.engines.triton.configs import block_w
from convt3d.engines.triton.sites import interpreter_active

# Above this many output elements the float64 reference is skipped (host/GPU memory and time).
REF_MAX_ELEMENTS = 6e8


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def bench_us(fn, args) -> float:
    if not torch.cuda.is_available():  # the interpreter check: one call, wall time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    if args.graph:
        return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=args.rep, return_mode="median") * 1e3


def compiler_facts(handle) -> dict:
    """Registers, spills, shared memory and MMA kind of a compiled Triton kernel, where it has them."""
    try:
        ptx = handle.asm["ptx"]
        mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "fma")
        return {"regs": handle.n_regs, "spills": handle.n_spills, "smem": handle.metadata.shared, "mma": mma}
    except Exception:  # noqa: BLE001 -- facts are optional: the timing stands without them
        return {}


def variant(base: E.Config, params, text: str) -> E.Config:
    """``base`` with ``"BLOCK_M=256,num_warps=8,tma=False"`` applied, values typed as its fields."""
    fields = {f.name for f in dc.fields(base)}
    consts = {"True": True, "False": False, "None": None}
    overrides = {}
    for item in filter(None, text.split(",")):
        key, _, raw = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set: {key!r} is not a field of {type(base).__name__}: {', '.join(sorted(fields))}")
        overrides[key] = consts[raw] if raw in consts else int(raw) if raw.lstrip("-").isdigit() else raw
    cfg = dc.replace(base, **overrides)
    if isinstance(cfg, E.Config) and "BLOCK_M" in overrides and "BLOCK_W" not in overrides:
        hw = tuple(max(ph.axes[i].size for ph in params.phases if not ph.empty) for i in (1, 2))
        cfg = dc.replace(cfg, BLOCK_W=cfg.BLOCK_M if cfg.flat else block_w(hw, cfg.BLOCK_M))
    return cfg


def run_case(case, args) -> None:
    g = case.geometry if torch.cuda.is_available() else suites.reduced_for_interpreter(case.geometry)
    t = suites.make_tensors(case, "cuda" if torch.cuda.is_available() else "cpu", geometry=g)
    cargs = g.conv_args()
    params, _ = check_call(t.x, t.w, t.b, *cargs)
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"  # cuDNN at the engine's precision
    t_cudnn = bench_us(lambda: F.conv_transpose3d(t.x, t.w, t.b, *cargs), args)
    torch.backends.cudnn.allow_tf32 = True
    ref = None
    if math.prod(params.out_shape) < REF_MAX_ELEMENTS:
        ref = F.conv_transpose3d(t.x.double(), t.w.double(), None if t.b is None else t.b.double(), *cargs)
    launch = E.prepare(t.x, t.w, t.b, params, args.precision)
    emit(what="case", case=case.label, precision=args.precision, cudnn_us=round(t_cudnn, 1),
         candidates=len(launch.configs))
    cands = list(launch.configs)
    configs = cands if args.candidates or not args.set else []
    for cfg in dict.fromkeys(configs + [variant(cands[0], params, s) for s in args.set]):
        try:
            launch.y.fill_(float("nan"))  # a config that leaves elements unwritten shows as a NaN error
            t0 = time.perf_counter()
            handle = launch.run(cfg)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            err = None if ref is None else (launch.y.double() - ref).abs().max().item()
            us = bench_us(lambda: launch.run(cfg), args)
            emit(what="config", case=case.label, precision=args.precision, config=cfg.short(), us=round(us, 1),
                 vs_cudnn=round(t_cudnn / us, 2), compile_s=round(compile_s, 2), err=err, **compiler_facts(handle))
        except Exception as exc:  # noqa: BLE001 -- a probe: record and go on
            emit(what="config", case=case.label, precision=args.precision, config=cfg.short(), error=repr(exc)[:400])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", help="comma-separated bench case names (kb77, aniso_122, ...)")
    ap.add_argument("--precision", default="tf32", choices=E.PRECISIONS, help="engine precision (fp32 inputs)")
    ap.add_argument("--dtype", default="fp32", choices=tuple(suites.DTYPES))
    ap.add_argument("--layout", default="ncdhw", choices=suites.LAYOUTS)
    ap.add_argument("--candidates", action="store_true", help="time the engine's candidate list")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=V[,KEY=V]",
                    help="one variant of the first candidate per --set")
    ap.add_argument("--rep", type=int, default=60, help="do_bench budget per timing (ms)")
    ap.add_argument("--graph", action="store_true", help="time by CUDA-graph replay (without the host's launch cost)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not interpreter_active():
        print("needs a CUDA device (or TRITON_INTERPRET=1 for a check through the interpreter)", file=sys.stderr)
        return 2
    # One row per geometry: the engine's precision is --precision, whatever the row's cuDNN flag.
    cases = [c for c in suites.select("all", args.cases.split(","), [args.dtype], [args.layout]) if c.allow_tf32]
    emit(what="env", gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "interpreter",
         torch=torch.__version__, triton=triton.__version__, cudnn=torch.backends.cudnn.version())
    for case in cases:
        run_case(case, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
