""""auto" against each backend on the GPU: is auto never slower than cuDNN, and how often does its
heuristic pick the fastest engine?

    PYTHONPATH=src python3 tools/gpu_auto.py auto.json                      # both suites + two tiny probes
    PYTHONPATH=src python3 tools/gpu_auto.py auto.json --suite layers --case gan_k4s2p1,refine_k3s1

For every case of the bench suites (the same tensors and flags as ``convt3d bench``), forward,
do_bench medians of cuDNN, ``backend="triton"``, auto with benchmark off (the heuristic; a fresh
cache directory) and on (the first call measures), and two tiny probe layers for the heuristic's
"tiny -> torch" rule. Prints a line per case (the JSON is rewritten after each), then the summary
and the two bars: auto with benchmark on >= 0.97x cuDNN on every row, the heuristic picking the
fastest engine on >= 90% of rows. ``tools/bench_md.py`` renders the JSON as a table.
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

# A private cache, so benchmark-off rows see the heuristic and not an earlier measurement.
os.environ["CONVT3D_CACHE_DIR"] = tempfile.mkdtemp(prefix="convt3d-auto-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import convt3d  # noqa: E402
from convt3d.bench import suites  # noqa: E402
from convt3d.bench.roofline import cudnn_tf32  # noqa: E402
from convt3d.bench.runner import TimingSettings, bench_budget  # noqa: E402
from convt3d.core.validate import check_call  # noqa: E402
from convt3d.dispatch import select as dispatch  # noqa: E402

PROBES = (suites.Geometry.of("tiny_k2s2", 1, 32, 16, 8, 2, 2, 0, bias=True),
          suites.Geometry.of("tiny_k3s1", 1, 16, 16, 8, 3, 1, 1, bias=True))


def bench_ms(fn) -> float:
    """Median ms with at least 5 timed calls (convt3d bench's budget rule)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    warmup, rep = bench_budget((time.perf_counter() - t0) * 1e3, TimingSettings())
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def run_case(case: suites.Case) -> dict:
    t = suites.make_tensors(case, "cuda")
    args = case.geometry.conv_args()
    params, _ = check_call(t.x, t.w, t.b, *args)
    row = {"case": case.name, "suite": case.suite, "dtype": case.dtype, "layout": case.layout,
           "precision": case.precision, "label": case.label}
    with torch.no_grad(), cudnn_tf32(case.allow_tf32):
        mem, comp, _ = dispatch.floors(params, t.x.dtype, dispatch.resolve_precision(None), t.b is not None)
        row.update(mem_floor_us=mem * 1e6, compute_floor_us=comp * 1e6)
        times = {"torch": bench_ms(lambda: F.conv_transpose3d(t.x, t.w, t.b, *args)),
                 "triton": bench_ms(lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend="triton"))}
        row["times_ms"] = times
        seen = []  # what convt3d.conv_transpose3d itself decides, through the dispatcher's listener

        def auto():
            return convt3d.conv_transpose3d(t.x, t.w, t.b, *args)

        torch.backends.cudnn.benchmark = False
        for key, benchmark in (("heuristic", False), ("bench", True)):
            convt3d.set_benchmark(benchmark)
            seen.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with dispatch.listening(lambda e, info: seen.append(info["decision"]) if e == "decision" else None):
                auto()
            torch.cuda.synchronize()
            row["auto_first_call_s"] = time.perf_counter() - t0  # the benchmark-on call's stays
            d = seen[-1] if seen else dispatch.decide(t.x, "auto", None, params, weight=t.w, bias=t.b, measure=False)
            row[f"{key}_engine"], row[f"{key}_reason"] = d.engine, d.reason
            row[f"auto_{key}_ms"] = bench_ms(auto)
        row["measured"] = getattr(d, "source", "") in ("measured", "cache") or d.reason.startswith("auto (measured")
        convt3d.set_benchmark(None)
    best = min(times, key=times.get)
    row.update(best_engine=best, best_ms=times[best], auto_bench_vs_cudnn=times["torch"] / row["auto_bench_ms"],
               auto_heuristic_vs_cudnn=times["torch"] / row["auto_heuristic_ms"],
               auto_bench_vs_best=times[best] / row["auto_bench_ms"],
               heuristic_is_fastest=row["heuristic_engine"] == best,
               heuristic_within_3pct=times.get(row["heuristic_engine"], math.inf) <= 1.03 * times[best])
    return row


