"""Render `convt3d bench --json` files (and `tools/gpu_auto.py`'s JSON) as the README's markdown
tables, one per file, then the file's summary groups. Needs neither a GPU nor convt3d:

    python3 tools/bench_md.py docs/bench/bench_kb.json [more.json ...]
"""
from __future__ import annotations

import argparse
import json
import re


def _engine(r: dict) -> str:
    eng = r.get("engine", "")
    bwd = r.get("bwd_choice")
    if bwd:
        # "dX triton M128 ... (timed: ...); dW cudnn (static rule ...)" -> "dX triton, dW cudnn"
        parts = re.findall(r"\b(dX|dW|db) (\w+)", bwd)
        eng += " (" + ", ".join(" ".join(p) for p in parts) + ")"
    return eng


def render_auto(d: dict, path: str) -> str:
    """tools/gpu_auto.py's JSON: each backend, auto with benchmark off (heuristic) and on."""
    env = d.get("env", {})
    out = [f"`{path}`: {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
           f"cuDNN {env.get('cudnn')}", "",
           "| case | cuDNN µs | triton µs | auto, benchmark off µs (pick) | auto, benchmark on µs (pick) "
           "| fastest | on / cuDNN |",
           "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        t = r["times_ms"]
        out.append(f"| {r['label']} | {t['torch'] * 1e3:.1f} | {t['triton'] * 1e3:.1f} "
                   f"| {r['auto_heuristic_ms'] * 1e3:.1f} ({r['heuristic_engine']}) "
                   f"| {r['auto_bench_ms'] * 1e3:.1f} ({r['bench_engine']}) | {r['best_engine']} "
                   f"| {r['auto_bench_vs_cudnn']:.2f}x |")
    return "\n".join(out)


def render_networks(d: dict, path: str) -> str:
    """The networks suite: one row per (network, mode)."""
    out = [f"`{path}`: argv {' '.join(d.get('argv', []))}", "",
           "| network | mode | dtype | transposed-conv share | untouched ms | patched ms | ratio "
           "| rounds untouched / patched ms | first call s (untouched / patched) "
           "| rel. error vs reference (patched / untouched) | engines |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        rounds = (", ".join(f"{t / 1e3:.2f}" for t in r["torch_us_rounds"]) + " / "
                  + ", ".join(f"{t / 1e3:.2f}" for t in r["convt3d_us_rounds"]))
        out.append(f"| {r['case']} | {r['mode']} | {r['dtype']} | {100 * r['convt_share']:.1f}% "
                   f"| {r['torch_us'] / 1e3:.2f} | {r['convt3d_us'] / 1e3:.2f} | {r['speedup']:.2f}x | {rounds} "
                   f"| {r['torch_first_call_s']:.2f} / {r['first_call_s']:.1f} "
                   f"| {r['rel_err_vs_reference']:.1e} / {r['torch_rel_err_vs_reference']:.1e} | {r['engine']} |")
    for s in d.get("summary", []):
        out.append(f"- {s['group']}: {s['cases']} modes, geometric mean {s['geomean_speedup']:.2f}x, "
                   f"min {s['min_speedup']:.2f}x ({s['min_speedup_case']})")
    for sk in d.get("skipped", []):
        out.append(f"- skipped: {sk}")
    if d.get("failures"):
        out.append(f"- failures: {d['failures']}")
    return "\n".join(out)


def render(path: str) -> str:
    d = json.load(open(path))
    if "env" in d and d.get("rows") and "times_ms" in d["rows"][0]:
        return render_auto(d, path)
    if d.get("rows") and d["rows"][0].get("suite") == "networks":
        return render_networks(d, path)
    rows = d["rows"]
    env = d.get("environment", {})
    out = [f"`{path}`: {env.get('gpu', env.get('device', '?'))}, torch {env.get('torch', '?')}, "
           f"triton {env.get('triton', '?')}, cuDNN {env.get('cudnn', '?')}; argv {' '.join(d.get('argv', []))}", ""]
    kb = all(r["suite"] == "kernelbench" for r in rows)
    if kb:
        out.append("| case | precision | engine | convt3d µs | cuDNN µs | speedup | vs default-flag cuDNN "
                   "| % of roofline | first call s |")
        out.append("|---|---|---|---|---|---|---|---|---|")
    else:
        out.append("| case | dtype | layout | engine | convt3d µs | cuDNN µs | speedup | % of roofline | first call s |")
        out.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        common = [f"{r['convt3d_us']:.1f}", f"{r['torch_us']:.1f}", f"{r['speedup']:.2f}x"]
        tail = [f"{r['roofline_pct']:.0f}", f"{r.get('first_call_s', float('nan')):.2f}"]
        if kb:
            vs = r.get("speedup_vs_default_flags")
            cells = [r["case"], r["precision"], _engine(r), *common, f"{vs:.2f}x" if vs else "", *tail]
        else:
            cells = [r["case"], r["dtype"], r["layout"], _engine(r), *common, *tail]
        out.append("| " + " | ".join(cells) + " |")
    for s in d.get("summary", []):
        line = (f"- {s['group']}: {s['cases']} cases, geometric mean {s['geomean_speedup']:.2f}x, "
                f"min {s['min_speedup']:.2f}x ({s['min_speedup_case']})")
        if "geomean_speedup_vs_default_flags" in s:
            line += (f"; against default-flag cuDNN {s['geomean_speedup_vs_default_flags']:.2f}x "
                     f"(min {s['min_speedup_vs_default_flags']:.2f}x)")
        out.append(line)
    if d.get("failures"):
        out.append(f"- failures: {d['failures']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="convt3d bench --json files, or tools/gpu_auto.py's JSON")
    args = ap.parse_args(argv)
    print("\n\n".join(render(p) for p in args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
