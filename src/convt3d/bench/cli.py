"""``convt3d bench``: time convt3d against PyTorch/cuDNN on the bench suites.

Without CUDA the Triton kernels are checked through Triton's interpreter instead, in a child
process with TRITON_INTERPRET=1 (it must be set before triton is imported). Exit status: 0 when
every case ran (and met its bar), 1 when one failed, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import convt3d
from ..dispatch.select import BACKENDS
from ..engines.triton.sites import interpreter_active
from . import networks, report, suites
from .check import CHECK_BACKEND, run_checks
from .roofline import measure_ceilings
from .runner import MODES, TimingSettings, run_cases

_REEXEC_MARK = "CONVT3D_BENCH_REEXEC"

SUITE_HELP = {
    "kernelbench": "the seven KernelBench ConvTranspose3d problems, fp32 NCDHW, at tf32 and tf32x3",
    "layers": "13 decoder layers and output heads (nnU-Net, MONAI, GANs, VideoGPT), fp32/bf16, ncdhw/cl",
    "all": "kernelbench + layers",
    "heads": "12 output heads generated from a fixed seed, outside the other suites",
    "networks": "whole networks (3D-GAN, VQ-VAE, MONAI and nnU-Net U-Nets): untouched vs convt3d.patch(model)",
}

EXAMPLES = """examples:
  convt3d bench --suite kernelbench --precision tf32x3 --json kb.json --plot kb.png
  convt3d bench --case kb77,gan_k4s2p1 --dtype bf16 --layout cl --backend triton --mode full
  convt3d bench --suite heads --list
  convt3d bench --suite networks --case gan3d --mode fwd"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and each option's default where it has one worth saying."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def comma_list(choices: tuple[str, ...] | list[str] | None, rename=None):
    """argparse type: a comma-separated list, each value in ``choices`` (if given) once ``rename`` has mapped it."""

    def split(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        values = [rename(v) for v in values] if rename else values
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"invalid choice(s) {', '.join(map(repr, bad))} "
                                             f"(choose from {', '.join(choices)})")
        return values

    return split


def add_filters(group, case_choices=None, case_help: str = "") -> None:
    """The row filters ``convt3d bench`` and ``convt3d tune`` share; ``--case a,b`` == ``--case a --case b``."""
    group.add_argument("--case", action="extend", type=comma_list(case_choices), metavar="NAME[,NAME]",
                       help=case_help or f"case names, repeatable: {', '.join(suites.case_names())}")
    group.add_argument("--dtype", action="extend", type=comma_list(tuple(suites.DTYPES)), metavar="{fp32,bf16}")
    group.add_argument("--layout", action="extend", type=comma_list(suites.LAYOUTS), metavar="{ncdhw,cl}",
                       help="input memory format: ncdhw (contiguous) or cl (channels_last_3d)")
    group.add_argument("--precision", action="extend", type=comma_list(suites.PRECISIONS, suites.precision_name),
                       metavar="{tf32,tf32x3}", help="fp32 rows: tf32 = PyTorch's default flags (TF32 allowed), "
                       "tf32x3 = cudnn.allow_tf32 off, exact grade (kernelbench only); the former names 'default' "
                       "and 'exact' still work, with a DeprecationWarning")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, a deprecated spelling warned of once: not again in the re-run child."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if os.environ.get(_REEXEC_MARK) else "default", DeprecationWarning)
        return parser.parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    summary, no_cuda = __doc__.split("\n\n")[:2]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    suites_help = "\n".join(f"  {name:<12} {text}" for name, text in SUITE_HELP.items())
    p = argparse.ArgumentParser(prog="convt3d bench", formatter_class=HelpFormatter,
                                description=f"{summary}\n\nsuites:\n{suites_help}", epilog=f"{EXAMPLES}\n\n{no_cuda}")
    sel = p.add_argument_group("what to run")
    sel.add_argument("--suite", choices=tuple(SUITE_HELP), default="all", help="the suite (listed above)")
    add_filters(sel, None, f"case names, repeatable: {', '.join(suites.case_names())}; with --suite networks, "
                           f"network names: {', '.join(networks.network_names())}")
    sel.add_argument("--backend", choices=BACKENDS, default="auto", help="convt3d backend to time")
    sel.add_argument("--mode", choices=tuple(MODES), default=None,
                     help="fwd (the default), bwd (dX, dW, db of a retained forward) or full (training step); "
                          "networks: fwd = inference, full = training step, default both")
    sel.add_argument("--tune", action="store_true",
                     help="with --suite networks: convt3d.tune(patched, x) before the patched first call")
    sel.add_argument("--rounds", type=_positive_int, default=networks.DEFAULT_PAIRS, metavar="N",
                     help="with --suite networks: pairs of timing blocks per mode (more on a host whose speed swings)")
    sel.add_argument("--first-calls", action="store_true", help="with --suite networks: first calls and agreement "
                     "only; after a full run, what a warm cache leaves to a new process's first call")
    sel.add_argument("--list", action="store_true", help="print the selected cases and exit")
    # 8 at most: each worker holds its own torch + triton.
    sel.add_argument("--jobs", type=_positive_int, default=min(cores, 8),
                     help="processes of the interpreter check (CPU cores, at most 8)")

    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write environment, ceilings, every row and the summary")
    out.add_argument("--plot", metavar="FILE.png", help="speedup and %% of roofline per case (matplotlib)")

    tim = p.add_argument_group("timing")
    tim.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up budget per call (ms)")
    tim.add_argument("--rep-ms", type=float, default=60.0, help="do_bench timing budget per call (ms)")
    tim.add_argument("--min-reps", type=int, default=5, help="timed calls at least, however slow the call")
    tim.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    tim.add_argument("--cudnn-benchmark", action="store_true",
                     help="set torch.backends.cudnn.benchmark = True (PyTorch's default is False)")
    return p


