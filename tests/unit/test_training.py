"""Training on the CPU: the custom ops under opcheck, needs_input_grad subsets against float64
PyTorch, the forced dW's fallback off output heads, torch.compile(fullgraph=True), autocast, a short
training curve against nn.ConvTranspose3d, and the bench's bwd/full modes.

Sizes are tiny: Triton's interpreter costs ~1 s per kernel call here. Channel counts are >= 8 per
group where the tensor-core path is meant (below 8 the forward takes the slower FMA path).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convt3d
from convt3d.engines.triton import backward as B
from convt3d.engines.op import conv_transpose3d_backward_op, conv_transpose3d_op
from convt3d.core.validate import check_call
from convt3d.core.errors import BackendUnavailableError

from conftest import CL, Case, assert_compiled_matches_eager, requires_interpreter

pytestmark = requires_interpreter


def _f64(t):
    return None if t is None else t.detach().double()


def _ref_grads(x, w, b, args, dy, mask=(True, True, True)):
    """float64 PyTorch gradients (dX, dW, db) of the same values."""
    return torch.ops.aten.convolution_backward(
        _f64(dy), _f64(x), _f64(w), None if b is None else [w.shape[1] * args[3]], list(args[0]), list(args[1]),
        list(args[4]), True, list(args[2]), args[3], list(mask))


def _norm_args(case: Case):
    x, w, b = case.tensors()
    params, _ = check_call(x, w, b, *case.args)
    return (list(params.stride), list(params.padding), list(params.output_padding), params.groups,
            list(params.dilation)), params


def _assert_grad_close(got, ref, what, rel):
    """Max-abs error relative to the gradient's own scale (sums of up to a few hundred terms here:
    fp32 1e-5 is ~100 ulp of headroom; tf32 and fp16 get their operand-rounding bound)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= rel * scale + 1e-12, f"{what}: max error {err:.3g} > {rel:g} x scale {scale:.3g}"


# ---- opcheck --------------------------------------------------------------------------------------
OPCHECK_CASES = {
    "tensor-core-k2s2-bias": Case(1, 8, 8, (2, 2, 2), (2, 2, 2), 2),
    "grouped-dilated-op1": Case(1, 16, 16, (2, 2, 2), (2, 2, 2), 2, 1, 1, 2, 2, bias=False),
    "channels_last-k3p1": Case(1, 8, 8, (2, 2, 2), (3, 3, 3), 1, 1, layout="channels_last_3d"),
}


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_forward_op(name):
    case = OPCHECK_CASES[name]
    x, w, b = case.tensors()
    (stride, padding, op, groups, dilation), _ = _norm_args(case)
    x.requires_grad_()
    w.requires_grad_()
    args = (x, w, b, stride, padding, op, groups, dilation, "ieee", "triton")
    torch.library.opcheck(conv_transpose3d_op, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False), (True, False, False)],
                         ids=["all", "weight-only", "input-only"])
def test_opcheck_backward_op(mask):
    case = OPCHECK_CASES["channels_last-k3p1"]
    x, w, _ = case.tensors()
    (stride, padding, op, groups, dilation), params = _norm_args(case)
    dy = torch.randn(params.out_shape).contiguous(memory_format=CL)
    torch.library.opcheck(conv_transpose3d_backward_op,
                          (dy, x, w, stride, padding, op, groups, dilation, "ieee", list(mask)))


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, True), (False, True, False)],
                         ids=["all", "input-and-bias", "weight-only"])
def test_eager_autograd_matches_the_custom_op(mask, monkeypatch):
    # Eager calls take ops.conv_transpose3d_autograd (no custom-op dispatch); compiled code takes
    # the registered op. Both must give bitwise the same output and gradients.
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "triton")
    case = OPCHECK_CASES["tensor-core-k2s2-bias"]
    x, w, b = case.tensors()
    (stride, padding, op, groups, dilation), params = _norm_args(case)
    dy = torch.randn(params.out_shape)
    results = []
    for path in ("eager", "op"):
        leaves = [t.detach().clone().requires_grad_(need) for t, need in zip((x, w, b), mask)]
        if path == "eager":
            y = convt3d.engines.op.conv_transpose3d_autograd(*leaves, params, "ieee", "triton")
        else:
            y = conv_transpose3d_op(*leaves, stride, padding, op, groups, dilation, "ieee", "triton")
        wanted = [t for t in leaves if t.requires_grad]
        results.append((y.detach(), torch.autograd.grad(y, wanted, dy)))
    (y_e, g_e), (y_o, g_o) = results
    assert torch.equal(y_e, y_o)
    assert len(g_e) == len(g_o) == sum(mask)
    for a, c in zip(g_e, g_o):
        assert torch.equal(a, c)


