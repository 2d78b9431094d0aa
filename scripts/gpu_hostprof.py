"""Where the host time of a small-layer call goes (session 3): cProfile of the engine and of the
public API on a tuned signature, plus micro-costs of a Triton launch (plain arguments, TMA
descriptors), of building a TensorDescriptor and of hashing the geometry."""
import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import convt3d
from convt3d import triton_engine as E
from convt3d.bench.suites import LAYERS
from convt3d.validate import check_call


def per_call(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return round(dt, 1)


@triton.jit
def _empty40(p, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
             c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, X: tl.constexpr):
    if tl.program_id(0) == 0 and a0 < 0:
        tl.store(p, 1.0)


@triton.jit
def _empty_desc(d1, d2, p, a0, a1, X: tl.constexpr):
    if tl.program_id(0) == 0 and a0 < 0:
        tl.store(p, 1.0)


p = torch.empty(16, device="cuda")
ints = list(range(3, 43))
print("launch, 40 int args:", per_call(lambda: _empty40[(1,)](p, *ints, X=1)), "us")
print("launch, 2 int args:", per_call(lambda: _empty_desc[(1,)](p, p, p, 5, 7, X=1)), "us")
xp = torch.empty(1 << 20, 64, device="cuda", dtype=torch.bfloat16)
wp = torch.empty(1024, 64, device="cuda", dtype=torch.bfloat16)
print("TensorDescriptor():", per_call(lambda: TensorDescriptor(xp, [1 << 20, 64], [64, 1], [128, 64])), "us")
d1 = TensorDescriptor(xp, [1 << 20, 64], [64, 1], [128, 64])
d2 = TensorDescriptor(wp, [1024, 64], [64, 1], [64, 64])
print("launch, 2 descriptors:", per_call(lambda: _empty_desc[(1,)](d1, d2, p, 5, 7, X=1)), "us")
print("torch.empty 8MB:", per_call(lambda: torch.empty(4 << 20, device="cuda", dtype=torch.bfloat16)), "us")

for name, dtype, cl in (("nnunet_128_64", torch.bfloat16, True), ("aniso_122", torch.bfloat16, True),
                        ("nnunet_128_64", torch.float32, False)):
    g = next(c for c in LAYERS if c.name == name)
    x = torch.randn(g.batch, g.in_channels, *g.in_size, device="cuda", dtype=dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(*g.weight_shape, device="cuda", dtype=dtype) * 0.05
    b = torch.randn(g.out_channels, device="cuda", dtype=dtype) if g.bias else None
    args = g.conv_args()
    params, _ = check_call(x, w, b, *args)
    print(f"== {name} {dtype} cl={cl}: hash(params) {per_call(lambda: hash(params), 1000)} us, "
          f"check_call {per_call(lambda: check_call(x, w, b, *args), 1000)} us", flush=True)
    for _ in range(3):
        convt3d.conv_transpose3d(x, w, b, *args)
    torch.cuda.synchronize()
    for label, fn in (("engine", lambda: E.forward(x, w, b, params, "tf32")),
                      ("api", lambda: convt3d.conv_transpose3d(x, w, b, *args)),
                      ("cudnn", lambda: torch.nn.functional.conv_transpose3d(x, w, b, *args))):
        print(f"{label}: {per_call(fn)} us/call", flush=True)
    for label, fn in (("engine", lambda: E.forward(x, w, b, params, "tf32")),
                      ("api", lambda: convt3d.conv_transpose3d(x, w, b, *args))):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print(f"--- cProfile {label} (100 calls)\n" + "\n".join(s.getvalue().splitlines()[4:40]), flush=True)
