"""Host time of a forward call: what the CPU spends before the GPU has work, on the small layers
whose GPU kernels are shorter than it.

Seven measurements, one per sub-command:

``layers`` (GPU) -- per bench row: do_bench medians of cuDNN, ``backend="triton"`` and auto
(twice, interleaved, to show the run-to-run swing); the host time per call (200 calls enqueued
without synchronising, timed on the CPU) and the wall time per call, for triton, auto, the
engine alone (``triton_engine.forward``) and cuDNN; the CUDA kernels of 20 calls (name, launches
per call, us per call, from torch.profiler); whether triton and auto give bitwise equal outputs;
the tuner's choices. Default rows: the host-bound ones of the layers suite.

``launch`` (GPU) -- micro-costs on this machine: a launch of an empty Triton kernel with 40 and
with 2 integer arguments, with 2 tensor descriptors, building one ``TensorDescriptor``,
``torch.empty`` of 8 MB; then per row ``hash(params)`` and ``check_call``.

``profile`` (GPU) -- cProfile (sorted by own time) of 100 calls of the engine alone and of the
public API on a tuned signature, per row.

``first-call`` (GPU) -- the first inference call of one network of the networks suite,
untouched then patched, the patched one under cProfile (by cumulative time). Run it twice with
the same ``CONVT3D_CACHE_DIR``: the second run shows what a warm cache leaves to a new
process's first call (Triton's own kernel cache is warm by then too).

``network`` (GPU) -- where a patched network's time goes beyond its kernels: for one network of
the networks suite, three copies (untouched; patched, auto; patched with every layer
``backend="torch"``), in interleaved rounds: the CUDA-event time per forward (median of 20), the
host time to enqueue one forward (no synchronisation), the Python garbage collections per
forward, and per copy the CUDA runtime calls of one forward that can stall the queue
(allocations, frees, synchronisations, copies) with their host microseconds, and the kernels
whose time changed against the untouched copy. ``--train``: the same for the bench's bf16 (or
fp32) training step instead of the forward, and the engine auto took for each layer.

``step`` (GPU) -- per bench row, a training step (forward, then dX, dW and db for a fixed dY)
three ways: the bench's public call under auto, the public call with ``backend="triton"``, and
the step that auto's measurement times (``Engine._step`` of the Triton engine); for each, four
do_bench medians and the host and wall time per step; then ``Engine.time`` of the Triton and
PyTorch steps three times each (``Timing``: median ms, host ms), the kernels and the stalling
CUDA runtime calls (synchronisations, allocations, copies) of a public step under auto and with
``backend="triton"``, cProfile of 50 Triton steps (by own time), and the auto decision's cache
entry (rounds, host rounds, margin). Default row: head_k2s2_8to2/bf16/cl, a small head whose
step is host-bound.

``stubbed`` (CPU, Triton's interpreter) -- the public API and the engine alone, every kernel launch stubbed out
(``triton_engine.Site.launch`` does nothing), so what remains is convt3d's own Python: us per
call, launches per call, and the cProfile of 300 calls (cumulative). CPU allocations cost more
than CUDA's caching allocator, so read the Python part, not the total.

Run on the GPU machine (``stubbed`` anywhere):

    PYTHONPATH=src python3 tools/host_time.py layers [--rows aniso_122/bf16/cl,monai_unet_k3/fp32/cl]
    PYTHONPATH=src python3 tools/host_time.py launch
    PYTHONPATH=src python3 tools/host_time.py profile --rows nnunet_128_64/bf16/cl
    CONVT3D_CACHE_DIR=/tmp/c PYTHONPATH=src python3 tools/host_time.py first-call --network gan3d [--dtype bf16]
    PYTHONPATH=src python3 tools/host_time.py network --network monai_unetr [--dtype bf16] [--train]
    PYTHONPATH=src python3 tools/host_time.py step [--rows head_k2s2_8to2/bf16/cl]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/host_time.py stubbed [--dtype bf16] [--layer head]

Prints plain text, one block per row.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

# A private cache: auto decides afresh instead of reusing another run's decisions.
os.environ.setdefault("CONVT3D_CACHE_DIR", tempfile.mkdtemp(prefix="convt3d-host-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.testing  # noqa: E402

import convt3d  # noqa: E402
from convt3d.engines.triton import engine as E  # noqa: E402
from convt3d.bench import suites  # noqa: E402
from convt3d.core.validate import check_call  # noqa: E402
from convt3d.dispatch.select import resolve_precision  # noqa: E402

# Layers-suite rows whose forward is host-bound: their GPU kernels are shorter than the call's host time.
DEFAULT_ROWS = "aniso_122/bf16/cl,monai_unet_k3/bf16/cl,nnunet_128_64/bf16/ncdhw,monai_unet_k3/fp32/cl"


def rows(spec: str):
    """``name/dtype/layout,...`` -> (case, tensors, conv args, params) per row, on CUDA."""
    out = []
    for item in spec.split(","):
        name, dtype, layout = item.split("/")
        case = suites.select("layers", [name], [dtype], [layout])[0]
        t = suites.make_tensors(case, "cuda")
        args = case.geometry.conv_args()
        params, _ = check_call(t.x, t.w, t.b, *args)
        out.append((case, t, args, params))
    return out


def do_bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def host_and_wall_us(fn, n: int = 200) -> tuple[float, float]:
    """(host us per call: n calls enqueued, timed on the CPU; wall us per call: until the GPU is done)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def cuda_kernels(fn, n: int = 20) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return [f"{e.key[:60]} x{e.count // n} {e.device_time_total / n:.1f}us" for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.count > 0]


