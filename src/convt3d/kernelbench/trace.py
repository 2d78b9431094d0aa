"""The engine's launches for KernelBench's call as a file's straight-line launcher source: its own steps
run on meta tensors with ``Site.launch`` recording, per candidate, precision and bias, and the records
become sites with constant grids and arguments, buffers and descriptors at their shapes, and tables."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from unittest import mock

import torch
from torch import nn

from ..core.validate import check_call
from ..engines.triton import engine as TE
from ..engines.triton import sites as TS
from .problems import Problem
from .shake import ExportError, PythonShaker


def meta_call(problem: Problem, has_bias: bool = False):
    """(params, x, weight, bias): KernelBench's call of the problem's layer as meta tensors."""
    layer = nn.ConvTranspose3d(**problem.layer_args(bias=has_bias), device="meta")
    x = torch.empty(problem.input_shape, device="meta")
    params, _ = check_call(x, layer.weight, layer.bias, layer.stride, layer.padding, layer.output_padding,
                           layer.groups, layer.dilation)
    return params, x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach()


@dataclasses.dataclass
class _Launch:
    name: str
    grid: tuple
    ints: tuple
    consts: dict
    args: list  # per argument, a tuple of its kind and what rebuilds it (``_arg_source`` reads each kind)


def _trace(problem: Problem, cfg, precision: str, has_bias: bool, tables: list, epi_code: int = 0) -> list[_Launch]:
    """The engine's launches under ``cfg`` on meta tensors; ``tables`` collects the (shape, values) they read.
    ``epi_code``: a fused epilogue program's code, its operands named ``epi_s``, ``epi_c``, ``epi_r``."""
    params, x, w, b = meta_call(problem, has_bias)
    recorded: list = []
    ops = tuple(torch.empty(1, device="meta") for _ in range(3)) if epi_code else ()
    with contextlib.ExitStack() as restored:
        # the engine's caches come back as they were: the trace's sites, tables and plan are of meta tensors
        for cache in (getattr(TS, "_sites"), getattr(TS, "_tables"), getattr(TE, "_plans")):
            restored.enter_context(mock.patch.dict(cache))
        restored.enter_context(mock.patch.object(
            TS.Site, "launch", lambda site, device, *tensors: recorded.append((site, tensors))))
        restored.enter_context(mock.patch.multiple(  # the Hopper GPU the candidates were tuned on
            TE, _tma_capable=lambda device: True, gluon_capable=lambda device: True,
            **({"_epilogue_operands": lambda epi, y: ops} if epi_code else {})))
        try:
            pl = TE.plan(params, x, w, precision)
            y = torch.empty(params.out_shape, device="meta", memory_format=pl.out_format)
            TE._Steps(params, pl, cfg, has_bias, torch.device("cpu"), epi_code).call(x, w, b, y, epi_code or None)
        except Exception as e:  # noqa: BLE001 - the engine changed under the exporter: say where
            raise ExportError(f"problem {problem.id}: tracing the engine's launches of {cfg.short()!r} failed: "
                              f"{type(e).__name__}: {e}") from e

    names = {id(t): n for t, n in zip((x, w, y, b, *ops), ("x", "weight", "y", "bias", "epi_s", "epi_c", "epi_r"))
             if t is not None}
    new: dict[int, str] = {}

    def tensor(t) -> tuple:
        if id(t) in names:
            return ("tensor", names[id(t)])
        if t.device.type == "cpu":  # a device table the engine built from the geometry
            entry = (tuple(t.shape), tuple(int(v) for v in t.flatten().tolist()))
            if entry not in tables:
                tables.append(entry)
            return ("table", tables.index(entry))
        if t._base is not None and id(t._base) in new:
            if not t.is_contiguous():
                order = next((p for p in itertools.permutations(range(t.dim())) if t._base.dim() == t.dim() and
                              t._base.permute(p).shape == t.shape and t._base.permute(p).stride() == t.stride()), None)
                if order is None:
                    raise ExportError(f"problem {problem.id}: a launch of {cfg.short()!r} reads a strided view")
                return ("permute", new[id(t._base)], order)
            return ("view", new[id(t._base)], tuple(t.shape))
        if id(t) not in new:
            if not t.is_contiguous():
                raise ExportError(f"problem {problem.id}: a buffer of {cfg.short()!r} is not contiguous")
            new[id(t)] = f"t{len(new)}"
            return ("new", new[id(t)], tuple(t.shape), t.dtype)
        return ("tensor", new[id(t)])

    out = []
    for site, args in recorded:
        if site.module is not None:
            raise ExportError(f"problem {problem.id}: {site.name} lives outside the forward's kernels")
        described = []
        for a in args:
            if isinstance(a, torch.Tensor):
                described.append(tensor(a))
            elif dataclasses.is_dataclass(a) and hasattr(a, "base"):
                fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name != "base"}
                made = TS.gluon_descriptor(a.base, tuple(a.block_shape)) if type(a) is TS.GluonDescriptor else None
                if made is not None and fields == {k: getattr(made, k) for k in fields}:
                    # the engine's own helper, whose shared-memory layout follows the Triton installed
                    described.append(("gluon", tensor(a.base), tuple(a.block_shape)))
                elif not any(dataclasses.is_dataclass(v) for v in fields.values()):
                    described.append(("descriptor", type(a), tensor(a.base), fields))
                else:
                    raise ExportError(f"problem {problem.id}: {site.name} takes a {type(a).__name__} the exporter "
                                      "cannot rebuild from plain fields")
            else:
                raise ExportError(f"problem {problem.id}: {site.name} takes a {type(a).__name__}, which the "
                                  "exporter cannot rebuild")
        out.append(_Launch(site.name, tuple(site.grid), tuple(site.ints), dict(site.consts), described))
    return out


