"""Probe of the main kernel's variants (TMA loads, companion rows, tiles) on a few cases, plus a
per-kernel breakdown of one full KB 77 forward (torch.profiler). See NOTES.md."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu_variants as GV  # noqa: E402
from gpu_probe import KB, LAYERS, make  # noqa: E402

from convt3d import triton_engine as E  # noqa: E402
from convt3d.validate import check_call  # noqa: E402

V77 = [{}, {"companions": False}, {"BLOCK_M": 256, "num_warps": 8}, {"tma": False},
       {"BLOCK_M": 256, "num_warps": 8, "tma": False}, {"BLOCK_M": 64, "num_warps": 4, "num_stages": 4}]


def breakdown(name, spec, dtype, cl, prec):
    x, w, b, (s, p, op, g, d) = make(spec, dtype, cl, False)
    params, _ = check_call(x, w, b, s, p, op, g, d)
    for _ in range(3):
        E.forward(x, w, b, params, prec)  # tunes on the first call
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            E.forward(x, w, b, params, prec)
        torch.cuda.synchronize()
    rows = {ev.key[:40]: round(ev.device_time_total / 5, 1) for ev in prof.key_averages()
            if ev.device_type == torch.autograd.DeviceType.CUDA}
    rec = E.tuning_log()
    print(json.dumps(dict(breakdown=name, prec=prec, kernels_us=rows,
                          tuned={str(k[1:4]): (v.config.short(), v.seconds, v.timings_ms) for k, v in rec.items()})),
          flush=True)


if __name__ == "__main__":
    which = set(sys.argv[1:])
    GV.sweep("kb77", KB["kb77"], torch.float32, False, "tf32", V77)
    GV.sweep("kb77", KB["kb77"], torch.float32, False, "tf32x3", V77[:3])
    breakdown("kb77", KB["kb77"], torch.float32, False, "tf32")
    breakdown("kb77", KB["kb77"], torch.float32, False, "tf32x3")
    GV.sweep("kb72", KB["kb72"], torch.float32, False, "tf32", V77[:1] + V77[3:4])
    GV.sweep("aniso_122", LAYERS["aniso_122"], torch.bfloat16, True, "tf32", V77[:1] + V77[2:4], bias=True)
    with open(os.path.join(GV.OUT, "tma.json"), "w") as f:
        json.dump(GV.rows, f, indent=1)