def usage_error(message: str, prog: str = "convt3d bench") -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def _progress(console, total: int, title: str):
    """(status, advance) of a rich progress bar on a terminal, else status prints a line numbered by steps advanced."""
    done = 0

    def line(msg: str) -> None:
        console.print(f"[{done + 1}/{total}] {msg}" if total else msg, highlight=False, markup=False)

    def step() -> None:
        nonlocal done
        done += 1

    if console.is_terminal and not isinstance(console, report.PlainConsole):  # PlainConsole: rich is not installed
        from rich import progress as rp

        with rp.Progress(rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(),
                         rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task(title, total=total)
            yield (lambda msg: bar.update(task, description=msg)), (lambda: bar.advance(task))
        return
    yield line, step


# ---- entry point --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(build_parser(), argv)
    except SystemExit as exc:  # argparse exits on --help (0) and usage errors (2)
        return int(exc.code or 0)
    if args.min_reps < 1 or args.rep_ms <= 0 or args.warmup_ms < 0:
        return usage_error("--min-reps must be >= 1, --rep-ms > 0 and --warmup-ms >= 0")
    if args.suite == "networks":
        return _networks_main(args, argv)
    args.mode = args.mode or "fwd"
    try:
        cases = suites.select(args.suite, args.case, args.dtype, args.layout, args.precision)
    except ValueError as exc:
        return usage_error(str(exc))
    if not cases:
        return usage_error("no case matches the filters (note: tf32x3 exists only in the kernelbench suite)")
    if args.list:
        print("\n".join(f"{c.suite:<12} {c.label}" for c in cases))
        return 0
    return _run(args, argv, cases, _run_interpreter_check, _run_timing)


def _run(args, argv, selected, check, timing, *extra) -> int:
    """``timing`` on a CUDA machine, else ``check`` in a process with Triton's interpreter on."""
    if torch.cuda.is_available():
        if args.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        return timing(args, argv, report.make_console(), report.environment(cuda=True), selected, *extra)
    if interpreter_active():
        return check(args, argv, selected)
    if os.environ.get(_REEXEC_MARK):
        return usage_error("TRITON_INTERPRET=1 did not switch Triton's interpreter on in the child process; "
                           "run: TRITON_INTERPRET=1 python -m convt3d bench ...")
    env = dict(os.environ, TRITON_INTERPRET="1", **{_REEXEC_MARK: "1"})
    # The child must import this same convt3d even when it was found through sys.path edits.
    root = str(Path(convt3d.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    print("convt3d bench: no CUDA device; re-running with TRITON_INTERPRET=1 for the interpreter check",
          file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, "-m", "convt3d", "bench", *argv], env=env)


def _settings(args, cases: list[str], **more) -> dict:
    return dict(suite=args.suite, cases=cases, backend=args.backend, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                min_reps=args.min_reps, seed=args.seed, cudnn_benchmark=args.cudnn_benchmark, **more)


def _write(console, args, data: dict, rows=(), plot_title: str | None = None) -> None:
    """--json and --plot: the JSON as given, the plot of timing ``rows`` (without a title: no timings)."""
    if args.json:
        report.write_json(args.json, data)
        console.print(f"wrote {args.json}")
    if args.plot and plot_title is None:
        console.print("--plot skipped: the plot shows timings, which need a GPU")
    elif args.plot and rows:
        try:
            report.write_plot(args.plot, list(rows), plot_title)
            console.print(f"wrote {args.plot}")
        except ImportError:
            console.print("--plot skipped: matplotlib is not installed (pip install matplotlib)")


def _check(args, argv, note: str, what: str, total: int, run, table, settings: dict, summary_extra: dict,
           command: str) -> int:
    """The no-CUDA check: ``run(status, advance)`` -> (rows, failures, skipped or None), table, summary line, JSON."""
    console, env = report.make_console(), report.environment(cuda=False)
    report.print_header(console, env, None, "[bold yellow]No CUDA device: timings need a GPU.[/bold yellow] " + note)
    t0 = time.perf_counter()
    with _progress(console, total, f"{what} check") as (status, advance):
        rows, failures, skipped = run(status, advance)
    if rows:
        table(console, rows)
    report.print_failures(console, failures, skipped or [])
    passed, seconds = sum(r["ok"] for r in rows), time.perf_counter() - t0
    extra = "" if skipped is None else f"{len(skipped)} skipped, "
    console.print(f"{passed}/{total} {what} within the bar, {len(rows) - passed} above it, {len(failures)} errors, "
                  f"{extra}in {seconds:.1f} s. Timings need a GPU: run `{command}` on a CUDA machine.")
    summary = dict({"cases": total, "passed": passed, "failed": len(rows) - passed, "errors": len(failures)},
                   **summary_extra, **({} if skipped is None else {"skipped": len(skipped)}), seconds=seconds)
    _write(console, args, report.payload("interpreter-check", argv, env, settings, rows, failures, summary,
                                         skipped=skipped))
    return 0 if passed == len(rows) and not failures else 1


def _run_interpreter_check(args, argv: list[str], cases) -> int:
    note = ("Checking the Triton kernels' correctness instead, through Triton's interpreter, against float64 "
            f"PyTorch, at reduced sizes (batch 1, <= {suites.INTERP_MAX_CHANNELS_PER_GROUP} channels per group, "
            f"~{suites.INTERP_IN_SIZE} input positions per dimension; kernel, stride, padding, dilation, "
            "output_padding and groups as in the suite).")
    if args.mode != "fwd":
        note += (f" (--mode {args.mode}: this check runs the forward kernels; the gradients are checked through "
                 "the interpreter by tests/test_training.py.)")
    if args.backend not in ("auto", CHECK_BACKEND):
        note += f" (--backend {args.backend} is ignored here: the check runs backend='{CHECK_BACKEND}'.)"
    # Triton's interpreter computes bf16 dot products wrongly (fp16 is right): bf16 is left to the GPU tests.
    skipped = [c for c in cases if c.dtype == "bf16"]
    cases = [c for c in cases if c.dtype != "bf16"]
    if skipped:
        note += (f" {len(skipped)} bf16 case(s) skipped: Triton's interpreter mis-computes bf16 dot products; "
                 "tests/test_gpu.py covers bf16 on a GPU.")
    return _check(args, argv, note, "cases", len(cases),
                  lambda status, advance: (*run_checks(cases, args.seed, status, advance, jobs=args.jobs), None),
                  report.print_check_table, _settings(args, [c.label for c in cases], mode=args.mode, jobs=args.jobs),
                  {"skipped_bf16": len(skipped)}, "convt3d bench")


def _run_timing(args, argv: list[str], console, env: dict, cases) -> int:
    t0 = time.perf_counter()
    with _progress(console, 0, "measuring device ceilings") as (status, _):
        status("measuring device ceilings")
        ceilings = measure_ceilings("cuda", status)
    report.print_header(console, env, ceilings)
    with _progress(console, len(cases), "timing") as (status, advance):
        rows, failures = run_cases(cases, args.mode, args.backend, ceilings, TimingSettings(
            args.warmup_ms, args.rep_ms, args.min_reps, args.seed), status, advance)
    seconds = time.perf_counter() - t0
    for suite in dict.fromkeys(r["suite"] for r in rows):
        report.print_timing_table(console, [r for r in rows if r["suite"] == suite],
                                  f"{suite}: {args.mode}, convt3d backend={args.backend} vs PyTorch/cuDNN")
    summary = report.summarize(rows)
    if summary:
        report.print_summary(console, summary)
    report.print_failures(console, failures)
    console.print(f"{len(rows)}/{len(cases)} cases timed in {seconds:.0f} s"
                  + (f", {len(failures)} failed" if failures else ""))
    settings = _settings(args, [c.label for c in cases], mode=args.mode, jobs=args.jobs, seconds=seconds)
    _write(console, args, report.payload("timing", argv, env, settings, rows, failures, summary, ceilings),
           rows, f"convt3d {env['convt3d']} on {env['gpu']}: {args.mode}, backend={args.backend}")
    return 0 if not failures else 1


# ---- the networks suite -------------------------------------------------------------------------
def _networks_main(args, argv: list[str]) -> int:
    try:
        nets, modes = networks.select_networks(args.case), networks.select_modes(args.mode, args.dtype)
        # Networks run as their users run them: NCDHW input, PyTorch's default flags.
        for name, values, allowed in (("--layout", args.layout, "ncdhw"), ("--precision", args.precision, "tf32")):
            if values is not None and set(values) != {allowed}:
                raise ValueError(f"{name} {','.join(values)}: the networks suite runs {allowed} only")
    except ValueError as exc:
        return usage_error(str(exc))
    if not modes:
        return usage_error("no network mode matches the filters (the training step runs in bf16 only)")
    if args.list:
        for net in nets:
            reason = networks.unavailable_reason(net)
            print(f"{'networks':<12} {net.name:<18} {', '.join(m.label for m in modes):<30} "
                  f"{net.description}" + (f"  [skipped: {reason}]" if reason else ""))
        return 0
    return _run(args, argv, nets, _run_network_check, _run_network_timing, modes)


def _network_settings(args, nets, modes) -> dict:
    return _settings(args, [n.name for n in nets], modes=[m.label for m in modes], tune=args.tune,
                     first_calls=args.first_calls, pairs=args.rounds)


def _run_network_check(args, argv: list[str], nets) -> int:
    note = (f"Checking each network at a tiny size instead: the patched model (backend='{CHECK_BACKEND}', "
            "Triton's interpreter) against the untouched one and float64, fp32 inference with TF32 off (bf16 and the "
            "training step need a GPU: tests/test_gpu_networks.py).")
    if args.backend not in ("auto", CHECK_BACKEND):
        note += f" (--backend {args.backend} is ignored here.)"
    run = functools.partial(networks.check_networks, nets, args.seed)
    return _check(args, argv, note, "networks", len(nets), run, report.print_network_check_table,
                  _network_settings(args, nets, []), {}, "convt3d bench --suite networks")


def _run_network_timing(args, argv: list[str], console, env: dict, nets, modes) -> int:
    report.print_header(console, env, None, "networks: untouched model vs convt3d.patch(copy.deepcopy(model)), "
                                            "same process; ratio = untouched time / patched time")
    t0 = time.perf_counter()

    def data(rows, failures, skipped, summary=None, final=False) -> dict:
        settings = dict(_network_settings(args, nets, modes), seconds=time.perf_counter() - t0, complete=final)
        return report.payload("timing", argv, env, settings, rows, failures, summary or [], skipped=skipped)

    # The JSON is rewritten after each network: an interrupted run keeps what it measured.
    rewrite = (lambda *lists: report.write_json(args.json, data(*lists))) if args.json else None
    with _progress(console, len(nets) * len(modes), "networks") as (status, advance):
        rows, failures, skipped = networks.run_networks(
            nets, modes, args.backend, TimingSettings(args.warmup_ms, args.rep_ms, args.min_reps, args.seed), status,
            advance, on_network=rewrite, tune=args.tune, measure=not args.first_calls, rounds=args.rounds)
    seconds = time.perf_counter() - t0
    summary = []
    if rows and args.first_calls:
        report.print_first_call_table(console, rows)
    elif rows:
        report.print_network_table(console, rows, f"networks, convt3d backend={args.backend} (patched) vs "
                                                   "PyTorch (untouched)")
        summary = report.summarize(rows)
        report.print_summary(console, summary)
    report.print_failures(console, failures, skipped)
    what = "network modes' first calls" if args.first_calls else "network modes timed"
    console.print(f"{len(rows)}/{len(nets) * len(modes)} {what} in {seconds:.0f} s"
                  + (f", {len(failures)} failed" if failures else "")
                  + (f", {len(skipped)} networks skipped" if skipped else ""))
    title = f"convt3d {env['convt3d']} on {env['gpu']}: networks, backend={args.backend}"
    # First calls have no steady times to plot.
    _write(console, args, data(rows, failures, skipped, summary, final=True), [] if args.first_calls else rows, title)
    return 0 if not failures else 1