# Expressions a constexpr may follow, as the launcher's arguments name them, with their values.
_FOLLOWS = {"has_bias": lambda precision, has_bias: has_bias, "precision": lambda precision, has_bias: precision,
            'precision == "tf32"': lambda precision, has_bias: precision == "tf32"}


def _merge(problem: Problem, cfg, traces: dict[tuple[str, bool], list[_Launch]]) -> list[_Launch]:
    """One launch list for a candidate's (precision, bias) traces, a varying constexpr as what it follows."""
    first = next(iter(traces.values()))
    where = f"problem {problem.id}, candidate {cfg.short()!r}"
    for key, launches in traces.items():
        if [(L.name, L.grid, L.ints) for L in launches] != [(L.name, L.grid, L.ints) for L in first]:
            raise ExportError(f"{where}: the launches differ between precisions or bias ({key}); the exporter "
                              "expects one sequence")
    merged = []
    for i, launch in enumerate(first):
        consts = {}
        for key in launch.consts:
            values = {k: t[i].consts.get(key) for k, t in traces.items()}
            if len(set(map(repr, values.values()))) == 1:
                consts[key] = repr(launch.consts[key])
                continue
            follows = [e for e, value in _FOLLOWS.items() if all(value(p, hb) == v for (p, hb), v in values.items())]
            if not follows:
                raise ExportError(f"{where}: {launch.name}'s constexpr {key} varies as {values}, which no argument "
                                  "of the launcher gives")
            consts[key] = follows[0]
        args = []
        for j, arg in enumerate(launch.args):
            seen = {k: t[i].args[j] for k, t in traces.items()}
            if len(set(map(repr, seen.values()))) == 1:
                args.append(arg)
                continue
            with_bias = {repr(v) for (p, hb), v in seen.items() if hb}
            without = {v for (p, hb), v in seen.items() if not hb}
            if with_bias != {repr(("tensor", "bias"))} or len({repr(v) for v in without}) != 1:
                raise ExportError(f"{where}: {launch.name}'s argument {j} varies as {seen}")
            args.append(("bias-or", next(iter(without))))
        merged.append(_Launch(launch.name, launch.grid, launch.ints, consts, args))
    return merged


# ---- the generated launcher -----------------------------------------------------------------------
def _wrap_call(head: str, items: list[str], indent: str, tail: str = ")") -> str:
    """``indent + head + items + tail``, the items wrapped at 112 columns under the first one."""
    text = indent + head + ", ".join(items) + tail
    if len(text) <= 112:
        return text
    lines, line = [], indent + head
    pad = " " * len(line)
    for k, item in enumerate(items):
        piece = item + (", " if k + 1 < len(items) else tail)
        if len(line) + len(piece.rstrip()) > 112 and line != indent + head:
            lines.append(line.rstrip())
            line = pad
        line += piece
    lines.append(line)
    return "\n".join(lines)


def _tuple_items(values) -> list[str]:
    """The items of a tuple literal (one item keeps its trailing comma)."""
    items = [str(v) for v in values]
    return [items[0] + ","] if len(items) == 1 else items


def _site_source(L: _Launch) -> str:
    """``Site(name, grid, ints, consts)`` of one launch, each part on its own lines if long."""
    one = f"        Site({L.name!r}, {L.grid!r}, {L.ints!r}, dict({', '.join(f'{k}={v}' for k, v in L.consts.items())})),"
    if len(one) <= 112:
        return one
    pad = " " * 13
    return "\n".join([f"        Site({L.name!r}, {L.grid!r},",
                      _wrap_call("(", _tuple_items(L.ints), pad, "),"),
                      _wrap_call("dict(", [f"{k}={v}" for k, v in L.consts.items()], pad, ")),")])


def _bound_name(shaker: PythonShaker, cls) -> str:
    """The name an import of the package source binds ``cls`` to, the shaker keeping that import."""
    for path, module in shaker.modules.items():
        for name, binding in module.bindings.items():
            if binding[0] == "ext":
                namespace: dict = {}
                exec(binding[1], namespace)  # noqa: S102 - the package's own import statement
                if namespace[name] is cls:
                    shaker.reach([(path, name)])
                    return name
    raise ExportError(f"no module the file draws on imports {cls.__module__}.{cls.__qualname__}")