def summarize(rows: list[dict], seconds: float) -> dict:
    n = len(rows)
    return {
        "rows": n, "seconds": seconds, "all_measured": all(r["measured"] for r in rows),
        "auto_bench_vs_cudnn_min": min(r["auto_bench_vs_cudnn"] for r in rows),
        "auto_bench_below_0.97": [r["label"] for r in rows if r["auto_bench_vs_cudnn"] < 0.97],
        "auto_bench_vs_best_min": min(r["auto_bench_vs_best"] for r in rows),
        "heuristic_fastest_fraction": sum(r["heuristic_is_fastest"] for r in rows) / n,
        "heuristic_within_3pct_fraction": sum(r["heuristic_within_3pct"] for r in rows) / n,
        "heuristic_misses": [f"{r['label']}: picked {r['heuristic_engine']}, best {r['best_engine']} "
                             f"({r['times_ms'][r['heuristic_engine']] / r['best_ms']:.2f}x slower)"
                             for r in rows if not r["heuristic_is_fastest"]],
        "auto_heuristic_vs_cudnn_min": min(r["auto_heuristic_vs_cudnn"] for r in rows),
        "geomean_auto_bench_vs_cudnn": math.exp(sum(math.log(r["auto_bench_vs_cudnn"]) for r in rows) / n),
    }


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
        cases += [suites.Case("probe", g, dt, "ncdhw", "default", "randn") for g in PROBES for dt in ("fp32", "bf16")]
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "convt3d": convt3d.__version__, "cudnn": torch.backends.cudnn.version(),
           "cache_dir": os.environ["CONVT3D_CACHE_DIR"]}
    print(json.dumps(env))
    rows, failures, summary = [], [], {}
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {case.label}", file=sys.stderr, flush=True)
        try:
            r = run_case(case)
            rows.append(r)
            print(f"  {r['label']}: " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in r["times_ms"].items())
                  + f" | auto-h {r['auto_heuristic_ms'] * 1e3:.1f} ({r['heuristic_engine']})"
                  f" auto-b {r['auto_bench_ms'] * 1e3:.1f} ({r['bench_engine']}) us", flush=True)
        except Exception as exc:  # noqa: BLE001 -- a probe: record and go on
            failures.append({"label": case.label, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-2000:]})
            print(f"  FAILED: {exc}", file=sys.stderr)
        torch.cuda.empty_cache()
        suite_rows = [r for r in rows if r["suite"] != "probe"]
        if suite_rows:
            summary = summarize(suite_rows, time.perf_counter() - t0)
        Path(args.json).write_text(json.dumps({"env": env, "summary": summary, "rows": rows, "failures": failures},
                                              indent=1))
    if summary:
        print(json.dumps(summary, indent=1))
        print(f"BAR auto(benchmark on) >= 0.97x cuDNN everywhere: "
              f"{'PASS' if not summary['auto_bench_below_0.97'] else 'FAIL'}; heuristic picks the fastest on >= 90%: "
              f"{'PASS' if summary['heuristic_fastest_fraction'] >= 0.9 else 'FAIL'} "
              f"({100 * summary['heuristic_fastest_fraction']:.0f}%)")
    probes = [(r["label"], r["heuristic_engine"], r["best_engine"]) for r in rows if r["suite"] == "probe"]
    if probes:
        print("tiny probes (label, heuristic's pick, fastest):", probes)
    print(f"wrote {args.json}; {len(failures)} failures")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
