"""``convt3d export-kernelbench --level 2``: KernelBench level 2's ConvTranspose3d problems as ``ModelNew`` files.

``level2.ModelNew`` runs on meta tensors once per mode (training, evaluation): its convolution with the fused
epilogue becomes level 1's traced launcher and chooser over the predictor's epilogue tiles, each finishing
kernel a straight-line launch; ``ModelNew`` creates the reference's parameters (same order, same draws)."""
from __future__ import annotations

import contextlib
import functools
import types
from unittest import mock

import torch
import triton
from torch import nn

from ..core.call import EXACT_GRADE
from ..core import validate as _validate
from ..core.epilogue import CHANNEL, SCALAR, TENSOR, as_epilogue
from ..engines.triton import engine as TE
from ..engines.triton import finish, predict
from ..engines.triton.configs import candidate_configs
from ..engines.triton.kernels import finish as FK
from ..version import __version__
from . import export, level2
from .shake import ExportError
from .trace import _wrap_call, meta_call

ROOTS = export.ROOTS + ("engines/triton/kernels/finish.py",)  # the engine, and the finishing kernels
TABLE_ARCH = "sm90"  # the predictor's table that ranks the candidates: the GPUs KernelBench times on
# The stages a file carries (a plain function computes with PyTorch).
SUPPORTED_STAGES = (level2.Conv, level2.DepthMeanConv, level2.PooledConv, level2.DirectConv, level2.NormPooledConv,
                    level2.Pool, level2.Reduce, level2.SubtractMean, level2.Norm)
_programs_of = finish._programs_of  # the original: a trace patches finish's with _Tracer._programs
_keyed: list[torch.Tensor] = []  # every tensor a trace has keyed, alive until it ends: no id is reused


def _key(t: torch.Tensor) -> tuple:
    """A tensor as a kernel sees it: its storage, offset and shape (two views of one buffer differ)."""
    base = t if t._base is None else t._base
    _keyed.append(base)
    return id(base), t.storage_offset(), tuple(t.shape)


def exported(problem: level2.Problem) -> bool:
    return all(type(s) in SUPPORTED_STAGES for s in problem.pipeline)


class _Grid:
    """``kernel[grid](*args, **consts)`` recorded, not launched."""

    def __init__(self, record):
        self.record = record

    def __getitem__(self, grid):
        return lambda *args, **consts: self.record(grid, args, consts)


