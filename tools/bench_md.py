"""docs/benchmarks.md from the bench records of a folder, without a GPU or convt3d.

    python tools/bench_md.py --docs docs/bench [--plot docs/benchmarks.png] > docs/benchmarks.md

Per suite, mode and GPU one table of the records' rows, with each record's GPU, versions and date,
and a geometric mean; ``--plot`` adds a bar chart of the layers and KernelBench speedups. A file that
is no record stops it, so that the folder holds records only (for one record, a folder of it alone).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from dataclasses import dataclass, field
from statistics import geometric_mean

# Runs written before the bench took the library's names say "default" and "exact".
PRECISION = {"default": "tf32", "exact": "tf32x3"}
NOT_RECORDED = "not recorded"

# Sections in page order: (key, title).
SUITES = (("kernelbench", "KernelBench problems, `convt3d bench --suite kernelbench`"),
          ("kernelbench-check", "KernelBench files, `convt3d kernelbench`"),
          ("kernelbench-harness", "KernelBench files, KernelBench's own harness"),
          ("layers", "Layers suite: decoder layers and output heads"),
          ("heads", "Heads sweep, `convt3d bench --suite heads`"),
          ("networks", "Networks: whole models, untouched against patched"))
MODES = {"fwd": "forward", "bwd": "backward", "full": "training step", "infer": "inference", "train": "training step"}

METHOD_FILE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks_method.md"


@dataclass
class Run:
    """One record's rows of one suite and mode: (case, dtype, layout, precision, engine, convt3d µs,
    cuDNN µs, speedup) each, and one line saying where they come from."""

    suite: str
    mode: str
    gpu: str
    source: str
    date: str = ""  # ISO, empty where not recorded
    rows: list[tuple] = field(default_factory=list)


def _precision(p: str | None) -> str:
    return PRECISION.get(p, p) if p else NOT_RECORDED


def _or_nr(v) -> str:
    return str(v) if v not in (None, "") else NOT_RECORDED


def _versions(gpu, date: str, **versions) -> str:
    """The GPU, each named version and the date, "not recorded" where the record lacks one."""
    return ", ".join([_or_nr(gpu)] + [f"{k} {_or_nr(v)}" for k, v in versions.items()] + [f"date {date}"])


def _command(tool: str, argv: list[str]) -> str:
    """The command as run, less its output paths (``--json``, ``--plot``), which name the machine's folders."""
    outputs = {i + j for i, a in enumerate(argv) if a in ("--json", "--plot") for j in (0, 1)}
    return f"`{' '.join([tool] + [a for i, a in enumerate(argv) if i not in outputs])}`"


def _env(d: dict) -> str:
    env = d.get("environment", {})
    c = env.get("convt3d") and env["convt3d"] + (f" @ {env['git_commit']}" if env.get("git_commit") else "")
    # The ISO timestamp as "YYYY-MM-DD HH:MM UTC" (without " UTC" where it has no offset).
    m = re.match(r"(\d{4}-\d\d-\d\d)T(\d\d:\d\d)", d.get("created") or "")
    date = f"{m[1]} {m[2]}" + (" UTC" if d["created"].endswith(("+00:00", "Z")) else "") if m else NOT_RECORDED
    return _versions(env.get("gpu"), date, convt3d=c, torch=env.get("torch"), triton=env.get("triton"),
                     cuDNN=env.get("cudnn"))


# ---- readers, one per kind of record -------------------------------------------------------------
def _engine(r: dict) -> str:
    """The row's engine, with the backward's picks where the row has them ("dX triton, dW cudnn")."""
    parts = re.findall(r"\b(dX|dW|db) (\w+)", r.get("bwd_choice") or "")
    return r.get("engine", "") + (" (" + ", ".join(" ".join(p) for p in parts) + ")" if parts else "")


def _bench_json(name: str, d: dict) -> list[Run]:
    """`convt3d bench --json`: one run per suite and mode of its rows."""
    env, st = d.get("environment", {}), d.get("settings", {})
    how = [_command("convt3d bench", d.get("argv", []))]
    if "warmup_ms" in st:
        how.append(f"warm-up {st['warmup_ms']:g} ms, rep {st['rep_ms']:g} ms, at least {st.get('min_reps', '?')} "
                   "calls per median")
    if "pairs" in st:
        how.append(f"{st['pairs']} pairs of blocks")
    how += ["cudnn.benchmark " + ("on" if st.get("cudnn_benchmark", env.get("cudnn_benchmark")) else "off"),
            f"backend {st.get('backend', NOT_RECORDED)}"]
    extra = [f"failed: {f.get('case')} {f.get('dtype', '')} {f.get('layout', '')} ({f.get('error', '')})"
             for f in d.get("failures", [])]
    extra += [f"skipped {s['case']} ({s['reason']})" for s in d.get("skipped") or []]
    src, runs = f"`{name}`: {_env(d)}; " + "; ".join(how + extra), {}
    for r in d["rows"]:
        key = (r["suite"], r.get("mode", "fwd"))
        runs.setdefault(key, Run(*key, _or_nr(env.get("gpu")), src, d.get("created", ""))).rows.append(
            (r["case"], r["dtype"], r["layout"], _precision(r.get("precision")), _engine(r), r["convt3d_us"],
             r["torch_us"], r["speedup"]))
    return list(runs.values())