# CUDA runtime calls that can stall the host on the GPU (or the GPU on the host).
STALLS = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
          "cudaMemcpy", "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaHostAlloc")


def runtime_calls(prof) -> str:
    """Launches and the stalling runtime calls (count, host us) of one profiled run."""
    found = [f"{e.key} x{e.count} {e.cpu_time_total:.0f}us" for e in prof.key_averages()
             if any(e.key.startswith(s) for s in STALLS)]
    launches = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key or e.key == "cuLaunchKernel")
    return f"{launches} launches; {', '.join(found) or 'no stalling runtime calls'}"


def cmd_layers(args) -> None:
    with torch.no_grad():
        for case, t, cargs, params in rows(args.rows):
            print(f"== {case.label}: x strides {t.x.stride()} w strides {t.w.stride()}", flush=True)
            tri = lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *cargs, backend="triton")  # noqa: E731
            aut = lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *cargs)  # noqa: E731
            eng = lambda: E.forward(t.x, t.w, t.b, params, "tf32")  # noqa: E731
            tor = lambda: F.conv_transpose3d(t.x, t.w, t.b, *cargs)  # noqa: E731
            print(f"  do_bench: torch {do_bench_us(tor):.1f}  triton {do_bench_us(tri):.1f}  auto {do_bench_us(aut):.1f}"
                  f"  triton {do_bench_us(tri):.1f}  auto {do_bench_us(aut):.1f} us", flush=True)
            for label, fn in (("triton", tri), ("auto", aut), ("engine", eng), ("torch", tor)):
                h, w = host_and_wall_us(fn)
                print(f"  {label}: host {h:.1f} us/call, wall {w:.1f} us/call; kernels: {cuda_kernels(fn)}",
                      flush=True)
            y1, y2 = tri(), aut()
            print(f"  triton and auto outputs bitwise equal: {torch.equal(y1, y2)}", flush=True)
    for key, rec in E.tuning_log().items():
        print("tuned", key[1:4], rec.config.short(), f"{rec.seconds:.2f}s")


@triton.jit
def _empty40(p, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
             c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, X: tl.constexpr):
    if tl.program_id(0) == 0 and a0 < 0:
        tl.store(p, 1.0)


@triton.jit
def _empty2(d1, d2, p, a0, a1, X: tl.constexpr):
    if tl.program_id(0) == 0 and a0 < 0:
        tl.store(p, 1.0)


def cmd_launch(args) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    def per_call(fn, n=200):
        return round(host_and_wall_us(fn, n)[0], 1)

    p = torch.empty(16, device="cuda")
    ints = list(range(3, 43))
    print("launch, 40 int args:", per_call(lambda: _empty40[(1,)](p, *ints, X=1)), "us")
    print("launch, 2 int args:", per_call(lambda: _empty2[(1,)](p, p, p, 5, 7, X=1)), "us")
    xp = torch.empty(1 << 20, 64, device="cuda", dtype=torch.bfloat16)
    wp = torch.empty(1024, 64, device="cuda", dtype=torch.bfloat16)
    print("TensorDescriptor():", per_call(lambda: TensorDescriptor(xp, [1 << 20, 64], [64, 1], [128, 64])), "us")
    d1 = TensorDescriptor(xp, [1 << 20, 64], [64, 1], [128, 64])
    d2 = TensorDescriptor(wp, [1024, 64], [64, 1], [64, 64])
    print("launch, 2 descriptors:", per_call(lambda: _empty2[(1,)](d1, d2, p, 5, 7, X=1)), "us")
    print("torch.empty 8MB:", per_call(lambda: torch.empty(4 << 20, device="cuda", dtype=torch.bfloat16)), "us")
    for case, t, cargs, params in rows(args.rows):
        print(f"{case.label}: hash(params) {per_call(lambda: hash(params), 1000)} us, "
              f"check_call {per_call(lambda: check_call(t.x, t.w, t.b, *cargs), 1000)} us", flush=True)


