"""What the bench prints and writes: environment, tables (rich, else plain text), summary, JSON
and the plot (matplotlib, else skipped with a line).

JSON, schema "convt3d-bench/1" (``*_us`` microseconds, ``*_s`` seconds, NaN and inf as null): schema, kind ("timing" or
"interpreter-check"), created, argv, environment, settings, ceilings (layer timing runs), rows, failures ({case, dtype,
layout, precision, error, traceback}), summary and, for networks, skipped ({case, reason}).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterable

import torch
import triton

import convt3d
from ..version import source_digest
from .roofline import Ceilings, geomean

SCHEMA = "convt3d-bench/1"

# A timing row whose output differs from PyTorch's by more than this (relative to the largest
# |output|) is shown in red: bf16 rounding alone gives ~4e-3, so this flags results that are wrong.
SUSPECT_REL_DIFF = 2e-2


# ---- environment ----------------------------------------------------------------------------------
def _git_commit() -> str | None:
    """The project's commit when run from a checkout, "+dirty" with tracked changes."""
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always",
                              "--dirty=+dirty", "--exclude=*"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(cuda: bool) -> dict:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env = {"convt3d": convt3d.__version__, "git_commit": _git_commit(), "source_digest": source_digest(),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           # cuDNN 9, the one torch >= 2.11 ships, encodes major*10000 + minor*100 + patch.
           "cudnn": f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}" if cudnn else None,
           "python": platform.python_version(), "platform": platform.platform(),
           "env": {k: v for k, v in os.environ.items() if k.startswith("CONVT3D_") or k == "TRITON_INTERPRET"},
           "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2 ** 30, 1))
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


# ---- summary --------------------------------------------------------------------------------------
def summarize(rows: list[dict]) -> list[dict]:
    """Geomean and minimum speedups per suite, then per precision, dtype, layout and mode where the suite varies it."""
    groups = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        in_suite = [r for r in rows if r["suite"] == suite]
        groups.append((suite, {"suite": suite}))
        for field in ("precision", "dtype", "layout", "mode"):
            values = list(dict.fromkeys(r.get(field) for r in in_suite))
            if len(values) > 1:
                groups += [(f"{suite} {v}", {"suite": suite, field: v}) for v in values]
    out = []
    for name, match in groups:
        sel = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
        worst = min(sel, key=lambda r: r["speedup"])
        entry = {"group": name, "filter": match, "cases": len(sel),
                 "geomean_speedup": geomean(r["speedup"] for r in sel),
                 "min_speedup": worst["speedup"], "min_speedup_case": _row_label(worst),
                 # Network rows have no roofline (a whole network has no single floor).
                 "geomean_roofline_pct": geomean(r["roofline_pct"] for r in sel if _finite(r.get("roofline_pct")))}
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
def payload(kind: str, argv: list[str], env: dict, settings: dict, rows: list[dict], failures: list[dict],
            summary, ceilings: Ceilings | None = None, skipped: list[dict] | None = None) -> dict:
    return {"schema": SCHEMA, "kind": kind, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(argv), "environment": env, "settings": settings,
            "ceilings": None if ceilings is None else ceilings.as_dict(), "rows": rows, "failures": failures,
            "summary": summary, **({} if skipped is None else {"skipped": skipped})}


def _parent_made(path: str | os.PathLike) -> Path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return Path(path)


def write_json(path: str | os.PathLike, data: dict) -> None:
    """``data`` as JSON, NaN and inf as null (JSON has neither)."""
    clean = json.loads(json.dumps(data), parse_constant=lambda _nan_or_inf: None)
    _parent_made(path).write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")


