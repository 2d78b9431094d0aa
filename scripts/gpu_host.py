"""Host vs device time of small layers: per-kernel GPU times (torch.profiler) and the host time
to enqueue one forward (no synchronisation), for the public API and for the engine alone."""
import json
import sys
import time

import torch

import convt3d
from convt3d import triton_engine as E
from convt3d.bench.suites import LAYERS
from convt3d.validate import check_call

torch.manual_seed(0)
for name, dtype, cl in (("monai_unet_k3", torch.bfloat16, True), ("nnunet_128_64", torch.bfloat16, False),
                        ("aniso_122", torch.bfloat16, True), ("nnunet_128_64", torch.float32, True)):
    g = next(c for c in LAYERS if c.name == name)
    x = torch.randn(g.batch, g.in_channels, *g.in_size, device="cuda", dtype=dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(*g.weight_shape, device="cuda", dtype=dtype) * 0.05
    b = torch.randn(g.out_channels, device="cuda", dtype=dtype) if g.bias else None
    args = g.conv_args()
    params, _ = check_call(x, w, b, *args)
    prec = "tf32"
    for _ in range(3):
        convt3d.conv_transpose3d(x, w, b, *args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            convt3d.conv_transpose3d(x, w, b, *args)
        torch.cuda.synchronize()
    ks = {ev.key[:28]: round(ev.device_time_total / 10, 1) for ev in prof.key_averages()
          if ev.device_type == torch.autograd.DeviceType.CUDA}
    host = {}
    for label, fn in (("api", lambda: convt3d.conv_transpose3d(x, w, b, *args)),
                      ("engine", lambda: E.forward(x, w, b, params, prec)),
                      ("cudnn", lambda: torch.nn.functional.conv_transpose3d(x, w, b, *args))):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        host[label] = round((time.perf_counter() - t0) / 50 * 1e6, 1)
        torch.cuda.synchronize()
    rec = [v.config.short() for k, v in E.tuning_log().items() if k[-1] == params]
    print(json.dumps(dict(case=name, dtype=str(dtype), cl=cl, kernels_us=ks, host_us_per_call=host, tuned=rec)),
          flush=True)
