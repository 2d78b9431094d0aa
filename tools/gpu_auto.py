""""auto" against each backend on the GPU: is auto never slower than cuDNN, and how often does
its heuristic pick the fastest engine?

Run on the GPU machine:

    PYTHONPATH=src python3 tools/gpu_auto.py auto.json                      # both suites + two tiny probes
    PYTHONPATH=src python3 tools/gpu_auto.py auto.json --suite layers --case gan_k4s2p1,refine_k3s1

For every case of both bench suites (``convt3d.bench.suites``: the same tensors and flags as
``convt3d bench``), forward, each timed with ``triton.testing.do_bench`` (median, L2 flushed):

* torch (cuDNN, PyTorch's flags of the row), triton, cuda (exact-grade fp32 rows, when the engine
  is built);
* auto with benchmark off (the heuristic; a fresh cache directory, so nothing measured is reused);
* auto with benchmark on (``convt3d.set_benchmark(True)``: the first call measures the candidates).

Prints a line per case as it goes (partial JSON survives a timeout), then a table (us) and the two
bars -- auto (benchmark on) >= 0.97x cuDNN on every row, and the heuristic picking the faster
engine on >= 90% of rows -- and writes everything as JSON (``tools/bench_md.py`` renders it as the
README's table). Options: ``--suite all|kernelbench|layers``, ``--case NAME,...``, ``--no-probes``.
The "meas" column says whether the benchmark-on decision came from a measurement (this run's, or
one in the cache file); "no" means auto fell back to a rule or the heuristic there.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# A private cache, so benchmark-off rows see the heuristic and not an earlier measurement.
os.environ["CONVT3D_CACHE_DIR"] = tempfile.mkdtemp(prefix="convt3d-auto-")

import triton  # noqa: E402
import triton.testing  # noqa: E402

import convt3d  # noqa: E402
from convt3d.dispatch import cache
from convt3d.engines.cuda import gemm as cuda_engine
from convt3d.dispatch import select as dispatch  # noqa: E402
from convt3d.bench import suites  # noqa: E402
from convt3d.bench.roofline import cudnn_tf32  # noqa: E402
from convt3d.core.validate import check_call  # noqa: E402

# Two layers far below the suites' smallest, to check the heuristic's "tiny -> torch" rule, which
# no suite row exercises.
PROBES = (
    suites.Geometry.of("tiny_k2s2", 1, 32, 16, 8, 2, 2, 0, bias=True),
    suites.Geometry.of("tiny_k3s1", 1, 16, 16, 8, 3, 1, 1, bias=True),
)


def bench_ms(fn, warmup_ms=10.0, rep_ms=60.0, min_reps=5) -> float:
    """Median ms with at least ``min_reps`` timed calls (convt3d bench's budget rule)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=max(warmup_ms, est), rep=max(rep_ms, (min_reps + 0.5) * est),
                                         return_mode="median"))


def probe_cases() -> list[suites.Case]:
    return [suites.Case("probe", g, dt, "ncdhw", "default", "randn") for g in PROBES for dt in ("fp32", "bf16")]


