"""``convt3d kernelbench``: evaluate the ``ModelNew`` files the way KernelBench does.

Trials and timings follow KernelBench's ``eval_kernel_against_ref``; without CUDA the files are imported,
constructed and, with ``TRITON_INTERPRET=1``, checked at a reduced size. Exit status: 0 when every file
loaded, matched the reference's parameters and passed every trial; 1 otherwise; 2 for an unknown problem."""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import functools
import importlib.util
import math
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ..bench import report
from ..core.flags import cudnn_conv_allows_tf32, cudnn_conv_tf32
from ..core.roofline import geomean
from .export import default_out_dir, reduced, render
from .problems import SEED, Problem, ReferenceModel, parse_ids

TOLERANCE = 1e-4  # KernelBench's atol = rtol for fp32
WARMUP = 3
DISCARD_FIRST = 1
CORRECT_TRIALS = 5
L2_FLUSH_BYTES = 256 * 2 ** 20  # KernelBench writes 32 x 1024 x 1024 int64
PRECISIONS = ("tf32", "tf32x3")  # PyTorch's flags as they are, or TF32 off for convolutions throughout
NOTE = ("'correct' is KernelBench's verdict: allclose(reference, ModelNew, atol=rtol=1e-4) with the reference "
        "run under the same flags, on every trial. With TF32 allowed cuDNN computes most references in TF32, "
        "and the files compute in TF32 as they do; 'vs fp64' checks the same outputs against the reference "
        "layer in float64, and 'ref err' is the reference's own distance from float64.")


# ---- KernelBench's building blocks ------------------------------------------------------------
def set_seed(seed: int) -> None:
    torch.manual_seed(seed)  # every device's generator: KernelBench's torch.cuda.manual_seed too


def trial_seeds(n: int) -> list[int]:
    """The per-trial seeds KernelBench derives from its seed."""
    torch.manual_seed(SEED)
    return [int(torch.randint(0, 2 ** 32 - 1, (1,)).item()) for _ in range(n)]


def run_trials(problem_id: int, n: int, console, check) -> list:
    """``check(seed)`` for each of KernelBench's ``n`` trial seeds, announced on ``console`` unless None."""
    trials = []
    for i, seed in enumerate(trial_seeds(n)):
        if console is not None:
            console.print(f"  problem {problem_id}: correctness trial {i + 1}/{n} (seed {seed})")
        trials.append(check(seed))
    return trials


def load_model_file(path: Path) -> ModuleType:
    """Import a ModelNew file as KernelBench does: a fresh module, not registered in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(f"kernelbench_{path.stem.split('_')[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_models(problem: Problem, module: ModuleType) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference Model, ModelNew), each built on the CPU right after seeding, without autograd."""
    with torch.no_grad():
        return tuple(set_seed(SEED) or make(*problem.init_inputs)
                     for make in (lambda *a: ReferenceModel(problem, *a), module.ModelNew))


def parameters_identical(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)


def time_with_cuda_events(fn, x: torch.Tensor, trials: int, warmup: int = WARMUP) -> list[float]:
    """Milliseconds of ``fn(x)`` per trial, KernelBench's "cuda_event" method (cold L2)."""
    device = x.device
    for _ in range(warmup):
        fn(x)
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    times = []
    for _ in range(trials + DISCARD_FIRST):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.empty(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=device).fill_(42)  # a cold L2
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return times[DISCARD_FIRST:]


