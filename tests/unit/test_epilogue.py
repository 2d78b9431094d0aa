"""The fused epilogue (``conv_transpose3d(..., epilogue=...)``) on CPU tensors: the Triton engine's real
kernels through Triton's interpreter, the program applied before the GEMM's store, against float64
PyTorch followed by the program (``conftest.check_epilogue`` carries the convolution's bound through it);
validation errors before any kernel; the routing of auto, triton, torch and autograd; explain."""
from __future__ import annotations

import ast
import dataclasses
import textwrap

import pytest
import torch
import torch.nn.functional as F

import convt3d
import convt3d.engines.triton.engine as engine
from convt3d.core.epilogue import apply_torch, as_epilogue
from convt3d.core.errors import BackendUnavailableError
from convt3d.core.validate import check_call
from convt3d.engines.triton.configs import candidate_configs

from conftest import CL, Case, check_epilogue, requires_interpreter

C16 = Case(1, 16, 16, (2, 3, 4), (3, 3, 3), 2, 1, 1)  # tensor cores, W residues interleaved (W_GROUP 2)
C16_OUT = (1, 16, 4, 6, 8)

# Programs by regime, built for C output channels and an output of shape `shape` (operands below 4).
PROGRAMS = {
    "scalar-mul-add-relu": lambda c, shape: [("mul", 0.5), ("add", 0.25), "relu"],
    "scalar-div-clamp": lambda c, shape: [("div", -2.0), ("clamp_min", -0.3), ("clamp_max", 0.4)],
    "channel-mul-add-div": lambda c, shape: [("mul", torch.randn(c)), ("add", torch.randn(c, 1, 1, 1)),
                                             ("div", torch.rand(c) + 0.5)],
    "residual-add-leaky": lambda c, shape: [("add", torch.randn(shape)), ("leaky_relu", 0.2)],
    "residual-strided-leaky-default": lambda c, shape: [("add", torch.randn(shape).transpose(-1, -2).contiguous()
                                                         .transpose(-1, -2)), "leaky_relu"],
    "register-x-hardswish": lambda c, shape: ["save", "hardswish", "mul_saved"],
    "register-sigmoid-add-saved": lambda c, shape: ["save", "sigmoid", "add_saved"],
    "gelu-erf": lambda c, shape: ["gelu"],
    "gelu-tanh-silu-tanh": lambda c, shape: ["gelu_tanh", "silu", "tanh"],
    "channel-softmax-sigmoid": lambda c, shape: [("mul", 3.0), "softmax", "sigmoid"],
    "eight-steps": lambda c, shape: [("mul", torch.randn(c)), ("add", torch.randn(shape)), "save", "silu",
                                     "mul_saved", ("clamp_min", -1.0), "add_saved", "tanh"],
}
MIXED = PROGRAMS["eight-steps"]

GEOMETRIES = {
    "tc-s2-k3p1op1": C16,
    "tc-s1-k3p1": Case(1, 8, 8, (2, 3, 4), (3, 3, 3), 1, 1),
    "tc-groups2": Case(1, 16, 16, (2, 3, 3), (2, 2, 2), 2, groups=2),
    "tc-dilation2-op1": Case(1, 8, 8, (2, 3, 3), (2, 2, 2), 1, 0, 1, 2),
    "tc-channels-last-input": Case(1, 8, 16, (2, 3, 3), (3, 3, 3), 2, 1, 1, layout="channels_last_3d"),
    "tc-nobias-batch2": Case(2, 8, 8, (1, 3, 3), (2, 2, 2), 2, bias=False),
    "tc-unbatched": Case(None, 8, 8, (2, 3, 3), (2, 2, 2), 2),
    "fma-s2-k3p1op1": Case(1, 2, 3, (1, 3, 3), (3, 3, 3), 2, 1, 1),
    "fma-depthwise": Case(1, 3, 3, (1, 3, 4), (3, 2, 3), 2, 1, 1, groups=3),
}


def _out_shape(case: Case, x, w, b) -> tuple:
    params, unbatched = check_call(x, w, b, *case.args[:3], case.groups, case.dilation)
    return params.out_shape[1:] if unbatched else params.out_shape


