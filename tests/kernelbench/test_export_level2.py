"""KernelBench level 2's exported ``ModelNew`` files (``convt3d export-kernelbench --level 2``), on the CPU.

* the committed files in kernelbench/level2/ are what the exporter makes from the package now, and
  ``--check`` names a file that drifted; the problems whose stages it cannot carry are refused;
* each file passes KernelBench's static rules within ``export.MAX_LINES`` lines, imports only torch,
  triton and the standard library, carries the engine's tiles that take an epilogue as its predictor
  ranks them, and its ModelNew builds bitwise the reference's state after the same seed, refusing
  other init inputs and input shapes;
* through Triton's interpreter, a problem exported at its reduced size matches the reference in
  float64 with every parameter perturbed alike and leaves its state (BatchNorm's running statistics
  and batch count; in evaluation mode the running statistics are read, not updated); at 16 channels,
  every candidate of a file (flat and phase tiles with the fused epilogue) does.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import shutil
import sys

import pytest
import torch

from convt3d.kernelbench import command, export, export_level2, level2, static_check
from convt3d.kernelbench.problems import SEED

from conftest import requires_interpreter

KB2 = export.default_out_dir() / "level2"
EXPORTED = [p for p in level2.PROBLEMS if export_level2.exported(p)]
IDS = [f"kb{p.id}" for p in EXPORTED]
# Through the interpreter at the reduced size: every stage kind and operand form (scalar, per-channel,
# residual; pre, mid and post programs; a squeezed output; BatchNorm, GroupNorm, LayerNorm; 13's depth
# sums, 50's pooled weight, 15's subtracted means; the direct kernel's channel reductions, pooling,
# plane means and 72's batch statistics beside its pools), within the file's time budget.
INTERPRETED = (3, 13, 15, 26, 38, 50, 58, 60, 72, 74, 77, 89, 96, 100)


def _load(path, name: str):
    """A file imported as KernelBench imports it: a fresh module, not registered in sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_modules: dict[int, object] = {}


def _module(problem):
    if problem.id not in _modules:
        path = KB2 / problem.file_name
        if not path.is_file():
            pytest.fail(f"{path} is missing: run 'convt3d export-kernelbench --level 2'")
        _modules[problem.id] = _load(path, f"kb2_{problem.id}")
    return _modules[problem.id]


def _built(problem, module):
    """(Reference, ModelNew), each built right after seeding."""
    torch.manual_seed(SEED)
    reference = level2.Reference(problem)
    torch.manual_seed(SEED)
    return reference, module.ModelNew(*problem.init_inputs)


def _same_state(a, b, tol: float | None = None) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(
        torch.equal(sa[k], sb[k]) if tol is None else torch.allclose(sa[k].double(), sb[k].double(), atol=tol, rtol=tol)
        for k in sa)


