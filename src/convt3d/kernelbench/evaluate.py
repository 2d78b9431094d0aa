"""``convt3d kernelbench``: evaluate the ``ModelNew`` files the way KernelBench does.

    convt3d kernelbench                          # all seven problems (and the CUDA entry), one table
    convt3d kernelbench --precision tf32x3       # TF32 off for convolutions, the references' and the files'
    convt3d kernelbench --problems 58,77 --json kb.json --trials 100
    convt3d kernelbench --level 2 --problems 3,100   # level 2: convt3d.kernelbench.level2's ModelNew

Trials and timings follow KernelBench's ``eval_kernel_against_ref``; without CUDA the files are imported,
constructed and, with ``TRITON_INTERPRET=1``, checked at a reduced size. Exit status: 0 when every file
loaded, matched the reference's parameters and passed every trial; 1 otherwise; 2 for an unknown problem.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
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

import convt3d

from ..bench.report import table, write_json
from ..core.flags import cudnn_conv_allows_tf32, cudnn_conv_tf32
from ..core.roofline import geomean
from .export import default_out_dir, reduced, render
from . import level2
from .problems import SEED, Problem, ReferenceModel, parse_ids

__all__ = ["TOLERANCE", "PRECISIONS", "load_model_file", "trial_seeds", "set_seed", "time_with_cuda_events",
           "check_trial", "flags_in_force", "main"]

TOLERANCE = 1e-4  # KernelBench's atol = rtol for fp32
WARMUP = 3
DISCARD_FIRST = 1
CORRECT_TRIALS = 5
L2_FLUSH_BYTES = 256 * 2 ** 20  # KernelBench writes 32 x 1024 x 1024 int64
# The library's precision names: PyTorch's flags as they are, or TF32 off for convolutions throughout.
PRECISIONS = ("tf32", "tf32x3")
NOTE = ("'correct' is KernelBench's verdict: allclose(reference, ModelNew, atol=rtol=1e-4) with the reference "
        "run under the same flags, on every trial. With TF32 allowed cuDNN computes most references in TF32, "
        "and the files compute in TF32 as they do; 'vs fp64' checks the same outputs against the reference "
        "layer in float64, and 'ref err' is the reference's own distance from float64.")


# ---- KernelBench's building blocks ------------------------------------------------------------
def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def trial_seeds(n: int, seed: int = SEED) -> list[int]:
    """The per-trial seeds KernelBench derives from its seed."""
    torch.manual_seed(seed)
    return [int(torch.randint(0, 2 ** 32 - 1, (1,)).item()) for _ in range(n)]


def load_model_file(path: Path) -> ModuleType:
    """Import a ModelNew file as KernelBench does: a fresh module, not registered in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(f"kernelbench_{path.stem.split('_')[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_models(problem: Problem, module: ModuleType) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference Model, ModelNew), each built on the CPU right after seeding, without autograd."""
    with torch.no_grad():
        set_seed(SEED)
        reference = ReferenceModel(problem, *problem.init_inputs)
        set_seed(SEED)
        candidate = module.ModelNew(*problem.init_inputs)
    return reference, candidate


def parameters_identical(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)


def _flush_l2(device: torch.device) -> None:
    dummy = torch.empty(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=device)
    dummy.fill_(42)
    del dummy


def time_with_cuda_events(fn, x: torch.Tensor, trials: int, warmup: int = WARMUP,
                          discard_first: int = DISCARD_FIRST) -> list[float]:
    """Milliseconds of ``fn(x)`` per trial, KernelBench's "cuda_event" method (cold L2)."""
    device = x.device
    for _ in range(warmup):
        fn(x)
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    times = []
    for trial in range(trials + discard_first):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _flush_l2(device)
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize(device)
        if trial >= discard_first:
            times.append(start.elapsed_time(end))
    return times


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
def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_trial(seed: int, reference: torch.nn.Module, reference64: torch.nn.Module | None,
                candidate: torch.nn.Module, input_shape, device: torch.device) -> Trial:
    """One trial as KernelBench's ``run_and_check_correctness`` runs it, then ``reference64`` unless None."""
    set_seed(seed)
    x = torch.rand(*input_shape).to(dtype=torch.float32).to(device=device)
    with torch.no_grad():
        y_ref = reference(x)
        _sync(device)
        y_new = candidate(x)
        _sync(device)
    if y_new.shape != y_ref.shape or y_new.dtype != torch.float32:
        raise RuntimeError(f"ModelNew returned {y_new.dtype} {tuple(y_new.shape)}, expected torch.float32 "
                           f"{tuple(y_ref.shape)}")
    trial = Trial(seed, bool(torch.allclose(y_ref, y_new, atol=TOLERANCE, rtol=TOLERANCE)), _max_abs(y_new, y_ref),
                  None, math.nan, None, math.nan)
    if reference64 is not None:
        with torch.no_grad():
            y64 = reference64(x.double())
            _sync(device)
        exact = y64.float()
        trial.passes_fp64 = bool(torch.allclose(exact, y_new, atol=TOLERANCE, rtol=TOLERANCE))
        trial.max_abs_err_fp64 = _max_abs(y_new, y64)
        trial.ref_passes_fp64 = bool(torch.allclose(exact, y_ref, atol=TOLERANCE, rtol=TOLERANCE))
        trial.ref_max_abs_err_fp64 = _max_abs(y_ref, y64)
    return trial


def _load(problem: Problem, path: Path, result: Result) -> tuple[ModuleType, torch.nn.Module, torch.nn.Module]:
    """The file's module, the reference and ModelNew built from it; ``result`` records each step."""
    module = load_model_file(path)
    result.loaded = True
    precision_of = getattr(module, "forward_precision", None)
    result.precision = precision_of() if precision_of is not None else None
    reference, candidate = build_models(problem, module)
    result.parameters_identical = parameters_identical(reference, candidate)
    return module, reference, candidate


def evaluate_gpu(problem: Problem, directory: Path, correct_trials: int, trials: int, warmup: int, console,
                 device: torch.device, file_name: str) -> Result:
    result = Result(problem.id, file_name, problem.describe(), list(problem.input_shape))
    module, reference, candidate = _load(problem, directory / file_name, result)
    reference, candidate = reference.to(device), candidate.to(device)
    reference64 = copy.deepcopy(reference).double()
    for i, seed in enumerate(trial_seeds(correct_trials)):
        console.print(f"  problem {problem.id}: correctness trial {i + 1}/{correct_trials} (seed {seed})")
        result.trials.append(check_trial(seed, reference, reference64, candidate, problem.input_shape, device))
    del reference64
    torch.cuda.empty_cache()

    set_seed(SEED)
    x = torch.rand(*problem.input_shape).to(device)
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


def evaluate_cpu(problem: Problem, directory: Path, correct_trials: int, interpret: bool, file_name: str) -> Result:
    """Import and construct; with the interpreter, the Triton file's trials at the problem's reduced size."""
    interpret = interpret and file_name == problem.file_name
    run = reduced(problem) if interpret else problem
    result = Result(problem.id, file_name, run.describe(), list(run.input_shape))
    _load(problem, directory / file_name, result)
    if interpret:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / file_name
            path.write_text(render(run, small=True), encoding="utf-8")
            small_module = load_model_file(path)
        reference, candidate = build_models(run, small_module)
        reference64 = copy.deepcopy(reference).double()
        for seed in trial_seeds(correct_trials):
            result.trials.append(check_trial(seed, reference, reference64, candidate, run.input_shape,
                                             torch.device("cpu")))
    return result


# ---- output -------------------------------------------------------------------------------------
def _verdict(r: Result, name: str) -> str:
    if not r.trials:
        return "-"
    count = f"{r.passed(name)}/{len(r.trials)}"
    return f"[green]yes {count}[/]" if r._all(name) else f"[red]no {count}[/]"


def _fmt(v: float, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _flags_text(flags: dict) -> str:
    return "TF32 allowed for convolutions" if flags["cudnn_conv_tf32"] else "TF32 off for convolutions"


def _entry(r: Result) -> str:
    return f"{r.problem} cuda" if r.file.endswith("_cuda.py") else f"{r.problem}"


def print_table(console, results: list[Result], env: dict, flags: dict) -> None:
    where = env.get("gpu") or "CPU (Triton interpreter, reduced geometries)"
    title = f"KernelBench level 1 ConvTranspose3d, fp32 - {where} - {_flags_text(flags)}"
    columns = ["problem", "layer", "precision", "correct (KernelBench)", "max abs diff", "ref ms", "new ms", "speedup",
               "vs fp64", "max abs err vs fp64", "ref err vs fp64", "same params"]
    rows = []
    for r in results:
        cells = [_entry(r), r.layer, r.precision or "-", _verdict(r, "passes"), _fmt(r.max_abs_diff, ".2e"),
                 _fmt(r.ref_ms.mean if r.ref_ms else None, ".3f"), _fmt(r.new_ms.mean if r.new_ms else None, ".3f"),
                 _fmt(r.speedup, ".2f") + ("x" if math.isfinite(r.speedup) else ""), _verdict(r, "passes_fp64"),
                 _fmt(r.max_abs_err_fp64, ".2e"), _fmt(r.ref_max_abs_err_fp64, ".2e"),
                 {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[r.parameters_identical]]
        if r.error:
            cells[3:] = [f"[red]error: {r.error.splitlines()[-1][:80]}[/]"] + [""] * (len(cells) - 4)
        rows.append(cells)
    table(console, title, columns, rows, left=3)
    console.print(f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
                  f"Python {env['python']}, convt3d {env['convt3d']} ({env.get('git_commit') or 'no git'})")


def summary(results: list[Result]) -> dict:
    # The speedup summary is over the seven Triton files; the CUDA entry is its own row.
    timed = [r for r in results if math.isfinite(r.speedup) and not r.file.endswith("_cuda.py")]
    checked = [r for r in results if r.trials]
    speedups = [r.speedup for r in timed]
    return {
        "problems": len(results),
        "checked": len(checked),
        "correct": sum(r.correct for r in checked),
        "correct_fp64": sum(r.correct_fp64 for r in checked),
        "ref_passes_fp64": sum(r.ref_passes_fp64 for r in checked),
        "geomean_speedup": geomean(speedups),
        "min_speedup": min(speedups, default=math.nan),
        "min_speedup_problem": min(timed, key=lambda r: r.speedup).problem if timed else None,
        "errors": sum(r.error is not None for r in results),
    }


def print_summary(console, s: dict, flags: dict) -> None:
    if s["checked"]:
        console.print(f"KernelBench's verdict ({_flags_text(flags)}): {s['correct']}/{s['checked']} correct "
                      f"(allclose to the reference at atol=rtol={TOLERANCE:g} on every trial)")
    if math.isfinite(s["geomean_speedup"]):
        console.print(f"speedup over the reference, Triton files: geometric mean {s['geomean_speedup']:.2f}x, "
                      f"lowest {s['min_speedup']:.2f}x (problem {s['min_speedup_problem']})")
    if s["checked"]:
        console.print(f"against float64: {s['correct_fp64']}/{s['checked']} files pass; the reference itself passes "
                      f"on {s['ref_passes_fp64']} of {s['checked']}.")
    console.print(f"note: {NOTE}")


def row_line(r: Result) -> str:
    """One result as a line (printed as each file finishes, before the table)."""
    n = len(r.trials)
    speed = (f", ModelNew {r.new_ms.mean:.3f} ms, reference {r.ref_ms.mean:.3f} ms, speedup {r.speedup:.2f}x"
             if r.new_ms and r.ref_ms else "")
    fp64 = (f", vs fp64 {r.passed('passes_fp64')}/{n} ({r.max_abs_err_fp64:.2e}; reference "
            f"{r.ref_max_abs_err_fp64:.2e})" if n else "")
    verdict = (f"{'correct' if r.correct else 'incorrect'} {r.passed('passes')}/{n} (max abs diff "
               f"{r.max_abs_diff:.2e})" if n else "not run")
    return f"  problem {_entry(r)} [{r.precision}]: {verdict}{speed}{fp64}"


def _flags() -> dict:
    conv = getattr(torch.backends.cudnn, "conv", None)
    return {"cudnn_conv_tf32": cudnn_conv_allows_tf32(),
            "cudnn_conv_fp32_precision": getattr(conv, "fp32_precision", None),
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}


# ---- level 2 ------------------------------------------------------------------------------------
# Where a normalisation right after the conv magnifies the reference's own TF32 rounding past KernelBench's
# fp32 tolerance (PyTorch's exact-fp32 output fails the check too), the verdict takes this one.
TOLERANCE_L2 = 1e-2
NOTE_L2 = ("'correct' is KernelBench's verdict: allclose(reference, ModelNew, atol=rtol=1e-4) on every trial, the "
           "reference run under the same flags. 'exact ref' (on a GPU, for the problems whose normalisation right "
           "after the conv magnifies TF32 rounding) judges PyTorch's own output with TF32 off for convolutions the "
           "same way against its default-flag output; where that fails every trial, the verdict is taken at "
           "atol=rtol=1e-2. 'vs compile' is the speedup over torch.compile of the reference after convt3d.patch().")


@dataclass
class Trial2:
    seed: int
    passes: bool  # KernelBench's check: allclose(reference under the flags in force, ModelNew)
    max_abs_diff: float
    passes_loose: bool = False  # the same check at TOLERANCE_L2
    exact_passes: bool | None = None  # the reference with TF32 off for convolutions, checked so; None: not run
    exact_max_abs_diff: float = math.nan


@dataclass
class Result2:
    problem: int
    file: str
    input_shapes: list[list[int]]
    parameters_identical: bool | None = None
    trials: list[Trial2] = field(default_factory=list)
    new_ms: Stats | None = None
    ref_ms: Stats | None = None  # the eager reference under the flags of the run
    compiled_ms: Stats | None = None  # torch.compile(convt3d.patch(reference))
    compile_error: str | None = None
    error: str | None = None

    passed, _all, as_dict = Result.passed, Result._all, Result.as_dict
    max_abs_diff = property(lambda self: max((t.max_abs_diff for t in self.trials), default=math.nan))
    speedup = property(lambda self: self.ref_ms.mean / self.new_ms.mean if self.ref_ms and self.new_ms else math.nan)

    @property
    def correct(self) -> bool | None:
        """KernelBench's verdict (every trial passes), at TOLERANCE_L2 only where the reference's own
        exact-fp32 output fails every trial at KernelBench's tolerance."""
        strict = self._all("passes")
        if strict or not self.trials or any(t.exact_passes is not False for t in self.trials):
            return strict
        return all(t.passes_loose for t in self.trials)
    speedup_compiled = property(lambda self: self.compiled_ms.mean / self.new_ms.mean
                                if self.compiled_ms and self.new_ms else math.nan)


def build_level2(problem: level2.Problem) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(Model, ModelNew) of a level-2 problem, each built on the CPU right after seeding, without autograd."""
    with torch.no_grad():
        set_seed(SEED)
        reference = level2.Reference(problem)
        set_seed(SEED)
        candidate = level2.ModelNew(problem)
    return reference, candidate


def check_trial2(seed: int, reference: torch.nn.Module, candidate: torch.nn.Module, input_shapes,
                 device: torch.device, exact: bool = False) -> Trial2:
    """One level-2 trial as KernelBench runs it (inputs: torch.rand of each shape after seeding); with
    ``exact``, also the reference (its state before the trial) with TF32 off for convolutions."""
    set_seed(seed)
    inputs = [torch.rand(*shape).to(dtype=torch.float32).to(device=device) for shape in input_shapes]
    twin = copy.deepcopy(reference) if exact else None
    with torch.no_grad():
        y_ref = reference(*inputs)
        _sync(device)
        y_new = candidate(*inputs)
        _sync(device)
        if twin is not None:
            with cudnn_conv_tf32(False):
                y_exact = twin(*inputs)
    if y_new.shape != y_ref.shape or y_new.dtype != torch.float32:
        raise RuntimeError(f"ModelNew returned {y_new.dtype} {tuple(y_new.shape)}, expected torch.float32 "
                           f"{tuple(y_ref.shape)}")
    trial = Trial2(seed, bool(torch.allclose(y_ref, y_new, atol=TOLERANCE, rtol=TOLERANCE)), _max_abs(y_new, y_ref),
                   bool(torch.allclose(y_ref, y_new, atol=TOLERANCE_L2, rtol=TOLERANCE_L2)))
    if twin is not None:
        trial.exact_passes = bool(torch.allclose(y_ref, y_exact, atol=TOLERANCE, rtol=TOLERANCE))
        trial.exact_max_abs_diff = _max_abs(y_exact, y_ref)
    return trial


def evaluate_level2(problem: level2.Problem, correct_trials: int, console, device: torch.device, trials: int = 0,
                    warmup: int = WARMUP, interpret: bool = False) -> Result2:
    """On a GPU: parameters, trials and timings at KernelBench's sizes. On the CPU: the parameters, and
    through the interpreter the trials at the problem's reduced size."""
    gpu = device.type == "cuda"
    run = problem if gpu or not interpret else problem.reduced()
    result = Result2(problem.id, problem.file_name, [list(s) for s in run.input_shapes])
    reference, candidate = build_level2(problem)
    result.parameters_identical = parameters_identical(reference, candidate)
    if not gpu and not interpret:
        return result
    if run is not problem:
        reference, candidate = build_level2(run)
    reference, candidate = reference.to(device), candidate.to(device)
    for i, seed in enumerate(trial_seeds(correct_trials)):
        console.print(f"  problem {problem.id}: correctness trial {i + 1}/{correct_trials} (seed {seed})")
        result.trials.append(check_trial2(seed, reference, candidate, run.input_shapes, device,
                                          exact=gpu and problem.tf32_sensitive))
    if not gpu:
        return result
    set_seed(SEED)
    inputs = [torch.rand(*shape).to(device) for shape in problem.input_shapes]
    with torch.no_grad():
        console.print(f"  problem {problem.id}: timing ModelNew, the reference, then torch.compile of the patched "
                      f"reference ({warmup} warm-ups, {trials} trials + {DISCARD_FIRST} each)")
        result.new_ms = Stats.of(time_with_cuda_events(lambda _: candidate(*inputs), inputs[0], trials, warmup))
        result.ref_ms = Stats.of(time_with_cuda_events(lambda _: reference(*inputs), inputs[0], trials, warmup))
        # Every problem's Reference.forward is one code object: a fresh cache keeps dynamo from
        # running later problems eagerly once its recompile limit is reached.
        torch._dynamo.reset()
        try:
            compiled = torch.compile(convt3d.patch(copy.deepcopy(reference)))
            result.compiled_ms = Stats.of(time_with_cuda_events(lambda _: compiled(*inputs), inputs[0], trials,
                                                                warmup))
        except Exception as e:  # the eager comparison stands without it
            result.compile_error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return result


def row_line2(r: Result2) -> str:
    """One level-2 result as a line: the verdict, then the speedups."""
    n = len(r.trials)
    out = (f"  problem {r.problem}: {'correct' if r.correct else 'incorrect'} {r.passed('passes')}/{n} "
           f"(max abs diff {r.max_abs_diff:.2e})" if n else f"  problem {r.problem}: not run")
    if any(t.exact_passes is not None for t in r.trials):
        out += f", exact-fp32 reference {r.passed('exact_passes')}/{n} against the default one"
    if r.new_ms and r.ref_ms:
        out += f", {r.speedup:.2f}x over eager ({r.ref_ms.mean:.3f} ms, ModelNew {r.new_ms.mean:.3f} ms)"
    if r.compiled_ms:
        out += f", {r.speedup_compiled:.2f}x over torch.compile ({r.compiled_ms.mean:.3f} ms)"
    elif r.compile_error:
        out += f", torch.compile failed: {r.compile_error}"
    return out


def summary2(results: list[Result2]) -> dict:
    checked = [r for r in results if r.trials]
    out = {"problems": len(results), "checked": len(checked), "correct": sum(r.correct for r in checked),
           "errors": sum(r.error is not None for r in results)}
    for key in ("speedup", "speedup_compiled"):
        timed = sorted((r for r in results if math.isfinite(getattr(r, key))), key=lambda r: getattr(r, key))
        out[f"geomean_{key}"] = geomean(getattr(r, key) for r in timed)
        out[f"min_{key}"] = getattr(timed[0], key) if timed else math.nan
        out[f"min_{key}_problem"] = timed[0].problem if timed else None
    return out


def print_level2(console, results: list[Result2], env: dict, flags: dict, s: dict) -> None:
    where = env.get("gpu") or "CPU (Triton interpreter, reduced geometries)"
    columns = ["problem", "ops after ConvTranspose3d", "correct (KernelBench)", "max abs diff", "exact-fp32 ref",
               "ref ms", "new ms", "speedup", "compiled ms", "vs compile", "same params"]
    rows = []
    for r in results:
        exact = [t for t in r.trials if t.exact_passes is not None]
        ms = [_fmt(t.mean if t else None, ".3f") for t in (r.ref_ms, r.new_ms, r.compiled_ms)]
        loose = r.correct and not r._all("passes")
        verdict = f"[green]yes at 1e-2 {r.passed('passes_loose')}/{len(r.trials)}[/]" if loose else _verdict(r, "passes")
        cells = [str(r.problem), r.file.split("ConvTranspose3d_")[-1][:-3], verdict,
                 _fmt(r.max_abs_diff, ".2e"), f"{r.passed('exact_passes')}/{len(exact)}" if exact else "-",
                 *ms[:2], _fmt(r.speedup, ".2f"), ms[2], _fmt(r.speedup_compiled, ".2f"),
                 {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[r.parameters_identical]]
        if r.error:
            cells[2:] = [f"[red]error: {r.error.splitlines()[-1][:80]}[/]"] + [""] * (len(cells) - 3)
        rows.append(cells)
    table(console, f"KernelBench level 2 ConvTranspose3d problems, fp32 - {where} - {_flags_text(flags)}", columns,
          rows, left=2)
    if s["checked"]:
        console.print(f"KernelBench's verdict ({_flags_text(flags)}): {s['correct']}/{s['checked']} correct "
                      f"(allclose to the reference at atol=rtol={TOLERANCE:g} on every trial; {TOLERANCE_L2:g} where "
                      "PyTorch's own exact-fp32 output fails that check)")
    for key, what in (("speedup", "the eager reference"),
                      ("speedup_compiled", "torch.compile(convt3d.patch(reference))")):
        if math.isfinite(s[f"geomean_{key}"]):
            console.print(f"speedup over {what}: geometric mean {s[f'geomean_{key}']:.2f}x, lowest "
                          f"{s[f'min_{key}']:.2f}x (problem {s[f'min_{key}_problem']})")
    console.print(f"note: {NOTE_L2}")


# ---- command ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
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
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The options; ``--exact`` becomes ``--precision tf32x3`` with a DeprecationWarning, shown unless -W says no."""
    args = build_parser().parse_args(argv)
    if args.exact:
        with warnings.catch_warnings():
            if not sys.warnoptions:
                warnings.simplefilter("default", DeprecationWarning)
            warnings.warn("convt3d kernelbench: --exact is deprecated and will be removed; use --precision tf32x3",
                          DeprecationWarning, stacklevel=3)
        args.precision = "tf32x3"
    return args


def entries(problems: list[Problem]) -> list[tuple[Problem, str]]:
    """(problem, file name) rows of the table: each problem's Triton file, then its CUDA entry if any."""
    return [(p, name) for p in problems for name in (p.file_name, p.cuda_file_name) if name]


def _run(problems: list[Problem], fn, console) -> list[Result]:
    results = []
    for p, name in entries(problems):
        console.print(f"[bold]problem {p.id}[/]: {name}")
        try:
            results.append(fn(p, name))
            console.print(row_line(results[-1]), markup=False, highlight=False)
        except Exception:  # one broken file must not hide the others' results
            r = Result(p.id, name, p.describe(), list(p.input_shape), error=traceback.format_exc())
            console.print(f"[red]problem {p.id} failed:[/]\n{r.error}")
            results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    from convt3d.bench.report import environment, make_console

    args = _parse(argv)
    if args.level == 2:
        return _main_level2(args, argv)
    try:
        problems = parse_ids(args.problems)
    except (KeyError, ValueError) as e:
        print(f"convt3d kernelbench: {e.args[0]}", file=sys.stderr)
        return 2
    directory = args.dir if args.dir is not None else default_out_dir()
    console = make_console()
    gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    if gpu:
        correct_trials = args.correct_trials or CORRECT_TRIALS
        device = torch.device("cuda", torch.cuda.current_device())
        precision, interpret = args.precision, False

        def run(p: Problem, name: str) -> Result:
            return evaluate_gpu(p, directory, correct_trials, args.trials, args.warmup, console, device, name)
    else:
        import triton

        interpret = bool(triton.knobs.runtime.interpret)
        correct_trials = args.correct_trials or 1
        precision = "tf32x3"  # PyTorch's CPU convolution is exact fp32 whatever the flags say
        console.print("[bold yellow]convt3d kernelbench needs a CUDA GPU[/] for KernelBench's timings and its "
                      "full-size correctness check; this machine has none.")
        console.print("Checking instead that every file imports and constructs with the reference's parameters"
                      + (f", and running {correct_trials} correctness trial(s) per problem through Triton's "
                         "interpreter on the problem at a reduced size (export.reduced: the file exported for "
                         "it), with TF32 off (PyTorch's CPU reference never uses TF32)." if interpret else
                         "; set TRITON_INTERPRET=1 to also check correctness through Triton's interpreter."))

        def run(p: Problem, name: str) -> Result:
            return evaluate_cpu(p, directory, correct_trials, interpret, name)
    with flags_in_force(precision):
        flags = _flags()
        results = _run(problems, run, console)
    env = environment(gpu)
    print_table(console, results, env, flags)
    s = summary(results)
    print_summary(console, s, flags)
    if args.json is not None:
        write_json(args.json, {
            "schema": "convt3d-kernelbench/3", "kind": "timing" if gpu else "cpu-check",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(sys.argv[1:] if argv is None else argv), "environment": env, "flags": flags,
            "method": {"seed": SEED, "correct_trials": correct_trials, "tolerance": TOLERANCE,
                       "verdict": "allclose(reference under the flags of the run, ModelNew) on every trial",
                       "precision": precision, "timed_trials": args.trials if gpu else 0, "warmup": args.warmup,
                       "discard_first": DISCARD_FIRST, "l2_flush_bytes": L2_FLUSH_BYTES,
                       "reduced_geometry": not gpu and interpret, "interpreter": interpret},
            "note": NOTE, "seconds": time.perf_counter() - t0,
            "problems": [r.as_dict() for r in results], "summary": s,
        })
        console.print(f"wrote {args.json}")
    failed = s["errors"] > 0 or s["correct"] < s["checked"] or \
        any(r.parameters_identical is False for r in results)
    return 1 if failed else 0


def _main_level2(args: argparse.Namespace, argv: list[str] | None) -> int:
    from convt3d.bench.report import environment, make_console

    try:
        problems = level2.parse_ids(args.problems)
    except (KeyError, ValueError) as e:
        print(f"convt3d kernelbench: {e.args[0]}", file=sys.stderr)
        return 2
    console = make_console()
    gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    if gpu:
        device, precision, interpret = torch.device("cuda", torch.cuda.current_device()), args.precision, False
        correct_trials = args.correct_trials or CORRECT_TRIALS
    else:
        import triton

        device, precision, interpret = torch.device("cpu"), "tf32x3", bool(triton.knobs.runtime.interpret)
        correct_trials = args.correct_trials or 1
        console.print("[bold yellow]convt3d kernelbench needs a CUDA GPU[/] for KernelBench's timings and its "
                      "full-size correctness check; this machine has none. Checking instead that every ModelNew "
                      "builds the reference's parameters" + (
                          f", and running {correct_trials} correctness trial(s) per problem through Triton's "
                          "interpreter at a reduced size." if interpret else
                          "; set TRITON_INTERPRET=1 to also check correctness through Triton's interpreter."))
    results = []
    with flags_in_force(precision):
        flags = _flags()
        for p in problems:
            console.print(f"[bold]problem {p.id}[/]: {p.file_name}")
            try:
                results.append(evaluate_level2(p, correct_trials, console, device, args.trials, args.warmup,
                                               interpret))
                console.print(row_line2(results[-1]), markup=False, highlight=False)
            except Exception:  # one failing problem must not hide the others' results
                results.append(Result2(p.id, p.file_name, [list(s) for s in p.input_shapes],
                                       error=traceback.format_exc()))
                console.print(f"[red]problem {p.id} failed:[/]\n{results[-1].error}")
            if gpu:
                torch.cuda.empty_cache()
    env = environment(gpu)
    s = summary2(results)
    print_level2(console, results, env, flags, s)
    if args.json is not None:
        write_json(args.json, {
            "schema": "convt3d-kernelbench-level2/1", "kind": "timing" if gpu else "cpu-check",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(sys.argv[1:] if argv is None else argv), "environment": env, "flags": flags,
            "method": {"seed": SEED, "correct_trials": correct_trials, "tolerance": TOLERANCE,
                       "tolerance_where_exact_reference_fails": TOLERANCE_L2,
                       "verdict": "allclose(reference under the flags of the run, ModelNew) on every trial",
                       "precision": precision, "timed_trials": args.trials if gpu else 0, "warmup": args.warmup,
                       "discard_first": DISCARD_FIRST, "l2_flush_bytes": L2_FLUSH_BYTES,
                       "reduced_geometry": not gpu and interpret, "interpreter": interpret},
            "note": NOTE_L2, "seconds": time.perf_counter() - t0,
            "problems": [r.as_dict() for r in results], "summary": s,
        })
        console.print(f"wrote {args.json}")
    failed = s["errors"] > 0 or s["correct"] < s["checked"] or any(r.parameters_identical is False for r in results)
    return 1 if failed else 0
