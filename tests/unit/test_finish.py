"""The finishing kernels (engines/triton/finish.py) against PyTorch in float64: reductions over each
axis and over all space, the subtraction of each plane's mean, pooling, BatchNorm (with the running
statistics' update) and GroupNorm, each with ``pre``/``post`` programs; the errors they raise; and a
compile of every kernel for sm_90 (the interpreter does not check what only the compiler rejects). The
helpers take a device: the GPU tests (tests/gpu/test_gpu_finish.py) run them on CUDA."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
import triton

from convt3d.core.epilogue import apply_torch, as_epilogue
from convt3d.engines.triton import finish as FIN
from clean_process import compile_in_clean_process

# CPU tensors run through Triton's interpreter (conftest turns it on where there is no GPU); not
# conftest's own marker, since the compile test's clean process runs this file without conftest.
requires_interpreter = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                                          reason="CPU tensors need TRITON_INTERPRET=1 before triton is imported")

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
KEEP = ("sum", "mean", "max", "logsumexp")


def _close(got, want, dtype):
    """Within a few units of the output dtype's rounding, relative to the reference's largest value."""
    assert got.dtype == dtype and got.shape == want.shape
    tol = RTOL[dtype] * (1.0 + want.abs().max().item())
    torch.testing.assert_close(got.double(), want, rtol=RTOL[dtype], atol=tol)


def _pre(C, device):
    """Per-channel, scalar and activation steps, the register included."""
    return [("mul", torch.linspace(0.5, 1.5, C, device=device)), ("add", -0.25), "save", "gelu", "add_saved"]


def _post(C, device):
    if C == 1:  # one channel: scalar steps (or a one-value tensor)
        return [("mul", 0.5), "tanh", ("add", torch.tensor([0.125], device=device))]
    return [("add", torch.linspace(-1.0, 1.0, C, device=device)), ("leaky_relu", 0.2), ("div", 2.0)]


def _f64(y, program, channels):
    """``program`` on ``y`` in PyTorch (which computes it in float32), as float64."""
    return y.double() if program is None else apply_torch(y.double(), as_epilogue(program, channels), 1).double()


def _ref_reduce(x, dims, op, w=None, b=None, eps=1e-5):
    """``op`` over the consecutive ``dims`` of the float64 ``x``, from their flattening."""
    a, z = dims[0], dims[-1]
    sh = list(x.shape)
    f = x.reshape(sh[:a] + [-1] + sh[z + 1:])
    if op == "softmax":
        return torch.softmax(f, a).reshape(sh)
    if op == "layer_norm":
        r = (f - f.mean(a, keepdim=True)) / torch.sqrt(f.var(a, unbiased=False, keepdim=True) + eps)
        at = [1] * r.dim()
        at[a] = -1
        r = r if w is None else r * w.double().reshape(at)
        return (r if b is None else r + b.double().reshape(at)).reshape(sh)
    r = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "logsumexp": torch.logsumexp}[op](f, a, keepdim=True)
    return r.reshape([1 if k in dims else s for k, s in enumerate(sh)])


def run_reduce(shape, dim, op, dtype, device, programs=True, affine=True):
    y = torch.randn(shape, device=device).to(dtype)
    dims = [d % 5 for d in (dim if isinstance(dim, tuple) else (dim,))]
    C = shape[1]
    c_post = 1 if op in KEEP and 1 in dims else C
    pre, post = (_pre(C, device), _post(c_post, device)) if programs else (None, None)
    R = torch.Size([shape[d] for d in dims]).numel()
    w = b = None
    if op == "layer_norm" and affine:
        w, b = torch.randn([shape[d] for d in dims], device=device), torch.randn(R, device=device)
    got = FIN.reduce(y, dim, op, pre=pre, post=post, weight=w, bias=b)
    _close(got, _f64(_ref_reduce(_f64(y, pre, C), dims, op, w, b), post, c_post), dtype)


def run_subtract_mean(shape, dtype, device, programs=True):
    C = shape[1]
    y = torch.randn(shape, device=device).to(dtype)
    pre, post = (_pre(C, device), _post(C, device)) if programs else (None, None)
    v = _f64(y, pre, C)
    got = FIN.subtract_mean(y, pre=pre, post=post)
    _close(got, _f64(v - v.mean((2, 3, 4), keepdim=True), post, C), dtype)


def run_pool(shape, kind, k, s, dtype, device):
    y = torch.randn(shape, device=device).to(dtype)
    C = shape[1]
    got = FIN.pool(y, kind, k, s, pre=_pre(C, device), post=_post(C, device))
    fn = F.max_pool3d if kind == "max" else F.avg_pool3d
    _close(got, _f64(fn(_f64(y, _pre(C, device), C), k, s), _post(C, device), C), dtype)


# The direct convolution: (input shape, output channels, kernel, stride, padding, output_padding, dilation)
DIRECTS = {
    "rgb-k3-s2-p1": ((2, 3, 4, 5, 6), 5, 3, 2, 1, 0, 1),
    "rgb-k3-s2-p1-op1": ((2, 3, 3, 4, 5), 4, 3, 2, 1, 1, 1),
    "gan-k4-s2-p1": ((1, 2, 3, 4, 5), 3, 4, 2, 1, 0, 1),
    "k3-s1-p1": ((2, 4, 3, 4, 5), 6, 3, 1, 1, 0, 1),
    "aniso-dilated": ((1, 2, 3, 4, 5), 3, (1, 3, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (1, 2, 1)),
}
# What follows it in registers: direct's keyword arguments (programs by channel count).
FINISHES = {
    "none": lambda C: dict(),
    "pre-max-pool": lambda C: dict(pre=_pre(C, "cpu"), pool="max"),
    "avg-pool-post": lambda C: dict(pool="avg", post=_post(C, "cpu")),
    "logsumexp-post": lambda C: dict(pre=_pre(C, "cpu"), channel_op="logsumexp", post=_post(1, "cpu")),
    "pool-softmax-mid-max": lambda C: dict(pool="max", softmax=True, mid=[("add", -0.1), "save", "sigmoid",
                                                                          "mul_saved"], channel_op="max"),
    "sum-then-mean": lambda C: dict(channel_op="sum", mean=True, post=_post(1, "cpu")),
    "pool-then-mean": lambda C: dict(pre=[("mul", 0.5)], pool="max", mean=True, post=[("clamp_min", 0.0)]),
}


def _on(program, device):
    return None if program is None else [tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in step)
                                         if isinstance(step, tuple) else step for step in program]


def _ref_direct(x, w, b, geometry, kw):
    """The composite ``direct`` stands for, in float64 from ``x``, ``w`` and ``b`` as given."""
    s, p, op, d = geometry
    C = w.shape[1]
    y = F.conv_transpose3d(x.double(), w.double(), b.double(), s, p, op, 1, d)
    y = _f64(y, kw.get("pre"), C)
    if kw.get("pool"):
        y = (F.max_pool3d if kw["pool"] == "max" else F.avg_pool3d)(y, s, s)
    if kw.get("softmax"):
        y = torch.softmax(y, 1)
    y = _f64(y, kw.get("mid"), C)
    op_ = kw.get("channel_op")
    if op_:
        y = {"sum": lambda t: t.sum(1, keepdim=True), "max": lambda t: t.amax(1, keepdim=True),
             "logsumexp": lambda t: torch.logsumexp(t, 1, keepdim=True)}[op_](y)
    if kw.get("mean"):
        y = y.mean((2, 3, 4), keepdim=True)
    return _f64(y, kw.get("post"), y.shape[1])


def run_direct(regime, finish, dtype, device, tf32=False):
    shape, cout, k, *geometry = DIRECTS[regime]
    k = (k,) * 3 if isinstance(k, int) else k
    x = torch.randn(shape, device=device).to(dtype)
    w = (0.3 * torch.randn(shape[1], cout, *k, device=device)).to(dtype)
    b = torch.randn(cout, device=device).to(dtype)
    kw = {key: _on(v, device) if key in ("pre", "mid", "post") else v
          for key, v in FINISHES[finish](cout).items()}
    got = FIN.direct(x, w, b, *geometry, tf32=tf32, **kw)
    if tf32:  # operands rounded to the nearest TF32, ties away, as cuDNN rounds them
        x, w = (((t.float().view(torch.int32) + 0x1000) & -8192).view(torch.float32) for t in (x, w))
    _close(got, _ref_direct(x, w, b, geometry, kw), dtype)


def run_batch_norm(shape, momentum, affine, dtype, device, steps=2, loc=0.0, programs=True, evaluate=True):
    """nn.BatchNorm3d in float64 (train mode, then eval unless not ``evaluate``) and our batch_norm
    on the same stream of inputs: outputs and running statistics after each step; ``momentum=None``
    is the module's cumulative average, to which it passes ``1 / num_batches_tracked``."""
    C = shape[1]
    bn = torch.nn.BatchNorm3d(C, momentum=momentum, affine=affine, device=device, dtype=torch.float64)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1.0, 1.0)
    rm = torch.zeros(C, device=device)
    rv = torch.ones(C, device=device)
    w, b = (bn.weight.float(), bn.bias.float()) if affine else (None, None)
    pre, post = (_pre(C, device), _post(C, device)) if programs else (None, None)
    for step in range(steps):
        y = (torch.randn(shape, device=device) + loc).to(dtype)
        bn.train()
        want = bn(_f64(y, pre, C)).detach()
        factor = 1.0 / bn.num_batches_tracked.item() if momentum is None else momentum
        got = FIN.batch_norm(y, w, b, rm, rv, True, factor, bn.eps, pre=pre, post=post)
        _close(got, _f64(want, post, C), dtype)
        torch.testing.assert_close(rm.double(), bn.running_mean, rtol=1e-5, atol=1e-5 * (1 + abs(loc)))
        torch.testing.assert_close(rv.double(), bn.running_var, rtol=1e-5, atol=1e-5)
    if not evaluate:
        return
    bn.eval()
    got = FIN.batch_norm(y, w, b, rm, rv, False, 0.1, bn.eps, pre=pre, post=post)
    _close(got, _f64(bn(_f64(y, pre, C)).detach(), post, C), dtype)


