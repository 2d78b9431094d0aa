"""Where the host time of one forward goes (cProfile), for small layers where it dominates."""
import cProfile
import pstats
import time

import torch

import convt3d
from convt3d import triton_engine as E
from convt3d.validate import check_call

for name, (shape, wshape, s, p, dtype, cl) in {
    "refine_bf16_cl": ((4, 64, 32, 32, 32), (64, 64, 3, 3, 3), 1, 1, torch.bfloat16, True),
    "kb77ish_fp32": ((2, 32, 8, 8, 8), (32, 64, 3, 3, 3), 2, 1, torch.float32, False),
}.items():
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    if cl:
        x = x.to(memory_format=torch.channels_last_3d)
    w = torch.randn(*wshape, device="cuda", dtype=dtype)
    b = torch.randn(wshape[1], device="cuda", dtype=dtype)
    with torch.no_grad():
        for _ in range(3):
            convt3d.conv_transpose3d(x, w, b, s, p)
        torch.cuda.synchronize()
        n = 300
        t = time.perf_counter()
        for _ in range(n):
            convt3d.conv_transpose3d(x, w, b, s, p)
        torch.cuda.synchronize()
        print(name, "wall per call us", round((time.perf_counter() - t) / n * 1e6, 1))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            convt3d.conv_transpose3d(x, w, b, s, p)
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