def flags_in_force(precision: str):
    """PyTorch's flags as they are ("tf32") or TF32 off for convolutions ("tf32x3"), restored on exit."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}; expected one of {PRECISIONS}")
    return cudnn_conv_tf32(False) if precision == "tf32x3" else contextlib.nullcontext()


# ---- results ------------------------------------------------------------------------------------
@dataclass
class Trial:
    seed: int
    passes: bool  # KernelBench's check: allclose(reference under the flags in force, ModelNew)
    max_abs_diff: float  # |ModelNew - reference|, max
    passes_fp64: bool | None  # allclose(float64 reference rounded to fp32, ModelNew); None: not run
    max_abs_err_fp64: float
    ref_passes_fp64: bool | None  # the reference itself against float64
    ref_max_abs_err_fp64: float


@dataclass
class Stats:
    mean: float
    std: float
    min: float
    max: float
    median: float
    trials: int

    @staticmethod
    def of(times: list[float]) -> "Stats":
        t = torch.tensor(times, dtype=torch.float64)
        return Stats(t.mean().item(), t.std().item() if len(times) > 1 else 0.0, t.min().item(), t.max().item(),
                     t.median().item(), len(times))


@dataclass
class Result:
    problem: int
    file: str
    layer: str
    input_shape: list[int]
    loaded: bool = False
    parameters_identical: bool | None = None
    precision: str | None = None  # what the file's forward computes in under the flags of the run
    trials: list[Trial] = field(default_factory=list)
    ref_ms: Stats | None = None  # the reference under the flags of the run
    new_ms: Stats | None = None
    ref_times_ms: list[float] = field(default_factory=list)
    new_times_ms: list[float] = field(default_factory=list)
    tuning: list[dict] = field(default_factory=list)
    error: str | None = None

    def passed(self, name: str) -> int:
        return sum(bool(getattr(t, name)) for t in self.trials)

    def _all(self, name: str) -> bool:
        return bool(self.trials) and self.passed(name) == len(self.trials)

    def _max(self, name: str) -> float:
        return max((getattr(t, name) for t in self.trials), default=math.nan)

    correct = property(lambda self: self._all("passes"))  # KernelBench's verdict: every trial passes
    correct_fp64 = property(lambda self: self._all("passes_fp64"))
    ref_passes_fp64 = property(lambda self: self._all("ref_passes_fp64"))
    max_abs_diff = property(lambda self: self._max("max_abs_diff"))
    max_abs_err_fp64 = property(lambda self: self._max("max_abs_err_fp64"))
    ref_max_abs_err_fp64 = property(lambda self: self._max("ref_max_abs_err_fp64"))
    speedup = property(lambda self: self.ref_ms.mean / self.new_ms.mean if self.ref_ms and self.new_ms else math.nan)

    def as_dict(self) -> dict:
        """The fields, then the properties above."""
        return {**asdict(self), **{k: getattr(self, k) for k, v in vars(type(self)).items() if isinstance(v, property)}}


# ---- the checks ---------------------------------------------------------------------------------
def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOLERANCE) -> bool:
    """KernelBench's check: allclose at atol = rtol = ``tol``."""
    return bool(torch.allclose(a, b, atol=tol, rtol=tol))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_trial(seed: int, reference: torch.nn.Module, candidate: torch.nn.Module, input_shapes,
              device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(inputs, reference output, ModelNew output) of a trial as KernelBench's ``run_and_check_correctness``
    runs it: torch.rand of each input shape after seeding ``seed``; a wrong shape or dtype raises."""
    set_seed(seed)
    inputs = [torch.rand(*shape).to(dtype=torch.float32).to(device=device) for shape in input_shapes]
    with torch.no_grad():
        y_ref = reference(*inputs)
        _sync(device)
        y_new = candidate(*inputs)
        _sync(device)
    if y_new.shape != y_ref.shape or y_new.dtype != torch.float32:
        raise RuntimeError(f"ModelNew returned {y_new.dtype} {tuple(y_new.shape)}, expected torch.float32 "
                           f"{tuple(y_ref.shape)}")
    return inputs, y_ref, y_new


def check_trial(seed: int, reference: torch.nn.Module, reference64: torch.nn.Module | None,
                candidate: torch.nn.Module, input_shape, device: torch.device) -> Trial:
    """One trial (``run_trial``), then ``reference64`` unless None."""
    (x,), y_ref, y_new = run_trial(seed, reference, candidate, [input_shape], device)
    trial = Trial(seed, close(y_ref, y_new), max_abs(y_new, y_ref), None, math.nan, None, math.nan)
    if reference64 is not None:
        with torch.no_grad():
            y64 = reference64(x.double())
            _sync(device)
        exact = y64.float()
        trial.passes_fp64, trial.max_abs_err_fp64 = close(exact, y_new), max_abs(y_new, y64)
        trial.ref_passes_fp64, trial.ref_max_abs_err_fp64 = close(exact, y_ref), max_abs(y_ref, y64)
    return trial


def evaluate_file(problem: Problem, directory: Path, m: Machine, console, trials: int, warmup: int,
                  file_name: str) -> Result:
    """On a GPU the parameters, trials and timings at KernelBench's size; on the CPU import and construction and,
    through the interpreter, the Triton file's trials at the problem's reduced size."""
    interpret = not m.gpu and m.interpret and file_name == problem.file_name
    run = reduced(problem) if interpret else problem
    module = load_model_file(directory / file_name)
    result = Result(problem.id, file_name, run.describe(), list(run.input_shape), loaded=True,
                    precision=getattr(module, "forward_precision", lambda: None)())
    reference, candidate = build_models(problem, module)
    result.parameters_identical = parameters_identical(reference, candidate)
    if interpret:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / file_name
            path.write_text(render(run, small=True), encoding="utf-8")
            reference, candidate = build_models(run, load_model_file(path))
    elif not m.gpu:
        return result
    reference, candidate = reference.to(m.device), candidate.to(m.device)
    # the float64 reference is held by the partial alone, so it is freed before the timings
    result.trials = run_trials(problem.id, m.correct_trials, console if m.gpu else None, functools.partial(
        check_trial, reference=reference, reference64=copy.deepcopy(reference).double(), candidate=candidate,
        input_shape=run.input_shape, device=m.device))
    if not m.gpu:
        return result
    torch.cuda.empty_cache()
    set_seed(SEED)
    x = torch.rand(*problem.input_shape).to(m.device)
    with torch.no_grad():
        # ModelNew first, then the reference, as KernelBench's evaluator does.
        console.print(f"  problem {problem.id}: timing ModelNew ({warmup} warm-ups, {trials} trials + {DISCARD_FIRST})")
        result.new_times_ms = time_with_cuda_events(candidate, x, trials, warmup)
        console.print(f"  problem {problem.id}: timing the reference")
        result.ref_times_ms = time_with_cuda_events(reference, x, trials, warmup)
    result.new_ms, result.ref_ms = Stats.of(result.new_times_ms), Stats.of(result.ref_times_ms)
    # what a Triton file's chooser timed at its first forward
    result.tuning = [{"config": c["config"], "precision": c["precision"], "tuning_s": c["seconds"],
                      "timings_ms": c["timings_ms"]} for c in getattr(module, "CHOICES", [])]
    return result


# ---- output -------------------------------------------------------------------------------------
SAME_PARAMS = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}  # the "same params" cell


def verdict_cell(r: Result, name: str) -> str:
    if not r.trials:
        return "-"
    count = f"{r.passed(name)}/{len(r.trials)}"
    return f"[green]yes {count}[/]" if r._all(name) else f"[red]no {count}[/]"


def fmt(v: float, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def flags_text(flags: dict) -> str:
    return "TF32 allowed for convolutions" if flags["cudnn_conv_tf32"] else "TF32 off for convolutions"


def _entry(r: Result) -> str:
    return f"{r.problem} cuda" if r.file.endswith("_cuda.py") else f"{r.problem}"


def print_results(console, what: str, env: dict, flags: dict, columns: list[str], results: list, cells,
                  left: int) -> None:
    """A row of ``cells(r)`` per result, the first ``left`` columns left-aligned, an error from column ``left`` on."""
    rows = []
    for r in results:
        row = cells(r)
        if r.error:
            row[left:] = [f"[red]error: {r.error.splitlines()[-1][:80]}[/]"] + [""] * (len(row) - left - 1)
        rows.append(row)
    where = env.get("gpu") or "CPU (Triton interpreter, reduced geometries)"
    report.table(console, f"KernelBench {what}, fp32 - {where} - {flags_text(flags)}", columns, rows, left=left)


def speedups(results: list, key: str = "speedup") -> dict:
    """The geometric mean and the lowest of ``key`` over the results that have one, and the lowest's problem."""
    timed = [r for r in results if math.isfinite(getattr(r, key))]
    low = min(timed, key=lambda r: getattr(r, key), default=None)
    return {f"geomean_{key}": geomean(getattr(r, key) for r in timed),
            f"min_{key}": math.nan if low is None else getattr(low, key),
            f"min_{key}_problem": None if low is None else low.problem}


def counts(results: list, *verdicts: str) -> dict:
    """How many problems ran, were checked and raised, and how many checked ones hold each of ``verdicts``."""
    checked = [r for r in results if r.trials]
    return {"problems": len(results), "checked": len(checked),
            **{name: sum(getattr(r, name) for r in checked) for name in verdicts},
            "errors": sum(r.error is not None for r in results)}


def verdict_text(r: Result) -> str:
    n = len(r.trials)
    return (f"{'correct' if r.correct else 'incorrect'} {r.passed('passes')}/{n} (max abs diff {r.max_abs_diff:.2e})"
            if n else "not run")


def row_line(r: Result) -> str:
    """One result as a line (printed as each file finishes, before the table)."""
    speed = (f", ModelNew {r.new_ms.mean:.3f} ms, reference {r.ref_ms.mean:.3f} ms, speedup {r.speedup:.2f}x"
             if r.new_ms and r.ref_ms else "")
    fp64 = (f", vs fp64 {r.passed('passes_fp64')}/{len(r.trials)} ({r.max_abs_err_fp64:.2e}; reference "
            f"{r.ref_max_abs_err_fp64:.2e})" if r.trials else "")
    return f"  problem {_entry(r)} [{r.precision}]: {verdict_text(r)}{speed}{fp64}"


# ---- command ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options; ``--exact`` becomes ``--precision tf32x3`` with a DeprecationWarning, shown unless -W says no."""
    p = argparse.ArgumentParser(prog="convt3d kernelbench", description=__doc__.split("\n\n")[0],
                                epilog="examples:\n  convt3d kernelbench --precision tf32x3 --json kb_tf32x3.json\n"
                                       "  convt3d kernelbench --problems 72,73 --trials 20",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", type=int, choices=(1, 2), default=1,
                   help="KernelBench level: 1 (the ModelNew files, the default) or 2 (convt3d.kernelbench.level2)")
    p.add_argument("--problems", default=None, help="comma-separated problem ids (default: every problem of the "
                                                    "level: 58,61,68,70,72,73,77, or level 2's nineteen)")
    p.add_argument("--precision", choices=PRECISIONS, default="tf32",
                   help="tf32 (the default): PyTorch's flags as they are, the files computing as their references "
                        "do; tf32x3: TF32 off for convolutions, the references in exact fp32, the files at exact grade")
    p.add_argument("--exact", action="store_true", help="deprecated: the same as --precision tf32x3")
    p.add_argument("--json", type=Path, default=None, help="write every measurement to this file (default: none)")
    p.add_argument("--trials", type=int, default=100, help="timed trials per model (default 100, plus 1 discarded)")
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"warm-up calls before timing (default {WARMUP})")
    p.add_argument("--correct-trials", type=int, default=None,
                   help=f"correctness trials (default {CORRECT_TRIALS} on a GPU, 1 through the interpreter)")
    p.add_argument("--dir", type=Path, default=None, help="directory of the ModelNew files (default: kernelbench/)")
    args = p.parse_args(argv)
    if args.exact:
        with warnings.catch_warnings():
            if not sys.warnoptions:
                warnings.simplefilter("default", DeprecationWarning)
            warnings.warn("convt3d kernelbench: --exact is deprecated and will be removed; use --precision tf32x3",
                          DeprecationWarning, stacklevel=3)
        args.precision = "tf32x3"
    return args


