"""What the bench prints and writes: environment, tables, summary, JSON, plot.

rich and matplotlib are imported inside the functions that draw, so importing this module (and
the tests of the arithmetic below) needs neither.

JSON (``--json FILE``), schema "convt3d-bench/1". Times are in microseconds (``*_us``) or seconds
(``*_s``), rates in bytes/s and FLOP/s; NaN/inf are written as null.

    schema, kind            "convt3d-bench/1"; "timing" (GPU) or "interpreter-check" (no CUDA)
    created, argv           UTC time; the bench options
    environment             convt3d, git_commit, source_digest, torch, triton, cuda, cudnn, python, platform,
                            gpu, gpu_capability, sm_count, gpu_memory_gib (GPU) or cpu,
                            env (CONVT3D_* and TRITON_INTERPRET variables), cudnn_benchmark
    settings                suite, cases (labels), backend, mode, warmup_ms, rep_ms, min_reps,
                            seed, cudnn_benchmark, jobs (+ seconds for a timing run)
    ceilings                timing only: copy_bytes_per_s (read + write), bf16/tf32/fp32 and
                            exact_grade _flops_per_s, copy_bytes, matmul_size, seconds; else null
    rows                    timing rows (below) or interpreter-check rows (``check.CheckRow``)
    failures                [{case, dtype, layout, precision, error, traceback}]
    summary                 timing: [{group, filter, cases, geomean_speedup, min_speedup,
                            min_speedup_case, geomean_roofline_pct,
                            geomean_speedup_vs_default_flags?, min_speedup_vs_default_flags?}];
                            interpreter-check: {cases, passed, failed, errors, seconds}

    timing row              case, suite, dtype, layout, precision, cudnn_allow_tf32, mode, backend,
                            input ("rand" | "randn"), geometry {batch, in_channels, out_channels,
                            in_size, kernel, stride, padding, output_padding, dilation, groups,
                            bias}, out_shape, useful_flop, min_bytes, engine, engine_reason,
                            convt3d_us, torch_us, speedup (= torch_us / convt3d_us),
                            first_call_s, torch_first_call_s, max_abs_diff_vs_torch,
                            max_abs_torch, output_layout_matches, peak_class, peak_flops_per_s,
                            mem_floor_us, compute_floor_us, bound ("memory" | "compute"),
                            tflops, torch_tflops, roofline_pct, torch_roofline_pct;
                            exact rows also torch_default_flags_us, speedup_vs_default_flags,
                            torch_default_flags_reused; bwd and full rows also bwd_choice (the dX and dW
                            implementation convt3d's backward chose, with its reason)

    network row             (``--suite networks``, see ``bench/networks.py``) case (network), suite
                            "networks", source (package and version, or "convt3d"), description,
                            mode ("infer" | "train"), dtype ("fp32" | "bf16": bf16 autocast), autocast,
                            layout, precision, cudnn_allow_tf32, backend, input_shape, output_shape
                            (infer), parameters, convt_layers, convt_layers_patched, engine (what
                            convt3d decided for the patched layers, counted), torch_first_call_s and
                            first_call_s (untouched and patched model's first call in this mode),
                            torch_us and convt3d_us (steady: the medians of each side's timing
                            blocks), speedup (the median of the paired blocks' ratios untouched /
                            patched), speedup_quartiles ([lower, upper] quartile of those ratios),
                            torch_us_rounds, convt3d_us_rounds (each block's us per call, in pair
                            order), convt_share
                            (ConvTranspose3d GPU time / all GPU time of the untouched forward),
                            convt_us, forward_kernel_us, max_abs_diff_vs_torch, max_abs_torch,
                            reference ("float64" | "fp32 step, TF32 off"), reference_s,
                            rel_err_vs_reference, torch_rel_err_vs_reference, within_error_budget,
                            output_layout_matches; train rows also loss, torch_loss, reference_loss,
                            convt_grad_rel_err, torch_convt_grad_rel_err (rel errors of train rows:
                            norm-wise over the gradients; see networks.py). No roofline.
    skipped                 networks only: [{case, reason}] (an optional extra not installed)
    settings (networks)     suite, cases, modes, backend, warmup_ms, rep_ms, min_reps, seed,
                            cudnn_benchmark, tune, first_calls, pairs, seconds, complete (false in
                            the file rewritten after each network while the run goes on, or left
                            by an interrupted run)
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Iterable

from ..version import source_digest

import torch

from .roofline import Ceilings, geomean

__all__ = ["SCHEMA", "environment", "summarize", "payload", "write_json", "write_plot", "make_console",
           "print_header", "print_timing_table", "print_summary", "print_check_table", "print_failures",
           "print_network_table", "print_network_check_table", "print_skipped"]

SCHEMA = "convt3d-bench/1"

# A timing row whose output differs from PyTorch's by more than this (relative to the largest
# |output|) is shown in red: bf16 outputs differ by ~2^-8 = 4e-3 from rounding alone, so 2e-2
# flags only results that are wrong, not merely rounded differently.
SUSPECT_REL_DIFF = 2e-2


# ---- environment ----------------------------------------------------------------------------------
def _cudnn_version() -> str | None:
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not v:
        return None
    # cuDNN 9 encodes major*10000 + minor*100 + patch (8.x used major*1000 + minor*100 + patch).
    if v >= 90000:
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def _git_commit() -> str | None:
    """The project's commit when run from a checkout (so a table can be traced to its code)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def environment(cuda: bool) -> dict:
    import triton

    import convt3d

    env = {
        "convt3d": convt3d.__version__, "git_commit": _git_commit(), "source_digest": source_digest(),
        "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "cudnn": _cudnn_version(),
        "python": platform.python_version(), "platform": platform.platform(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("CONVT3D_") or k == "TRITON_INTERPRET"},
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2 ** 30, 1))
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


