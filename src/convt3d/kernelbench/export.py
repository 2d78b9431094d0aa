"""``convt3d export-kernelbench``: regenerate the self-contained KernelBench ``ModelNew`` files.

    convt3d export-kernelbench                 # write kernelbench/<problem file>.py, one per problem
    convt3d export-kernelbench --check         # exit 1 if a committed file differs from a fresh export
    convt3d export-kernelbench --out DIR

KernelBench evaluates one file per problem, so each file carries the engine itself. It is built
from the package's own source, one source of truth: the modules in ``SOURCES`` are concatenated
verbatim in dependency order and only their import lines are rewritten --

* ``from .x import name`` is dropped: ``name`` is defined earlier in the same file;
* ``from .pkg import module as alias`` becomes ``alias = types.SimpleNamespace(...)`` of that
  module's top-level names (the engine reaches its kernels as ``K.<kernel name>``);
* ``from __future__ import annotations`` is dropped, not hoisted: KernelBench imports a Triton
  file as a module that is not registered in ``sys.modules``, and ``dataclasses`` then fails on
  string annotations (it looks the class's module up there). Annotations are evaluated eagerly
  instead, which the package source supports (Python >= 3.11, names defined before use);

-- and a small ``ModelNew`` for the problem (``_model_new_source``) is appended. Every other import
must be torch, triton or the standard library. A file that breaks one of KernelBench's static
rules (``convt3d.kernelbench.static_check``) is never written; the error names the package source
line to reword.

Exit status: 0 written / up to date; 1 a file differs (``--check``) or a rule is broken.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import static_check
from .problems import PROBLEMS, Problem

__all__ = ["SOURCES", "CUDA_SOURCES", "CUDA_PROBLEMS", "ExportError", "render", "render_cuda", "render_all",
           "cuda_file_name", "default_out_dir", "main"]

# Package modules copied into every file, in dependency order (each imports only earlier ones).
SOURCES = ("params.py", "errors.py", "validate.py", "kernels/phase_gemm.py", "triton_engine.py")
# The CUDA entry (problem 77 only): the same geometry and validation, the CUDA engine's Python side,
# then the .cu text as the string the engine compiles (CUDA_SOURCE).
CUDA_SOURCES = ("params.py", "errors.py", "validate.py", "cuda_engine.py")
CUDA_PROBLEMS = (77,)
CUDA_FILE = "csrc/convt3d.cu"
_ALLOWED_THIRD_PARTY = frozenset({"torch", "triton"})


class ExportError(RuntimeError):
    """The package source cannot be exported as it is (the message says which line and why)."""


@dataclass
class _Line:
    text: str
    origin: str  # "convt3d/<module>:<line>" or "generated"


@dataclass
class _Module:
    path: str  # relative to the package, e.g. "kernels/phase_gemm.py"
    source: str
    names: set[str] = field(default_factory=set)  # top-level names it defines (imports excluded)


def _package_path(module: str) -> str:
    """'convt3d.kernels.phase_gemm' -> 'kernels/phase_gemm.py'."""
    return "/".join(module.split(".")[1:]) + ".py"


def _module_name(path: str) -> str:
    """'kernels/phase_gemm.py' -> 'convt3d.kernels.phase_gemm'."""
    return "convt3d." + path[:-3].replace("/", ".")


def _read(path: str) -> str:
    return resources.files("convt3d").joinpath(path).read_text(encoding="utf-8")


def _defined_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _check_absolute_import(node: ast.AST, where: str) -> None:
    tops = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
            else [(node.module or "").split(".")[0]])
    for top in tops:
        if top == "__future__":
            continue
        if top not in _ALLOWED_THIRD_PARTY and top not in sys.stdlib_module_names:
            raise ExportError(f"{where}: imports {top!r}; a KernelBench file may import only torch, triton "
                              "and the standard library")


def _resolve(node: ast.ImportFrom, importer: str) -> str:
    """The package path of the module a relative import names ('kernels' or 'params', ...)."""
    package = importer.split("/")[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return "/".join(base + ([node.module.replace(".", "/")] if node.module else []))


def _inline(module: _Module, done: dict[str, _Module]) -> list[_Line]:
    """The module's lines with its import lines rewritten (see the module docstring)."""
    where = f"convt3d/{module.path}"
    tree = ast.parse(module.source)
    lines = module.source.split("\n")
    replace: dict[int, tuple[int, list[str]]] = {}  # first line (0-based) -> (last line, new lines)
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        at = f"{where}:{node.lineno}"
        relative = isinstance(node, ast.ImportFrom) and node.level > 0
        absolute_package = (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "convt3d") or \
            (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "convt3d" for a in node.names))
        if absolute_package or (relative and id(node) not in top_level):
            raise ExportError(f"{at}: package imports must be top-level and relative ('from .x import y') "
                              "for the exporter to inline them")
        if not relative:
            _check_absolute_import(node, at)
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                replace[node.lineno - 1] = (node.end_lineno - 1, [])
            continue
        base = _resolve(node, module.path)
        new: list[str] = []
        for alias in node.names:
            as_module = f"{base}/{alias.name}.py" if base else f"{alias.name}.py"
            if as_module in done:
                names = sorted(n for n in done[as_module].names if not n.startswith("__"))
                body = "".join(f"    {n}={n},\n" for n in names)
                new.append(f"{alias.asname or alias.name} = types.SimpleNamespace(\n{body})")
                continue
            source_path = f"{base}.py" if f"{base}.py" in done else f"{base}/__init__.py"
            if source_path not in done or alias.name not in done[source_path].names:
                raise ExportError(f"{at}: 'from {'.' * node.level}{node.module or ''} import {alias.name}' names "
                                  f"nothing the exporter inlines earlier (SOURCES = {SOURCES}, CUDA_SOURCES = "
                                  f"{CUDA_SOURCES})")
            if alias.asname and alias.asname != alias.name:
                new.append(f"{alias.asname} = {alias.name}")
        replace[node.lineno - 1] = (node.end_lineno - 1, new)

    out: list[_Line] = [_Line(f"# {'=' * 20} {where} (verbatim; package-relative imports rewritten) {'=' * 20}",
                              "generated")]
    i = 0
    while i < len(lines):
        if i in replace:
            last, new = replace[i]
            if new:
                out.extend(_Line(t, f"{where}:{i + 1} (rewritten import)") for t in "\n".join(new).split("\n"))
            i = last + 1
            continue
        out.append(_Line(lines[i], f"{where}:{i + 1}"))
        i += 1
    while out and not out[-1].text.strip():
        out.pop()
    return out