def launcher_source(problem: Problem, configs, shaker: PythonShaker, epi_code: int = 0) -> tuple[str, set[str]]:
    """The generated launches (constants, tables, each candidate's sites and launcher) and the kernels they name;
    with ``epi_code``, a fused epilogue's, each launcher taking its operands ``epi_s, epi_c, epi_r`` last."""
    params, _, weight, _ = meta_call(problem)
    geometry = {k: getattr(params, k) for k in ("stride", "padding", "output_padding", "dilation", "groups")}
    tables, kernels, parts, entries = [], set(), [], []
    for index, (cfg, runs) in enumerate(configs):
        traces = {(p, hb): _trace(problem, cfg, p, hb, tables, epi_code) for p in runs for hb in (False, True)}
        launches = _merge(problem, cfg, traces)
        sites, body = [], []
        for k, L in enumerate(launches):
            kernels.add(L.name)
            sites.append(_site_source(L))
            args = [_arg_source(a, body, shaker) for a in L.args]
            body.append(_wrap_call(f"s[{k}].launch(", ["x.device"] + args, " " * 4))
        gpu = "Gluon, sm_90" if cfg.gluon else "TMA, sm_90+" if (cfg.flat or cfg.tma) else "sm_80+"
        operands = ", epi_s, epi_c, epi_r" if epi_code else ""
        parts.append(f'''def _launch_{index}(x, weight, bias, y, precision{operands}):
    """{cfg.short()!r} ({gpu}): its launches onto ``y``."""
    has_bias = bias is not None
    s = _sites(({index}, precision, has_bias), lambda: (
{chr(10).join(sites)}
    ))
{chr(10).join(body)}
''')
        entries.append(f"    dict(name={cfg.short()!r}, precisions={runs!r}, gluon={cfg.gluon!r}, "
                       f"tma={bool(cfg.flat or cfg.tma)!r}, launch=_launch_{index}),")
    table_text = ",\n".join(_wrap_call(f"({shape!r}, (", _tuple_items(values), " " * 4, "))")
                            for shape, values in tables)
    head = f'''# {"=" * 20} the launches of problem {problem.id}'s candidates (generated) {"=" * 20}
# Traced from the engine's own steps for KernelBench's call (convt3d export-kernelbench), so they
# hold only for that call: float32 input {problem.input_shape}, this layer, contiguous tensors.
PROBLEM = {problem.id}
INPUT_SHAPE = {tuple(problem.input_shape)!r}
WEIGHT_SHAPE = {tuple(weight.shape)!r}
OUTPUT_SHAPE = {tuple(params.out_shape)!r}
LAYER = {geometry!r}
# The device tables the launches read (shape, values): the engine's phase table (a row per phase:
# residues, tap counts, first taps and offsets, compact sizes, companion mask) and its empty planes
# or rows, for this geometry.
TABLES = (
{table_text},
)
_tables = {{}}


def _table(k, device):
    """TABLES[k] as an int32 tensor on ``device``, made once per device."""
    t = _tables.get((k, str(device)))
    if t is None:
        shape, values = TABLES[k]
        t = _tables[(k, str(device))] = torch.tensor(values, dtype=torch.int32).reshape(shape).to(device)
    return t


'''
    return head + "\n\n".join(parts) + f'''

# The candidates, fastest first where measured; ``precisions``: those each runs at (Gluon's wgmma
# reads fp32 as TF32 only); ``gluon``, ``tma``: the GPU it needs.
CANDIDATES = (
{chr(10).join(entries)}
)
''', kernels


def _arg_source(a, body: list[str], shaker: PythonShaker) -> str:
    """The expression of one launch argument (a buffer's allocation goes to ``body`` first)."""
    kind = a[0]
    if kind == "tensor":
        return a[1]
    if kind == "table":
        return f"_table({a[1]}, x.device)"
    if kind == "new":
        body.append(f"    {a[1]} = torch.empty({a[2]!r}, dtype={a[3]!r}, device=x.device)")
        return a[1]
    if kind == "view":
        return f"{a[1]}.view({a[2]!r})"
    if kind == "permute":
        return f"{a[1]}.permute{a[2]!r}"
    if kind == "bias-or":
        return f"{_arg_source(a[1], body, shaker)} if bias is None else bias"
    if kind == "gluon":
        shaker.reach([("engines/triton/sites.py", "gluon_descriptor")])
        return f"gluon_descriptor({_arg_source(a[1], body, shaker)}, {a[2]!r})"
    if kind == "descriptor":
        cls, base, fields = a[1], a[2], a[3]
        items = [_arg_source(base, body, shaker)]
        for f in dataclasses.fields(cls):
            if f.name in fields and not (f.default is not dataclasses.MISSING and fields[f.name] == f.default):
                items.append(f"{f.name}={fields[f.name]!r}" if f.default is not dataclasses.MISSING
                             else repr(fields[f.name]))
        return f"{_bound_name(shaker, cls)}({', '.join(items)})"
    raise ExportError(f"unknown launch argument {a!r}")