class _Tracer:
    """A problem's in-library forward on meta tensors, its parameters on the CPU: per stage, the lines of
    the file's forward (the convolution, each program's operands, each finishing launch)."""

    def __init__(self, problem: level2.Problem, training: bool):
        if not exported(problem):
            raise ExportError(f"problem {problem.id}: a stage computes with PyTorch; the exporter does not carry "
                              "it yet")
        self.problem, self.conv, self.kernels, self.stages = problem, None, set(), []
        with torch.random.fork_rng():
            self.model = level2.ModelNew(problem).train(training)
        self.inputs = {n: torch.empty(s, device="meta") for n, s in zip(problem.inputs, problem.input_shapes)}
        self.names = {_key(t): f"self.{n}" for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]}
        self.names.update((_key(t), n) for n, t in self.inputs.items())
        y = self.inputs[problem.inputs[0]]
        with contextlib.ExitStack() as patched:
            patched.callback(_keyed.clear)
            # PooledConv's weight: zero-padded by a copy, average-pooled by the finishing kernel
            patched.enter_context(mock.patch.multiple(level2, _convt=self._conv, F=types.SimpleNamespace(
                pad=self._pad, avg_pool3d=lambda t, size: finish.pool(t, "avg", size))))
            # finish's check_call sees a meta input and the model's parameters on the CPU as if on one device
            patched.enter_context(mock.patch.multiple(finish, _programs_of=self._programs, FK=self,
                                                      _ones=lambda n, device: self._new(n, "ones"),
                                                      check_call=lambda x, w, b, *a: _validate.check_call(
                                                          x, w.to("meta"), None if b is None else b.to("meta"), *a)))
            for k, self.stage in enumerate(problem.pipeline):
                self.events = []
                y = self.stage(self.model, y, self.inputs)
                self.stages.append(self._render(k, y))

    # ---- what the stages call ------------------------------------------------------------------
    def _conv(self, x, weight, bias, stride, padding, output_padding, groups, dilation, program):
        layer = dict(in_channels=weight.shape[0], out_channels=weight.shape[1] * groups,
                     kernel_size=tuple(weight.shape[2:]), stride=stride, padding=padding,
                     output_padding=output_padding, groups=groups, dilation=dilation)
        call = types.SimpleNamespace(id=self.problem.id, input_shape=tuple(x.shape),
                                     layer_args=lambda bias=True: dict(layer, bias=bias))
        params, xm, wm, _ = meta_call(call)
        epi = as_epilogue(program, params.out_channels, tuple(params.out_shape))
        with mock.patch.dict(getattr(TE, "_plans")), mock.patch.object(TE, "_tma_capable", lambda device: True), \
                mock.patch.object(TE, "gluon_capable", lambda device: True):  # the engine's plan on a Hopper GPU
            why = TE.epilogue_reason(params, xm, wm, "tf32", epi) if epi else None
        if why is not None or self.conv is not None:
            raise ExportError(f"problem {self.problem.id}: {why or 'a second transposed convolution'}")
        self.conv = (call, epi)
        return self._new(params.out_shape, "conv", x, weight, bias, self.stage.steps, epi)

    def _pad(self, w, pads):
        return self._new([*w.shape[:2], *(n + pads[4 - 2 * i] + pads[5 - 2 * i] for i, n in enumerate(w.shape[2:]))],
                         "pad", w, pads)

    def _new(self, shape, *event) -> torch.Tensor:
        """A meta tensor of ``shape``, recorded as the last item of ``event`` (finish._ones: a vector of ones)."""
        out = torch.empty(shape, device="meta")
        self.events.append((*event, out))
        return out

    def _programs(self, y, programs, name):
        """Each program's events: the stage's of its role (``pre``, ``mid``, ``post``), read from its names,
        or finish.NEGATE, from its numbers."""
        args, codes = _programs_of(y, programs, name)
        for k, (p, channels, shape, role) in enumerate(programs):
            raw = p if p is finish.NEGATE else getattr(self.stage, role, ())
            self.events.append(("program", y, raw, as_epilogue(p, channels, tuple(shape)), channels,
                                args[2 * k:2 * k + 2]))
        return args, codes

    def __getattr__(self, kernel: str):  # finish.FK.<kernel>[grid](...)
        if not kernel.endswith("_kernel"):
            raise AttributeError(kernel)
        self.kernels.add(kernel)
        return _Grid(lambda grid, args, consts: self.events.append(("launch", kernel, grid, args, consts)))

    # ---- the file's lines ---------------------------------------------------------------------
    def _operand(self, raw) -> str:
        """A program operand as the file reads it: a number, a forward input, a constant of a module
        without state (as a literal), else the model's attribute."""
        if not isinstance(raw, str):
            return repr(raw)
        ref, neg = raw.lstrip("-"), "-" if raw.startswith("-") else ""
        head = None if ref in self.inputs else getattr(self.model, ref.split(".")[0])
        if isinstance(head, nn.Module) and not head.state_dict():
            value = functools.reduce(getattr, ref.split(".")[1:], head)
            return repr(-value if neg else value)
        return neg + (ref if head is None else f"self.{ref}")

    def _depth_sums(self, x, lines: list[str]) -> str:
        """DepthMeanConv's input: per depth tap, the sum of the input depths it reaches (its ranges) by
        axis_kernel over a depth slice of ``x``, into a stack in reverse the layer reads as (N, C, K, H, W)."""
        (n, ch, d, h, w), (_, reach) = x.shape, level2.depth_reach(self.model.conv_transpose, x.shape[2])
        k = len(reach)
        if h * w == 1:
            raise ExportError(f"problem {self.problem.id}: depth sums of a 1x1 plane are not exported")
        lines.append(f"sums = torch.empty({(k, n, ch, h, w)!r}, dtype=torch.float32, device=x.device)")
        for j, (lo, hi) in enumerate(reach):
            block_r = min(triton.next_power_of_2(max(hi - lo, 1)), 128)
            block_i = min(triton.next_power_of_2(h * w), finish.FINISH_TILE // block_r)
            ints = (hi - lo, h * w, triton.cdiv(h * w, block_i), d * h * w, h * w, 1, d * h * w, ch, ch, 1e-05)
            lines.append(_wrap_call(f"axis_kernel[({n * ch * ints[2]},)](", [
                f"x[:, :, {lo}:]", f"sums[{k - 1 - j}]", *["x"] * 6, *map(str, ints), "MODE=0", "PRE=0", "POST=0",
                "HAS_W=False", "HAS_B=False", f"BLOCK_R={block_r}", f"BLOCK_I={block_i}"], ""))
        self.kernels.add("axis_kernel")
        return "sums.permute(1, 2, 0, 3, 4)"

    def _render(self, k: int, out) -> list[str]:
        names, lines, temps, launches = dict(self.names), [], iter(range(1 << 30)), 0
        module = getattr(self.stage, "norm", None) or getattr(self.stage, "name", None)

        def expr(t) -> str:
            """A tensor's name, a new buffer or a view of a named one getting one."""
            if _key(t) not in names:
                name = f"y{k}" if _key(t) == _key(out) else f"t{next(temps)}"
                if t._base is not None and _key(t._base) in names:
                    if t.storage_offset() or not t.is_contiguous():
                        raise ExportError(f"problem {self.problem.id}: a launch reads a strided view")
                    lines.append(f"{name} = {names[_key(t._base)]}.view({tuple(t.shape)!r})")
                else:
                    lines.append(f"{name} = torch.empty({tuple(t.shape)!r}, dtype={t.dtype}, device=x.device)")
                names[_key(t)] = name
            return names[_key(t)]

        def program(raw, epi, channels, dummy) -> tuple[str, str, str]:
            """(scalars, table, residual) of a program; the kernels read none of a program without operands."""
            items, residual = [], dummy
            for step, s in zip(raw, epi.steps):
                operand = self._operand(step[1] if isinstance(step, tuple) and len(step) > 1 else s.operand)
                residual = operand if s.form == TENSOR else residual
                items.append(f'("{"s" if s.form == SCALAR else "c"}", {operand})' if s.form in (SCALAR, CHANNEL)
                             else "None")
            while items and items[-1] == "None":
                items.pop()
            if not items:
                return dummy, dummy, residual
            j = next(temps)
            lines.append(_wrap_call(f"s{j}, c{j} = _program(x.device, {channels}, ", items, ""))
            return f"s{j}", f"c{j}", residual if residual != dummy else f"s{j}"

        for event in self.events:
            if event[0] == "conv":
                _, x, weight, bias, raw, epi, y = event
                if isinstance(self.stage, level2.DepthMeanConv):  # its input, and the steps it puts first
                    names[_key(x)] = self._depth_sums(self.inputs[self.problem.inputs[0]], lines)
                    has_bias = self.model.conv_transpose.bias is not None
                    raw = (("div", epi.steps[0].operand),) + (("add", "conv_transpose.bias"),) * has_bias + raw
                ops = program(raw, epi, y.shape[1], expr(x)) if epi else ()
                names[_key(y)] = f"y{k}"
                args = [expr(x), expr(weight), "None" if bias is None else names[_key(bias)], "precision", *ops]
                lines.append(_wrap_call(f"y{k} = forward(", args, ""))
            elif event[0] == "pad":  # a copy of the weight's overlap with the padded box, zeros elsewhere
                _, w, pads, padded = event
                box = [(max(0, -pads[4 - 2 * i]), n - max(0, -pads[5 - 2 * i]), max(0, pads[4 - 2 * i]))
                       for i, n in enumerate(w.shape[2:])]
                names[_key(padded)] = name = f"t{next(temps)}"
                lines += [f"{name} = torch.zeros({tuple(padded.shape)!r}, dtype=torch.float32, device=x.device)",
                          f"{name}[:, :, {', '.join(f'{d}:{d + b - a}' for a, b, d in box)}] = {names[_key(w)]}"
                          f"[:, :, {', '.join(f'{a}:{b}' for a, b, _ in box)}]"]
            elif event[0] == "ones":
                names[_key(event[1])] = name = f"t{next(temps)}"
                lines.append(f"{name} = torch.ones({tuple(event[1].shape)!r}, dtype=torch.float32, device=x.device)")
            elif event[0] == "program":
                _, y, raw, epi, channels, tensors = event
                names.update(zip(map(_key, tensors), program(raw, epi, channels, expr(y))))
            else:
                _, kernel, grid, args, consts = event
                # a norm's eps and momentum are read from the model, as its layer reads them
                items = [expr(a) if isinstance(a, torch.Tensor) else f"self.{module}.{n}" if module and
                         n in ("eps", "momentum") and getattr(getattr(self.model, module), n, None) == a else repr(a)
                         for n, a in zip(getattr(FK, kernel).arg_names, args)]
                # the direct kernel rounds to TF32 where the file's precision and device say so
                items += [f"{n}={v!r}" if n != "TF32" else 'TF32=precision == "tf32" and x.is_cuda'
                          for n, v in consts.items()]
                lines.append(_wrap_call(f"{kernel}[{tuple(grid)!r}](", items, ""))
                launches += 1
        if _key(out) not in names:
            if out._base is None or _key(out._base) not in names:
                raise ExportError(f"problem {self.problem.id}: stage {k} returns what no kernel wrote (a PyTorch "
                                  "fallback)")
            expr(out)
        if not isinstance(self.stage, level2.Conv) and not launches:
            raise ExportError(f"problem {self.problem.id}: stage {k} launches no finishing kernel")
        self.names[_key(out)] = f"y{k}"
        return lines


def candidates(call, epi=None) -> list[tuple[object, tuple[str, ...]]]:
    """(Config, precisions it runs at) of the first ``predict.SHORTLIST`` tiles that take an epilogue, as the
    engine's predictor ranks them at TF32 (PyTorch's default) on ``TABLE_ARCH``'s table, and the exact
    grade's first where none of those runs at exact grade."""
    params, *_ = meta_call(call)
    table = predict.table_for(TABLE_ARCH)
    if table is None:
        raise ExportError(f"no predictor table for {TABLE_ARCH} (engines/triton/tables/{TABLE_ARCH}.json)")
    offered, ranked = {}, {}
    for p in ("tf32", EXACT_GRADE):
        offered[p] = TE.epilogue_configs(candidate_configs(params, torch.float32, p, False, flat=True, gluon=True),
                                         epi, params)
        order = predict.rank(offered[p], params, torch.float32, p, False, table)
        ranked[p] = [offered[p][i] for i in predict.pick(offered[p], order)]
    chosen = ranked["tf32"][:predict.SHORTLIST]
    if not any(c in offered[EXACT_GRADE] for c in chosen):
        chosen.append(ranked[EXACT_GRADE][0])
    return [(c, tuple(p for p in offered if c in offered[p])) for c in chosen]


# ---- the generated source ------------------------------------------------------------------------
_SUPPORT = '''# {rule} the programs' operands, the layers' state (generated) {rule}
_programs = {{}}


def _program(device, channels, *operands):
    """A program's operands as the kernels read them (convt3d.core.epilogue): the steps' scalars and
    an [8, channels] table of their per-channel values, from step i's ("s", a number or one value),
    ("c", channels values or one) or None; made once for numbers (a host-to-device copy waits)."""
    key = None if any(o is not None and isinstance(o[1], torch.Tensor) for o in operands) else \\
        (str(device), channels, operands)
    if key in _programs:
        return _programs[key]
    s = torch.zeros(8, dtype=torch.float32, device=device)
    c = torch.zeros((8, channels), dtype=torch.float32, device=device)
    for i, operand in enumerate(operands):
        if operand is not None:
            v = torch.as_tensor(operand[1], dtype=torch.float32).detach().reshape(-1)
            (s[i:i + 1] if operand[0] == "s" else c[i]).copy_(v)
    if key is not None:
        _programs[key] = s, c
    return s, c


def _expect(t, shape):
    """``t`` contiguous, where it is a float32 tensor of the shape the file's launches are specialised to."""
    if tuple(t.shape) != shape or t.dtype != torch.float32:
        raise RuntimeError(f"this file's launches are specialised to KernelBench problem {{PROBLEM}}'s float32 inputs, "
                           f"{{shape}} here, but got {{t.dtype}} {{tuple(t.shape)}}")
    return t.contiguous()


'''
_NORM = '''

class _Norm(torch.nn.Module):
    """The state of PyTorch's LayerNorm, GroupNorm or (``running``) BatchNorm3d, in its order: weight
    ones and bias zeros of ``shape``, running mean zeros and variance ones, no batch counted."""

    def __init__(self, shape, eps=1e-5, momentum=0.1, running=False):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = torch.nn.Parameter(torch.ones(shape))
        self.bias = torch.nn.Parameter(torch.zeros(shape))
        if running:
            self.register_buffer("running_mean", torch.zeros(shape))
            self.register_buffer("running_var", torch.ones(shape))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
'''


def _init_lines(problem: level2.Problem) -> list[str]:
    """ModelNew's constructor body: what Model creates, in its order and with its draws, each argument
    named where the constructor's argument of that name holds it."""
    args = vars(problem.bind())

    def arg(name, value, default=None, keyword=True, norm=lambda v: v) -> str | None:
        text = name if name in args and norm(args[name]) == value else None if value == default else repr(value)
        return None if text is None else f"{name}={text}" if keyword else text

    def shape(value) -> str:
        found = [n for n, v in args.items() if v == tuple(value)]
        dims = ["out_channels" if d == args["out_channels"] != 1 else str(d) for d in value]
        return found[0] if found else f"({', '.join(dims)}{',' * (len(dims) == 1)})"

    lines = []
    with torch.random.fork_rng():
        created = problem.creates(problem.bind())
    for name, value in created:
        if isinstance(value, nn.ConvTranspose3d):
            kw = [arg(k, getattr(value, k), keyword=False, norm=level2._triple if k == "kernel_size" else int)
                  for k in ("in_channels", "out_channels", "kernel_size")]
            kw += [arg(k, getattr(value, k), (d,) * 3, norm=level2._triple)
                   for k, d in (("stride", 1), ("padding", 0), ("output_padding", 0), ("dilation", 1))]
            kw += [arg("groups", value.groups, 1), arg("bias", value.bias is not None, True)]
            text = _wrap_call("ConvTranspose3dTriton(", [a for a in kw if a], " " * (len(name) + 8)).lstrip()
        elif isinstance(value, nn.Parameter):
            fill = "ones" if bool((value == 1).all()) else "zeros" if bool((value == 0).all()) else "randn"
            text = f"torch.tensor({arg(name, value.item(), keyword=False)})" if value.dim() == 0 else \
                f"torch.{fill}({shape(value.shape)})"
            text = f"torch.nn.Parameter({text})"
        elif isinstance(value, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm3d)):
            bn = isinstance(value, nn.BatchNorm3d)
            if bn and not (value.affine and value.track_running_stats and value.momentum is not None):
                raise ExportError(f"problem {problem.id}: a BatchNorm3d without affine parameters, running "
                                  "statistics or a momentum is not exported")
            size = value.normalized_shape if isinstance(value, nn.LayerNorm) else (getattr(
                value, "num_channels", None) or value.num_features,)
            kw = [shape(size), arg("eps", value.eps, 1e-5)] + ([arg("momentum", value.momentum, 0.1), "running=True"]
                                                                if bn else [])
            text = f"_Norm({', '.join(a for a in kw if a)})"
        elif isinstance(value, nn.Module):
            if value.state_dict():
                raise ExportError(f"problem {problem.id}: its {type(value).__name__} holds state the file lacks")
            lines.append(f"# {name} ({type(value).__name__}): stateless, its constants are literals below")
            continue
        else:
            text = arg(name, value, keyword=False)
        lines.append(f"self.{name} = {text}")
    return lines