def select(parse, text: str | None) -> list | None:
    """``parse(text)``'s problems, or None once an unknown or malformed id is reported."""
    try:
        return parse(text)
    except (KeyError, ValueError) as e:
        print(f"convt3d kernelbench: {e.args[0]}", file=sys.stderr)
        return None


@dataclass
class Machine:
    """Where the problems run: a GPU at KernelBench's sizes and the flags asked for, or the CPU with TF32
    off (PyTorch's CPU convolution is exact fp32 whatever the flags say), through the interpreter if on."""
    gpu: bool
    device: torch.device
    precision: str
    interpret: bool
    correct_trials: int
    start: float = field(default_factory=time.perf_counter)


def machine(args: argparse.Namespace, checking: str, interpreted: str, sep: str = "\n") -> tuple[object, Machine]:
    """The console and this machine, saying without CUDA what is checked instead (``checking``, ``interpreted``)."""
    console = report.make_console()
    if torch.cuda.is_available():
        return console, Machine(True, torch.device("cuda", torch.cuda.current_device()), args.precision, False,
                                args.correct_trials or CORRECT_TRIALS)
    import triton

    m = Machine(False, torch.device("cpu"), "tf32x3", bool(triton.knobs.runtime.interpret), args.correct_trials or 1)
    console.print("[bold yellow]convt3d kernelbench needs a CUDA GPU[/] for KernelBench's timings and its full-size "
                  f"correctness check; this machine has none.{sep}Checking instead that {checking}" + (
                      f", and running {m.correct_trials} correctness trial(s) per problem through Triton's "
                      f"interpreter {interpreted}." if m.interpret else
                      "; set TRITON_INTERPRET=1 to also check correctness through Triton's interpreter."))
    return console, m