# ---- plot -----------------------------------------------------------------------------------------
def write_plot(path: str | os.PathLike, rows: list[dict], title: str) -> None:
    """Speedup over cuDNN (log scale) and both sides' % of roofline, a bar per row; ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    ys = list(range(len(rows)))
    fig, (ax_s, ax_r) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.28 * len(rows)), sharey=True)
    colors = [{"kernelbench": "tab:blue", "networks": "tab:orange"}.get(r["suite"], "tab:green") for r in rows]
    # Bars grow from 1x, so a slowdown points left instead of looking like a short win.
    ax_s.barh(ys, [r["speedup"] - 1 for r in rows], left=1, color=colors)
    vs_default = [(y, r["speedup_vs_default_flags"]) for y, r in zip(ys, rows) if "speedup_vs_default_flags" in r]
    if vs_default:
        ax_s.scatter([v for _, v in vs_default], [y for y, _ in vs_default], marker="|", s=120, color="black",
                     zorder=3, label="tf32x3 rows: vs cuDNN at default flags")
        ax_s.legend(loc="lower right", fontsize=8)
    ax_s.axvline(1.0, color="red", linewidth=1)
    ax_s.set_xscale("log")
    values = [r["speedup"] for r in rows] + [v for _, v in vs_default] + [1.0]
    ax_s.set_xticks([t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200)
                     if min(values) / 1.5 <= t <= max(values) * 1.5])
    ax_s.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}x"))
    ax_s.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))
    ax_s.set_xlabel("speedup over PyTorch/cuDNN (same flags; networks: untouched / patched), log scale")
    ax_s.set_yticks(ys, [_row_label(r) for r in rows], fontsize=8)
    ax_s.invert_yaxis()
    for key, dy, label, color in (("roofline_pct", -0.2, "convt3d", None), ("torch_roofline_pct", 0.2, "cuDNN",
                                                                            "tab:gray")):
        ax_r.barh([y + dy for y in ys], [r[key] if _finite(r.get(key)) else math.nan for r in rows], height=0.4,
                  label=label, color=color)
    ax_r.axvline(100.0, color="red", linewidth=1)
    ax_r.set_xlabel("% of roofline (100 * max(memory floor, compute floor) / time)")
    ax_r.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(_parent_made(path), dpi=110)
    plt.close(fig)


# ---- console and tables ---------------------------------------------------------------------------
_MARKUP = re.compile(r"\[/?(?:bold |dim )?(?:bold|dim|red|green|yellow)?\]")


class PlainConsole:
    """rich's Console as far as the bench and the evaluator use it, in plain text (no markup)."""

    def __init__(self, file):
        self.file = file
        self.is_terminal = file.isatty()

    def print(self, *objects, markup: bool = True, **_style) -> None:
        text = " ".join(str(o) for o in objects)
        print(_MARKUP.sub("", text) if markup else text, file=self.file, flush=True)


def make_console(file=None):
    """A rich Console on ``file`` (stdout), or a :class:`PlainConsole` where rich is not installed."""
    stream = file or sys.stdout
    try:
        from rich.console import Console
    except ImportError:
        print("rich is not installed: plain-text tables (pip install rich)", file=sys.stderr)
        return PlainConsole(stream)
    # Piped output (CI logs, `| tee`) would otherwise be squeezed to 80 columns.
    return Console(file=stream, width=None if stream.isatty() else 220)


