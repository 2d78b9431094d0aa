"""Session 5: exact-grade (tf32x3) flat_gemm tiles beyond the candidate list, on the compute-bound
KernelBench problems. For each case, the tuned candidates' best and a grid of (BLOCK_M, warps,
stages, BLOCK_K) variants of the flat config, each timed with do_bench (L2 flushed), median ms.
One JSON line per measurement."""
import json
import sys
from dataclasses import replace

import torch
import triton

from convt3d import triton_engine as TE
from convt3d.bench.suites import select, make_tensors
from convt3d.params import ConvT3dParams

names = sys.argv[1].split(",")
prec = sys.argv[2] if len(sys.argv) > 2 else "tf32x3"
GRID = [(128, 4, 3, 32), (128, 4, 4, 32), (128, 4, 5, 32), (128, 8, 3, 32), (128, 8, 4, 32), (256, 8, 3, 32),
        (256, 8, 2, 32), (64, 4, 5, 32), (64, 4, 6, 32), (128, 4, 6, 16), (64, 4, 8, 16), (128, 4, 3, 64)]
for case in select("kernelbench", names=names, precisions=["exact"]):
    g = case.geometry
    t = make_tensors(case, "cuda")
    p = ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel, g.stride,
                             g.padding, g.output_padding, g.dilation)
    cands = TE.plan(p, t.x, t.w, prec).configs
    base = next(c for c in cands if c.flat)
    seen = set()
    for bm, warps, stages, bk in GRID:
        cfg = replace(base, BLOCK_M=bm, BLOCK_W=bm, num_warps=warps, num_stages=stages, BLOCK_K=bk)
        if cfg in seen:
            continue
        seen.add(cfg)
        try:
            fn = lambda: TE.forward(t.x, t.w, None, p, prec, config=cfg)
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=3, rep=60)
            print(json.dumps(dict(case=g.name, precision=prec, config=cfg.short(), ms=round(ms, 4))), flush=True)
        except Exception as e:  # noqa: BLE001 -- a probe: report and go on
            print(json.dumps(dict(case=g.name, config=cfg.short(), error=f"{type(e).__name__}: {e}"[:300])), flush=True)
    del t
    torch.cuda.empty_cache()
