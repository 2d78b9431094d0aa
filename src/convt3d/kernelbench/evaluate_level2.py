"""``convt3d kernelbench --level 2``: convt3d.kernelbench.level2's ModelNew judged (``Result2.correct``) and timed
as KernelBench does, with ``evaluate``'s seeds, trials, timing, tables and JSON."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

import convt3d

from ..core.flags import cudnn_conv_tf32
from . import level2
from .evaluate import (DISCARD_FIRST, SAME_PARAMS, SEED, Machine, Result, Stats, close, conclude, counts, fmt,
                       machine, max_abs, parameters_identical, print_results, run_all, run_trial, run_trials,
                       select, set_seed, speedups, time_with_cuda_events, verdict_cell, verdict_text)

TOLERANCE_L2 = 1e-2  # the verdict's tolerance where the exact-fp32 reference fails KernelBench's (Result2.correct)
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
    passes_loose: bool  # the same check at TOLERANCE_L2
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

    passed, _all, _max, as_dict = Result.passed, Result._all, Result._max, Result.as_dict
    max_abs_diff, speedup = Result.max_abs_diff, Result.speedup
    # KernelBench's verdict: every trial passes, at TOLERANCE_L2 where PyTorch's own exact-fp32 output failed every
    # one (a normalisation right after the conv magnifies the reference's TF32 rounding past fp32's tolerance)
    correct = property(lambda self: self._all("passes_loose" if self.trials and all(
        t.exact_passes is False for t in self.trials) else "passes"))
    speedup_compiled = property(lambda self: self.compiled_ms.mean / self.new_ms.mean
                                if self.compiled_ms and self.new_ms else math.nan)


def build_level2(problem: level2.Problem) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(Model, ModelNew), each built on the CPU right after seeding, without autograd."""
    with torch.no_grad():
        return tuple(set_seed(SEED) or make(problem) for make in (level2.Reference, level2.ModelNew))


def check_trial2(seed: int, reference: torch.nn.Module, candidate: torch.nn.Module, input_shapes,
                 device: torch.device, exact: bool = False) -> Trial2:
    """One trial (``run_trial``); with ``exact``, also the reference as it was before, TF32 off for convolutions."""
    twin = copy.deepcopy(reference) if exact else None
    inputs, y_ref, y_new = run_trial(seed, reference, candidate, input_shapes, device)
    trial = Trial2(seed, close(y_ref, y_new), max_abs(y_new, y_ref), close(y_ref, y_new, TOLERANCE_L2))
    if twin is not None:
        with torch.no_grad(), cudnn_conv_tf32(False):
            y_exact = twin(*inputs)
        trial.exact_passes, trial.exact_max_abs_diff = close(y_ref, y_exact), max_abs(y_exact, y_ref)
    return trial


def evaluate_level2(problem: level2.Problem, m: Machine, console, trials: int, warmup: int) -> Result2:
    """On a GPU the parameters, trials and timings at KernelBench's sizes; on the CPU the parameters and,
    through the interpreter, the trials at the problem's reduced size."""
    run = problem if m.gpu or not m.interpret else problem.reduced()
    result = Result2(problem.id, problem.file_name, [list(s) for s in run.input_shapes])
    result.parameters_identical = parameters_identical(*build_level2(problem))
    if not m.gpu and not m.interpret:
        return result
    reference, candidate = (x.to(m.device) for x in build_level2(run))
    result.trials = run_trials(problem.id, m.correct_trials, console, lambda seed: check_trial2(
        seed, reference, candidate, run.input_shapes, m.device, exact=m.gpu and problem.tf32_sensitive))
    if not m.gpu:
        return result
    set_seed(SEED)
    inputs = [torch.rand(*shape).to(m.device) for shape in problem.input_shapes]

    def timed(model) -> Stats:
        return Stats.of(time_with_cuda_events(lambda _: model(*inputs), inputs[0], trials, warmup))
    with torch.no_grad():
        console.print(f"  problem {problem.id}: timing ModelNew, the reference, then torch.compile of the patched "
                      f"reference ({warmup} warm-ups, {trials} trials + {DISCARD_FIRST} each)")
        result.new_ms, result.ref_ms = timed(candidate), timed(reference)
        # Every problem's Reference.forward is one code object: a fresh cache keeps dynamo from
        # running later problems eagerly once its recompile limit is reached.
        torch._dynamo.reset()
        try:
            result.compiled_ms = timed(torch.compile(convt3d.patch(copy.deepcopy(reference))))
        except Exception as e:  # the eager comparison stands without it
            result.compile_error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return result


def row_line2(r: Result2) -> str:
    """One result as a line: the verdict, then the speedups."""
    out = f"  problem {r.problem}: {verdict_text(r)}"
    if any(t.exact_passes is not None for t in r.trials):
        out += f", exact-fp32 reference {r.passed('exact_passes')}/{len(r.trials)} against the default one"
    if r.new_ms and r.ref_ms:
        out += f", {r.speedup:.2f}x over eager ({r.ref_ms.mean:.3f} ms, ModelNew {r.new_ms.mean:.3f} ms)"
    if r.compiled_ms:
        out += f", {r.speedup_compiled:.2f}x over torch.compile ({r.compiled_ms.mean:.3f} ms)"
    elif r.compile_error:
        out += f", torch.compile failed: {r.compile_error}"
    return out


def _cells(r: Result2) -> list[str]:
    exact = [t for t in r.trials if t.exact_passes is not None]
    loose = r.correct and not r._all("passes")
    return [str(r.problem), r.file.split("ConvTranspose3d_")[-1][:-3],
            f"[green]yes at 1e-2 {r.passed('passes_loose')}/{len(r.trials)}[/]" if loose else verdict_cell(r, "passes"),
            fmt(r.max_abs_diff, ".2e"), f"{r.passed('exact_passes')}/{len(exact)}" if exact else "-",
            *(fmt(t.mean if t else None, ".3f") for t in (r.ref_ms, r.new_ms)), fmt(r.speedup, ".2f"),
            fmt(r.compiled_ms.mean if r.compiled_ms else None, ".3f"), fmt(r.speedup_compiled, ".2f"),
            SAME_PARAMS[r.parameters_identical]]


def main_level2(args, argv: list[str] | None) -> int:
    """``convt3d kernelbench --level 2`` with ``evaluate``'s parsed options."""
    if (problems := select(level2.parse_ids, args.problems)) is None:
        return 2
    console, m = machine(args, "every ModelNew builds the reference's parameters", "at a reduced size", sep=" ")
    flags, results, env = run_all(m, [(p, p.file_name) for p in problems], lambda p, _: evaluate_level2(
        p, m, console, args.trials, args.warmup), console, row_line2, lambda p, name, tb: Result2(
        p.id, name, [list(s) for s in p.input_shapes], error=tb))
    s = {**counts(results, "correct"), **speedups(results), **speedups(results, "speedup_compiled")}
    columns = ["problem", "ops after ConvTranspose3d", "correct (KernelBench)", "max abs diff", "exact-fp32 ref",
               "ref ms", "new ms", "speedup", "compiled ms", "vs compile", "same params"]
    print_results(console, "level 2 ConvTranspose3d problems", env, flags, columns, results, _cells, left=2)
    return conclude(args, argv, console, m, env, flags, results, s, "convt3d-kernelbench-level2/1", NOTE_L2,
                    {"speedup": "the eager reference", "speedup_compiled": "torch.compile(convt3d.patch(reference))"},
                    f"; {TOLERANCE_L2:g} where PyTorch's own exact-fp32 output fails that check",
                    tolerance_where_exact_reference_fails=TOLERANCE_L2)
