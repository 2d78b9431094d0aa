"""The KernelBench deliverables (issue 4), on the CPU.

* the committed ``kernelbench/*.py`` files are exactly what ``convt3d export-kernelbench`` makes
  from the package source now (one source of truth);
* they pass KernelBench's static rules under strict settings, and our checker really rejects what
  those rules reject (planted violations);
* they import with nothing but torch, triton and the standard library, loaded the way KernelBench
  loads a Triton file (a module object that is not in ``sys.modules``);
* ``ModelNew(*get_init_inputs())`` builds bitwise the parameters of KernelBench's ``Model`` under
  the same seed, with the same state_dict;
* through Triton's interpreter, one ModelNew forward on a tiny input matches float64 to 1e-4 and
  leaves PyTorch's flags and RNG untouched.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from convt3d.kernelbench import evaluate, export, static_check
from convt3d.kernelbench.problems import PROBLEMS, SEED, ReferenceModel, by_id

from conftest import requires_interpreter

KB_DIR = export.default_out_dir()
IDS = [p.id for p in PROBLEMS]


def _path(problem):
    path = KB_DIR / problem.file_name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run 'convt3d export-kernelbench'")
    return path


_modules: dict[int, object] = {}


def _module(problem):
    """The problem's file, imported once per session the way KernelBench imports it."""
    if problem.id not in _modules:
        _modules[problem.id] = evaluate.load_model_file(_path(problem))
    return _modules[problem.id]