def _kb_row(file: str, precision: str, new_us: float, ref_us: float, speedup: float) -> tuple:
    """A KernelBench file's row (fp32 NCDHW): its problem number as the case, the hand-kept CUDA entry apart."""
    engine = "cuda file" if file.endswith("_cuda.py") else "triton file"
    return (f"kb{int(file.split('_', 1)[0])}", "fp32", "ncdhw", precision, engine, new_us, ref_us, speedup)


def _kernelbench_json(name: str, d: dict) -> list[Run]:
    """`convt3d kernelbench --json`: one row per file both sides were timed on."""
    env, m, fl, s = d.get("environment", {}), d.get("method", {}), d.get("flags", {}), d.get("summary", {})
    how = (_command("convt3d kernelbench", d.get("argv", [])) +
           f"; {m.get('correct_trials', '?')} correctness trials, {m.get('timed_trials', '?')} timed trials after "
           f"{m.get('warmup', '?')} warm-ups, L2 flush of {m.get('l2_flush_bytes', 0) / 2**20:g} MiB; cuDNN TF32 "
           + ("on" if fl.get("cudnn_conv_tf32") else "off") + f"; correct {s.get('correct', '?')} of "
           f"{s.get('checked', '?')}")
    run = Run("kernelbench-check", "fwd", _or_nr(env.get("gpu")), f"`{name}`: {_env(d)}; {how}", d.get("created", ""))
    for p in d["problems"]:
        if p.get("new_ms") and p.get("ref_ms"):
            new, ref = p["new_ms"]["median"] * 1e3, p["ref_ms"]["median"] * 1e3
            run.rows.append(_kb_row(p["file"], _precision(p.get("precision")), new, ref, ref / new))
    return [run]


def _harness_json(name: str, d: dict, log: bool) -> list[Run]:
    """KernelBench's eval_kernel_against_ref results by file, with the device, versions, trials and timing method
    ``tools/kb_harness.py`` records under "environment"; its printed output may lie beside as a .log."""
    env = d.pop("environment", {})
    trials, warm = env.get("timed_trials"), env.get("warm_up")
    how = f"{trials} timed trials" + (f" after {warm} warm-ups" if warm else "") if trials else "trials " + NOT_RECORDED
    how += f", timing method {env.get('timing_method') or NOT_RECORDED}"
    ok = sum(bool(v.get("correctness")) for v in d.values())
    src = (f"`{name}`" + (f" and `{name[:-5]}.log`" if log else "") + ": "
           + _versions(env.get("gpu"), env.get("date", NOT_RECORDED), torch=env.get("torch"),
                       triton=env.get("triton"), cuDNN=env.get("cudnn")) + f"; {how}; correct {ok} of {len(d)}")
    run = Run("kernelbench-harness", "fwd", _or_nr(env.get("gpu")), src)
    for file, v in sorted(d.items()):
        if v.get("runtime") and v.get("ref_runtime"):
            run.rows.append(_kb_row(file, env.get("precision", NOT_RECORDED), v["runtime"] * 1e3,
                                    v["ref_runtime"] * 1e3, v["speedup"]))
    return [run]


def read_records(folder: str) -> list[Run]:
    """Every record of ``folder``, in file-name order; a file that is none stops the page."""
    names = sorted(os.listdir(folder))
    runs: list[Run] = []
    for n in names:
        if n.endswith(".log") and n[:-4] + ".json" in names:
            continue  # the harness's printed output, named with its JSON
        d = json.loads(Path(folder, n).read_text(encoding="utf-8")) if n.endswith(".json") else None
        schema = str(d.get("schema", "")) if isinstance(d, dict) else ""
        if schema.startswith("convt3d-bench/"):
            runs += _bench_json(n, d)
        elif schema.startswith("convt3d-kernelbench/"):
            runs += _kernelbench_json(n, d)
        elif isinstance(d, dict) and d and all(isinstance(v, dict) and "ref_runtime" in v
                                               for k, v in d.items() if k != "environment"):
            runs += _harness_json(n, d, n[:-5] + ".log" in names)
        else:
            raise ValueError(f"{os.path.join(folder, n)}: not a record this page reads")
    return runs