def run_group_norm(shape, groups, affine, dtype, device, loc=0.0, programs=True):
    C = shape[1]
    y = (torch.randn(shape, device=device) + loc).to(dtype)
    w, b = (torch.rand(C, device=device) + 0.5, torch.randn(C, device=device)) if affine else (None, None)
    pre, post = (_pre(C, device), _post(C, device)) if programs else (None, None)
    got = FIN.group_norm(y, groups, w, b, 1e-5, pre=pre, post=post)
    want = F.group_norm(_f64(y, pre, C), groups, None if w is None else w.double(),
                        None if b is None else b.double(), 1e-5)
    _close(got, _f64(want, post, C), dtype)


# (shape, dim): each axis, all space, odd sizes; C = 130 crosses the channel block; a width of 300
# and a space of 990 take the one-row-per-program view, the shorter ones many rows per program.
REDUCTIONS = {
    "channels-c3-odd": ((2, 3, 5, 3, 7), 1),
    "channels-c130-crosses-block": ((1, 130, 2, 3, 5), 1),
    "depth": ((2, 4, 7, 3, 5), 2),
    "height": ((1, 3, 2, 9, 5), 3),
    "width": ((2, 3, 3, 4, 9), 4),
    "width-300-long-rows": ((1, 2, 2, 1, 300), -1),
    "spatial": ((2, 3, 5, 6, 7), (2, 3, 4)),
    "spatial-990-long-rows": ((1, 2, 9, 10, 11), (2, 3, 4)),
    "height-width": ((2, 3, 3, 5, 6), (3, 4)),
}