def _run(case: Case, make, dtype=torch.float32, backend="triton"):
    x, w, b = case.tensors(dtype)
    shape = _out_shape(case, x, w, b)
    program = make(case.cout, shape)
    y = convt3d.conv_transpose3d(x, w, b, *case.args, backend=backend, precision="ieee", epilogue=program)
    check_epilogue(y, x, w, b, case.args, as_epilogue(program, case.cout, shape), context=case.id())
    return y


@requires_interpreter
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_programs_fused(name):
    _run(C16, PROGRAMS[name])


@requires_interpreter
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_geometries_fused(name):
    _run(GEOMETRIES[name], MIXED)


@requires_interpreter
@pytest.mark.parametrize("name", ["tc-s2-k3p1op1", "fma-s2-k3p1op1", "tc-unbatched"])
def test_fp16_fused(name):
    # 16-bit output rounded once, after the program; the residual in float32.
    _run(GEOMETRIES[name], lambda c, shape: [("mul", torch.randn(c)), ("add", torch.randn(shape)), "gelu"],
         torch.float16)


def _configs(params, x, channels_last: bool):
    """(id, config) of every tile kind the interpreter runs: flat TMA boxes, the phase kernel with TMA, and
    the phase kernel with pointer loads."""
    flat = engine.epilogue_configs(candidate_configs(params, x.dtype, "ieee", channels_last, flat=True))
    ptr = engine.epilogue_configs(candidate_configs(params, x.dtype, "ieee", channels_last, flat=False))
    return ([(f"flat-{i}", c) for i, c in enumerate(c for c in flat if c.flat)]
            + [("phase-tma", next(c for c in flat if c.tma)), ("phase-pointer", ptr[0])])


@requires_interpreter
@pytest.mark.parametrize("program", ["eight-steps", "channel-softmax-sigmoid"])
@pytest.mark.parametrize("layout", ["ncdhw-wgroup2", "channels-last-out"])
def test_every_tile_kind(layout, program):
    case = C16 if layout == "ncdhw-wgroup2" else Case(1, 16, 16, (2, 3, 4), (3, 3, 3), 2, 1, 1,
                                                      layout="channels_last_3d")
    x, w, b = case.tensors()
    params, _ = check_call(x, w, b, *case.args[:3], case.groups, case.dilation)
    epi = as_epilogue(PROGRAMS[program](16, params.out_shape), 16, params.out_shape)
    for kind, cfg in _configs(params, x, layout != "ncdhw-wgroup2"):
        y = engine.forward(x, w, b, params, "ieee", config=cfg, epilogue=epi)
        check_epilogue(y, x, w, b, case.args, epi, context=f"{layout} {kind} {cfg.short()}")


@requires_interpreter
def test_operands_are_passed_per_call():
    # One signature (same steps and operand forms), other values: the steady path must not keep them.
    x, w, b = C16.tensors()
    for scale in (2.0, -3.0):
        program = [("mul", scale), ("add", torch.randn(16))]
        y = convt3d.conv_transpose3d(x, w, b, *C16.args, backend="triton", precision="ieee", epilogue=program)
        check_epilogue(y, x, w, b, C16.args, as_epilogue(program, 16), context=f"scale {scale}")


@requires_interpreter
def test_plain_tuned_tile_is_reused_where_it_takes_an_epilogue(monkeypatch):
    x, w, b = C16.tensors()
    params, _ = check_call(x, w, b, *C16.args[:3], C16.groups, C16.dilation)
    monkeypatch.setattr(engine, "_tuned", {})
    monkeypatch.setattr(engine, "_steady", {})
    pl = engine.plan(params, x, w, "ieee")
    second = engine.epilogue_configs(pl.configs)[1]
    engine.seed_tuning(pl.tune_key, second)
    epi = as_epilogue([("mul", 2.0)], 16)
    engine.forward(x, w, b, params, "ieee", epilogue=epi)
    settled = [st.cfg for key, st in engine._steady.items() if key[-1] == epi.signature]
    assert settled == [second]


