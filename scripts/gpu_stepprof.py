"""Where a convt3d training step's time goes (session 3): per-part do_bench times and a
torch.profiler table (CPU and CUDA) of a few full steps, for small layers of the layers suite."""
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

import convt3d
from convt3d.bench import suites


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def host(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["nnunet_128_64"]
for case in suites.select("layers", names):
    if (case.dtype, case.layout) not in (("bf16", "cl"), ("fp32", "ncdhw")):
        continue
    t = suites.make_tensors(case, "cuda", 0)
    g = case.geometry
    args = g.conv_args()
    leaves = [v.detach().requires_grad_() for v in (t.x, t.w, t.b) if v is not None]
    bias = leaves[2] if len(leaves) > 2 else None
    with torch.no_grad():
        dy = torch.randn_like(F.conv_transpose3d(t.x, t.w, t.b, *args))

    def ours():
        return torch.autograd.grad(convt3d.conv_transpose3d(leaves[0], leaves[1], bias, *args), leaves, dy)

    def theirs():
        return torch.autograd.grad(F.conv_transpose3d(leaves[0], leaves[1], bias, *args), leaves, dy)

    def ours_fwd():
        return convt3d.conv_transpose3d(leaves[0], leaves[1], bias, *args)

    y = ours_fwd()

    def ours_bwd():
        return torch.autograd.grad(y, leaves, dy, retain_graph=True)

    print(f"== {case.label}: full ours {bench(ours):.1f} cudnn {bench(theirs):.1f}  fwd(grad) {bench(ours_fwd):.1f}"
          f"  bwd {bench(ours_bwd):.1f} us;  host: full {host(ours):.1f} cudnn {host(theirs):.1f}"
          f" fwd {host(ours_fwd):.1f} bwd {host(ours_bwd):.1f} us", flush=True)
    c = dy.shape[1]
    db = {"sum(0,2,3,4)": lambda: dy.sum(dim=(0, 2, 3, 4), dtype=torch.float32)}
    if dy.stride(1) == 1:
        db["rows[M,C].sum(0)"] = lambda: dy.permute(0, 2, 3, 4, 1).reshape(-1, c).sum(0, dtype=torch.float32)
        db["rows[M,C] fp32 mm ones"] = lambda: (torch.ones(1, dy.numel() // c, device="cuda", dtype=dy.dtype)
                                               @ dy.permute(0, 2, 3, 4, 1).reshape(-1, c))
    else:
        db["view[N,C,S].sum((0,2))"] = lambda: dy.view(dy.shape[0], c, -1).sum((0, 2), dtype=torch.float32)
        db["view[N,C,S].sum(2).sum(0)"] = lambda: dy.view(dy.shape[0], c, -1).sum(2, dtype=torch.float32).sum(0)
    print("   db: " + ", ".join(f"{k} {bench(f):.1f}" for k, f in db.items()) + f" us ({dy.numel() * dy.element_size() / 1e6:.1f} MB)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ours()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60), flush=True)