# Engine names the ModelNew template calls, and the names it defines itself (see _model_new_source).
_TEMPLATE_NEEDS = ("triple", "check_call", "forward")
_TEMPLATE_DEFINES = ("EXACT_GRADE", "ConvTranspose3dTriton", "ModelNew")


def _engine_lines(sources: tuple[str, ...] = SOURCES, defines: tuple[str, ...] | None = None,
                  needs: tuple[str, ...] | None = None) -> list[_Line]:
    defines = _TEMPLATE_DEFINES if defines is None else defines
    needs = _TEMPLATE_NEEDS if needs is None else needs
    done: dict[str, _Module] = {}
    owner: dict[str, str] = {}
    lines: list[_Line] = []
    for path in sources:
        module = _Module(path, _read(path))
        module.names = _defined_names(ast.parse(module.source))
        for name in module.names - {"__all__"}:
            if name in owner:
                raise ExportError(f"convt3d/{path} and convt3d/{owner[name]} both define {name!r}; the exported "
                                  "file puts them in one namespace")
            owner[name] = path
        lines += _inline(module, done)
        lines += [_Line("", "generated"), _Line("", "generated")]
        done[path] = module
    taken = [f"{name} (convt3d/{owner[name]})" for name in defines if name in owner]
    if taken:
        raise ExportError(f"the ModelNew template defines {taken} too; rename one of them")
    missing = [name for name in needs if name not in owner]
    if missing:
        raise ExportError(f"the ModelNew template calls {missing}, which no module in SOURCES defines any more; "
                          "update convt3d/kernelbench/export.py (_model_new_source)")
    return lines


