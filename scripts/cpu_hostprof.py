"""Host cost of one forward through the public API on the CPU, with every kernel launch stubbed
out (``Site.launch`` does nothing): what remains is convt3d's own Python per call.

    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/cpu_hostprof.py [float32|bfloat16]

Prints us per call and the cProfile of 300 calls (cumulative). CPU allocations (torch.empty)
cost more than on CUDA's caching allocator, so read the Python part, not the total.
"""
import cProfile, pstats, time, torch, sys
import convt3d
from convt3d import triton_engine as E
calls = {"n": 0}
def fake_launch(self, device, *tensors):
    calls["n"] += 1
    return None
E.Site.launch = fake_launch
dt = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
x = torch.randn(4, 64, 32, 32, 32, dtype=dt).to(memory_format=torch.channels_last_3d)
w = torch.randn(64, 32, 3, 3, 3, dtype=dt)
b = torch.randn(32, dtype=dt)
args = (2, 1, 1)
with torch.no_grad():
    f = lambda: convt3d.conv_transpose3d(x, w, b, *args, backend="triton")
    for _ in range(5): f()
    n = 300
    t0 = time.perf_counter()
    for _ in range(n): f()
    print(f"{(time.perf_counter()-t0)/n*1e6:.1f} us/call, launches/call {calls['n']/(n+5):.1f}")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n): f()
    pr.disable()
    pstats.Stats(pr).sort_stats("cumtime").print_stats(30)