def entries(problems: list[Problem]) -> list[tuple[Problem, str]]:
    """(problem, file name) rows of the table: each problem's Triton file, then its CUDA entry if any."""
    return [(p, name) for p in problems for name in (p.file_name, p.cuda_file_name) if name]


def run_all(m: Machine, rows: list[tuple], fn, console, line, failed) -> tuple[dict, list, dict]:
    """(flags, results, environment) of ``fn(problem, name)`` per row under the flags of the run, each printed by
    ``line``; one that raises gives ``failed(problem, name, traceback)``, hiding no other problem's result."""
    with flags_in_force(m.precision):
        conv, results = getattr(torch.backends.cudnn, "conv", None), []
        flags = {"cudnn_conv_tf32": cudnn_conv_allows_tf32(),
                 "cudnn_conv_fp32_precision": getattr(conv, "fp32_precision", None),
                 "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                 "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}
        for p, name in rows:
            console.print(f"[bold]problem {p.id}[/]: {name}")
            try:
                results.append(fn(p, name))
                console.print(line(results[-1]), markup=False, highlight=False)
            except Exception:
                results.append(failed(p, name, traceback.format_exc()))
                console.print(f"[red]problem {p.id} failed:[/]\n{results[-1].error}")
            torch.cuda.empty_cache()  # a problem's cached blocks are not the next one's
    return flags, results, report.environment(m.gpu)