def _exact_grade() -> str:
    from convt3d.dispatch import EXACT_GRADE  # imports the engine (and triton): only when exporting
    return EXACT_GRADE


# The layer class both kinds of file define: PyTorch's ConvTranspose3d parameters and checks, one
# forward through the exported engine. One text, so the Triton and CUDA entries cannot drift.
_LAYER_CLASS = """class @CLS@(torch.nn.Module):
    \"\"\"The parameters of PyTorch's ConvTranspose3d layer, created and initialised the way it does
    (the same seed gives bitwise the same values, the same state_dict keys), computed by the
    @DOC@.\"\"\"

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0,
                 groups=1, bias=True, dilation=1, device=None, dtype=None):
        super().__init__()
        # The checks of PyTorch's ConvTranspose3d constructor, with its messages.
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups != 0:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups != 0:
            raise ValueError("out_channels must be divisible by groups")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = triple("kernel_size", kernel_size)
        self.stride = triple("stride", stride)
        self.padding = triple("padding", padding)
        self.output_padding = triple("output_padding", output_padding)
        self.dilation = triple("dilation", dilation)
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(
            torch.empty((in_channels, out_channels // groups, *self.kernel_size), **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        # PyTorch's ConvTranspose3d initialisation, draw for draw (the RNG sequence must match).
        with torch.no_grad():
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            if self.bias is not None:
                fan_in, _ = torch.nn.init._calculate_fan_in_and_fan_out(self.weight)
                bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
                torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        params, unbatched = check_call(x, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                                       self.groups, self.dilation)
        x5 = x.unsqueeze(0) if unbatched else x
        # forward() is @WHAT@, not this method.
        y = forward(x5, self.weight, self.bias, params@EXTRA@)
        return y.squeeze(0) if unbatched else y
"""


def _layer_class(cls: str, doc: str, what: str, extra_args: str = "") -> str:
    """The source of the layer class ``cls``: ``doc`` ends its docstring ("Triton engine above at
    exact grade"), ``what`` names the engine entry forward() is, ``extra_args`` follow ``params``."""
    return (_LAYER_CLASS.replace("@CLS@", cls).replace("@DOC@", doc).replace("@WHAT@", what)
            .replace("@EXTRA@", extra_args))


def _model_new_source(problem: Problem, grade: str) -> str:
    """The per-problem tail: the layer, then ModelNew with the problem's own constructor."""
    signature = ", ".join(["self"] + [a.source() for a in problem.signature])
    forwarded = "".join(f", {name}={name}" for name in problem.forwarded)
    ignored = "".join(
        f"        # KernelBench's Model accepts {name} but never passes it on (so {name}={problem.bind()[name]!r}\n"
        f"        # from get_init_inputs() is dropped there); this one does the same.\n"
        for name in problem.ignored)
    return f'''# {"=" * 20} ModelNew for KernelBench level 1 problem {problem.id} (generated) {"=" * 20}
import math

import torch

# convt3d.dispatch.EXACT_GRADE at export time: what precision=None means when TF32 is off.
# KernelBench's fp32 tolerance (1e-4) needs it; nothing here reads or changes PyTorch's flags.
EXACT_GRADE = {grade!r}


{_layer_class("ConvTranspose3dTriton", "Triton engine above at exact grade",
                  "the engine's launcher (triton_engine.forward above)", ", EXACT_GRADE")}

class ModelNew(torch.nn.Module):
    """KernelBench level 1 problem {problem.id}: the constructor of its Model, the layer it builds."""

    def __init__({signature}):
        super().__init__()
{ignored}        self.conv_transpose3d = ConvTranspose3dTriton(in_channels, out_channels, kernel_size{forwarded})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_transpose3d(x)


__all__ = ["ModelNew", "ConvTranspose3dTriton"]
'''