# ---- the page ------------------------------------------------------------------------------------
def _summary(rows: list[tuple]) -> str:
    low = min(rows, key=lambda r: r[7])
    line = (f"Geomean speedup over the {len(rows)} rows: **{geometric_mean(r[7] for r in rows):.2f}x** "
            f"(min {low[7]:.2f}x, {' '.join(low[:3])})")
    for col in (1, 2, 3):
        values = dict.fromkeys(r[col] for r in rows)
        if len(values) > 1:
            line += "; " + ", ".join(f"{v} {geometric_mean(r[7] for r in rows if r[col] == v):.2f}x" for v in values)
    return line + "."


def group(runs: list[Run]) -> list[tuple[str, str, str, list[Run]]]:
    """(suite, mode, gpu, runs) in page order (SUITES' order, then mode, then GPU), the latest record first."""
    order, modes = [k for k, _ in SUITES], list(MODES)
    keys = sorted({(r.suite, r.mode, r.gpu) for r in runs},
                  key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[0],
                                 modes.index(k[1]) if k[1] in modes else len(modes), k[1], k[2]))
    latest = sorted(sorted(runs, key=lambda r: r.source), key=lambda r: r.date, reverse=True)
    return [(s, m, g, [r for r in latest if (r.suite, r.mode, r.gpu) == (s, m, g)]) for s, m, g in keys]


def page(folder: str) -> str:
    """docs/benchmarks.md from the records of ``folder``, named in it as given (normalised)."""
    folder = os.path.normpath(folder).replace(os.sep, "/")
    out = ["# Benchmarks", "",
           f"Generated from the records in `{folder}/` by `python tools/bench_md.py --docs {folder} "
           "> docs/benchmarks.md` (add `--plot docs/benchmarks.png` for the chart); do not edit by hand. "
           f"`{folder}/` keeps the latest run of each suite per GPU; earlier runs are in git's history. "
           "Every version and date below is read from its record, or says it was not recorded.", "",
           "![speedup over cuDNN per layers row and KernelBench problem](benchmarks.png)", "",
           METHOD_FILE.read_text(encoding="utf-8")]
    current = None
    for suite, mode, gpu, runs in group(read_records(folder)):
        if suite != current:
            out += [f"## {dict(SUITES).get(suite, suite)}", ""]
            current = suite
        out += [f"### {gpu}, {MODES.get(mode, mode)}", ""] + [f"- {r.source}" for r in runs] + [""]
        rows = [row for r in runs for row in r.rows]
        out += ["| case | dtype | layout | precision | engine | convt3d µs | cuDNN µs | speedup |", "|" + "---|" * 8]
        out += [f"| {' | '.join(r[:5])} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.2f}x |" for r in rows]
        out += ["", _summary(rows), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def plot(folder: str, path: str) -> bool:
    """Bars of the speedup per layers row and KernelBench file, a colour per group; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = group(read_records(folder))
    # Training steps are left out: their bars would stand beside forward bars of the same row.
    panels = [("Layers suite", [g for g in groups if g[0] == "layers" and g[1] == "fwd"]),
              ("KernelBench, TF32 allowed", [g for g in groups if g[0].startswith("kernelbench")])]
    tools = {k: t.split(", ")[-1].replace("`", "") for k, t in SUITES}
    fig, axes = plt.subplots(1, 2, figsize=(15, 14), gridspec_kw={"width_ratios": [3, 2]})
    for ax, (title, gs) in zip(axes, panels):
        labels, series = [], []
        for suite, mode, gpu, runs in gs:
            if suite == "layers":
                vals = {f"{r[0]} {r[1]} {r[2]}": r[7] for run in runs for r in run.rows}
                what = MODES[mode]
            else:  # PyTorch's default flags (TF32 allowed), as KernelBench runs: one bar per problem and series
                vals = {r[0] + (" cuda" if r[4] == "cuda file" else ""): r[7] for run in runs for r in run.rows
                        if r[3] in ("tf32", NOT_RECORDED)}
                what = tools[suite]
            labels += [k for k in vals if k not in labels]
            series.append((f"{gpu}, {what}", vals))
        h = 0.8 / max(len(series), 1)
        for i, (name, vals) in enumerate(series):
            ys = [j + (i - (len(series) - 1) / 2) * h for j, k in enumerate(labels) if k in vals]
            ax.barh(ys, [vals[k] for k in labels if k in vals], height=h, label=name)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set(xscale="log", xlabel="speedup over cuDNN (log scale)", title=title)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", metavar="DIR", required=True, help="write docs/benchmarks.md from every record of DIR")
    ap.add_argument("--plot", metavar="PNG", help="the chart, when matplotlib is installed")
    args = ap.parse_args(argv)
    # Bytes, so that the page is the same under any locale ("µ" is in it).
    sys.stdout.buffer.write(page(args.docs).encode("utf-8"))
    if args.plot and not plot(args.docs, args.plot):
        print(f"matplotlib is not installed: {args.plot} not written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