def _model_new(problem: level2.Problem, train: _Tracer, evaluation: _Tracer) -> str:
    """The layers' classes and ModelNew, its forward the stages' lines (BatchNorm's per mode)."""
    body = ["precision = forward_precision()"]
    body += [f"{n} = _expect({n}, {tuple(s)!r})" for n, s in zip(problem.inputs, problem.input_shapes)]
    for stage, a, b in zip(problem.pipeline, train.stages, evaluation.stages):
        if a != b and not isinstance(getattr(train.model, getattr(stage, "name", ""), None), nn.BatchNorm3d):
            raise ExportError(f"problem {problem.id}: the launches differ between training and evaluation")
        if a == b:
            body += a
            continue
        train_lines, eval_lines = (["    " + line for line in "\n".join(lines).split("\n")] for lines in (a, b))
        body += [f"if self.{stage.name}.training:", f"    self.{stage.name}.num_batches_tracked.add_(1)",
                 *train_lines, "else:", *eval_lines]
    body.append(f"return y{len(problem.pipeline) - 1}")
    init = ["given = {k: tuple(v) if isinstance(v, list) else v for k, v in locals().items() if k in INIT_INPUTS}",
            "if given != INIT_INPUTS:",
            "    raise ValueError(f\"this file's launches are specialised to KernelBench problem {PROBLEM}'s init \"",
            "                     f\"inputs {INIT_INPUTS}, but got {given}\")", "super().__init__()",
            *_init_lines(problem)]
    classes = export._MODEL_NEW
    classes = classes[classes.index("def _triple"):classes.index("    def forward(self, x):")].rstrip() + "\n"
    classes += _NORM * any(isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm3d)) for m in train.model.modules())
    indent = "\n        "
    return f'''{classes}

{_wrap_call("INIT_INPUTS = dict(", [f"{k}={v!r}" for k, v in vars(problem.bind()).items()], "")}


class ModelNew(torch.nn.Module):
    """KernelBench level 2 problem {problem.id}: Model's constructor and state, its forward as convt3d's
    kernels (the launches above), for KernelBench's init inputs."""

{_wrap_call("def __init__(", ["self", *(level2.CHANNELS + problem.signature).split(", ")], "    ", "):")}{"".join(
        indent + line for b in init for line in b.split(chr(10)))}

    def forward(self, {", ".join(problem.inputs)}):{"".join(indent + line for b in body for line in b.split(chr(10)))}


__all__ = ["ModelNew"]
'''


