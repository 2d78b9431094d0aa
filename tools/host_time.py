"""Host time of a call: what the CPU spends before the GPU has work, where the kernels are short.

``layers`` (GPU): per layers-suite row, do_bench medians of cuDNN, triton and auto (twice, to show
the swing), then host and wall time per call (200 calls enqueued without synchronising) of triton,
auto, the engine alone and cuDNN with their CUDA kernels, and the tuner's choices.
``network`` (GPU): one network of the networks suite as three copies (untouched; patched, auto;
patched, all PyTorch) in interleaved rounds: CUDA-event time and host time per call, garbage
collections, the CUDA runtime calls that can stall the queue, the kernels whose time changed, and
auto's decision per layer; ``--train`` for the bench's training step.
``stubbed`` (CPU, interpreter): the public call and the engine alone with every launch stubbed out,
so what remains is convt3d's own Python (read that part: CPU allocations cost more than CUDA's).

    PYTHONPATH=src python3 tools/host_time.py layers [--rows aniso_122/bf16/cl,monai_unet_k3/fp32/cl]
    PYTHONPATH=src python3 tools/host_time.py network --network monai_unetr [--dtype bf16] [--train]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 tools/host_time.py stubbed [--dtype bf16] [--layer head]
"""
from __future__ import annotations

import argparse
import cProfile
import copy
import gc
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