def table(console, title: str, columns: list[str], rows: list[list[str]], left: int | set = 1) -> None:
    """A table: the first ``left`` columns (or those named in it) left-aligned, the others right-aligned."""
    lefts = [i < left if isinstance(left, int) else name in left for i, name in enumerate(columns)]
    if not isinstance(console, PlainConsole):
        from rich.table import Table

        table = Table(title=title, header_style="bold")
        for name, is_left in zip(columns, lefts):
            table.add_column(name, justify="left" if is_left else "right", no_wrap=True)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    cells = [columns] + [[_MARKUP.sub("", c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    console.print(title, markup=False)
    for r in cells:
        console.print("  ".join(c.ljust(w) if is_left else c.rjust(w) for c, w, is_left in zip(r, widths, lefts)),
                      markup=False)


def print_header(console, env: dict, ceilings: Ceilings | None, note: str = "") -> None:
    device = env.get("gpu") or f"CPU ({env.get('cpu')}), Triton interpreter"
    console.print(f"[bold]convt3d bench[/bold] on {device}"
                  + (f" (sm {env['gpu_capability']}, {env['sm_count']} SMs)" if env.get("gpu") else ""))
    console.print(f"convt3d {env['convt3d']}{' @ ' + env['git_commit'] if env.get('git_commit') else ''}, "
                  f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}")
    if ceilings is not None:
        console.print(f"ceilings (measured in {ceilings.seconds:.1f} s): copy {ceilings.copy_bytes_per_s / 1e12:.2f} "
                      f"TB/s (read + write); matmul bf16 {ceilings.bf16_flops_per_s / 1e12:.0f}, tf32 "
                      f"{ceilings.tf32_flops_per_s / 1e12:.0f}, exact fp32 {ceilings.fp32_flops_per_s / 1e12:.0f} "
                      f"TFLOP/s (exact grade uses {ceilings.exact_grade_flops_per_s / 1e12:.0f})")
    if note:
        console.print(note)


def _fmt(v, spec: str) -> str:
    return format(v, spec) if _finite(v) else "-"


def _x(v, red_below: float | None = 1.0) -> str:
    """A speedup as "1.23x", red below ``red_below``."""
    text = _fmt(v, ".2f") + "x"
    return f"[red]{text}[/red]" if red_below is not None and _finite(v) and v < red_below else text


def print_timing_table(console, rows: list[dict], title: str) -> None:
    out = []
    for r in rows:
        rel = r["max_abs_diff_vs_torch"] / r["max_abs_torch"] if r["max_abs_torch"] else math.nan
        rel_text = _fmt(rel, ".0e")
        if not rel <= SUSPECT_REL_DIFF or not r["output_layout_matches"]:
            rel_text = f"[red]{rel_text}{'' if r['output_layout_matches'] else ' layout!'}[/red]"
        engine = r["engine"]
        if r.get("bwd_choice"):  # e.g. "triton tf32, dX triton dW cudnn"
            engine += ", " + " ".join(" ".join(part.split()[:2]) for part in r["bwd_choice"].split("; "))
        vs_default = _x(r["speedup_vs_default_flags"], None) if "speedup_vs_default_flags" in r else ""
        out.append([r["case"], r.get("mode", "fwd"), r["dtype"], r["layout"], r["precision"], engine,
                    _fmt(r["convt3d_us"], ".1f"), _fmt(r["torch_us"], ".1f"), _x(r["speedup"]), vs_default,
                    _fmt(r["tflops"], ".1f"), _fmt(r["mem_floor_us"], ".1f"), _fmt(r["compute_floor_us"], ".1f"),
                    _fmt(r["roofline_pct"], ".0f"), _fmt(r["first_call_s"], ".2f"), rel_text])
    table(console, title, ["case", "mode", "dtype", "layout", "prec", "engine", "convt3d µs", "cuDNN µs", "speedup",
                            "vs dflt cuDNN", "TFLOP/s", "mem floor µs", "comp floor µs", "% roofline",
                            "first call s", "max rel diff"], out, left=6)


def print_summary(console, summary: list[dict]) -> None:
    out = [[s["group"], str(s["cases"]), _x(s["geomean_speedup"], None),
            f"{_x(s['min_speedup'], None)} ({s['min_speedup_case']})",
            _x(s["geomean_speedup_vs_default_flags"], None) if "geomean_speedup_vs_default_flags" in s else "",
            _fmt(s["geomean_roofline_pct"], ".0f")] for s in summary]
    table(console, "summary (speedup = cuDNN time / convt3d time, same process)",
           ["group", "cases", "geomean speedup", "min speedup", "geomean vs dflt cuDNN", "geomean % roofline"], out)


def _ok(ok: bool) -> str:
    return "[green]ok[/green]" if ok else "[red]FAIL[/red]"


def print_check_table(console, rows: Iterable[dict]) -> None:
    out = []
    for r in rows:
        g = r["reduced_geometry"]
        shape = f"{g['batch']}x{g['in_channels']}x{'x'.join(map(str, g['in_size']))}"
        out.append([r["case"], r["dtype"], r["layout"], r["precision"], r["engine"], shape, f"{r['max_abs_err']:.2e}",
                    f"{r['ref_max_abs_err']:.2e}", f"{r['bar']:.2e}", "ok" if r["layout_ok"] else "[red]WRONG[/red]",
                    f"{r['seconds']:.1f}", _ok(r["ok"])])
    table(console, "Triton kernels through the interpreter vs float64 PyTorch (reduced sizes)",
           ["case", "dtype", "layout", "prec", "engine", "reduced input", "max abs err", "ref err", "bar (2x ref)",
            "out layout", "s", "ok"], out, left=6)


def print_failures(console, failures: list[dict], skipped: list[dict] = ()) -> None:
    """Each skipped network with its reason, then each failure."""
    for s in skipped:
        console.print(f"[yellow]skipped[/yellow] {s['case']}: {s['reason']}", highlight=False)
    for f in failures:
        mode = f" {f['mode']}" if f.get("mode") else ""  # network failures name their mode
        console.print(f"[red]failed[/red] {f['case']}{mode} {f['dtype']} {f['layout']} {f['precision']}: {f['error']}")


# ---- networks suite -------------------------------------------------------------------------------
def _rel_text(r: dict) -> str:
    text = f"{_fmt(r['rel_err_vs_reference'], '.1e')} / {_fmt(r['torch_rel_err_vs_reference'], '.1e')}"
    return text if r["within_error_budget"] else f"[red]{text}[/red]"


def print_network_table(console, rows: list[dict], title: str) -> None:
    """Timing rows of ``--suite networks``: one per network and mode."""
    out = []
    for r in rows:
        quartiles = " ({:.2f}-{:.2f})".format(*r["speedup_quartiles"]) if r.get("speedup_quartiles") else ""
        share = _fmt(100 * r["convt_share"], ".1f") + "%" if _finite(r.get("convt_share")) else "-"
        out.append([r["case"], r["mode"], r["dtype"], f"{r['convt_layers_patched']}/{r['convt_layers']}: "
                    f"{r.get('engine', '')}", share, _fmt(r["torch_us"] / 1e3, ".2f"),
                    _fmt(r["convt3d_us"] / 1e3, ".2f"), _x(r["speedup"]) + quartiles,
                    f"{_fmt(r['torch_first_call_s'], '.2f')} / {_fmt(r['first_call_s'], '.2f')}", _rel_text(r),
                    r["reference"]])
    table(console, title, ["network", "mode", "dtype", "patched layers: engine", "convT share", "untouched ms",
                            "patched ms", "ratio (pairs' quartiles)", "first call s (untouched / patched)",
                            "rel err vs ref (patched / untouched)", "ref"], out,
           left={"network", "mode", "dtype", "patched layers: engine", "ref"})


def print_first_call_table(console, rows: list[dict]) -> None:
    """``--first-calls``: each network's first call, untouched and patched, and what the patched one
    costs on top (compiling, tuning and measuring, or with a warm cache loading what others left)."""
    out = [[r["case"], r["mode"], r["dtype"], _fmt(r["torch_first_call_s"], ".2f"), _fmt(r["first_call_s"], ".2f"),
            _fmt(r["first_call_extra_s"], ".2f"), _rel_text(r)] for r in rows]
    table(console, "networks: first calls (untouched, then convt3d.patch)",
           ["network", "mode", "dtype", "untouched s", "patched s", "extra s", "rel err vs ref (patched / untouched)"],
           out, left=3)


def print_network_check_table(console, rows: Iterable[dict]) -> None:
    """Rows of the networks' CPU check (``networks.check_networks``)."""
    out = [[r["case"], r["source"], "x".join(map(str, r["input_shape"])), "x".join(map(str, r["output_shape"])),
            f"{r['convt_layers_patched']}/{r['convt_layers']}", _rel_text(r), f"{r['max_abs_diff_vs_torch']:.1e}",
            f"{r['seconds']:.1f}", _ok(r["ok"])] for r in rows]
    table(console, "networks at tiny sizes: patched (Triton interpreter) vs untouched vs float64, fp32",
           ["network", "source", "input", "output", "patched layers", "rel err (patched / untouched)",
            "max abs diff", "s", "ok"], out, left=4)
