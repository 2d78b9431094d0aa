"""Why does "auto" run some small layers ~100 us slower than backend="triton" when both run the
Triton engine (scripts/gpu_auto.py, session 4: aniso_122 bf16 cl 76 -> 182 us)?

    python scripts/gpu_autodiag.py

Per case, gpu_auto's order (torch, triton, auto), then: do_bench medians again, host time per
call (200 calls enqueued, timed on the CPU), and the CUDA kernels of 20 calls of each from
torch.profiler (names, count, total us), and the tune log.
"""
import os
import tempfile
import time

os.environ.setdefault("CONVT3D_CACHE_DIR", tempfile.mkdtemp(prefix="convt3d-diag-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

import convt3d  # noqa: E402
from convt3d import triton_engine  # noqa: E402
from convt3d.bench import suites  # noqa: E402


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def host_us(fn, n=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def kernels(fn, n=20):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count > 0:
            rows.append(f"{e.key[:60]} x{e.count // n} {e.device_time_total / n:.1f}us")
    return rows


def main():
    names = {("aniso_122", "bf16", "cl"), ("monai_unet_k3", "bf16", "cl"), ("nnunet_128_64", "bf16", "ncdhw"),
             ("monai_unet_k3", "fp32", "cl")}
    for case in suites.select("layers", None):
        if (case.name, case.dtype, case.layout) not in names:
            continue
        t = suites.make_tensors(case, "cuda")
        args = case.geometry.conv_args()
        print(f"== {case.label}: x strides {t.x.stride()} w strides {t.w.stride()}", flush=True)
        with torch.no_grad():
            tri = lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend="triton")  # noqa: E731
            aut = lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *args)  # noqa: E731
            tor = lambda: F.conv_transpose3d(t.x, t.w, t.b, *args)  # noqa: E731
            print(f"  torch {bench(tor):.1f}  triton {bench(tri):.1f}  auto {bench(aut):.1f}  "
                  f"triton {bench(tri):.1f}  auto {bench(aut):.1f} us", flush=True)
            for name, fn in (("triton", tri), ("auto", aut), ("torch", tor)):
                h, w = host_us(fn)
                print(f"  {name}: host {h:.1f} us/call, wall {w:.1f} us/call; kernels: {kernels(fn)}", flush=True)
            y1, y2 = tri(), aut()
            print(f"  outputs equal: {torch.equal(y1, y2)}; out strides {y1.stride()} / {y2.stride()}", flush=True)
    for k, rec in triton_engine.tuning_log().items():
        print("tune", k[1:4], rec.config.short(), f"{rec.seconds:.2f}s")


if __name__ == "__main__":
    main()
