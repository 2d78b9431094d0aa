"""The fused epilogue on CUDA (skipped without it): every dtype and precision, every tile kind that takes a
program (flat TMA boxes, the phase kernel with and without TMA), residuals in either layout, and auto's
timed choice between the fused path and the composite; against float64 PyTorch followed by the program
(``conftest.check_epilogue``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convt3d
import convt3d.engines.triton.engine as engine
from convt3d import functional
from convt3d.core.epilogue import apply_torch, as_epilogue
from convt3d.core.errors import BackendUnavailableError
from convt3d.core.validate import check_call
from convt3d.engines.triton.configs import candidate_configs

from conftest import CL, Case, check_epilogue

pytestmark = [pytest.mark.gpu]
DEV = "cuda"


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    # Tuning compiles every candidate; these tests check the program, not the tile choice.
    monkeypatch.setenv("CONVT3D_AUTOTUNE", "0")


GEOMETRIES = {
    "tc-s2-k3p1op1": Case(2, 32, 64, (4, 8, 8), (3, 3, 3), 2, 1, 1),
    "tc-groups2-k4s2p1": Case(1, 32, 32, (3, 6, 6), (4, 4, 4), 2, 1, groups=2),
    "tc-channels-last-input": Case(1, 32, 16, (3, 6, 10), (3, 3, 3), 2, 1, 1, layout="channels_last_3d"),
    "tc-s1-k3p1-nobias": Case(1, 16, 32, (4, 6, 6), (3, 3, 3), 1, 1, bias=False),
    "fma-c3-depthwise": Case(1, 3, 3, (3, 6, 6), (3, 3, 3), 2, 1, 1, groups=3),
}
DTYPES = {"fp32-tf32": (torch.float32, "tf32"), "fp32-ieee": (torch.float32, "ieee"),
          "bf16": (torch.bfloat16, "tf32"), "fp16": (torch.float16, "tf32")}


def _program(c: int, shape, layout=torch.contiguous_format):
    """Per-channel, residual, register and activation steps (operands below 4)."""
    res = torch.randn(shape, device=DEV).contiguous(memory_format=layout)
    return [("mul", torch.rand(c, device=DEV) + 0.5), ("add", res), "save", "gelu", "mul_saved",
            ("clamp_max", 3.0), ("add", torch.randn(c, device=DEV)), "silu"]


def _tensors(case: Case, dtype):
    x, w, b = case.tensors(dtype, DEV)
    params, _ = check_call(x, w, b, *case.args[:3], case.groups, case.dilation)
    return x, w, b, params


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_fused_matches_reference(name, dtype):
    case, (dt, prec) = GEOMETRIES[name], DTYPES[dtype]
    x, w, b, params = _tensors(case, dt)
    program = _program(case.cout, params.out_shape)
    y = convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", precision=prec, epilogue=program)
    check_epilogue(y, x, w, b, case.args, as_epilogue(program, case.cout, params.out_shape), precision=prec,
                   context=f"{name} {dtype}")


@pytest.mark.parametrize("dtype", ["fp32-tf32", "bf16"])
@pytest.mark.parametrize("layout", ["ncdhw-out-cl-residual", "cl-out-ncdhw-residual"])
def test_every_tile_kind(layout, dtype):
    # Forced configs: each flat and phase tile the plan offers, and the phase kernel's pointer tiles.
    case = GEOMETRIES["tc-s2-k3p1op1"]
    dt, prec = DTYPES[dtype]
    x, w, b, params = _tensors(case, dt)
    cl_out = layout.startswith("cl-out")
    if cl_out:
        x = x.contiguous(memory_format=CL)
    program = _program(case.cout, params.out_shape, torch.contiguous_format if cl_out else CL)
    epi = as_epilogue(program, case.cout, params.out_shape)
    plan = engine.plan(params, x, w, prec)
    configs = engine.epilogue_configs(plan.configs) + engine.epilogue_configs(
        candidate_configs(params, dt, prec, cl_out, flat=False))[:2]
    assert any(c.flat for c in configs) and any(not c.flat for c in configs)
    for cfg in configs:
        y = engine.forward(x, w, b, params, prec, config=cfg, epilogue=epi)
        assert y.is_contiguous(memory_format=CL if cl_out else torch.contiguous_format)
        check_epilogue(y, x, w, b, case.args, epi, precision=prec, context=f"{layout} {dtype} {cfg.short()}")


def test_gluon_and_head_tiles_are_left_out():
    case = GEOMETRIES["tc-s2-k3p1op1"]
    x, w, b, params = _tensors(case, torch.bfloat16)
    eligible = engine.epilogue_configs(engine.plan(params, x, w, "tf32").configs)
    assert eligible and not any(getattr(c, "gluon", False) or not isinstance(c, engine.Config) for c in eligible)
    gluon = [c for c in engine.plan(params, x, w, "tf32").configs if getattr(c, "gluon", False)]
    if gluon:
        with pytest.raises(BackendUnavailableError, match="takes no epilogue"):
            engine.forward(x, w, b, params, "tf32", config=gluon[0], epilogue=as_epilogue(["relu"]))


def test_auto_times_the_fused_path_against_the_composite(auto_state, monkeypatch):
    monkeypatch.setattr(functional, "_fused", {})
    case = GEOMETRIES["tc-s2-k3p1op1"]
    x, w, b, params = _tensors(case, torch.float16)
    program = _program(case.cout, params.out_shape)
    for _ in range(2):  # the first call times and remembers; the second reuses
        y = convt3d.conv_transpose3d(x, w, b, *case.args, epilogue=program)
        check_epilogue(y, x, w, b, case.args, as_epilogue(program, case.cout, params.out_shape), precision="tf32",
                       context="auto")
    assert len(functional._fused) == 1
    assert "auto (measured)" in str(convt3d.explain(x, w, b, *case.args, epilogue=program))


def test_named_triton_raises_where_it_cannot_fuse():
    case = Case(1, 16, 16, (3, 6, 6), (1, 1, 1), 2)  # kernel 1 < stride 2: bias-only rows
    x, w, b, params = _tensors(case, torch.float32)
    with pytest.raises(BackendUnavailableError, match="no tap reaches"):
        convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", epilogue=["relu"])
    y = convt3d.conv_transpose3d(x, w, b, *case.args, precision="ieee", epilogue=["relu", ("mul", 2.0)])
    check_epilogue(y, x, w, b, case.args, as_epilogue(["relu", ("mul", 2.0)]), context="auto composite")


def test_autograd_runs_the_composite():
    case = GEOMETRIES["tc-s2-k3p1op1"]
    x, w, b, params = _tensors(case, torch.float32)
    res = torch.randn(params.out_shape, device=DEV, requires_grad=True)
    w.requires_grad_()
    program = [("add", res), "gelu"]
    with pytest.raises(convt3d.BackendUnavailableError, match="forward-only"):
        convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", precision="ieee", epilogue=program)
    y = convt3d.conv_transpose3d(x, w, b, *case.args, precision="ieee", epilogue=program)
    got = torch.autograd.grad(y, (w, res), torch.ones_like(y))
    # The reference in float64: PyTorch's own call at its default flags would compute in TF32.
    w64, res64 = (t.detach().double().requires_grad_() for t in (w, res))
    ref = apply_torch(F.conv_transpose3d(x.double(), w64, b.double(), *case.args),
                      as_epilogue([("add", res64), "gelu"], case.cout, params.out_shape))
    want = torch.autograd.grad(ref, (w64, res64), torch.ones_like(ref))
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)