def conclude(args: argparse.Namespace, argv: list[str] | None, console, m: Machine, env: dict, flags: dict,
             results: list, s: dict, schema: str, note: str, over: dict[str, str], rule: str = "",
             more: tuple[str, ...] = (), **tolerances) -> int:
    """Prints KernelBench's verdict (``rule`` after its tolerance), the speedups ``over``, ``more`` and ``note``;
    writes ``--json``. Exit status 1 where a problem raised, failed the verdict or differs in parameters, else 0."""
    if s["checked"]:
        console.print(f"KernelBench's verdict ({flags_text(flags)}): {s['correct']}/{s['checked']} correct "
                      f"(allclose to the reference at atol=rtol={TOLERANCE:g} on every trial{rule})")
    for key, what in over.items():
        if math.isfinite(s[f"geomean_{key}"]):
            console.print(f"speedup over {what}: geometric mean {s[f'geomean_{key}']:.2f}x, lowest "
                          f"{s[f'min_{key}']:.2f}x (problem {s[f'min_{key}_problem']})")
    for line in more if s["checked"] else ():
        console.print(line)
    console.print(f"note: {note}")
    if args.json is not None:
        report.write_json(args.json, {
            "schema": schema, "kind": "timing" if m.gpu else "cpu-check",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(sys.argv[1:] if argv is None else argv), "environment": env, "flags": flags,
            "method": {"seed": SEED, "correct_trials": m.correct_trials, "tolerance": TOLERANCE, **tolerances,
                       "verdict": "allclose(reference under the flags of the run, ModelNew) on every trial",
                       "precision": m.precision, "timed_trials": args.trials if m.gpu else 0, "warmup": args.warmup,
                       "discard_first": DISCARD_FIRST, "l2_flush_bytes": L2_FLUSH_BYTES,
                       "reduced_geometry": not m.gpu and m.interpret, "interpreter": m.interpret},
            "note": note, "seconds": time.perf_counter() - m.start,
            "problems": [r.as_dict() for r in results], "summary": s})
        console.print(f"wrote {args.json}")
    return int(s["errors"] > 0 or s["correct"] < s["checked"] or any(r.parameters_identical is False for r in results))


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    """``convt3d kernelbench`` at level 1 (``command.main`` routes level 2 to ``evaluate_level2``)."""
    args = parse_args(argv) if args is None else args
    if (problems := select(parse_ids, args.problems)) is None:
        return 2
    directory = args.dir if args.dir is not None else default_out_dir()
    console, m = machine(args, "every file imports and constructs with the reference's parameters",
                         "on the problem at a reduced size (export.reduced: the file exported for it), with TF32 "
                         "off (PyTorch's CPU reference never uses TF32)")
    flags, results, env = run_all(m, entries(problems), lambda p, name: evaluate_file(
        p, directory, m, console, args.trials, args.warmup, name), console, row_line, lambda p, name, tb: Result(
        p.id, name, p.describe(), list(p.input_shape), error=tb))
    columns = ["problem", "layer", "precision", "correct (KernelBench)", "max abs diff", "ref ms", "new ms", "speedup",
               "vs fp64", "max abs err vs fp64", "ref err vs fp64", "same params"]
    print_results(console, "level 1 ConvTranspose3d", env, flags, columns, results, lambda r: [
        _entry(r), r.layer, r.precision or "-", verdict_cell(r, "passes"), fmt(r.max_abs_diff, ".2e"),
        fmt(r.ref_ms.mean if r.ref_ms else None, ".3f"), fmt(r.new_ms.mean if r.new_ms else None, ".3f"),
        fmt(r.speedup, ".2f") + ("x" if math.isfinite(r.speedup) else ""), verdict_cell(r, "passes_fp64"),
        fmt(r.max_abs_err_fp64, ".2e"), fmt(r.ref_max_abs_err_fp64, ".2e"), SAME_PARAMS[r.parameters_identical]],
        left=3)
    console.print(f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
                  f"Python {env['python']}, convt3d {env['convt3d']} ({env.get('git_commit') or 'no git'})")
    # the speedups over the seven Triton files; the CUDA entry is its own row
    s = {**counts(results, "correct", "correct_fp64", "ref_passes_fp64"),
         **speedups([r for r in results if not r.file.endswith("_cuda.py")])}
    return conclude(args, argv, console, m, env, flags, results, s, "convt3d-kernelbench/3", NOTE,
                    {"speedup": "the reference, Triton files"}, more=(
                        f"against float64: {s['correct_fp64']}/{s['checked']} files pass; the reference itself "
                        f"passes on {s['ref_passes_fp64']} of {s['checked']}.",))