def test_public_api_records_autograd_without_the_custom_op(monkeypatch):
    # The eager path must not silently route through the (slower) custom op; the op is for
    # torch.compile. A tripwire on the op proves which path ran.
    def tripwire(*args, **kwargs):
        raise AssertionError("eager autograd call went through the custom op")

    monkeypatch.setattr(convt3d.functional, "conv_transpose3d_op", tripwire)
    case = OPCHECK_CASES["tensor-core-k2s2-bias"]
    x, w, b = case.tensors()
    w.requires_grad_()
    y = convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", precision="ieee")
    assert y.grad_fn is not None and "EagerConvT3d" in type(y.grad_fn).__name__


def test_op_rejects_unknown_engine():
    x, w = torch.randn(1, 8, 2, 2, 2), torch.randn(8, 8, 2, 2, 2)
    with pytest.raises(ValueError, match="engine='tpu'"):
        conv_transpose3d_op(x, w, None, [1] * 3, [0] * 3, [0] * 3, 1, [1] * 3, "ieee", "tpu")


# ---- gradients against float64 ------------------------------------------------------------------
SUBSETS = {"input-only": (True, False, False), "weight-only": (False, True, False), "bias-only": (False, False, True),
           "input+bias": (True, False, True), "all": (True, True, True)}


@pytest.mark.parametrize("subset,wgrad", [(s, "cudnn") for s in SUBSETS] + [("weight-only", "triton"),
                                                                            ("all", "triton")],
                         ids=[f"{s}-cudnn" for s in SUBSETS] + ["weight-only-triton", "all-triton"])
def test_needs_input_grad_subsets(subset, wgrad, monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", wgrad)
    need = SUBSETS[subset]
    case = Case(2, 8, 8, (2, 2, 1), (2, 2, 2), 2, layout="channels_last_3d")
    x, w, b = case.tensors()
    leaves = [t.requires_grad_(n) for t, n in zip((x, w, b), need)]
    y = convt3d.conv_transpose3d(*leaves, *case.args, backend="triton", precision="ieee")
    dy = torch.randn(y.shape, dtype=torch.float64)
    y.backward(dy.float())
    ref = _ref_grads(x, w, b, ((2,) * 3, (0,) * 3, (0,) * 3, 1, (1,) * 3), dy)
    for t, n, r, what in zip(leaves, need, ref, ("input", "weight", "bias")):
        if not n:
            assert t.grad is None, f"{what} got a gradient it did not ask for"
            continue
        _assert_grad_close(t.grad, r, what, 1e-5)
        if what == "input":
            assert t.grad.is_contiguous(memory_format=CL), "dX should keep the input's channels_last_3d layout"


def test_forced_wgrad_name_is_validated(monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "magic")
    x = torch.randn(1, 8, 2, 2, 2, requires_grad=True)
    w = torch.randn(8, 8, 2, 2, 2, requires_grad=True)
    y = convt3d.conv_transpose3d(x, w, backend="triton", precision="ieee")
    with pytest.raises(ValueError, match="CONVT3D_BWD_WEIGHT='magic'"):
        y.sum().backward()


def test_forced_triton_wgrad_off_heads_raises(monkeypatch):
    # The Triton dW kernels are the head kernels: a wider layer's forced dW raises (a forced
    # implementation never runs another), and explain says why without raising.
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "triton")
    B.clear_caches()
    x, w = torch.randn(1, 8, 2, 2, 2), torch.randn(8, 16, 2, 2, 2)
    params, _ = check_call(x, w, None, 2, 0, 0, 1, 1)
    with pytest.raises(BackendUnavailableError, match="CONVT3D_BWD_WEIGHT=triton cannot run this call: .*output heads only"):
        B.choose_wgrad(torch.randn(params.out_shape), x, w, params, "ieee")
    lines = convt3d.explain(x, w, stride=2, backend="triton", precision="ieee").backward
    assert any("forced:" in line and "16 output channels per group" in line for line in lines), lines
    leaves = [x.requires_grad_(), w.requires_grad_()]
    y = convt3d.conv_transpose3d(*leaves, stride=2, backend="triton", precision="ieee")
    with pytest.raises(BackendUnavailableError, match="output heads only"):
        y.backward(torch.ones_like(y))