# ---------------------------------------------------------------------------------------------
# Generation and static rules
# ---------------------------------------------------------------------------------------------
def test_committed_files_equal_a_fresh_export(capsys):
    rc = export.main(["--check"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("pid", IDS)
def test_file_passes_kernelbench_static_rules(pid):
    text = _path(by_id(pid)).read_text()
    violations = static_check.check(text, strict=True)
    assert not violations, static_check.format_violations(violations, text, by_id(pid).file_name)


@pytest.mark.parametrize("pid", IDS)
def test_file_imports_only_torch_triton_and_the_standard_library(pid):
    tree = ast.parse(_path(by_id(pid)).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: relative import"
            tops = [(node.module or "").split(".")[0]]
        elif isinstance(node, ast.Import):
            tops = [a.name.split(".")[0] for a in node.names]
        else:
            continue
        for top in tops:
            assert top in ("torch", "triton") or top in sys.stdlib_module_names, f"line {node.lineno}: imports {top}"
            assert top != "__future__", f"line {node.lineno}: KernelBench's loader breaks dataclasses under it"


def test_files_import_and_construct_without_convt3d(tmp_path):
    """In a fresh interpreter where importing convt3d is impossible, each file loads as KernelBench
    loads it and builds its ModelNew."""
    script = textwrap.dedent("""
        import importlib.util, json, sys

        class NoConvt3d:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "convt3d":
                    raise ImportError("convt3d must not be imported by a KernelBench file")
                return None

        sys.meta_path.insert(0, NoConvt3d())
        for path, init_inputs in json.loads(sys.argv[1]):
            spec = importlib.util.spec_from_file_location("temp_module", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            model = module.ModelNew(*init_inputs)
            assert "temp_module" not in sys.modules
            print(path.rsplit("/", 1)[-1].split("_")[0], type(model).__name__, sum(p.numel() for p in model.parameters()))
        assert not any(m.split(".")[0] == "convt3d" for m in sys.modules)
    """)
    files = [[str(_path(p)), json.loads(json.dumps(p.init_inputs))] for p in PROBLEMS]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", script, json.dumps(files)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.splitlines()) == len(PROBLEMS), out.stdout


# ---------------------------------------------------------------------------------------------
# Our checker rejects what KernelBench's rejects
# ---------------------------------------------------------------------------------------------
VALID = textwrap.dedent('''
    """A valid Triton entry: a kernel, ModelNew with a Parameter and nn.init."""
    import torch
    import triton
    import triton.language as tl


    @triton.jit
    def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


    class ModelNew(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4))
            torch.nn.init.uniform_(self.weight)  # a comment may say pass, try: or torch.nn.functional
            self.half_block = 4 // 2

        def forward(self, x):
            y = torch.empty_like(x)
            copy_kernel[(1,)](x, y, x.numel(), BLOCK=16)
            return y
''')

PLANTED = {
    "pass-in-docstring": ('    def helper(self):\n        """Nothing to pass on here."""\n        return 1\n', "code_bypass"),
    "pass-in-string": ('    NAME = "pass"\n', "code_bypass"),
    "pass-statement": ("    def helper(self):\n        pass\n", "code_bypass"),
    "try-except": ("    def helper(self):\n        try:\n            return 1\n        except Exception:\n"
                   "            return 2\n", "code_bypass"),
    "torch.nn.functional-call": ("    def act(self, x):\n        return torch.nn.functional.relu(x)\n",
                                 "torch_computation_ops"),
    "functional-import": ("    import torch.nn.functional as F\n", "torch_computation_ops"),
    "F.conv": ("    def act(self, x, w):\n        return F.conv_transpose3d(x, w)\n", "torch_computation_ops"),
    "nn.Conv3d-layer": ("    def layer(self):\n        return nn.Conv3d(1, 1, 3)\n", "pytorch_wrap"),
    "torch.nn.Linear-layer": ("    def layer(self):\n        return torch.nn.Linear(2, 2)\n", "pytorch_wrap"),
    "torch-op": ("    def act(self, x, w):\n        return torch.conv_transpose3d(x, w)\n", "torch_computation_ops"),
    "threading": ("    import threading\n", "thread_injection"),
    "timing-patch": ("    def cheat(self):\n        time.perf_counter = lambda: 0.0\n", "timing_event_patch"),
    "stream": ("    def side(self):\n        return torch.cuda.Stream()\n", "stream_injection"),
    "fp16-downgrade": ("    def low(self, x):\n        return x.half()\n", "precision_downgrade"),
}


def test_checker_accepts_the_valid_entry():
    assert static_check.check(VALID) == []


@pytest.mark.parametrize("name", list(PLANTED))
def test_checker_rejects_planted_violation(name):
    snippet, category = PLANTED[name]
    code = VALID + snippet
    found = static_check.check(code)
    assert category in {v.category for v in found}, f"{name}: not flagged ({found})"
    line = len(VALID.split("\n")) - 1  # the planted lines follow the valid entry
    assert all(v.line >= line for v in found), found


def test_checker_rejects_a_missing_triton_kernel():
    found = static_check.check(VALID.replace("@triton.jit", ""))
    assert [v.rule for v in found] == ["triton-jit"]


def test_exporter_refuses_source_that_breaks_a_rule(monkeypatch, tmp_path, capsys):
    """A 'pass' in an engine docstring: nothing is written and the message names the source line."""
    real_read = export._read

    def planted(path):
        text = real_read(path)
        return text.replace('"""Exceptions of convt3d', '"""Nothing to pass. Exceptions of convt3d', 1) \
            if path == "errors.py" else text

    monkeypatch.setattr(export, "_read", planted)
    assert export.main(["--out", str(tmp_path)]) == 1
    assert list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err
    assert "convt3d/errors.py:1" in err and "code_bypass/pass-word" in err, err


# ---------------------------------------------------------------------------------------------
# ModelNew: signature and parameters as KernelBench's Model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pid", IDS)
def test_model_new_has_the_model_signature(pid):
    problem = by_id(pid)
    params = list(inspect.signature(_module(problem).ModelNew.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == [(a.name, a.default) for a in problem.signature]


@pytest.mark.parametrize("bias", [False, True], ids=["problem-bias", "bias"])
@pytest.mark.parametrize("pid", IDS)
def test_model_new_parameters_equal_the_reference_bitwise(pid, bias):
    """Seeded like KernelBench's evaluator: same values, keys, shapes, and the same RNG draws."""
    problem = by_id(pid)
    module = _module(problem)
    with torch.no_grad():
        torch.manual_seed(SEED)
        reference = ReferenceModel(problem, *problem.init_inputs, bias=bias)
        after_reference = torch.get_rng_state()
        torch.manual_seed(SEED)
        candidate = module.ModelNew(*problem.init_inputs, bias=bias)
        after_candidate = torch.get_rng_state()
    ref_sd, new_sd = reference.state_dict(), candidate.state_dict()
    assert list(new_sd) == list(ref_sd) == (["conv_transpose3d.weight", "conv_transpose3d.bias"] if bias
                                            else ["conv_transpose3d.weight"])
    for key in ref_sd:
        assert new_sd[key].shape == ref_sd[key].shape and new_sd[key].dtype == ref_sd[key].dtype, key
        assert torch.equal(new_sd[key], ref_sd[key]), f"{key} differs"
    assert torch.equal(after_reference, after_candidate), "a different number of random draws"
    candidate.load_state_dict(ref_sd)  # and the state_dicts interchange
    layer, theirs = candidate.conv_transpose3d, reference.conv_transpose3d
    assert (layer.stride, layer.padding, layer.output_padding, layer.dilation, layer.groups) == \
        (theirs.stride, theirs.padding, theirs.output_padding, theirs.dilation, theirs.groups)


def test_problem_73_builds_groups_1_and_output_padding_0():
    """Its get_init_inputs puts groups=4 in the output_padding slot, which its Model drops."""
    layer = _module(by_id(73)).ModelNew(*by_id(73).init_inputs).conv_transpose3d
    assert (layer.groups, layer.output_padding, layer.stride, layer.padding) == (1, (0, 0, 0), (2, 2, 2), (1, 1, 1))
    assert _module(by_id(72)).ModelNew(*by_id(72).init_inputs).conv_transpose3d.groups == 4


# ---------------------------------------------------------------------------------------------
# Through the interpreter: the real kernels on a tiny input
# ---------------------------------------------------------------------------------------------
def _global_state():
    return (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic, torch.get_float32_matmul_precision(), torch.get_rng_state())


@requires_interpreter
def test_model_new_forward_matches_float64_and_keeps_global_state():
    """KernelBench's original problem (77) with its own constructor arguments, batch 1 and a
    2x3x4 input: 7 of 8 phases empty, dilation 2, tile tails."""
    problem = by_id(77)
    module = _module(problem)
    torch.manual_seed(SEED)
    model = module.ModelNew(*problem.init_inputs)
    x = torch.rand(1, problem.input_shape[1], *evaluate.SCALED_SPATIAL)
    before = _global_state()
    with torch.no_grad():
        y = model(x)
    after = _global_state()
    layer = model.conv_transpose3d
    y64 = F.conv_transpose3d(x.double(), layer.weight.double(), None, layer.stride, layer.padding,
                             layer.output_padding, layer.groups, layer.dilation)
    assert y.dtype == torch.float32 and y.shape == y64.shape
    assert torch.allclose(y64.float(), y, atol=1e-4, rtol=1e-4), (y.double() - y64).abs().max()
    assert before[:-1] == after[:-1] and torch.equal(before[-1], after[-1]), "ModelNew changed global state"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the evaluator times the full problems")
def test_evaluator_without_gpu(tmp_path, capsys):
    out = tmp_path / "kb.json"
    assert evaluate.main(["--problems", "73", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "needs a CUDA GPU" in text
    data = json.loads(out.read_text())
    (row,) = data["problems"]
    assert row["problem"] == 73 and row["loaded"] and row["parameters_identical"]
    interpreted = bool(data["method"]["interpreter"])
    assert len(row["trials"]) == int(interpreted)
    assert row["correct_fp64"] == interpreted


# ---------------------------------------------------------------------------------------------
# The CUDA entry for problem 77 (issue 6); its regeneration is covered by the --check test above
# ---------------------------------------------------------------------------------------------
def _cuda_path():
    path = KB_DIR / export.cuda_file_name(by_id(77))
    if not path.is_file():
        pytest.fail(f"{path} is missing: run 'convt3d export-kernelbench'")
    return path


def test_cuda_entry_passes_kernelbench_cuda_static_rules():
    text = _cuda_path().read_text()
    violations = static_check.check(text, strict=True, backend="cuda")
    assert not violations, static_check.format_violations(violations, text, _cuda_path().name)
    # the requirements are really checked: without the kernel the file is refused
    assert [v.rule for v in static_check.check(text.replace("__global__", "__device__"), backend="cuda")] == \
        ["cuda-global"]


def test_cuda_entry_embeds_the_package_source_and_imports_only_torch():
    from convt3d import cuda_engine

    text = _cuda_path().read_text()
    assert 'CUDA_SOURCE = r"""' + cuda_engine.cuda_source() + '"""' in text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            tops = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) \
                else [(node.module or "").split(".")[0]]
            assert all(t == "torch" or t in sys.stdlib_module_names for t in tops), f"line {node.lineno}"


def test_cuda_entry_builds_the_reference_parameters_without_compiling():
    """Imported as KernelBench imports a file; ModelNew is built on the CPU (nothing compiles
    before the first forward) with bitwise the reference's parameters."""
    problem = by_id(77)
    module = evaluate.load_model_file(_cuda_path())
    assert module.build_seconds() is None
    with torch.no_grad():
        torch.manual_seed(SEED)
        reference = ReferenceModel(problem, *problem.init_inputs)
        torch.manual_seed(SEED)
        candidate = module.ModelNew(*problem.init_inputs)
    assert evaluate.parameters_identical(reference, candidate)
    with pytest.raises(module.BackendUnavailableError, match="CPU"):
        candidate(torch.rand(1, 32, 2, 3, 4))