def _precision(direct: bool = False) -> list:
    how = ("""the direct
# convolution rounds its operands to TF32 where PyTorch allows TF32 for convolutions on a GPU (cuDNN
# computes this layer in TF32 then) and computes in full float32 otherwise, as do the finishing steps.""" if direct
           else """the convolution
# computes in TF32 where PyTorch allows TF32 for convolutions (as cuDNN may then), at the
# engine's exact grade otherwise; the finishing kernels compute in float32.""")
    rule = f'''# KernelBench compares ModelNew with its reference under the same PyTorch flags: {how}
EXACT_GRADE = {EXACT_GRADE!r}  # convt3d.dispatch.select.EXACT_GRADE at export time'''
    return export.precision_lines("the convolution", rule, "The convolution's precision", "")


def _header(problem: level2.Problem, configs, small: bool) -> list:
    """The provenance of the candidates and the docstring; without candidates, the direct kernel's."""
    if not configs:
        size = " at a reduced size for Triton's interpreter (Problem.reduced)" if small else ""
        return export.header_lines(2, problem, [f"# convt3d {__version__}. Problem {problem.id}{size}: no tile to "
                                                "choose."], [], [], (
            "``ModelNew`` computes the problem with one of convt3d's Triton kernels: the transposed convolution of "
            "few channels computed directly (the taps that reach each output chosen at compile time, all output "
            "channels of a position in one program) with what follows it done in registers before the only store, "
            "in TF32 where PyTorch allows TF32 for convolutions on a GPU, else in float32, specialised to "
            "KernelBench's inputs. Generated by ``convt3d export-kernelbench --level 2``: edit the package and "
            "regenerate."))
    provenance = [f"# convt3d {__version__}. Problem {problem.id} at a reduced size for Triton's interpreter "
                  "(Problem.reduced), with its first candidate there:"] if small else [export._paragraph(
        f"convt3d {__version__}. Candidates: the Triton engine's tiles that take an epilogue, ranked for this "
        f"problem's transposed convolution by its predictor (engines/triton/predict.py, the {TABLE_ARCH} table) at "
        "TF32; the first forward times those its GPU and precision run and keeps the fastest:", "# ")]
    notes = [f"rank {rank}; runs at {', '.join(runs)}" for rank, (_, runs) in enumerate(configs, 1)]
    stages = ", ".join("pooling" if isinstance(s, level2.Pool) else f"the {s.name}" if isinstance(s, level2.Norm)
                       else "the subtraction of each plane's mean" if isinstance(s, level2.SubtractMean)
                       else f"a {s.op} over dim{'s' * isinstance(s.dim, tuple)} {s.dim}"
                       for s in problem.pipeline if not isinstance(s, level2.Conv))
    return export.header_lines(2, problem, provenance, configs, notes, (
        "``ModelNew`` computes the problem with convt3d's Triton kernels: the transposed convolution with the "
        "elementwise steps after it fused into its store (the candidates above, in TF32 where PyTorch allows "
        f"TF32 for convolutions, else at exact grade){f', then {stages} in finishing kernels' if stages else ''}, "
        "all specialised to KernelBench's inputs. Generated by ``convt3d export-kernelbench --level 2``: edit "
        "the package and regenerate."))