# ---- summary --------------------------------------------------------------------------------------
def _group_keys(rows: list[dict]) -> list[tuple[str, dict]]:
    """Groups to summarise: each suite, then its split by precision, dtype and layout where it varies."""
    groups = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        in_suite = [r for r in rows if r["suite"] == suite]
        groups.append((suite, {"suite": suite}))
        for field in ("precision", "dtype", "layout", "mode"):
            values = list(dict.fromkeys(r.get(field) for r in in_suite))
            if len(values) > 1:
                groups += [(f"{suite} {v}", {"suite": suite, field: v}) for v in values]
    return groups


def summarize(rows: list[dict]) -> list[dict]:
    """Geometric-mean and minimum speedups per group of timing rows (see ``_group_keys``)."""
    out = []
    for name, match in _group_keys(rows):
        sel = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
        worst = min(sel, key=lambda r: r["speedup"])
        # Network rows have no roofline (a whole network has no single floor).
        roof = [r["roofline_pct"] for r in sel if _finite(r.get("roofline_pct"))]
        entry = {"group": name, "filter": match, "cases": len(sel),
                 "geomean_speedup": geomean(r["speedup"] for r in sel),
                 "min_speedup": worst["speedup"], "min_speedup_case": _row_label(worst),
                 "geomean_roofline_pct": geomean(roof)}
        vs_default = [r["speedup_vs_default_flags"] for r in sel if "speedup_vs_default_flags" in r]
        if vs_default:
            entry["geomean_speedup_vs_default_flags"] = geomean(vs_default)
            entry["min_speedup_vs_default_flags"] = min(vs_default)
        out.append(entry)
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _row_label(r: dict) -> str:
    if r.get("suite") == "networks":
        return f"{r['case']} {r['mode']} {r['dtype']}"
    return f"{r['case']} {r['dtype']} {r['layout']} {r['precision']}"


# ---- JSON -----------------------------------------------------------------------------------------
def _clean(v):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def payload(kind: str, argv: list[str], env: dict, settings: dict, rows: list[dict], failures: list[dict],
            summary, ceilings: Ceilings | None = None, skipped: list[dict] | None = None) -> dict:
    data = {
        "schema": SCHEMA, "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv), "environment": env, "settings": settings,
        "ceilings": ceilings.as_dict() if ceilings is not None else None,
        "rows": rows, "failures": failures, "summary": summary,
    }
    if skipped is not None:
        data["skipped"] = skipped
    return _clean(data)


def write_json(path: str | os.PathLike, data: dict) -> None:
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")