@pytest.fixture
def exact():
    """TF32 off for convolutions (the file then computes at exact grade), restored afterwards."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    saved = (torch.backends.cudnn.allow_tf32, getattr(conv, "fp32_precision", None))
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved[0]
    if saved[1] is not None:
        torch.backends.cudnn.conv.fp32_precision = saved[1]


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------
def test_committed_files_equal_a_fresh_export_and_check_names_a_drifted_one(tmp_path, capsys):
    shutil.copytree(KB2, tmp_path / "level2")
    drifted = tmp_path / "level2" / EXPORTED[0].file_name
    drifted.write_text(drifted.read_text().replace("EXACT_GRADE = 'tf32x3'", "EXACT_GRADE = 'ieee'"))
    assert command.export_main(["--level", "2", "--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"1 of {len(EXPORTED)} files in {tmp_path} differ from a fresh export" in err
    assert f"{drifted} (committed)" in err and "+EXACT_GRADE = 'tf32x3'" in err
    assert "not exported yet" not in err
    assert sorted(p.name for p in KB2.glob("*.py")) == sorted(p.file_name for p in EXPORTED)
    assert EXPORTED == list(level2.PROBLEMS)


def test_a_problem_with_a_stage_the_exporter_cannot_carry_is_refused():
    """15 with its mean subtracted by PyTorch, as a plain function: no file."""
    problem = level2.by_id(15)
    torch_stage = dataclasses.replace(problem, pipeline=problem.pipeline[:-1] + (
        lambda m, y, env: y - y.mean((2, 3, 4), keepdim=True),))
    assert not export_level2.exported(torch_stage)
    with pytest.raises(export.ExportError, match="problem 15: a stage computes with PyTorch"):
        export_level2.render(torch_stage)


@pytest.mark.parametrize("pid", [p.id for p in EXPORTED], ids=IDS)
def test_file_passes_static_rules_within_the_line_limit_importing_torch_and_triton_only(pid):
    problem = level2.by_id(pid)
    text = (KB2 / problem.file_name).read_text()
    assert text.split("\n", 1)[0] == export.MARKER
    assert ast.get_docstring(ast.parse(text)).startswith(f"KernelBench level 2, problem {pid}: {problem.file_name}")
    violations = static_check.check(text)
    assert not violations, list(map(str, violations))
    assert text.count("\n") <= export.MAX_LINES == 1000
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            tops = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) \
                else [(node.module or "").split(".")[0]]
            assert all(t in ("torch", "triton") or t in sys.stdlib_module_names for t in tops), f"line {node.lineno}"


def test_static_rules_catch_a_pytorch_layer_in_a_file():
    """The check above can fail: the files' own layers are plain modules, a torch.nn layer is refused."""
    text = (KB2 / EXPORTED[0].file_name).read_text()
    planted = text.replace("super().__init__()\n", "super().__init__()\n        self.bn = torch.nn.BatchNorm3d(4)\n", 1)
    assert [v.rule for v in static_check.check(planted)] == ["torch.nn-layer"]


@pytest.mark.parametrize("pid", [p.id for p in EXPORTED], ids=IDS)
def test_file_carries_the_predictors_candidates_and_builds_the_reference_state(pid):
    """The engine's epilogue tiles as its predictor ranks them (one at exact grade at least), all of
    them or as many as fit in ``export.MAX_LINES`` (15's four finishing kernels leave no room for its
    TMA tile), named in the header; ModelNew's state bitwise the reference's after the same seed, the
    RNG left where the reference leaves it; other init inputs and input shapes are refused."""
    problem = level2.by_id(pid)
    module = _module(problem)
    conv = export_level2._Tracer(problem, True).conv
    header = (KB2 / problem.file_name).read_text().split('"""', 1)[0]
    if conv is None:  # the direct kernel computes the convolution: no GEMM tile, no chooser
        assert "no tile to choose" in header and "direct_kernel" in vars(module)
        assert not hasattr(module, "CANDIDATES")
    else:
        expected = export_level2.candidates(conv[0])
        kept = len(module.CANDIDATES)
        assert [c["name"] for c in module.CANDIDATES] == [cfg.short() for cfg, _ in expected[:kept]]
        assert [c["precisions"] for c in module.CANDIDATES] == [runs for _, runs in expected[:kept]]
        if kept < len(expected):  # one more would take the file over the limit
            forms = export_level2._render_lines(problem, False, kept + 1)
            assert min(map(export._line_count, forms)) > export.MAX_LINES
        assert not any(c["gluon"] for c in module.CANDIDATES)
        assert any(module.EXACT_GRADE in c["precisions"] for c in module.CANDIDATES)
        assert all(c["name"] in header for c in module.CANDIDATES)
    with torch.no_grad():
        reference, candidate = _built(problem, module)
        after = torch.get_rng_state()
        torch.manual_seed(SEED)
        level2.Reference(problem)
    assert _same_state(reference, candidate)
    assert torch.equal(after, torch.get_rng_state())
    with pytest.raises(ValueError, match=f"specialised to KernelBench problem {pid}'s init inputs"):
        module.ModelNew(*problem.small[0])
    with pytest.raises(RuntimeError, match=f"specialised to KernelBench problem {pid}'s float32 inputs"):
        candidate(*[torch.rand(*s) for s in problem.small[1]])


def test_forward_precision_follows_pytorchs_tf32_flag_for_convolutions(exact):
    module = _module(EXPORTED[0])
    assert module.forward_precision() == module.EXACT_GRADE == "tf32x3"
    torch.backends.cudnn.allow_tf32 = True
    assert module.forward_precision() == "tf32"