def _header(problem: Problem, grade: str) -> list[_Line]:
    text = f'''"""KernelBench level 1, problem {problem.id}: {problem.file_name}

``ModelNew`` computes the problem's 3-D transposed convolution with the Triton engine of convt3d,
at exact grade ({grade}). Generated by ``convt3d export-kernelbench`` from the package source,
which follows verbatim apart from its package-relative import lines; edit the package and
regenerate rather than editing this file.
"""
import types

'''
    return [_Line(t, "generated") for t in text.split("\n")]


def _render_lines(problem: Problem, engine: list[_Line], grade: str) -> list[_Line]:
    tail = [_Line(t, "generated") for t in _model_new_source(problem, grade).split("\n")]
    return _header(problem, grade) + engine + tail


def _checked(problem: Problem, lines: list[_Line], backend: str = "triton", file_name: str | None = None) -> str:
    text = "\n".join(line.text for line in lines)
    file_name = file_name or problem.file_name
    violations = static_check.check(text, strict=True, backend=backend)
    if violations:
        report = []
        for v in violations:
            if v.line:
                origin = lines[v.line - 1]
                report.append(f"  {origin.origin}: {v.category}/{v.rule} matches {v.text!r} in\n"
                              f"      {origin.text.strip()}")
            else:
                report.append(f"  {file_name}: {v.category}/{v.rule}: no match for {v.text!r}")
        raise ExportError(
            f"{file_name} would break KernelBench's static rules (its checker cuts '#' comments and then "
            "matches the text anywhere, docstrings and strings included). The exporter copies the package source "
            "verbatim, so reword these source lines:\n" + "\n".join(report))
    return text


def render(problem: Problem) -> str:
    """The file for one problem (raises ExportError if it would break a static rule)."""
    return _checked(problem, _render_lines(problem, _engine_lines(), _exact_grade()))


def render_all(problems=PROBLEMS) -> dict[str, str]:
    """file name -> content, for every problem and its CUDA entry if any (engine sources read once)."""
    engine, grade = _engine_lines(), _exact_grade()
    files = {p.file_name: _checked(p, _render_lines(p, engine, grade)) for p in problems}
    cuda = [p for p in problems if p.id in CUDA_PROBLEMS]
    if cuda:
        engine = _cuda_engine_lines()
        files.update((cuda_file_name(p), _checked(p, _render_cuda_lines(p, engine), "cuda", cuda_file_name(p)))
                     for p in cuda)
    return files


# ---- the CUDA entry ---------------------------------------------------------------------------
# The CUDA template calls the same names as the Triton one (_TEMPLATE_NEEDS; one _LAYER_CLASS).
_CUDA_TEMPLATE_DEFINES = ("ConvTranspose3dCuda", "ModelNew")


def cuda_file_name(problem: Problem) -> str:
    """'77_..._strided__.py' -> '77_..._strided___cuda.py' (beside the Triton file)."""
    return problem.name + "_cuda.py"


def _cuda_engine_lines() -> list[_Line]:
    lines = _engine_lines(CUDA_SOURCES, _CUDA_TEMPLATE_DEFINES, _TEMPLATE_NEEDS)
    text = _read(CUDA_FILE)
    if '"""' in text or text.rstrip("\n").endswith("\\"):
        raise ExportError(f"convt3d/{CUDA_FILE} cannot be embedded as a raw triple-quoted string")
    lines.append(_Line(f"# {'=' * 20} convt3d/{CUDA_FILE} (verbatim; compiled by load_inline) {'=' * 20}",
                       "generated"))
    body = ('CUDA_SOURCE = r"""' + text + '"""').split("\n")
    lines += [_Line(t, f"convt3d/{CUDA_FILE}:{i}") for i, t in enumerate(body, start=1)]
    return lines + [_Line("", "generated"), _Line("", "generated")]