def print_profile(label: str, fn, n: int, sort: str, lines: int) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(lines)
    print(f"--- cProfile {label} ({n} calls, by {sort})\n" + "\n".join(s.getvalue().splitlines()[4:lines + 14]),
          flush=True)


def cmd_profile(args) -> None:
    with torch.no_grad():
        for case, t, cargs, params in rows(args.rows):
            print(f"== {case.label}", flush=True)
            api = lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *cargs)  # noqa: E731
            for _ in range(3):
                api()  # tunes and settles the signature
            torch.cuda.synchronize()
            print_profile("engine", lambda: E.forward(t.x, t.w, t.b, params, "tf32"), 100, "tottime", 22)
            print_profile("api", api, 100, "tottime", 22)
            torch.cuda.synchronize()


def _network(args):
    """(model, input, autocast) of ``--network`` on CUDA, or None (with a line) where its package
    is missing."""
    from convt3d.bench import networks

    net = networks.select_networks([args.network])[0]
    why = networks.unavailable_reason(net)
    if why is not None:
        print(f"{args.cmd}: {why}", file=sys.stderr)
        return None
    model, x = networks.build_network(net, "cuda")
    return model, x, args.dtype == "bf16"


def cmd_first_call(args) -> None:
    from convt3d.bench import networks

    built = _network(args)
    if built is None:
        return
    model, x, autocast = built
    untouched = networks._inference(model, x, autocast)
    t0 = time.perf_counter()
    untouched()
    torch.cuda.synchronize()
    t_u = time.perf_counter() - t0
    patched = networks._inference(convt3d.patch(model), x, autocast)
    t0 = time.perf_counter()
    print_profile("first patched call", lambda: (patched(), torch.cuda.synchronize()), 1, "cumtime", 45)
    print(f"first call: untouched {t_u:.3f} s, patched {time.perf_counter() - t0:.3f} s (profiled) "
          f"[cache {os.environ['CONVT3D_CACHE_DIR']}]")


def cmd_network(args) -> None:
    import copy
    import gc
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from convt3d.bench import networks

    built = _network(args)
    if built is None:
        return
    model, x, autocast = built
    auto_m = convt3d.patch(copy.deepcopy(model))
    torch_m = convt3d.patch(copy.deepcopy(model), backend="torch")
    copies = {"untouched": model, "auto": auto_m, "torch": torch_m}
    if args.train:
        target = networks._target_for(model, x, 2)
        fns = {k: networks._training(m, x, target, autocast) for k, m in copies.items()}
    else:
        fns = {k: networks._inference(m, x, autocast) for k, m in copies.items()}
    for label, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"{label}: first call {time.perf_counter() - t0:.3f} s", flush=True)
    collections = {"n": 0}
    gc.callbacks.append(lambda phase, info: collections.__setitem__("n", collections["n"] + (phase == "start")))

    def event_us(fn, n: int = 20) -> float:
        times = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)

    for r in range(args.rounds):
        line = []
        for label, fn in fns.items():
            ev = event_us(fn)
            torch.cuda.synchronize()
            collections["n"] = 0
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            host = (time.perf_counter() - t0) / 5 * 1e6
            torch.cuda.synchronize()
            line.append(f"{label} {ev:.0f} us (host {host:.0f} us, gc {collections['n'] / 5:.1f}/fwd)")
        print(f"round {r + 1}: " + "; ".join(line), flush=True)
    kernels: dict[str, dict[str, float]] = {}
    for label, fn in fns.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"{label}: {runtime_calls(prof)}", flush=True)
        kernels[label] = networks.top_kernels(prof.events(), None)
        if label != "untouched":
            changes = networks.kernel_changes(kernels["untouched"], kernels[label])
            print(f"  kernel us changed against untouched: {changes}", flush=True)
    _, decisions = networks._layer_engines(auto_m, fns["auto"])
    print("auto's layers:\n  " + "\n  ".join(decisions), flush=True)


