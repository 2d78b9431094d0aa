"""Variant sweep of the main kernel on a few cases (design probe; see NOTES.md)."""
import dataclasses as dc
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from convt3d import triton_engine as E
from convt3d.validate import check_call

sys.path.insert(0, os.path.dirname(__file__))
from gpu_probe import KB, LAYERS, make, kinfo  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
rows = []


def bench(fn, rep=60):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def sweep(name, spec, dtype, cl, prec, variants, bias=False):
    x, w, b, (s, p, op, g, d) = make(spec, dtype, cl, bias)
    params, _ = check_call(x, w, b, s, p, op, g, d)
    tf32 = prec == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32
    t_cudnn = bench(lambda: F.conv_transpose3d(x, w, b, s, p, op, g, d), rep=100)
    torch.backends.cudnn.allow_tf32 = True
    ref = None
    if params.batch * params.out_channels * math.prod(params.out_size) < 4e8:
        ref = F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), s, p, op, g, d)
    launch = E.prepare(x, w, b, params, prec)
    base = launch.configs[0]
    best = None
    for v in variants:
        v = dict(v)
        if "BLOCK_M" in v:
            hw = tuple(max(ph.axes[i].size for ph in params.phases if not ph.empty) for i in (1, 2))
            v["BLOCK_W"] = E.block_w(hw, v["BLOCK_M"])
        cfg = dc.replace(base, **v)
        try:
            launch.y.fill_(float("nan"))
            h = launch.run(cfg)
            torch.cuda.synchronize()
            err = (launch.y.double() - ref).abs().max().item() if ref is not None else None
            t = bench(lambda: launch.run(cfg))
            r = dict(case=name, prec=prec, cfg=cfg.short(), us=round(t, 1), cudnn=round(t_cudnn, 1),
                     x=round(t_cudnn / t, 2), tflops=round(params.useful_flops / t / 1e6, 1), err=err,
                     **(kinfo(h) if h is not None else {}))
            if best is None or t < best[0]:
                best = (t, cfg.short())
        except Exception as e:  # noqa: BLE001 -- a probe: record and go on
            r = dict(case=name, cfg=cfg.short(), error=repr(e)[:400])
        rows.append(r)
        print(json.dumps(r), flush=True)
    full = bench(lambda: E.forward(x, w, b, params, prec, config=dc.replace(base, **variants[0])))
    print(json.dumps(dict(case=name, prec=prec, BEST=best, cudnn=round(t_cudnn, 1), full_first_variant=round(full, 1))))
    del x, w, b, ref, launch
    torch.cuda.empty_cache()


V77 = [{}, {"fill_separate": False}, {"x_cache": ".ca"}, {"num_stages": 4}, {"num_stages": 4, "x_cache": ".ca"},
       {"maxnreg": 128}, {"maxnreg": 128, "x_cache": ".ca"},
       {"BLOCK_M": 64, "num_warps": 4, "num_stages": 4, "x_cache": ".ca"},
       {"BLOCK_M": 64, "num_warps": 4, "num_stages": 6, "x_cache": ".ca"},
       {"BLOCK_M": 256, "num_warps": 8, "num_stages": 3, "x_cache": ".ca"},
       {"BLOCK_M": 256, "num_warps": 8, "num_stages": 4, "x_cache": ".ca", "maxnreg": 200}]
V68 = [{}, {"x_cache": ".ca"}, {"num_stages": 4, "x_cache": ".ca"}, {"num_stages": 5, "x_cache": ".ca"},
       {"BLOCK_M": 256, "num_warps": 8, "num_stages": 3, "x_cache": ".ca"},
       {"BLOCK_M": 256, "num_warps": 8, "num_stages": 4, "x_cache": ".ca"},
       {"maxnreg": 128, "x_cache": ".ca"}]
VBF = [{}, {"x_cache": ".ca"}, {"num_stages": 4, "x_cache": ".ca"},
       {"BLOCK_M": 256, "num_warps": 8, "num_stages": 3, "x_cache": ".ca"},
       {"BLOCK_M": 64, "num_warps": 4, "num_stages": 4, "x_cache": ".ca"},
       {"maxnreg": 128, "x_cache": ".ca"}]

if __name__ == "__main__":
    t0 = time.time()
    which = set(sys.argv[1:])
    if not which or "kb77" in which:
        sweep("kb77", KB["kb77"], torch.float32, False, "tf32", V77)
        sweep("kb77", KB["kb77"], torch.float32, False, "tf32x3", V77[:3] + V77[7:9])
    if not which or "kb68" in which:
        sweep("kb68", KB["kb68"], torch.float32, False, "tf32", V68)
    if not which or "kb73" in which:
        sweep("kb73", KB["kb73"], torch.float32, False, "tf32", V68[:4])
    for nm in ("gan_k4s2p1", "videogpt_k4s2p3", "refine_k3s1", "nnunet_64_32"):
        if not which or nm in which or "layers" in which:
            sweep(nm, LAYERS[nm], torch.bfloat16, True, "tf32", VBF, bias=True)
    print("seconds", round(time.time() - t0, 1))
    with open(os.path.join(OUT, "variants.json"), "w") as f:
        json.dump(rows, f, indent=1)