# A private cache: auto decides afresh instead of reusing another run's decisions.
os.environ.setdefault("CONVT3D_CACHE_DIR", tempfile.mkdtemp(prefix="convt3d-host-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import convt3d  # noqa: E402
from convt3d.bench import networks, suites  # noqa: E402
from convt3d.bench.runner import event_seconds  # noqa: E402
from convt3d.core.call import resolve_precision  # noqa: E402
from convt3d.core.validate import check_call  # noqa: E402
from convt3d.engines.triton import engine as E  # noqa: E402
from convt3d.engines.triton.configs import tuning_log  # noqa: E402
from convt3d.engines.triton.sites import Site, interpreter_active  # noqa: E402

# Layers-suite rows whose forward is host-bound: their GPU kernels are shorter than the call's host time.
DEFAULT_ROWS = "aniso_122/bf16/cl,monai_unet_k3/bf16/cl,nnunet_128_64/bf16/ncdhw,monai_unet_k3/fp32/cl"
# CUDA runtime calls that can stall the host on the GPU (or the GPU on the host).
STALLS = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
          "cudaMemcpy", "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaHostAlloc")


def host_and_wall_us(fn, n: int = 200) -> tuple[float, float]:
    """(host us per call: n calls enqueued, timed on the CPU; wall us per call: until the GPU is done)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6, (time.perf_counter() - t0) / n * 1e6


def cuda_kernels(fn, n: int = 20) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return [f"{e.key[:60]} x{e.count // n} {e.device_time_total / n:.1f}us" for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.count > 0]


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


def cmd_layers(args) -> None:
    for item in args.rows.split(","):
        name, dtype, layout = item.split("/")
        case = suites.select("layers", [name], [dtype], [layout])[0]
        t = suites.make_tensors(case, "cuda")
        cargs = case.geometry.conv_args()
        params, _ = check_call(t.x, t.w, t.b, *cargs)
        print(f"== {case.label}: x strides {t.x.stride()} w strides {t.w.stride()}", flush=True)
        fns = {"triton": lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *cargs, backend="triton"),
               "auto": lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *cargs),
               "engine": lambda: E.forward(t.x, t.w, t.b, params, "tf32"),
               "torch": lambda: F.conv_transpose3d(t.x, t.w, t.b, *cargs)}
        with torch.no_grad():
            medians = [(k, triton.testing.do_bench(fns[k], warmup=10, rep=60, return_mode="median") * 1e3)
                       for k in ("torch", "triton", "auto", "triton", "auto")]
            print("  do_bench: " + "  ".join(f"{k} {us:.1f}" for k, us in medians) + " us", flush=True)
            for label, fn in fns.items():
                h, w = host_and_wall_us(fn)
                print(f"  {label}: host {h:.1f} us/call, wall {w:.1f} us/call; kernels: {cuda_kernels(fn)}",
                      flush=True)
            print(f"  triton and auto bitwise equal: {torch.equal(fns['triton'](), fns['auto']())}", flush=True)
    for key, rec in tuning_log().items():
        print("tuned", key[1:4], rec.config.short(), f"{rec.seconds:.2f}s")


def runtime_calls(prof) -> str:
    """Launches and the stalling runtime calls (count, host us) of one profiled run."""
    found = [f"{e.key} x{e.count} {e.cpu_time_total:.0f}us" for e in prof.key_averages()
             if any(e.key.startswith(s) for s in STALLS)]
    launches = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key or e.key == "cuLaunchKernel")
    return f"{launches} launches; {', '.join(found) or 'no stalling runtime calls'}"


def cmd_network(args) -> int:
    net = networks.select_networks([args.network])[0]
    why = networks.unavailable_reason(net)
    if why is not None:
        print(f"network: {why}", file=sys.stderr)
        return 2
    model, x = networks.build_network(net, "cuda")
    autocast = args.dtype == "bf16"
    copies = {"untouched": model, "auto": convt3d.patch(copy.deepcopy(model)),
              "torch": convt3d.patch(copy.deepcopy(model), backend="torch")}
    target = networks.target_for(model, x, 2) if args.train else None
    fns = {k: networks.training_step(m, x, target, autocast) if args.train else networks.forward_fn(m, x, autocast)
           for k, m in copies.items()}
    for label, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"{label}: first call {time.perf_counter() - t0:.3f} s", flush=True)
    collections = {"n": 0}
    gc.callbacks.append(lambda phase, info: collections.__setitem__("n", collections["n"] + (phase == "start")))

    for r in range(args.rounds):
        line = []
        for label, fn in fns.items():
            ev = statistics.median(event_seconds(fn, 1) for _ in range(20)) * 1e6
            torch.cuda.synchronize()
            collections["n"] = 0
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            host = (time.perf_counter() - t0) / 5 * 1e6
            torch.cuda.synchronize()
            line.append(f"{label} {ev:.0f} us (host {host:.0f} us, gc {collections['n'] / 5:.1f}/call)")
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
    _, decisions = networks.layer_engines(copies["auto"], fns["auto"])
    print("auto's layers:\n  " + "\n  ".join(decisions), flush=True)
    return 0


def cmd_stubbed(args) -> None:
    calls = {"n": 0}

    def no_launch(self, device, *tensors):
        calls["n"] += 1

    Site.launch = no_launch
    dt = suites.DTYPES[args.dtype]
    if args.layer == "head":
        # A small 3-D GAN head (64 -> 1, k4 s2 p1) at 8^3, channels-last, with bias: the head path.
        x = torch.randn(2, 64, 8, 8, 8, dtype=dt).to(memory_format=torch.channels_last_3d)
        w, b, geo = torch.randn(64, 1, 4, 4, 4, dtype=dt), torch.randn(1, dtype=dt), (2, 1, 0)
    else:
        # A monai_unet_k3-like layer (64 -> 32, k3 s2 p1 op1) at 32^3, channels-last, with bias.
        x = torch.randn(4, 64, 32, 32, 32, dtype=dt).to(memory_format=torch.channels_last_3d)
        w, b, geo = torch.randn(64, 32, 3, 3, 3, dtype=dt), torch.randn(32, dtype=dt), (2, 1, 1)
    with torch.no_grad():
        f = lambda: convt3d.conv_transpose3d(x, w, b, *geo, backend="triton")  # noqa: E731
        for _ in range(5):
            f()
        params, _ = check_call(x, w, b, *geo, 1, 1)
        prec = resolve_precision(None)
        n = 300
        for label, fn in (("public call", f), ("engine alone", lambda: E.forward(x, w, b, params, prec))):
            calls["n"] = 0
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            print(f"{label}: {(time.perf_counter() - t0) / n * 1e6:.1f} us/call, launches/call {calls['n'] / n:.1f}")
        print_profile("api, launches stubbed", f, n, "cumtime", 30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("layers").add_argument("--rows", default=DEFAULT_ROWS, help="name/dtype/layout,... (layers suite)")
    sp = sub.add_parser("network")
    sp.add_argument("--network", default="monai_unetr", help="a network of the networks suite")
    sp.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="fp32, or bf16 autocast")
    sp.add_argument("--rounds", type=int, default=3)
    sp.add_argument("--train", action="store_true", help="the bench's training step instead of the forward")
    sp = sub.add_parser("stubbed")
    sp.add_argument("--dtype", default="fp32", choices=tuple(suites.DTYPES))
    sp.add_argument("--layer", default="monai", choices=("monai", "head"),
                    help="a monai_unet_k3-like phase-GEMM layer, or a small 3-D GAN head")
    args = ap.parse_args(argv)
    if args.cmd == "stubbed":
        if not interpreter_active():
            print("stubbed: set TRITON_INTERPRET=1 (the calls run on CPU tensors)", file=sys.stderr)
            return 2
        cmd_stubbed(args)
        return 0
    if not torch.cuda.is_available():
        print(f"{args.cmd}: needs a CUDA device", file=sys.stderr)
        return 2
    if args.cmd == "layers":
        cmd_layers(args)
        return 0
    return cmd_network(args)


if __name__ == "__main__":
    raise SystemExit(main())