@requires_interpreter
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("op", FIN.REDUCE_OPS)
@pytest.mark.parametrize("regime", list(REDUCTIONS))
def test_reduce(regime, op, dtype):
    shape, dim = REDUCTIONS[regime]
    run_reduce(shape, dim, op, DT[dtype], "cpu")


@requires_interpreter
@pytest.mark.parametrize("op", FIN.REDUCE_OPS)
@pytest.mark.parametrize("regime", ["channels-c3-odd", "width", "spatial"])
def test_reduce_without_programs(regime, op):
    shape, dim = REDUCTIONS[regime]
    run_reduce(shape, dim, op, torch.float32, "cpu", programs=False, affine=False)


@requires_interpreter
def test_reduce_negative_dim_is_the_same_axis():
    y = torch.randn(2, 3, 2, 2, 5)
    torch.testing.assert_close(FIN.reduce(y, -1, "softmax"), FIN.reduce(y, 4, "softmax"), rtol=0, atol=0)


@requires_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_softmax_and_logsumexp_of_a_column_of_minus_infinity():
    """PyTorch's answers: softmax is NaN where every value is -inf, logsumexp -inf (the interpreter's
    NumPy warns of the 0 / 0 and log(0) that give them)."""
    y = torch.randn(1, 4, 1, 1, 3)
    y[0, :, 0, 0, 1] = float("-inf")
    torch.testing.assert_close(FIN.reduce(y, 1, "softmax"), torch.softmax(y, 1), equal_nan=True)
    torch.testing.assert_close(FIN.reduce(y, 1, "logsumexp"), torch.logsumexp(y, 1, keepdim=True))


