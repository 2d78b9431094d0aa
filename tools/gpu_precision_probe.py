"""What each fp32 dot precision costs and how far it lands from float64, on the KernelBench
problems: the Triton engine tuned per precision, against cuDNN at default flags.

Precisions: the engine's "tf32", "tf32x3" (exact grade) and "ieee"; "bf16x3", a Triton dot
precision (three bf16 MMAs, operands split in registers) that the engine does not offer -- the
probe admits it for its own calls only, to keep that comparison reproducible; and "ieee-fma",
the engine's FMA path (no tensor cores) forced on a call that would use them (the small-group
problem KB 72).

Run on the GPU machine (problems and precisions are optional, comma-separated):

    PYTHONPATH=src python3 tools/gpu_precision_probe.py [kb58,kb61,...] [tf32,tf32x3,bf16x3,ieee-fma]

Prints one JSON line per measurement: cuDNN's time and error, then per precision the engine's
median ms (triton.testing.do_bench, L2 flushed before each rep), ratio to cuDNN, max and mean
abs error against float64, whether allclose(atol=rtol=1e-4) holds, the tuned config and the
tuner's per-candidate ms.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.testing

from convt3d.engines.triton import configs as TC
from convt3d.engines.triton import engine as TE
from convt3d.bench.suites import select, make_tensors
from convt3d.core.params import ConvT3dParams


def emit(**kw):
    print(json.dumps(kw), flush=True)


def run(names: list[str] | None, precs: list[str]) -> None:
    for case in select("kernelbench", names=names, precisions=["default"]):
        g = case.geometry
        t = make_tensors(case, "cuda")
        args = g.conv_args()
        y64 = F.conv_transpose3d(t.x.double(), t.w.double(), None, *args)
        torch.backends.cudnn.allow_tf32 = True
        ref = lambda: F.conv_transpose3d(t.x, t.w, None, *args)
        ref_ms = triton.testing.do_bench(ref, warmup=5, rep=200)
        err_ref = (ref().double() - y64).abs().max().item()
        emit(case=g.name, engine="cudnn_default", ms=ref_ms, err=err_ref)
        p = ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel, g.stride,
                                 g.padding, g.output_padding, g.dilation)
        variants = [(pr, None) for pr in precs if pr != "ieee-fma"]
        if "ieee-fma" in precs:
            variants += [("ieee-fma", "fma")]
        for pr, kind in variants:
            engine_precisions = TE.PRECISIONS
            try:
                if pr not in TE.PRECISIONS and kind is None:
                    TE.PRECISIONS = TE.PRECISIONS + (pr,)  # a Triton dot precision the engine does not offer
                if kind == "fma":
                    orig = TE.uses_tensor_cores
                    # Read by the plan (triton_engine) and by the tile list (triton_configs).
                    TE.uses_tensor_cores = TC.uses_tensor_cores = lambda params: False
                    TE.candidate_configs.cache_clear()
                    TE._plans.clear()
                    prec = "ieee"
                else:
                    prec = pr
                fn = lambda: TE.forward(t.x, t.w, None, p, prec)
                y = fn()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=5, rep=200)
                err = (y.double() - y64).abs()
                ok = bool(torch.allclose(y.double(), y64, atol=1e-4, rtol=1e-4))
                rec = TE._tuned.get(TE.plan(p, t.x, t.w, prec).tune_key)
                emit(case=g.name, engine="triton", precision=pr, ms=ms, ratio=ref_ms / ms, err=err.max().item(),
                     err_mean=err.mean().item(), allclose=ok, config=rec.config.short() if rec else None,
                     tuning_ms={c: round(v, 3) for c, v in sorted(rec.timings_ms.items(), key=lambda kv: kv[1])}
                     if rec else None)
            except Exception as e:  # noqa: BLE001 -- a probe: report and go on
                emit(case=g.name, precision=pr, error=f"{type(e).__name__}: {e}"[:400])
            finally:
                TE.PRECISIONS = engine_precisions
                if kind == "fma":
                    TE.uses_tensor_cores = TC.uses_tensor_cores = orig
                    TE.candidate_configs.cache_clear()
                    TE._plans.clear()
        del y64, t
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("problems", nargs="?", default=None, help="comma-separated KernelBench cases (default: all)")
    ap.add_argument("precisions", nargs="?", default="tf32,tf32x3,bf16x3",
                    help="comma-separated, from tf32, tf32x3, ieee, bf16x3, ieee-fma (default tf32,tf32x3,bf16x3)")
    args = ap.parse_args(argv)
    run(args.problems.split(",") if args.problems else None, args.precisions.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