# ---- validation: PyTorch's exception types, raised before any kernel -------------------------------
BAD = {
    "unknown-step": ([("exp",)], ValueError, "unknown step"),
    "operand-wrong-shape": ([("mul", torch.randn(5))], ValueError, "per-channel"),
    "operand-wrong-type": ([("mul", "2")], TypeError, "takes a number"),
    "scalar-step-given-tensor": ([("clamp_min", torch.randn(16))], TypeError, "takes a number"),
    "integer-tensor": ([("add", torch.ones(16, dtype=torch.int64))], TypeError, "floating tensor"),
    "step-not-a-pair": ([("mul", 1.0, 2.0)], TypeError, "name or a"),
    "div-by-zero": ([("div", 0)], ValueError, "by zero"),
    "nine-steps": (["relu"] * 9, ValueError, "at most 8 steps"),
    "operand-on-another-device": ([("mul", torch.ones(16, device="meta"))], RuntimeError, "same device"),
}


@pytest.mark.parametrize("name", list(BAD) + ["two-residuals"])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_invalid_programs_raise_before_any_kernel(name, backend, monkeypatch):
    x, w, b = C16.tensors()

    def never(*args, **kwargs):
        raise AssertionError("a kernel ran before the program was validated")

    monkeypatch.setattr(engine, "forward", never)
    monkeypatch.setattr(F, "conv_transpose3d", never)
    if name == "two-residuals":
        res = torch.zeros(C16_OUT)
        program, exc, match = [("add", res), ("add", res)], ValueError, "one residual"
    else:
        program, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        convt3d.conv_transpose3d(x, w, b, *C16.args, backend=backend, epilogue=program)


# ---- routing ---------------------------------------------------------------------------------------
@requires_interpreter
@pytest.mark.parametrize("case", [
    # Kernel 2 < stride 3: a residue no tap reaches is filled with the bias outside the GEMM's store.
    Case(1, 8, 8, (2, 3, 3), (2, 2, 2), 3, 0, 2),
    # Kernel 3 >= stride 2, but dilation 2 shares the stride's factor: every tap lands on even rows.
    Case(1, 8, 8, (3, 3, 3), (3, 3, 3), 2, 1, 1, dilation=(2, 1, 1)),
], ids=["kernel-below-stride", "dilation-shares-stride-factor"])
def test_triton_raises_where_it_cannot_fuse(case):
    x, w, b = case.tensors()
    with pytest.raises(BackendUnavailableError, match="no tap reaches"):
        convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", epilogue=["relu"])
    # auto runs the composite, with the program on the bias-only rows too.
    y = convt3d.conv_transpose3d(x, w, b, *case.args, precision="ieee", epilogue=["relu", ("add", 1.0)])
    check_epilogue(y, x, w, b, case.args, as_epilogue(["relu", ("add", 1.0)]), context="auto composite")


@requires_interpreter
def test_channel_softmax_needs_a_tile_holding_every_channel():
    case = GEOMETRIES["tc-groups2"]
    x, w, b = case.tensors()
    with pytest.raises(BackendUnavailableError, match="channel softmax needs groups=1"):
        convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", epilogue=["softmax"])
    y = convt3d.conv_transpose3d(x, w, b, *case.args, precision="ieee", epilogue=["softmax"])  # auto: composite
    check_epilogue(y, x, w, b, case.args, as_epilogue(["softmax"]), context="auto composite")
    wide = check_call(torch.randn(1, 16, 2, 3, 3), torch.randn(16, 48, 2, 2, 2), None, 2, 0, 0, 1, 1)[0]
    every = engine.epilogue_configs(candidate_configs(wide, torch.float32, "ieee", False, flat=True))
    narrow = dataclasses.replace(every[0], BLOCK_N=32)  # 32 of the 48 channels: the softmax would see part
    kept = engine.epilogue_configs(every + (narrow,), as_epilogue(["softmax"]), wide)
    assert kept and narrow not in kept and all(c.BLOCK_N >= 48 for c in kept)


def test_finishing_kernels_refuse_the_channel_softmax():
    from convt3d.engines.triton import finish
    with pytest.raises(ValueError, match="softmax step is not allowed"):
        finish.reduce(torch.randn(1, 4, 2, 2, 2), (2, 3, 4), "mean", pre=["softmax"])