# Planes of 105 values (many per program), 990 (one per program, one block) and 4347 (several
# blocks); a plane of one value leaves post(0).
SUBTRACT_MEANS = {
    "odd-105-many-rows": (2, 3, 5, 3, 7),
    "990-one-row-per-program": (1, 2, 9, 10, 11),
    "4347-several-blocks": (1, 2, 9, 23, 21),
    "one-value-planes": (2, 5, 1, 1, 1),
}


@requires_interpreter
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("regime", list(SUBTRACT_MEANS))
def test_subtract_mean(regime, dtype):
    run_subtract_mean(SUBTRACT_MEANS[regime], DT[dtype], "cpu")


@requires_interpreter
@pytest.mark.parametrize("regime", ["odd-105-many-rows", "4347-several-blocks"])
def test_subtract_mean_without_programs(regime):
    run_subtract_mean(SUBTRACT_MEANS[regime], torch.float32, "cpu", programs=False)


POOLS = {
    "k2-odd-floor": ((2, 3, 7, 6, 5), 2, None),
    "k3-s1-overlap": ((1, 2, 5, 6, 7), 3, 1),
    "k123-s122": ((2, 3, 4, 6, 7), (1, 2, 3), (1, 2, 2)),
    "k2-s3-gaps": ((1, 3, 8, 7, 9), 2, 3),
}


@requires_interpreter
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("regime", list(POOLS))
def test_pool(regime, kind, dtype):
    shape, k, s = POOLS[regime]
    run_pool(shape, kind, k, s, DT[dtype], "cpu")


@requires_interpreter
@requires_interpreter
@pytest.mark.parametrize("finish", list(FINISHES))
@pytest.mark.parametrize("regime", list(DIRECTS))
def test_direct(regime, finish):
    run_direct(regime, finish, torch.float32, "cpu")


@requires_interpreter
@pytest.mark.parametrize("dtype", ["fp16", "fp32-tf32"])
def test_direct_low_precision(dtype):
    run_direct("rgb-k3-s2-p1", "pool-softmax-mid-max", torch.float32 if dtype == "fp32-tf32" else DT[dtype], "cpu",
               tf32=dtype == "fp32-tf32")