_CUDA_HEADER = '''"""KernelBench level 1, problem {id}: {file} -- CUDA entry

``ModelNew`` computes the problem's 3-D transposed convolution with the CUDA C++ engine of
convt3d (exact fp32 FFMA). Its source is the string CUDA_SOURCE below, compiled with
torch.utils.cpp_extension.load_inline on the first forward. Generated by ``convt3d
export-kernelbench`` from the package source (Python modules verbatim apart from their
package-relative import lines, then convt3d/{cu}); edit the package and regenerate.
"""
import types

'''

_CUDA_LAYER = '''# {rule} ModelNew for KernelBench level 1 problem {id}, CUDA entry (generated) {rule}
import math

import torch


{layer_class}

class ModelNew(torch.nn.Module):
    """KernelBench level 1 problem {id}: the constructor of its Model, the layer it builds."""

    def __init__({signature}):
        super().__init__()
        self.conv_transpose3d = ConvTranspose3dCuda(in_channels, out_channels, kernel_size{forwarded})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_transpose3d(x)


__all__ = ["ModelNew", "ConvTranspose3dCuda"]
'''


def _render_cuda_lines(problem: Problem, engine: list[_Line]) -> list[_Line]:
    if problem.ignored:
        raise ExportError(f"problem {problem.id}: the CUDA template does not handle ignored arguments")
    header = _CUDA_HEADER.format(id=problem.id, file=problem.file_name, cu=CUDA_FILE)
    layer = _layer_class("ConvTranspose3dCuda",
                         "CUDA engine above (exact fp32; built by load_inline on the first forward)",
                         "the CUDA engine's entry (cuda_engine.forward above)")
    tail = _CUDA_LAYER.format(rule="=" * 20, id=problem.id, layer_class=layer,
                              signature=", ".join(["self"] + [a.source() for a in problem.signature]),
                              forwarded="".join(f", {name}={name}" for name in problem.forwarded))
    return [_Line(t, "generated") for t in header.split("\n")] + engine + \
        [_Line(t, "generated") for t in tail.split("\n")]


def render_cuda(problem: Problem) -> str:
    """The CUDA entry for one problem (raises ExportError if it would break a static rule)."""
    return _checked(problem, _render_cuda_lines(problem, _cuda_engine_lines()), "cuda", cuda_file_name(problem))


def default_out_dir() -> Path:
    """The checkout's ``kernelbench/`` (src layout: two levels above the package), else ./kernelbench."""
    package = Path(__file__).resolve().parents[1]
    root = package.parents[1]
    if package.parent.name == "src" and (root / "pyproject.toml").is_file():
        return root / "kernelbench"
    return Path.cwd() / "kernelbench"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convt3d export-kernelbench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory of the files (default: the checkout's kernelbench/)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from a fresh export")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out if args.out is not None else default_out_dir()
    try:
        files = render_all()
    except ExportError as e:
        print(f"convt3d export-kernelbench: {e}", file=sys.stderr)
        return 1
    if args.check:
        stale = []
        for name, text in files.items():
            path = out / name
            current = path.read_text(encoding="utf-8") if path.is_file() else None
            if current != text:
                stale.append(name)
                diff = difflib.unified_diff((current or "").splitlines(), text.splitlines(), f"{path} (committed)",
                                            f"{name} (fresh export)", lineterm="", n=1)
                print("\n".join(list(diff)[:40]) if current is not None else f"{path}: missing", file=sys.stderr)
        if stale:
            print(f"convt3d export-kernelbench --check: {len(stale)} of {len(files)} files in {out} differ from a fresh "
                  "export; run 'convt3d export-kernelbench' and commit the result", file=sys.stderr)
            return 1
        print(f"{len(files)} KernelBench files in {out} are up to date")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} KernelBench files to {out}")
    return 0