# ---- plot -----------------------------------------------------------------------------------------
def write_plot(path: str | os.PathLike, rows: list[dict], title: str = "") -> None:
    """Two panels, one bar per case: speedup over cuDNN (log scale) and % of roofline of both."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    labels = [_row_label(r) for r in rows]
    ys = list(range(len(rows)))
    fig, (ax_s, ax_r) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.28 * len(rows)), sharey=True)
    colors = [{"kernelbench": "tab:blue", "networks": "tab:orange"}.get(r["suite"], "tab:green") for r in rows]
    # Bars grow from 1x, so a slowdown points left instead of looking like a short win.
    ax_s.barh(ys, [r["speedup"] - 1 for r in rows], left=1, color=colors)
    exact = [(y, r["speedup_vs_default_flags"]) for y, r in zip(ys, rows) if "speedup_vs_default_flags" in r]
    if exact:
        ax_s.scatter([v for _, v in exact], [y for y, _ in exact], marker="|", s=120, color="black", zorder=3,
                     label="exact rows: vs cuDNN at default flags")
        ax_s.legend(loc="lower right", fontsize=8)
    ax_s.axvline(1.0, color="red", linewidth=1)
    ax_s.set_xscale("log")
    values = [r["speedup"] for r in rows] + [v for _, v in exact] + [1.0]
    ax_s.set_xticks([t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200)
                     if min(values) / 1.5 <= t <= max(values) * 1.5])
    ax_s.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}x"))
    ax_s.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))
    ax_s.set_xlabel("speedup over PyTorch/cuDNN (same flags; networks: untouched / patched), log scale")
    ax_s.set_yticks(ys)
    ax_s.set_yticklabels(labels, fontsize=8)
    ax_s.invert_yaxis()
    h = 0.4
    # Network rows have no roofline: no bar.
    roof = [r.get("roofline_pct") if _finite(r.get("roofline_pct")) else math.nan for r in rows]
    troof = [r.get("torch_roofline_pct") if _finite(r.get("torch_roofline_pct")) else math.nan for r in rows]
    ax_r.barh([y - h / 2 for y in ys], roof, height=h, label="convt3d")
    ax_r.barh([y + h / 2 for y in ys], troof, height=h, label="cuDNN", color="tab:gray")
    ax_r.axvline(100.0, color="red", linewidth=1)
    ax_r.set_xlabel("% of roofline (100 * max(memory floor, compute floor) / time)")
    ax_r.legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)


# ---- rich output ----------------------------------------------------------------------------------
def make_console(file=None):
    from rich.console import Console

    stream = file or sys.stdout
    # Piped output (CI logs, `| tee`) would otherwise be squeezed to 80 columns.
    width = None if stream.isatty() else 220
    return Console(file=stream, width=width)


def print_header(console, env: dict, ceilings: Ceilings | None, note: str = "") -> None:
    device = env.get("gpu") or f"CPU ({env.get('cpu')}), Triton interpreter"
    console.print(f"[bold]convt3d bench[/bold] on {device}"
                  + (f" (sm {env['gpu_capability']}, {env['sm_count']} SMs)" if env.get("gpu") else ""))
    console.print(f"convt3d {env['convt3d']}{' @ ' + env['git_commit'] if env.get('git_commit') else ''}, "
                  f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}")
    if ceilings is not None:
        console.print(f"ceilings (measured in {ceilings.seconds:.1f} s): copy "
                      f"{ceilings.copy_bytes_per_s / 1e12:.2f} TB/s (read + write); matmul bf16 "
                      f"{ceilings.bf16_flops_per_s / 1e12:.0f}, tf32 {ceilings.tf32_flops_per_s / 1e12:.0f}, "
                      f"exact fp32 {ceilings.fp32_flops_per_s / 1e12:.0f} TFLOP/s (exact grade uses "
                      f"{ceilings.exact_grade_flops_per_s / 1e12:.0f})")
    if note:
        console.print(note)


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def print_timing_table(console, rows: list[dict], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, header_style="bold", show_lines=False)
    cols = [("case", "left"), ("mode", "left"), ("dtype", "left"), ("layout", "left"), ("prec", "left"),
            ("engine", "left"),
            ("convt3d µs", "right"), ("cuDNN µs", "right"), ("speedup", "right"), ("vs dflt cuDNN", "right"),
            ("TFLOP/s", "right"), ("mem floor µs", "right"), ("comp floor µs", "right"), ("% roofline", "right"),
            ("first call s", "right"), ("max rel diff", "right")]
    for name, justify in cols:
        table.add_column(name, justify=justify, no_wrap=True)
    for r in rows:
        speed = _fmt(r["speedup"], ".2f") + "x"
        if r["speedup"] < 1:
            speed = f"[red]{speed}[/red]"
        vs_default = _fmt(r.get("speedup_vs_default_flags"), ".2f") + "x" if "speedup_vs_default_flags" in r else ""
        rel = r["max_abs_diff_vs_torch"] / r["max_abs_torch"] if r["max_abs_torch"] else math.nan
        rel_text = _fmt(rel, ".0e")
        if not rel <= SUSPECT_REL_DIFF or not r["output_layout_matches"]:
            rel_text = f"[red]{rel_text}{'' if r['output_layout_matches'] else ' layout!'}[/red]"
        engine = r["engine"]
        if r.get("bwd_choice"):
            # e.g. "triton tf32, dX triton dW cudnn"
            engine += ", " + " ".join(" ".join(part.split()[:2]) for part in r["bwd_choice"].split("; "))
        table.add_row(r["case"], r.get("mode", "fwd"), r["dtype"], r["layout"], r["precision"], engine,
                      _fmt(r["convt3d_us"], ".1f"),
                      _fmt(r["torch_us"], ".1f"), speed, vs_default, _fmt(r["tflops"], ".1f"),
                      _fmt(r["mem_floor_us"], ".1f"), _fmt(r["compute_floor_us"], ".1f"),
                      _fmt(r["roofline_pct"], ".0f"), _fmt(r["first_call_s"], ".2f"), rel_text)
    console.print(table)


def print_summary(console, summary: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="summary (speedup = cuDNN time / convt3d time, same process)", header_style="bold")
    for name in ("group", "cases", "geomean speedup", "min speedup", "geomean vs dflt cuDNN",
                 "geomean % roofline"):
        table.add_column(name, justify="left" if name == "group" else "right", no_wrap=True)
    for s in summary:
        vs = _fmt(s.get("geomean_speedup_vs_default_flags"), ".2f") + "x" \
            if "geomean_speedup_vs_default_flags" in s else ""
        table.add_row(s["group"], str(s["cases"]), _fmt(s["geomean_speedup"], ".2f") + "x",
                      f"{_fmt(s['min_speedup'], '.2f')}x ({s['min_speedup_case']})", vs,
                      _fmt(s["geomean_roofline_pct"], ".0f"))
    console.print(table)


def print_check_table(console, rows: Iterable[dict]) -> None:
    from rich.table import Table

    table = Table(title="Triton kernels through the interpreter vs float64 PyTorch (reduced sizes)",
                  header_style="bold")
    for name in ("case", "dtype", "layout", "prec", "engine", "reduced input", "max abs err", "ref err",
                 "bar (2x ref)", "out layout", "s", "ok"):
        table.add_column(name, justify="left" if name in ("case", "dtype", "layout", "prec", "engine",
                                                          "reduced input") else "right", no_wrap=True)
    for r in rows:
        g = r["reduced_geometry"]
        shape = f"{g['batch']}x{g['in_channels']}x{'x'.join(map(str, g['in_size']))}"
        table.add_row(r["case"], r["dtype"], r["layout"], r["precision"], r["engine"], shape,
                      f"{r['max_abs_err']:.2e}", f"{r['ref_max_abs_err']:.2e}", f"{r['bar']:.2e}",
                      "ok" if r["layout_ok"] else "[red]WRONG[/red]", f"{r['seconds']:.1f}",
                      "[green]ok[/green]" if r["ok"] else "[red]FAIL[/red]")
    console.print(table)


def print_failures(console, failures: list[dict]) -> None:
    for f in failures:
        mode = f" {f['mode']}" if f.get("mode") else ""  # network failures name their mode
        console.print(f"[red]failed[/red] {f['case']}{mode} {f['dtype']} {f['layout']} {f['precision']}: {f['error']}")


# ---- networks suite -------------------------------------------------------------------------------
def _rel_text(err, ref_err, ok) -> str:
    text = f"{_fmt(err, '.1e')} / {_fmt(ref_err, '.1e')}"
    return text if ok else f"[red]{text}[/red]"


def print_network_table(console, rows: list[dict], title: str) -> None:
    """Timing rows of ``--suite networks``: one per network and mode."""
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    cols = [("network", "left"), ("mode", "left"), ("dtype", "left"), ("patched layers: engine", "left"),
            ("convT share", "right"), ("untouched ms", "right"), ("patched ms", "right"),
            ("ratio (pairs' quartiles)", "right"),
            ("first call s (untouched / patched)", "right"), ("rel err vs ref (patched / untouched)", "right"),
            ("ref", "left")]
    for name, justify in cols:
        table.add_column(name, justify=justify, no_wrap=True)
    for r in rows:
        ratio = _fmt(r["speedup"], ".2f") + "x"
        if r["speedup"] < 1:
            ratio = f"[red]{ratio}[/red]"
        if r.get("speedup_quartiles"):
            ratio += " ({:.2f}-{:.2f})".format(*r["speedup_quartiles"])
        layers = f"{r['convt_layers_patched']}/{r['convt_layers']}: {r.get('engine', '')}"
        share = _fmt(100 * r["convt_share"], ".1f") + "%" if _finite(r.get("convt_share")) else "-"
        table.add_row(r["case"], r["mode"], r["dtype"], layers, share, _fmt(r["torch_us"] / 1e3, ".2f"),
                      _fmt(r["convt3d_us"] / 1e3, ".2f"), ratio,
                      f"{_fmt(r['torch_first_call_s'], '.2f')} / {_fmt(r['first_call_s'], '.2f')}",
                      _rel_text(r["rel_err_vs_reference"], r["torch_rel_err_vs_reference"], r["within_error_budget"]),
                      r["reference"])
    console.print(table)


def print_first_call_table(console, rows: list[dict]) -> None:
    """``--suite networks --first-calls``: each network's first call, untouched and patched, and
    what the patched one costs on top (compile, tuning and measurement, or with a warm cache the
    loading of what earlier processes left)."""
    from rich.table import Table

    table = Table(title="networks: first calls (untouched, then convt3d.patch)", header_style="bold")
    for name, justify in [("network", "left"), ("mode", "left"), ("dtype", "left"), ("untouched s", "right"),
                          ("patched s", "right"), ("extra s", "right"), ("rel err vs ref (patched / untouched)",
                                                                          "right")]:
        table.add_column(name, justify=justify, no_wrap=True)
    for r in rows:
        table.add_row(r["case"], r["mode"], r["dtype"], _fmt(r["torch_first_call_s"], ".2f"),
                      _fmt(r["first_call_s"], ".2f"), _fmt(r["first_call_extra_s"], ".2f"),
                      _rel_text(r["rel_err_vs_reference"], r["torch_rel_err_vs_reference"], r["within_error_budget"]))
    console.print(table)


def print_network_check_table(console, rows: Iterable[dict]) -> None:
    """Rows of the networks' CPU check (``networks.check_networks``)."""
    from rich.table import Table

    table = Table(title="networks at tiny sizes: patched (Triton interpreter) vs untouched vs float64, fp32",
                  header_style="bold")
    for name in ("network", "source", "input", "output", "patched layers", "rel err (patched / untouched)",
                 "max abs diff", "s", "ok"):
        table.add_column(name, justify="left" if name in ("network", "source", "input", "output") else "right",
                         no_wrap=True)
    for r in rows:
        table.add_row(r["case"], r["source"], "x".join(map(str, r["input_shape"])),
                      "x".join(map(str, r["output_shape"])), f"{r['convt_layers_patched']}/{r['convt_layers']}",
                      _rel_text(r["rel_err_vs_reference"], r["torch_rel_err_vs_reference"], r["within_error_budget"]),
                      f"{r['max_abs_diff_vs_torch']:.1e}", f"{r['seconds']:.1f}",
                      "[green]ok[/green]" if r["ok"] else "[red]FAIL[/red]")
    console.print(table)


def print_skipped(console, skipped: list[dict]) -> None:
    for s in skipped:
        console.print(f"[yellow]skipped[/yellow] {s['case']}: {s['reason']}", highlight=False)