@requires_interpreter
@pytest.mark.parametrize("geometry, window", [
    (((2, 3, 4, 5, 6), 5, 3, 2, 1, 0, 1), 4),  # KernelBench 72's: two pools of 2 after a stride of 2
    (((1, 2, 3, 4, 5), 3, (1, 3, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (1, 2, 1)), (2, 4, 3)),
    (((1, 2, 10, 12, 14), 4, 3, 1, 1, 0, 1), (1, 2, 3)),  # 300 cells: three blocks' sums a plane
], ids=["kb72", "aniso-dilated", "three-blocks"])
def test_direct_stats_give_batch_norm_of_the_pooled_layer(geometry, window):
    """``direct(stats=True)``'s sums of every output element (those the pool leaves out too) give batch_norm the
    layer's batch statistics, its affine applied to the pooled tensor: BatchNorm then the average pool, and
    the running statistics, as PyTorch's in float64."""
    shape, cout, k, *geo = geometry
    k = (k,) * 3 if isinstance(k, int) else k
    x, w, b = torch.rand(shape) + 0.5, 0.3 * torch.randn(shape[1], cout, *k), torch.randn(cout)
    weight, bias = torch.rand(cout) + 0.5, torch.randn(cout)
    rm, rv = torch.randn(cout), torch.rand(cout) + 0.5
    rm64, rv64 = rm.double(), rv.double()
    pooled, sums = FIN.direct(x, w, b, *geo, pool="avg", window=window, pre=[("mul", 0.5)], stats=True)
    got = FIN.batch_norm(pooled, weight, bias, rm, rv, True, 0.1, 1e-5, sums=sums)
    y = 0.5 * F.conv_transpose3d(x.double(), w.double(), b.double(), geo[0], geo[1], geo[2], 1, geo[3])
    want = F.avg_pool3d(F.batch_norm(y, rm64, rv64, weight.double(), bias.double(), True, 0.1, 1e-5), window)
    _close(got, want, torch.float32)
    _close(torch.stack([rm, rv]), torch.stack([rm64, rv64]), torch.float32)


def test_direct_reason_names_the_limit():
    x = torch.randn(1, 3, 2, 2, 2)
    assert FIN.direct_reason(x, torch.randn(3, 16, 3, 3, 3)) is None
    assert "groups=3" in FIN.direct_reason(x, torch.randn(3, 4, 3, 3, 3), groups=3)
    assert "65 output channels" in FIN.direct_reason(x, torch.randn(3, 65, 1, 1, 1))
    assert "takes at most" in FIN.direct_reason(torch.randn(1, 32, 2, 2, 2), torch.randn(32, 4, 3, 3, 3))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum-0.1", "momentum-none-cumulative"])
def test_batch_norm_train_updates_running_stats(momentum, affine, dtype):
    run_batch_norm((3, 5, 3, 4, 5), momentum, affine, DT[dtype], "cpu")


@requires_interpreter
def test_batch_norm_large_mean_and_count():
    """70,000 values per (n, c) row, split into chunks, around a mean of 1000: a sum of squares in
    float32 would lose the variance; centred partials keep it. (The moments are the training step's:
    evaluation mode reads the running statistics, checked on the small shapes.)"""
    run_batch_norm((2, 2, 40, 35, 50), 0.1, True, torch.float32, "cpu", steps=1, loc=1000.0, programs=False,
                   evaluate=False)


@requires_interpreter
def test_batch_norm_without_running_stats_uses_batch_stats():
    y = torch.randn(2, 3, 2, 3, 4)
    got = FIN.batch_norm(y, None, None, None, None, True, 0.1, 1e-5)
    _close(got, F.batch_norm(y.double(), None, None, training=True), torch.float32)


@requires_interpreter
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("groups", [1, 3, 6], ids=["one-group", "groups-of-2", "group-per-channel"])
def test_group_norm(groups, affine, dtype):
    run_group_norm((2, 6, 3, 5, 4), groups, affine, DT[dtype], "cpu")


@requires_interpreter
def test_group_norm_large_mean_and_count():
    """72,000 values per (n, group) row around a mean of 1000, as for BatchNorm."""
    run_group_norm((1, 4, 30, 30, 40), 2, True, torch.float32, "cpu", loc=1000.0, programs=False)


@requires_interpreter
def test_a_validated_epilogue_is_checked_against_the_call():
    y = torch.randn(1, 3, 2, 2, 2)
    epi = as_epilogue([("mul", torch.ones(3)), "relu"], 3)
    _close(FIN.reduce(y, 2, "sum", pre=epi), F.relu(y.double()).sum(2, keepdim=True), torch.float32)
    with pytest.raises(ValueError, match="per-channel"):
        FIN.reduce(torch.randn(1, 4, 2, 2, 2), 2, "sum", pre=epi)


@requires_interpreter
@pytest.mark.parametrize("op", KEEP)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1, 1, 1)], ids=["0d", "one-value", "one-value-4d"])
def test_one_value_tensor_in_post_of_a_channel_reduction(op, shape):
    """The output of a reduction over channels has one channel, so a tensor of one value is a per-channel
    operand (channel 0): a model's one-value parameter stays on the device."""
    y = torch.randn(2, 3, 2, 3, 5)
    b = torch.tensor(0.75).reshape(shape)
    got = FIN.reduce(y, 1, op, post=[("add", -b), "tanh", ("mul", b)])
    _close(got, torch.tanh(_ref_reduce(y.double(), [1], op) - 0.75) * 0.75, torch.float32)