@pytest.mark.parametrize("backend", ["auto-cpu", "torch"])
def test_composite_backends(backend, monkeypatch):
    monkeypatch.setattr(engine, "forward", lambda *a, **k: pytest.fail("the fused path ran"))
    _run(C16, MIXED, backend=backend.removesuffix("-cpu"))


@requires_interpreter
@pytest.mark.parametrize("needs_grad", ["input", "residual", "channel-operand"])
def test_autograd_runs_the_composite(needs_grad):
    x, w, b = C16.tensors()
    res, ch = torch.randn(C16_OUT), torch.randn(16)
    leaf = {"input": x, "residual": res, "channel-operand": ch}[needs_grad].requires_grad_()
    program = [("mul", ch), ("add", res), "silu"]
    with pytest.raises(BackendUnavailableError, match="forward-only"):  # a named engine never falls back
        convt3d.conv_transpose3d(x, w, b, *C16.args, backend="triton", precision="ieee", epilogue=program)
    y = convt3d.conv_transpose3d(x, w, b, *C16.args, precision="ieee", epilogue=program)
    (got,) = torch.autograd.grad(y, leaf, torch.ones_like(y))
    ref = apply_torch(F.conv_transpose3d(x, w, b, *C16.args), as_epilogue(program, 16, C16_OUT))
    (want,) = torch.autograd.grad(ref, leaf, torch.ones_like(ref))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@requires_interpreter
def test_explain_reports_the_epilogue():
    x, w, b = C16.tensors()

    def text(**kw):
        return str(convt3d.explain(x, w, b, *C16.args, **kw))

    assert "epilogue: fused into the Triton GEMM" in text(backend="triton", epilogue=["relu"])
    assert "epilogue: after the convolution" in text(epilogue=["relu"])  # auto on the CPU
    assert "epilogue" not in text(backend="triton")
    assert "autograd" in text(backend="triton", epilogue=[("mul", torch.ones(16, requires_grad=True))])
    case = Case(1, 8, 8, (2, 3, 3), (2, 2, 2), 3, 0, 2)
    assert "epilogue: cannot run" in str(convt3d.explain(*case.tensors(), *case.args, backend="triton",
                                                         epilogue=["relu"]))
    with pytest.raises(ValueError, match="unknown step"):
        convt3d.explain(x, w, b, *C16.args, epilogue=["exp"])


def test_channels_last_residual_matches():
    # Cheap layout check of the composite (auto on CPU): a channels-last residual on an NCDHW output.
    x, w, b = C16.tensors()
    res = torch.randn(C16_OUT).contiguous(memory_format=CL)
    y = convt3d.conv_transpose3d(x, w, b, *C16.args, epilogue=[("add", res)])
    torch.testing.assert_close(y, F.conv_transpose3d(x, w, b, *C16.args) + res)


def test_kernelbench_files_leave_the_unused_epilogue_out():
    # KernelBench's calls fuse no program: the shaker drops `if EPI != 0:` blocks and what only they reach.
    from convt3d.kernelbench import export
    from convt3d.kernelbench.problems import PROBLEMS
    from convt3d.kernelbench.shake import PythonShaker

    source = textwrap.dedent("""
        def helper(v):
            return v

        def only_epilogue(v):
            return v

        def kernel(v, EPI=0):
            v = helper(v)
            if EPI != 0:
                v = only_epilogue(helper(v))
            return v
        """)
    for dead, kept in ((set(), True), ({"EPI"}, False)):
        shaker = PythonShaker(("m.py",), lambda path: source, lambda path: path == "m.py")
        shaker.dead = dead
        shaker.reach([("m.py", "kernel")])
        text = "\n".join(line.text for line in shaker.lines())
        assert ("only_epilogue" in text) == kept and ("EPI != 0" in text) == kept and "def helper" in text
        ast.parse(text)
    text = export.render(PROBLEMS[0])
    assert "flat_gemm_kernel" in text and "apply_epilogue" not in text and "EPI != 0" not in text
