"""Probe: per-kernel times (torch.profiler) of flat_gemm_kernel variants on KB 77 and others."""
import dataclasses as dc
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu_probe import KB, LAYERS, make, kinfo  # noqa: E402

from convt3d import triton_engine as E  # noqa: E402
from convt3d.validate import check_call  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
rows = []


def per_kernel(name, spec, dtype, cl, prec, variants, bias=False):
    x, w, b, (s, p, op, g, d) = make(spec, dtype, cl, bias)
    params, _ = check_call(x, w, b, s, p, op, g, d)
    ref = F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), s, p, op, g, d)
    launch = E.prepare(x, w, b, params, prec)
    base = launch.configs[0]
    for v in variants:
        cfg = dc.replace(base, **v)
        h = launch.run(cfg)
        torch.cuda.synchronize()
        err = (launch.y.double() - ref).abs().max().item()
        for _ in range(3):
            launch.run(cfg)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                launch.run(cfg)
            torch.cuda.synchronize()
        ks = {ev.key[:24]: round(ev.device_time_total / 10, 1) for ev in prof.key_averages()
              if ev.device_type == torch.autograd.DeviceType.CUDA}
        r = dict(case=name, prec=prec, cfg=cfg.short(), kernels=ks, err=err, **(kinfo(h) if h is not None else {}))
        rows.append(r)
        print(json.dumps(r), flush=True)
    del x, w, b, ref, launch
    torch.cuda.empty_cache()


if __name__ == "__main__":
    V = [{}, {"companions": False}, {"num_stages": 3}, {"num_stages": 6}, {"BLOCK_M": 128, "BLOCK_W": 128},
         {"BLOCK_M": 128, "BLOCK_W": 128, "num_warps": 4, "num_stages": 3}]
    per_kernel("kb77", KB["kb77"], torch.float32, False, "tf32",
               [{"BLOCK_M": 64, "BLOCK_W": 64, "num_warps": 4, "num_stages": 4, "flat": True, **v} for v in V])
    per_kernel("kb77", KB["kb77"], torch.float32, False, "tf32x3",
               [{"BLOCK_M": 64, "BLOCK_W": 64, "num_warps": 4, "num_stages": 4, "flat": True, **v} for v in V[:2]])
    per_kernel("kb73", KB["kb73"], torch.float32, False, "tf32", [{}, {"BLOCK_M": 64, "BLOCK_W": 64, "num_warps": 4}])
    per_kernel("gan_k4s2p1", LAYERS["gan_k4s2p1"], torch.bfloat16, True, "tf32",
               [{}, {"BLOCK_M": 64, "BLOCK_W": 64, "num_warps": 4, "num_stages": 4}], bias=True)
    with open(os.path.join(OUT, "flat2.json"), "w") as f:
        json.dump(rows, f, indent=1)