def test_static_choice_on_cpu_is_pytorch_and_cached():
    B.clear_caches()
    x, w = torch.randn(1, 8, 2, 2, 2), torch.randn(8, 8, 2, 2, 2)
    params, _ = check_call(x, w, None, 2, 0, 0, 1, 1)
    dy = torch.randn(params.out_shape)
    rec = B.choose_wgrad(dy, x, w, params, "ieee")
    assert rec.impl == "cudnn" and "static" in rec.reason
    assert list(B.choices().values()) == [rec]


# ---- torch.compile --------------------------------------------------------------------------------
def _decoder(precision="ieee"):
    torch.manual_seed(0)
    m = nn.Sequential(convt3d.ConvTranspose3d(8, 8, 2, stride=2), nn.ReLU(),
                      convt3d.ConvTranspose3d(8, 8, 3, stride=1, padding=1, bias=False))
    for layer in (m[0], m[2]):
        layer.backend, layer.precision = "triton", precision
    return m


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
def test_compile_fullgraph_matches_eager(layout):
    # tests/gpu/test_gpu_training.py compiles with Inductor.
    m = _decoder()
    x = torch.randn(1, 8, 2, 2, 2)
    if layout == "channels_last_3d":
        x = x.contiguous(memory_format=CL)
    assert_compiled_matches_eager(m, x.requires_grad_())


# ---- autocast --------------------------------------------------------------------------------------
def test_cpu_autocast_casts_like_nn_convtranspose3d():
    # float16 (the interpreter computes bf16 dots wrongly; tests/gpu/test_gpu_training.py covers bf16).
    torch.manual_seed(0)
    ours = convt3d.ConvTranspose3d(8, 8, 2, stride=2)
    ours.backend = "triton"
    ref = nn.ConvTranspose3d(8, 8, 2, stride=2)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(1, 8, 2, 2, 2)
    with torch.autocast("cpu", dtype=torch.float16):
        y = ours(x)
        y_ref = ref(x)
    assert y.dtype == y_ref.dtype == torch.float16
    y.float().sum().backward()
    y_ref.float().sum().backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-3, atol=2e-3)