def _render_lines(problem: level2.Problem, small: bool, count: int) -> list[list]:
    """The file's forms (package source verbatim, then without docstrings) with its first ``count`` candidates."""
    p = problem.reduced() if small else problem
    train, evaluation = _Tracer(p, True), _Tracer(p, False)
    kernels = [(ROOTS[-1], k) for k in sorted(train.kernels | evaluation.kernels)]
    support = _SUPPORT.format(rule="=" * 20) + _model_new(p, train, evaluation)
    if train.conv is None:  # the direct kernel computed the convolution: no GEMM, no chooser
        rest = _precision(direct=True) + export._gen(f"PROBLEM = {problem.id}\n\n\n" + support)
        return export.assemble(ROOTS, None, [], _header(problem, [], small), rest, 0, kernels)
    call, epi = train.conv
    ranked = candidates(call, epi)
    configs = ranked[:1 if small else count]
    if not any(EXACT_GRADE in runs for _, runs in configs):  # one candidate runs at exact grade, always
        configs[-1] = next(c for c in ranked if EXACT_GRADE in c[1])
    rest = export._gen(export._CHOOSER.format(rule="=" * 20, ops=", *ops") + "\n") + _precision() + export._gen(support)
    return export.assemble(ROOTS, call, configs, _header(problem, configs, small), rest, epi.code, kernels)


def render(problem: level2.Problem, small: bool = False) -> str:
    """The file (``small``: at the reduced size) in its first form within MAX_LINES, fewer candidates if need be."""
    return export.checked_text(problem.file_name, (form for count in range(predict.SHORTLIST + 1, 0, -1)
                                                   for form in _render_lines(problem, small, count)))