# ---------------------------------------------------------------------------------------------
# Through the interpreter
# ---------------------------------------------------------------------------------------------
def _check_forward(problem, module, candidate_index: int | None = None):
    """ModelNew against the reference in float64, all parameters perturbed alike (a dropped step
    cannot hide behind a one or a zero), in training mode as KernelBench builds them: the output
    within 1e-4 and the state (running statistics, batch count) as the reference leaves it."""
    reference, candidate = _built(problem, module)
    assert _same_state(reference, candidate)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), candidate.parameters()):
            noise = torch.randn_like(p)
            p.add_(noise)
            q.add_(noise)
    reference64 = copy.deepcopy(reference).double()
    inputs = [torch.rand(*s) for s in problem.input_shapes]
    if candidate_index is not None:  # on the CPU the chooser keeps the first candidate: pin one instead
        module._chosen[("cpu", module.EXACT_GRADE)] = module.CANDIDATES[candidate_index]
    with torch.no_grad():
        y64, y = reference64(*(x.double() for x in inputs)), candidate(*inputs)
    assert y.dtype == torch.float32 and y.shape == y64.shape
    assert torch.allclose(y.double(), y64, atol=1e-4, rtol=1e-4), f"max abs error {(y.double() - y64).abs().max():.2e}"
    assert _same_state(reference64, candidate, tol=1e-5), "the forward left another state"
    return reference64, candidate, inputs


@requires_interpreter
@pytest.mark.parametrize("pid", INTERPRETED, ids=[f"kb{i}" for i in INTERPRETED])
def test_reduced_file_matches_the_reference_in_float64(pid, tmp_path, exact):
    problem = level2.by_id(pid)
    path = tmp_path / problem.file_name
    path.write_text(export_level2.render(problem, small=True))
    module = _load(path, f"kb2_small_{pid}")
    _check_forward(problem.reduced(), module)


# 16 channels, where the engine ranks tensor-core tiles first: (init inputs, input shapes, whether
# the file carries a phase tile beside its flat ones; 77's BatchNorm kernels leave room for flat ones only).
SIXTEEN_CHANNELS = {
    100: ((16, 16, 3, 2, 1, -1.0, 2.0), ((1, 16, 2, 3, 4),), True),
    26: ((16, 16, 3, 2, 1, 1, (16, 1, 1, 1, 1)), ((1, 16, 2, 3, 4), (1, 16, 4, 6, 8)), True),
    77: ((16, 16, 3, 2.0), ((2, 16, 2, 3, 4),), False),
}


@requires_interpreter
@pytest.mark.parametrize("pid", SIXTEEN_CHANNELS, ids=["kb100-scalars", "kb26-residual", "kb77-batch-norm"])
def test_every_candidate_of_a_sixteen_channel_file_matches_the_reference(pid, tmp_path, exact):
    """Then, for 77, in evaluation mode: BatchNorm reads its running statistics and counts no batch."""
    init, shapes, phase = SIXTEEN_CHANNELS[pid]
    problem = dataclasses.replace(level2.by_id(pid), init_inputs=init, input_shapes=shapes)
    path = tmp_path / problem.file_name
    path.write_text(export_level2.render(problem))
    module = _load(path, f"kb2_16_{pid}")
    names = [c["name"] for c in module.CANDIDATES]
    assert len(names) >= 2 and all("tma" in n or "flat" in n for n in names), names
    assert any("flat" not in n for n in names) == phase, names
    for index in range(len(names)):
        reference64, candidate, inputs = _check_forward(problem, module, index)
    if pid == 77:
        assert candidate.batch_norm.num_batches_tracked.item() == 1
        reference64.eval()
        candidate.eval()
        with torch.no_grad():
            y64, y = reference64(*(x.double() for x in inputs)), candidate(*inputs)
        assert torch.allclose(y.double(), y64, atol=1e-4, rtol=1e-4)
        assert _same_state(reference64, candidate, tol=1e-5) and candidate.batch_norm.num_batches_tracked.item() == 1