def test_autocast_leaves_float64_alone():
    x = torch.randn(1, 2, 2, 2, 2, dtype=torch.float64)
    w = torch.randn(2, 2, 2, 2, 2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = convt3d.conv_transpose3d(x, w)
        y_ref = F.conv_transpose3d(x, w)
    assert y.dtype == y_ref.dtype == torch.float64


# ---- training curve ------------------------------------------------------------------------------
class TinyUNetDecoder(nn.Module):
    """Two up-sampling stages of a 3-D U-Net decoder with skip connections (channels 16 -> 8 -> 8)."""

    def __init__(self, conv_t=nn.ConvTranspose3d):
        super().__init__()
        self.up1 = conv_t(16, 8, 2, stride=2)
        self.fuse1 = nn.Conv3d(16, 8, 3, padding=1)
        self.up2 = conv_t(8, 8, 2, stride=2)
        self.head = nn.Conv3d(16, 1, 1)

    def forward(self, bottom, skip1, skip2):
        h = torch.relu(self.fuse1(torch.cat([self.up1(bottom), skip1], 1)))
        return self.head(torch.cat([self.up2(h), skip2], 1))


def test_training_curve_tracks_nn_convtranspose3d():
    """fp32, exact precision on both sides: the two runs differ only by summation order (~1e-7
    relative per step), so 6 Adam steps must agree to 1e-4 relative. A wrong gradient of any
    parameter would change the loss at the first step by far more."""
    torch.manual_seed(0)
    ref = TinyUNetDecoder()
    ours = TinyUNetDecoder()
    ours.load_state_dict(ref.state_dict())
    convt3d.patch(ours, backend="triton", precision="ieee")
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 16, 1, 1, 1, generator=gen), torch.randn(1, 8, 2, 2, 2, generator=gen),
             torch.randn(1, 8, 4, 4, 4, generator=gen), torch.randn(1, 1, 4, 4, 4, generator=gen)) for _ in range(2)]
    losses = {}
    for name, model in (("ref", ref), ("ours", ours)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses[name] = []
        for step in range(6):
            bottom, s1, s2, target = data[step % len(data)]
            loss = F.mse_loss(model(bottom, s1, s2), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["ref"][-1] < losses["ref"][0]  # it trains
    for step, (a, b_) in enumerate(zip(losses["ours"], losses["ref"])):
        assert abs(a - b_) <= 1e-4 * abs(b_), f"step {step}: convt3d loss {a} vs nn.ConvTranspose3d {b_}"


# ---- bench modes -----------------------------------------------------------------------------------
class _FakeTimer:
    def first_call(self, fn):
        return fn(), 0.1

    def steady(self, fn):
        fn()
        return 1e-3 if fn.__name__ == "ours" else 2e-3

    def release(self):
        pass


@pytest.mark.parametrize("mode,backend", [("bwd", "torch"), ("full", "triton")], ids=["bwd-torch", "full-triton"])
def test_bench_training_modes_rows(mode, backend):
    from convt3d.bench import report, roofline, runner
    from convt3d.bench.suites import Case as BenchCase, Geometry

    geom = Geometry.of("tiny", 1, 8, 8, 2, 2, 2, bias=True)
    cases = [BenchCase("layers", geom, "fp32", "ncdhw", "tf32", "randn")]
    ceilings = roofline.Ceilings(copy_bytes_per_s=4.24e12, bf16_flops_per_s=683e12, tf32_flops_per_s=374e12,
                                 fp32_flops_per_s=51e12)
    rows, failures = runner.run_cases(cases, mode, backend, ceilings, runner.TimingSettings(), device="cpu",
                                      timer=_FakeTimer())
    assert failures == [], failures
    (row,) = rows
    assert row["mode"] == mode and row["speedup"] == pytest.approx(2.0)
    # The gradients of both engines were compared: tiny, not zero-scale.
    assert row["max_abs_torch"] > 0 and row["max_abs_diff_vs_torch"] <= 1e-2 * row["max_abs_torch"]
    assert row["output_layout_matches"]
    # backend torch runs PyTorch's own backward, so no convt3d choice is reported for it.
    if backend == "triton":
        assert row["bwd_choice"].startswith("dX cudnn") and "; dW cudnn" in row["bwd_choice"]
    else:
        assert row["bwd_choice"] == ""
    fwd_flop, fwd_bytes = runner.MODES["fwd"].work(_params_of(geom), 4, True)
    assert row["useful_flop"] == (2 if mode == "bwd" else 3) * fwd_flop
    assert row["min_bytes"] > (0 if mode == "bwd" else fwd_bytes)
    import io

    buf = io.StringIO()
    report.print_timing_table(report.make_console(buf), rows, f"layers: {mode}")
    assert mode in buf.getvalue() and ("dW cudnn" in buf.getvalue()) == (backend == "triton")


def _params_of(geom):
    x = torch.empty((geom.batch, geom.in_channels) + geom.in_size, device="meta")
    w = torch.empty(geom.weight_shape, device="meta")
    params, _ = check_call(x, w, None, *geom.conv_args())
    return params


# ---- double backward (create_graph=True) ----------------------------------------------------------
# Gradient penalties and path-length regularisers differentiate a gradient again. Our backward's
# kernels record no graph, so a step taken with create_graph=True takes PyTorch's own formula.
@pytest.mark.parametrize("case,backend", [
    (Case(1, 4, 6, (3, 2, 3), (3, 3, 3), 1, 1), "conv3d"),
    (Case(None, 4, 6, (3, 2, 3), (3, 2, 3), 1, (1, 0, 1), groups=2), "conv3d"),
], ids=["conv3d-k3p1", "conv3d-unbatched-grouped"])
def test_gradgradcheck(case, backend):
    x, w, b = case.tensors(torch.float64)
    inputs = tuple(t.clone().requires_grad_() for t in (x, w, b))
    fn = lambda x, w, b: convt3d.conv_transpose3d(x, w, b, *case.args, backend=backend)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, inputs)


@requires_interpreter
@pytest.mark.parametrize("case", [
    Case(1, 8, 8, (2, 3, 2), (3, 3, 3), 2, 1, 1),
    Case(2, 8, 16, (2, 2, 3), (2, 2, 2), 2, layout="channels_last_3d"),
], ids=["k3s2p1op1", "k2s2-channels-last"])
def test_second_order_gradients_on_the_triton_engine(case):
    """A path-length-style penalty: |dL/dx|^2 differentiated again w.r.t. the weight and bias,
    against the same in float64 through PyTorch."""
    x, w, b = case.tensors()
    results = []
    for dtype, backend in ((torch.float32, "triton"), (torch.float64, "torch")):
        xs, ws, bs = (t.to(dtype).clone().requires_grad_() for t in (x, w, b))
        y = convt3d.conv_transpose3d(xs, ws, bs, *case.args, backend=backend, precision="ieee")
        gx, = torch.autograd.grad(y.square().sum(), xs, create_graph=True)
        results.append(torch.autograd.grad(gx.square().sum(), (ws, bs)))
    for got, want in zip(*results):
        scale = want.abs().max().item()
        assert scale > 0 and (got.double() - want).abs().max().item() <= 1e-4 * scale


def test_first_order_steps_keep_the_engines_backward(monkeypatch):
    """Without create_graph the backward stays convt3d's (its kernels or its per-gradient choice)."""
    calls = []
    grads = B.grads
    monkeypatch.setattr(B, "grads", lambda *a: calls.append("grads") or grads(*a))
    monkeypatch.setattr(B, "differentiable_grads", lambda *a: pytest.fail("the differentiable formula ran"))
    case = Case(1, 4, 6, (3, 2, 3), (3, 3, 3), 1, 1)
    x, w, b = (t.clone().requires_grad_() for t in case.tensors())
    torch.autograd.grad(convt3d.conv_transpose3d(x, w, b, *case.args, backend="conv3d").sum(), (x, w, b))
    assert calls == ["grads"]


@pytest.mark.parametrize("precision", ["ieee", "tf32"], ids=["exact-fp32", "tf32"])
def test_torch_engine_backward_runs_at_the_calls_precision(precision, monkeypatch):
    # PyTorch's autograd would run the backward at the TF32 flag of the moment; an explicit precision
    # holds for it too. The flag path is CUDA's: here the check that treats CPU tensors as "at the
    # flags as they are" is lifted, and the precision each PyTorch kernel runs at is recorded.
    from convt3d.core.call import Call
    from convt3d.engines.torch import calls, peer

    seen = []
    real = calls.at_precision
    monkeypatch.setattr(calls, "at_precision", lambda op, args, prec: seen.append((op, prec)) or real(op, args, prec))
    monkeypatch.setattr(peer, "at_flags_as_they_are", lambda x, prec: False)
    case = Case(2, 4, 6, (3, 4, 5), (3, 3, 2), (2, 1, 2), (1, 0, 1), (1, 0, 0))
    x, w, b = (t.requires_grad_() for t in case.tensors())
    params, _ = check_call(x, w, b, *case.args)
    y = peer.TorchEngine().run(Call(x, w, b, params, precision, precision, True, False))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), dy)
    assert [(op, p) for op, p in seen] == [(F.conv_transpose3d, precision),
                                           (torch.ops.aten.convolution_backward, precision)]
    for g, r, what in zip(got, _ref_grads(x, w, b, _norm_args(case)[0], dy), ("dX", "dW", "db")):
        _assert_grad_close(g, r, what, 1e-5)