Y = torch.randn(2, 3, 4, 4, 4)
ERRORS = {
    "dim-batch": (lambda: FIN.reduce(Y, 0, "sum"), ValueError, "dim must be"),
    "dim-not-consecutive": (lambda: FIN.reduce(Y, (2, 4), "sum"), ValueError, "dim must be"),
    "dim-out-of-range": (lambda: FIN.reduce(Y, 5, "sum"), ValueError, "dim must be"),
    "dim-not-int": (lambda: FIN.reduce(Y, "w", "sum"), TypeError, "dim must be"),
    "op-unknown": (lambda: FIN.reduce(Y, 1, "median"), ValueError, "op must be"),
    "weight-not-layer-norm": (lambda: FIN.reduce(Y, 1, "sum", weight=torch.ones(3)), ValueError, "layer_norm"),
    "layer-norm-weight-size": (lambda: FIN.reduce(Y, 4, "layer_norm", weight=torch.ones(3)), RuntimeError,
                               "4 elements"),
    "residual-in-pre": (lambda: FIN.reduce(Y, 1, "softmax", pre=[("add", torch.randn(Y.shape))]), ValueError,
                        "residual"),
    "residual-in-post": (lambda: FIN.pool(Y, "max", 2, post=[("add", torch.randn(2, 3, 2, 2, 2))]), ValueError,
                         "residual"),
    "per-channel-post-of-channel-sum": (lambda: FIN.reduce(Y, 1, "sum", post=[("mul", torch.ones(3))]),
                                        ValueError, "per-channel"),
    "unknown-step": (lambda: FIN.reduce(Y, 2, "max", pre=["swish"]), ValueError, "unknown step"),
    "not-5d": (lambda: FIN.reduce(Y[0], 1, "sum"), ValueError, "5-D"),
    "subtract-mean-not-5d": (lambda: FIN.subtract_mean(Y[0]), ValueError, "5-D"),
    "subtract-mean-not-tensor": (lambda: FIN.subtract_mean(Y.tolist()), TypeError, "must be Tensor"),
    "subtract-mean-residual-in-post": (lambda: FIN.subtract_mean(Y, post=[("add", torch.randn(Y.shape))]), ValueError,
                                       "residual"),
    "subtract-mean-per-channel-size": (lambda: FIN.subtract_mean(Y, pre=[("mul", torch.ones(4))]), ValueError,
                                       "per-channel"),
    "int-dtype": (lambda: FIN.pool(Y.long(), "max", 2), TypeError, "float32"),
    "pool-kind": (lambda: FIN.pool(Y, "min", 2), ValueError, "kind"),
    "pool-kernel-zero": (lambda: FIN.pool(Y, "max", 0), ValueError, "greater than zero"),
    "pool-kernel-pair": (lambda: FIN.pool(Y, "avg", (2, 2)), TypeError, "three ints"),
    "pool-too-small": (lambda: FIN.pool(Y, "max", 5), RuntimeError, "Output size is too small"),
    "bn-eval-without-stats": (lambda: FIN.batch_norm(Y, None, None, None, None, False, 0.1, 1e-5), RuntimeError,
                              "evaluation mode"),
    "bn-one-value-per-channel": (lambda: FIN.batch_norm(Y[:1, :, :1, :1, :1], None, None, None, None, True, 0.1,
                                                        1e-5), ValueError, "more than 1 value"),
    "bn-weight-size": (lambda: FIN.batch_norm(Y, torch.ones(4), None, None, None, True, 0.1, 1e-5), RuntimeError,
                       "weight should contain 3 elements not 4"),
    "bn-bias-size": (lambda: FIN.batch_norm(Y, None, torch.ones(4), None, None, True, 0.1, 1e-5), RuntimeError,
                     "bias should contain 3 elements not 4"),
    "bn-running-var-size": (lambda: FIN.batch_norm(Y, None, None, torch.zeros(3), torch.ones(2), False, 0.1, 1e-5),
                            RuntimeError, "running_var should contain 3 elements not 2"),
    "bn-momentum-none": (lambda: FIN.batch_norm(Y, None, None, torch.zeros(3), torch.ones(3), True, None, 1e-5),
                         TypeError, "momentum"),
    "gn-groups": (lambda: FIN.group_norm(Y, 2), RuntimeError, "divisible by num_groups"),
    "direct-pool-kind": (lambda: FIN.direct(Y, torch.randn(3, 2, 2, 2, 2), pool="min"), ValueError, "pool must be"),
    "direct-channel-op": (lambda: FIN.direct(Y, torch.randn(3, 2, 2, 2, 2), channel_op="mean"), ValueError,
                          "channel_op must be"),
    "direct-weight-channels": (lambda: FIN.direct(Y, torch.randn(4, 2, 2, 2, 2)), RuntimeError, "to have 4 channels"),
    "direct-too-many-channels": (lambda: FIN.direct(Y, torch.randn(3, 80, 1, 1, 1)), ValueError,
                                 "at most 64"),
    "direct-weight-dtype": (lambda: FIN.direct(Y, torch.randn(3, 2, 2, 2, 2).half()), RuntimeError,
                            "should be the same"),
    "direct-bias-size": (lambda: FIN.direct(Y, torch.randn(3, 2, 2, 2, 2), torch.randn(3)), RuntimeError,
                         "with 2 elements"),
    "direct-stride-zero": (lambda: FIN.direct(Y, torch.randn(3, 2, 2, 2, 2), None, 0), RuntimeError,
                           "non-positive stride"),
    "direct-pooled-too-small": (lambda: FIN.direct(Y[:, :, :1, :1, :1], torch.randn(3, 2, 1, 1, 1), None, 2,
                                                   pool="max"), RuntimeError, "too small"),
    "direct-window": (lambda: FIN.direct(Y, torch.randn(3, 2, 1, 1, 1), None, 2, pool="avg", window=3), ValueError,
                      "multiple of the stride"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
    fn, exc, match = ERRORS[case]
    with pytest.raises(exc, match=match):
        fn()


# Every kernel with steps of each operand form, in each mode, compiled for sm_90 in a clean process.
PROG = 8 | (2 << 5) | (14 << 10) | (16 << 15) | (17 << 20)  # relu, per-channel mul, sigmoid, save, mul_saved
COMPILES = [("axis_kernel", "fp16", dict(MODE=m, PRE=PROG, POST=1 | (4 << 5), HAS_W=m == 5, HAS_B=m == 5,
                                         BLOCK_R=64, BLOCK_I=64)) for m in range(6)] + [
    ("axis_kernel", "bf16", dict(MODE=3, PRE=0, POST=1, HAS_W=False, HAS_B=False, BLOCK_R=4096, BLOCK_I=1)),
    ("moments_kernel", "fp32", dict(PRE=PROG, BLOCK=1024)),
    ("stats_kernel", "fp32", dict(TRAIN=True, UPDATE=True, HAS_W=True, HAS_B=True, RAW=False, BLOCK_T=128,
                                  BLOCK_C=1)),
    ("stats_kernel", "fp32", dict(TRAIN=True, UPDATE=True, HAS_W=True, HAS_B=True, RAW=True, BLOCK_T=1024,
                                  BLOCK_C=1)),
    ("stats_kernel", "fp32", dict(TRAIN=False, UPDATE=False, HAS_W=False, HAS_B=True, RAW=False, BLOCK_T=1,
                                  BLOCK_C=8)),
    ("affine_kernel", "bf16", dict(PRE=PROG, POST=PROG, BLOCK=1024)),
    ("pool_kernel", "fp16", dict(KD=2, KH=3, KW=2, MAX=True, PRE=PROG, POST=PROG, BLOCK=256)),
    ("pool_kernel", "fp32", dict(KD=2, KH=2, KW=2, MAX=False, PRE=0, POST=0, BLOCK=1024)),
    ("direct_kernel", "fp32", dict(KD=3, KH=3, KW=3, SD=2, SH=2, SW=2, PD=1, PH=1, PW=1, DD=1, DH=1, DW=1,
                                   HAS_B=True, TF32=True, POOL=1, SOFTMAX=True, RED=2, MEAN=False, STATS=False,
                                   PRE=PROG, MID=PROG, POST=1, BLOCK_P=256, BLOCK_C=16, BLOCK_R=1)),
    ("direct_kernel", "bf16", dict(KD=3, KH=3, KW=3, SD=2, SH=2, SW=2, PD=1, PH=1, PW=1, DD=1, DH=1, DW=1,
                                   HAS_B=False, TF32=False, POOL=0, SOFTMAX=False, RED=0, MEAN=True, STATS=False,
                                   PRE=PROG, MID=0, POST=0, BLOCK_P=128, BLOCK_C=16, BLOCK_R=16)),
    ("direct_kernel", "fp16", dict(KD=1, KH=3, KW=4, SD=1, SH=2, SW=3, PD=0, PH=1, PW=2, DD=1, DH=2, DW=1,
                                   HAS_B=True, TF32=False, POOL=2, SOFTMAX=False, RED=3, MEAN=False, STATS=True, PRE=0,
                                   MID=0, POST=PROG, BLOCK_P=64, BLOCK_C=4, BLOCK_R=1)),
]


def _compile(name: str, dtype: str, consts: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from convt3d.engines.triton.kernels import finish as K

    fn = getattr(K, name)
    floats, data = {"eps", "momentum", "inv_count"}, {"x_ptr", "out_ptr"}
    sig = {a: "constexpr" if a in consts else f"*{dtype}" if a in data else "*fp32" if a.endswith(
        ("_ptr", "_s", "_c")) else "fp32" if a in floats else "i32" for a in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    out = compile_in_clean_process([__file__, "compile"])
    assert out.count(".entry") == len(COMPILES), out[-2000:]


if __name__ == "__main__" and sys.argv[1:] == ["compile"]:  # the compile test's clean process
    for name_, dtype_, consts_ in COMPILES:
        print(next(line for line in _compile(name_, dtype_, consts_).splitlines() if ".entry" in line))