def run_case(case: suites.Case, cuda_ok: bool) -> dict:
    g = case.geometry
    t = suites.make_tensors(case, "cuda")
    args = g.conv_args()
    params, _ = check_call(t.x, t.w, t.b, *args)
    row = {"case": case.name, "suite": case.suite, "dtype": case.dtype, "layout": case.layout,
           "precision": case.precision, "label": case.label}
    with torch.no_grad(), cudnn_tf32(case.allow_tf32):
        prec = dispatch.resolve_precision(None)
        mem, comp, _ = dispatch.floors(params, t.x.dtype, prec, t.b is not None)
        row.update(mem_floor_us=mem * 1e6, compute_floor_us=comp * 1e6)
        times = {"torch": bench_ms(lambda: F.conv_transpose3d(t.x, t.w, t.b, *args))}
        times["triton"] = bench_ms(lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend="triton"))
        variant = cuda_engine.choose_variant(params) if cuda_ok else None
        if variant is not None and variant not in cuda_engine.GEMM_VARIANTS:
            # The phase_kernel/direct fallbacks, which auto does not time either: on the large
            # problems one call of them can take longer than the whole run's budget.
            row["cuda_skipped"] = f"its tile for this geometry is {variant!r}, not gemm_kernel"
        elif cuda_ok and case.dtype == "fp32" and prec != "tf32":
            try:  # the engine itself, independent of the dispatcher's wiring
                times["cuda"] = bench_ms(lambda: cuda_engine.forward(t.x, t.w, t.b, params))
            except Exception as exc:  # noqa: BLE001
                row["cuda_error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["times_ms"] = times

        # What convt3d.conv_transpose3d itself decides (seen through the dispatcher's listener,
        # whatever arguments functional.py passes to decide()).
        seen = []

        def first_call() -> float:
            seen.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with dispatch.listening(lambda e, info: seen.append(info["decision"]) if e == "decision" else None):
                convt3d.conv_transpose3d(t.x, t.w, t.b, *args)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        # auto, benchmark off: the heuristic.
        torch.backends.cudnn.benchmark = False
        convt3d.set_benchmark(False)
        first_call()
        d = seen[-1] if seen else dispatch.decide(t.x, "auto", None, params, weight=t.w, bias=t.b, measure=False)
        row["heuristic_engine"], row["heuristic_reason"] = d.engine, d.reason
        row["auto_heuristic_ms"] = bench_ms(lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *args))

        # auto, benchmark on: the first call measures.
        convt3d.set_benchmark(True)
        row["auto_first_call_s"] = first_call()
        d = seen[-1] if seen else dispatch.decide(t.x, "auto", None, params, weight=t.w, bias=t.b, measure=False)
        row["bench_engine"], row["bench_reason"] = d.engine, d.reason
        row["measured"] = getattr(d, "source", "") in ("measured", "cache") or d.reason.startswith("auto (measured")
        row["auto_bench_ms"] = bench_ms(lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *args))
        convt3d.set_benchmark(None)

    best = min(times, key=times.get)
    row.update(best_engine=best, best_ms=times[best],
               auto_bench_vs_cudnn=times["torch"] / row["auto_bench_ms"],
               auto_heuristic_vs_cudnn=times["torch"] / row["auto_heuristic_ms"],
               auto_bench_vs_best=times[best] / row["auto_bench_ms"],
               heuristic_is_fastest=row["heuristic_engine"] == best,
               heuristic_within_3pct=times.get(row["heuristic_engine"], math.inf) <= 1.03 * times[best])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="output JSON path")
    ap.add_argument("--suite", default="all", choices=("all", "kernelbench", "layers"))
    ap.add_argument("--case", default=None, help="comma-separated case names")
    ap.add_argument("--no-probes", action="store_true", help="skip the two tiny probe layers")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    names = args.case.split(",") if args.case else None
    cases = suites.select(args.suite, names)
    if not args.no_probes and names is None:
        cases += probe_cases()
    try:
        cuda_engine.load_module()  # builds the extension or loads it from the torch extensions cache
        cuda_ok, why = True, None
    except Exception as exc:  # noqa: BLE001 -- the table is still useful without the cuda column
        cuda_ok, why = False, f"{type(exc).__name__}: {exc}"[:300]
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "convt3d": convt3d.__version__, "cudnn": torch.backends.cudnn.version(), "cuda_engine": cuda_ok,
           "cuda_engine_note": None if cuda_ok else why, "cache_dir": os.environ["CONVT3D_CACHE_DIR"]}
    print(json.dumps(env))
    rows, failures = [], []
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {case.label}", file=sys.stderr, flush=True)
        try:
            rows.append(run_case(case, cuda_ok))
            r = rows[-1]
            print(f"  {r['label']}: " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in r["times_ms"].items())
                  + f" | auto-h {r['auto_heuristic_ms'] * 1e3:.1f} ({r['heuristic_engine']})"
                  f" auto-b {r['auto_bench_ms'] * 1e3:.1f} ({r['bench_engine']}) us", flush=True)
            # Partial results survive a timeout.
            Path(args.json).write_text(json.dumps({"env": env, "rows": rows, "failures": failures}, indent=1))
        except Exception as exc:  # noqa: BLE001
            failures.append({"label": case.label, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-2000:]})
            print(f"  FAILED: {exc}", file=sys.stderr)
        torch.cuda.empty_cache()

    hdr = (f"{'case':<34} {'torch':>9} {'triton':>9} {'cuda':>9} {'auto-h':>9} {'auto-b':>9} {'h pick':>7} "
           f"{'b pick':>7} {'best':>7} {'b/cuDNN':>8} {'h/cuDNN':>8} meas")
    print(hdr)
    for r in rows:
        t = r["times_ms"]
        print(f"{r['label']:<34} {t['torch'] * 1e3:9.1f} {t['triton'] * 1e3:9.1f} "
              f"{(t['cuda'] * 1e3 if 'cuda' in t else float('nan')):9.1f} {r['auto_heuristic_ms'] * 1e3:9.1f} "
              f"{r['auto_bench_ms'] * 1e3:9.1f} {r['heuristic_engine']:>7} {r['bench_engine']:>7} "
              f"{r['best_engine']:>7} {r['auto_bench_vs_cudnn']:8.2f} {r['auto_heuristic_vs_cudnn']:8.2f} "
              f"{'yes' if r['measured'] else 'no'}")
    print("(times in us)")
    suite_rows = [r for r in rows if r["suite"] != "probe"]
    summary = {}
    if suite_rows:
        summary = {
            "rows": len(suite_rows),
            "auto_bench_vs_cudnn_min": min(r["auto_bench_vs_cudnn"] for r in suite_rows),
            "auto_bench_below_0.97": [r["label"] for r in suite_rows if r["auto_bench_vs_cudnn"] < 0.97],
            "auto_bench_vs_best_min": min(r["auto_bench_vs_best"] for r in suite_rows),
            "heuristic_fastest_fraction": sum(r["heuristic_is_fastest"] for r in suite_rows) / len(suite_rows),
            "heuristic_within_3pct_fraction": sum(r["heuristic_within_3pct"] for r in suite_rows) / len(suite_rows),
            "heuristic_misses": [f"{r['label']}: picked {r['heuristic_engine']}, best {r['best_engine']} "
                                 f"({r['times_ms'][r['heuristic_engine']] / r['best_ms']:.2f}x slower)"
                                 for r in suite_rows if not r["heuristic_is_fastest"]],
            "auto_heuristic_vs_cudnn_min": min(r["auto_heuristic_vs_cudnn"] for r in suite_rows),
            "geomean_auto_bench_vs_cudnn": math.exp(sum(math.log(r["auto_bench_vs_cudnn"]) for r in suite_rows)
                                                    / len(suite_rows)),
            "all_measured": all(r["measured"] for r in suite_rows),
            "seconds": time.perf_counter() - t0,
        }
        print(json.dumps(summary, indent=1))
        print(f"BAR auto(benchmark on) >= 0.97x cuDNN everywhere: "
              f"{'PASS' if not summary['auto_bench_below_0.97'] else 'FAIL'}; "
              f"heuristic picks the faster on >= 90%: "
              f"{'PASS' if summary['heuristic_fastest_fraction'] >= 0.9 else 'FAIL'} "
              f"({100 * summary['heuristic_fastest_fraction']:.0f}%)")
    probe_rows = [r for r in rows if r["suite"] == "probe"]
    if probe_rows:
        print("tiny probes (heuristic rule 1):", [(r["label"], r["heuristic_engine"], r["best_engine"])
                                                  for r in probe_rows])
    Path(args.json).write_text(json.dumps({"env": env, "summary": summary, "rows": rows, "failures": failures,
                                           "cache_file": str(cache.file_for(cache.cache_dir(), env["gpu"]))},
                                          indent=1))
    print(f"wrote {args.json}; {len(failures)} failures")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