def cmd_step(args) -> None:
    import json

    from convt3d.dispatch import cache
    from convt3d.bench import runner
    from convt3d.core.call import make_call
    from convt3d.engines.peers import ENGINES

    for case, t, cargs, params in rows(args.rows):
        print(f"== {case.label}", flush=True)
        # The bench's own steps (runner._build_full): the public call under auto and with
        # backend="triton".
        public_auto, _ = runner._build_full(case, t, None)
        public_triton, _ = runner._build_full(case, t, "triton")
        leaves = runner._grad_leaves(t)
        bias = leaves[2] if len(leaves) > 2 else None
        call = make_call(leaves[0], leaves[1], bias, *cargs, autograd=True)
        tri = ENGINES["triton"]
        for label, fn in (("public auto", public_auto), ("public triton", public_triton),
                          ("auto's timed step", tri._step(call, tri.steady_cost(call)))):
            fn()
            medians = [round(do_bench_us(fn), 1) for _ in range(4)]
            h, w = host_and_wall_us(fn, 50)
            print(f"  {label}: do_bench {medians} us; host {h:.1f} us/step, wall {w:.1f} us/step", flush=True)
        for name in ("triton", "torch"):
            print(f"  Engine.time {name}: {[tuple(round(v, 4) for v in ENGINES[name].time(call)) for _ in range(3)]}",
                  flush=True)
        # A step whose host time equals its GPU time waits for the GPU somewhere: which call.
        from torch.profiler import ProfilerActivity, profile

        for label, fn in (("public auto", public_auto), ("public triton", public_triton)):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            print(f"  runtime calls of a {label} step: {runtime_calls(prof)}", flush=True)
            print(f"  kernels of a {label} step: {cuda_kernels(fn)}", flush=True)
        print_profile("public triton step", public_triton, 50, "tottime", 25)
        torch.cuda.synchronize()
        store = cache.store_for(E.device_name(leaves[0].device))
        store.load()
        for sig, entry in list(store.entries["decisions"].items()):
            keep = {k: entry.get(k) for k in ("engine", "rounds_ms", "host_rounds_ms", "margin")}
            print(f"  cache entry {sig[:100]}: {json.dumps(keep)}", flush=True)


def cmd_stubbed(args) -> None:
    calls = {"n": 0}

    def no_launch(self, device, *tensors):
        calls["n"] += 1

    E.Site.launch = no_launch
    dt = suites.DTYPES[args.dtype]
    if args.layer == "head":
        # A small 3-D GAN head (64 -> 1, k4 s2 p1) at 8^3, channels-last, with bias: the head path's
        # two launches (the rows GEMM and its gather).
        x = torch.randn(2, 64, 8, 8, 8, dtype=dt).to(memory_format=torch.channels_last_3d)
        w = torch.randn(64, 1, 4, 4, 4, dtype=dt)
        b = torch.randn(1, dtype=dt)
        geo = (2, 1, 0)
    else:
        # A monai_unet_k3-like layer (64 -> 32, k3 s2 p1 op1) at 32^3, channels-last, with bias.
        x = torch.randn(4, 64, 32, 32, 32, dtype=dt).to(memory_format=torch.channels_last_3d)
        w = torch.randn(64, 32, 3, 3, 3, dtype=dt)
        b = torch.randn(32, dtype=dt)
        geo = (2, 1, 1)
    with torch.no_grad():
        f = lambda: convt3d.conv_transpose3d(x, w, b, *geo, backend="triton")  # noqa: E731
        for _ in range(5):
            f()
        params, _ = check_call(x, w, b, *geo, 1, 1)
        prec = resolve_precision(None)
        engine = lambda: E.forward(x, w, b, params, prec)  # noqa: E731
        n = 300
        for label, fn in (("public call", f), ("engine alone", engine)):
            calls["n"] = 0
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            print(f"{label}: {(time.perf_counter() - t0) / n * 1e6:.1f} us/call, launches/call {calls['n'] / n:.1f}")
        print_profile("api, launches stubbed", f, n, "cumtime", 30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("layers", "launch", "profile"):
        sp = sub.add_parser(name)
        sp.add_argument("--rows", default=DEFAULT_ROWS, help="name/dtype/layout,... of the layers suite")
    sp = sub.add_parser("step")
    sp.add_argument("--rows", default="head_k2s2_8to2/bf16/cl", help="name/dtype/layout,... of the layers suite")
    sp = sub.add_parser("first-call")
    sp.add_argument("--network", default="gan3d", help="a network of the networks suite")
    sp.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="fp32, or bf16 autocast inference")
    sp = sub.add_parser("network")
    sp.add_argument("--network", default="monai_unetr", help="a network of the networks suite")
    sp.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="fp32, or bf16 autocast inference")
    sp.add_argument("--rounds", type=int, default=3)
    sp.add_argument("--train", action="store_true", help="the bench's training step instead of the forward")
    sp = sub.add_parser("stubbed")
    sp.add_argument("--dtype", default="fp32", choices=tuple(suites.DTYPES))
    sp.add_argument("--layer", default="monai", choices=("monai", "head"),
                    help="a monai_unet_k3-like phase-GEMM layer, or a small 3-D GAN head")
    args = ap.parse_args(argv)
    if args.cmd == "stubbed":
        if not E.interpreter_active():
            print("stubbed: set TRITON_INTERPRET=1 (the calls run on CPU tensors)", file=sys.stderr)
            return 2
        cmd_stubbed(args)
        return 0
    if not torch.cuda.is_available():
        print(f"{args.cmd}: needs a CUDA device", file=sys.stderr)
        return 2
    {"layers": cmd_layers, "launch": cmd_launch, "profile": cmd_profile,
     "first-call": cmd_first_call, "network": cmd_network, "step": cmd_step}[args.cmd](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
