"""GPU tests of training (skipped without CUDA): opcheck on CUDA, the gradient sweep
against float64 with the 2x-cuDNN bar (every Triton dX tile configuration, and dX forced to
Triton through autograd), torch.compile(fullgraph=True) with Inductor, CUDA graph capture and
replay of forward + backward, autocast, and a 50-step training curve against nn.ConvTranspose3d.

Accuracy bar (as tests/gpu/test_gpu.py for the forward): per gradient, our max abs error against
float64 is at most 2x cuDNN's own error for the same inputs, dtype and TF32 flag, plus one unit of
the output's last place; for "tf32", 2x the larger of cuDNN's error and the error of exact TF32
arithmetic (operands rounded to TF32, float64 sums), since cuDNN sometimes runs exact fp32 anyway.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convt3d
from convt3d.engines.triton import backward as B
from convt3d.dispatch.select import cudnn_conv_tf32
from convt3d.engines.op import conv_transpose3d_op
from convt3d.core.validate import check_call

from conftest import round_tf32_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"
CL = torch.channels_last_3d


def _bwd(dy, x, w, params, mask, dtype64=False):
    f = (lambda t: t.double()) if dtype64 else (lambda t: t)
    return torch.ops.aten.convolution_backward(
        f(dy), f(x), f(w), None, list(params.stride), list(params.padding), list(params.dilation), True,
        list(params.output_padding), params.groups, mask)


# (N, Cin, Cout, in, k, s, p, op, d, groups, bias, layout)
SWEEP = {
    "nnunet-k2s2": (2, 32, 16, (6, 6, 6), 2, 2, 0, 0, 1, 1, True, "ncdhw"),
    "monai-k3s2p1op1-cl": (2, 32, 16, (5, 6, 7), 3, 2, 1, 1, 1, 1, True, "cl"),
    "gan-k4s2p1": (2, 64, 32, (4, 4, 4), 4, 2, 1, 0, 1, 1, False, "ncdhw"),
    "aniso-k122": (2, 64, 32, (3, 8, 8), (1, 2, 2), (1, 2, 2), 0, 0, 1, 1, True, "cl"),
    "refine-k3s1p1": (2, 32, 32, (6, 6, 6), 3, 1, 1, 0, 1, 1, True, "ncdhw"),
    "grouped-dilated": (2, 32, 32, (4, 5, 6), 3, 2, 2, 1, 2, 2, True, "ncdhw"),
    "depthwise": (2, 8, 8, (4, 4, 4), 3, 2, 1, 1, 1, 8, True, "ncdhw"),
}
PRECISIONS = [("fp32", "tf32"), ("fp32", "tf32x3"), ("bf16", None), ("fp16", None)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tensors(spec, dtype):
    n, cin, cout, size, k, s, p, op, d, groups, bias, layout = spec
    k3 = (k,) * 3 if isinstance(k, int) else k
    x = torch.randn(n, cin, *size, device=DEV).to(dtype)
    if layout == "cl":
        x = x.contiguous(memory_format=CL)
    w = (torch.randn(cin, cout // groups, *k3, device=DEV) * 0.1).to(dtype)
    b = torch.randn(cout, device=DEV).to(dtype) if bias else None
    return x, w, b, (s, p, op, groups, d)


@pytest.mark.parametrize("dtype,precision", PRECISIONS, ids=[f"{a}-{b or 'native'}" for a, b in PRECISIONS])
@pytest.mark.parametrize("name", list(SWEEP))
def test_gradients_within_2x_cudnn(name, dtype, precision, monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "cudnn")
    torch.manual_seed(0)
    x, w, b, args = _tensors(SWEEP[name], DTYPES[dtype])
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    bias = leaves[2] if len(leaves) > 2 else None
    y = convt3d.conv_transpose3d(leaves[0], leaves[1], bias, *args, backend="triton", precision=precision)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    params, _ = check_call(x, w, b, *args)
    ref = _bwd(dy, x, w, params, [True, True, False], dtype64=True)
    with cudnn_conv_tf32(precision == "tf32"):
        cud = _bwd(dy, x, w, params, [True, True, False])
    budgets = [(cud[0].double() - ref[0]).abs().max().item(), (cud[1].double() - ref[1]).abs().max().item()]
    if precision == "tf32":
        ideal = _bwd(round_tf32_reference(dy), round_tf32_reference(x), round_tf32_reference(w), params,
                     [True, True, False], dtype64=True)
        budgets = [max(bud, (i - r).abs().max().item()) for bud, i, r in zip(budgets, ideal, ref)]
    for what, got, r, bud in zip(("dX", "dW"), grads[:2], ref[:2], budgets):
        err = (got.double() - r).abs().max().item()
        ulp = torch.finfo(got.dtype).eps * r.abs().max().item()
        assert err <= 2 * bud + ulp, f"{what}: error {err:.3g} > 2 x cuDNN-bar {bud:.3g} + {ulp:.3g}"
    # dX keeps the input's layout (channels_last_3d in, channels_last_3d gradient).
    assert grads[0].is_contiguous(memory_format=CL if SWEEP[name][-1] == "cl" else torch.contiguous_format)
    if bias is not None:
        db_ref = dy.double().sum((0, 2, 3, 4))
        err = (grads[2].double() - db_ref).abs().max().item()
        assert err <= 2 * torch.finfo(dy.dtype).eps * dy.double().abs().sum((0, 2, 3, 4)).max().item() + 1e-6


def test_backward_is_deterministic(monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "cudnn")
    x, w, b, args = _tensors(SWEEP["gan-k4s2p1"], torch.float32)
    runs = []
    for _ in range(2):
        leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
        y = convt3d.conv_transpose3d(*leaves, None, *args)
        runs.append(torch.autograd.grad(y, leaves, torch.ones_like(y)))
    assert all(torch.equal(p, q) for p, q in zip(runs[0], runs[1]))


# ---- Triton dX (kernels/dgrad_bwd.py) ----------------------------------------------------------
DGRAD_PRECISIONS = PRECISIONS + [("fp32", "ieee")]


def _dx_budget(dy, x, w, params, precision, ref):
    """cuDNN's own dX error against float64 (for "tf32", the larger of it and exact TF32's; 16-bit
    dtypes pass precision None)."""
    with cudnn_conv_tf32(precision == "tf32"):
        cud = _bwd(dy, x, w, params, [True, False, False])[0]
    bud = (cud.double() - ref).abs().max().item()
    if precision == "tf32":
        ideal = _bwd(round_tf32_reference(dy), x.float(), round_tf32_reference(w), params, [True, False, False],
                     dtype64=True)[0]
        bud = max(bud, (ideal - ref).abs().max().item())
    return bud


@pytest.mark.parametrize("dy_layout", ["ncdhw", "cl"])
@pytest.mark.parametrize("dtype,precision", DGRAD_PRECISIONS, ids=[f"{a}-{b or 'native'}" for a, b in DGRAD_PRECISIONS])
@pytest.mark.parametrize("name", [n for n in SWEEP if n != "depthwise"])
def test_triton_dgrad_every_candidate_within_2x_cudnn(name, dtype, precision, dy_layout):
    # Every tile configuration the timed choice may pick, on both dY layouts (NCDHW is copied to
    # NDHWC first -- rounded to TF32 in the same pass for "tf32" -- channels-last is read in place).
    torch.manual_seed(0)
    x, w, b, args = _tensors(SWEEP[name], DTYPES[dtype])
    params, _ = check_call(x, w, b, *args)
    dy = torch.randn(params.out_shape, device=DEV).to(x.dtype)
    if dy_layout == "cl":
        dy = dy.contiguous(memory_format=CL)
    prec = precision or "tf32"
    ref = _bwd(dy, x, w, params, [True, False, False], dtype64=True)[0]
    bud = _dx_budget(dy, x, w, params, precision, ref)
    ulp = torch.finfo(x.dtype).eps * ref.abs().max().item()
    fx = B.grad_formats(x, w)[0]
    for cfg in B.dgrad_candidates(params, w.dtype, x.device, prec):
        gx = B.dgrad_triton(dy, w, params, prec, x.dtype, cfg, fx)
        assert gx.dtype == x.dtype and gx.is_contiguous(memory_format=fx)
        err = (gx.double() - ref).abs().max().item()
        assert err <= 2 * bud + ulp, f"{cfg.short()}: dX error {err:.3g} > 2 x cuDNN-bar {bud:.3g} + {ulp:.3g}"
        assert torch.equal(gx, B.dgrad_triton(dy, w, params, prec, x.dtype, cfg, fx)), "not deterministic"


@pytest.mark.parametrize("dtype,precision", PRECISIONS, ids=[f"{a}-{b or 'native'}" for a, b in PRECISIONS])
@pytest.mark.parametrize("name", ["gan-k4s2p1", "monai-k3s2p1op1-cl", "grouped-dilated"])
def test_forced_triton_dgrad_through_autograd(name, dtype, precision, monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "triton")
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "cudnn")
    torch.manual_seed(0)
    x, w, b, args = _tensors(SWEEP[name], DTYPES[dtype])
    leaves = [t.detach().requires_grad_() for t in (x, w)]
    y = convt3d.conv_transpose3d(leaves[0], leaves[1], b, *args, backend="triton", precision=precision)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, leaves, dy)
    params, _ = check_call(x, w, b, *args)
    ref = _bwd(dy, x, w, params, [True, True, False], dtype64=True)
    bud = _dx_budget(dy, x, w, params, precision, ref[0])
    err = (gx.double() - ref[0]).abs().max().item()
    assert err <= 2 * bud + torch.finfo(gx.dtype).eps * ref[0].abs().max().item()
    assert gx.is_contiguous(memory_format=CL if SWEEP[name][-1] == "cl" else torch.contiguous_format)
    # dW is checked by test_gradients_within_2x_cudnn; here only that it is still there and sane.
    assert (gw.double() - ref[1]).abs().max().item() <= 0.05 * ref[1].abs().max().item()


def test_dgrad_choice_is_timed_on_cuda(monkeypatch, auto_state):
    # auto_state: a fresh cache directory, so the choice is timed here, not read from a file.
    monkeypatch.delenv("CONVT3D_BWD_INPUT", raising=False)
    monkeypatch.delenv("CONVT3D_AUTOTUNE", raising=False)
    B.clear_caches()
    x, w, b, args = _tensors(SWEEP["gan-k4s2p1"], torch.bfloat16)
    leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
    y = convt3d.conv_transpose3d(*leaves, b, *args, backend="triton")
    torch.autograd.grad(y, leaves, torch.randn_like(y))
    recs = list(B.dgrad_choices().values())
    assert len(recs) == 1 and recs[0].reason.startswith("timed")
    params, _ = check_call(x, w, b, *args)
    assert "cudnn" in recs[0].timings_ms
    assert len(recs[0].timings_ms) == 1 + len(B.dgrad_candidates(params, x.dtype, x.device, "tf32"))
    assert (recs[0].impl == "triton") == (recs[0].config is not None)


# ---- opcheck -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,precision", [("fp32", "tf32x3"), ("bf16", "tf32")], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["monai-k3s2p1op1-cl", "grouped-dilated"])
def test_opcheck_cuda(name, dtype, precision, monkeypatch):
    # opcheck compares eager and compiled gradients at ~1e-6 relative; pin the backward to one
    # implementation per gradient, or the two runs may time different winners (cuDNN exact fp32
    # vs Triton 3xTF32: both within the accuracy bar, not equal to 1e-6). The kernels' accuracy
    # is tested by the gradient sweeps.
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "cudnn")
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "cudnn")
    x, w, b, args = _tensors(SWEEP[name], DTYPES[dtype])
    params, _ = check_call(x, w, b, *args)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(conv_transpose3d_op, (x, w, b, list(params.stride), list(params.padding),
                                                list(params.output_padding), params.groups,
                                                list(params.dilation), precision, "triton"))


# ---- compile, CUDA graphs, autocast ------------------------------------------------------------
def _model(dtype=torch.float32, cl=False):
    torch.manual_seed(0)
    m = nn.Sequential(convt3d.ConvTranspose3d(32, 16, 2, stride=2), nn.ReLU(),
                      convt3d.ConvTranspose3d(16, 16, 3, stride=2, padding=1, output_padding=1)).to(DEV, dtype)
    return m.to(memory_format=CL) if cl else m


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compile_fullgraph_inductor(dtype):
    torch._dynamo.reset()
    m = _model(DTYPES[dtype])
    x = torch.randn(2, 32, 4, 4, 4, device=DEV, dtype=DTYPES[dtype], requires_grad=True)
    y0 = m(x)
    y0.float().square().sum().backward()
    eager = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    cm = torch.compile(m, fullgraph=True)
    y1 = cm(x)
    y1.float().square().sum().backward()
    tol = 1e-5 if dtype == "fp32" else 2e-2
    torch.testing.assert_close(y1, y0, rtol=tol, atol=tol)
    for a, b_ in zip([p.grad for p in m.parameters()] + [x.grad], eager):
        torch.testing.assert_close(a, b_, rtol=tol, atol=tol * max(1.0, b_.abs().max().item()))


def test_cuda_graph_capture_forward_backward():
    m = _model()
    static_x = torch.randn(2, 32, 4, 4, 4, device=DEV, requires_grad=True)
    opt_params = list(m.parameters())
    # Warm up on a side stream: compiles, tunes forward and backward (no tuning during capture).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            for p in opt_params:
                p.grad = None
            m(static_x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    for p in opt_params:
        p.grad = None
    static_x.grad = None
    with torch.cuda.graph(g):
        static_loss = m(static_x).square().sum()
        static_loss.backward()
    static_grads = [p.grad for p in opt_params] + [static_x.grad]  # the graph's own buffers
    for trial in range(2):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
        g.replay()
        torch.cuda.synchronize()
        xe = static_x.detach().clone().requires_grad_()
        captured = [t.clone() for t in static_grads]
        for p in opt_params:
            p.grad = None
        loss = m(xe).square().sum()
        loss.backward()
        eager = [p.grad for p in opt_params] + [xe.grad]
        torch.testing.assert_close(static_loss, loss, rtol=1e-5, atol=1e-5)
        for a, b_ in zip(captured, eager):
            torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5 * max(1.0, b_.abs().max().item()))
        for p in opt_params:
            p.grad = None


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_autocast_like_nn_convtranspose3d(dtype):
    torch.manual_seed(0)
    ours = convt3d.ConvTranspose3d(32, 16, 3, stride=2, padding=1).to(DEV)
    ref = nn.ConvTranspose3d(32, 16, 3, stride=2, padding=1).to(DEV)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 32, 4, 4, 4, device=DEV)
    with torch.autocast("cuda", dtype=DTYPES[dtype]):
        y, y_ref = ours(x), ref(x)
    assert y.dtype == y_ref.dtype == DTYPES[dtype]
    y.float().sum().backward()
    y_ref.float().sum().backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2 * q.grad.abs().max().item())
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)


# ---- training curve ----------------------------------------------------------------------------
class UNetDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up1 = nn.ConvTranspose3d(64, 32, 2, stride=2)
        self.fuse1 = nn.Conv3d(64, 32, 3, padding=1)
        self.up2 = nn.ConvTranspose3d(32, 16, 2, stride=2)
        self.fuse2 = nn.Conv3d(32, 16, 3, padding=1)
        self.head = nn.Conv3d(16, 1, 1)

    def forward(self, bottom, s1, s2):
        h = torch.relu(self.fuse1(torch.cat([self.up1(bottom), s1], 1)))
        h = torch.relu(self.fuse2(torch.cat([self.up2(h), s2], 1)))
        return self.head(h)


@pytest.mark.parametrize("regime", ["fp32-exact", "bf16-autocast"])
def test_training_curve_50_steps(regime, restore_tf32):
    # fp32 with TF32 off on both sides: the runs differ by summation order only, so the losses
    # agree to 1e-3 relative over 50 Adam steps; bf16 autocast rounds every activation to 8 bits
    # (2^-9 relative), so 5e-2 relative is noise level there.
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    ref = UNetDecoder().to(DEV)
    ours = UNetDecoder().to(DEV)
    ours.load_state_dict(ref.state_dict())
    convt3d.patch(ours)
    gen = torch.Generator(device=DEV).manual_seed(1)
    batches = [(torch.randn(2, 64, 4, 4, 4, device=DEV, generator=gen),
                torch.randn(2, 32, 8, 8, 8, device=DEV, generator=gen),
                torch.randn(2, 16, 16, 16, 16, device=DEV, generator=gen),
                torch.randn(2, 1, 16, 16, 16, device=DEV, generator=gen)) for _ in range(4)]
    losses = {}
    for name, model in (("ref", ref), ("ours", ours)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses[name] = []
        for step in range(50):
            bottom, s1, s2, target = batches[step % 4]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=regime == "bf16-autocast"):
                loss = F.mse_loss(model(bottom, s1, s2).float(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    tol = 1e-3 if regime == "fp32-exact" else 5e-2
    assert losses["ref"][-1] < losses["ref"][0]
    for step, (a, b_) in enumerate(zip(losses["ours"], losses["ref"])):
        assert abs(a - b_) <= tol * abs(b_), f"step {step}: {a} vs {b_}"


@pytest.fixture
def restore_tf32():
    old = torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_second_order_gradients(backend):
    """create_graph=True on our engines (a path-length-style penalty): the second-order gradients
    of the weight and bias against float64 PyTorch, exact grade. TF32 is off for the whole test:
    the ops of the second backward run at cuDNN's flags as they are then (as PyTorch's own
    layer's do), which at PyTorch's default TF32 err ~1e-4 of the largest gradient."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 5, 6, 7, device=DEV)
    w = torch.randn(16, 8, 3, 3, 3, device=DEV) * 0.2
    b = torch.randn(8, device=DEV)
    results = []
    with cudnn_conv_tf32(False):
        for dtype, be in ((torch.float32, backend), (torch.float64, "torch")):
            xs, ws, bs = (t.to(dtype).clone().requires_grad_() for t in (x, w, b))
            y = convt3d.conv_transpose3d(xs, ws, bs, 2, 1, backend=be)
            gx, = torch.autograd.grad(y.square().sum(), xs, create_graph=True)
            results.append(torch.autograd.grad(gx.square().sum(), (ws, bs)))
    for got, want in zip(*results):
        scale = want.abs().max().item()
        assert scale > 0 and (got.double() - want).abs().max().item() <= 1e-4 * scale
