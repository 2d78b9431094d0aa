"""GPU tests of the output-head path (head_engine; skipped without CUDA).

Accuracy bar as tests/gpu/test_gpu.py (``_check``): against float64 PyTorch, at most 2x cuDNN's own
error at the same dtype and precision flag (for "tf32", 2x the larger of cuDNN's error and that of
exact TF32 arithmetic), plus one unit in the last place of the largest output. Head
configurations are forced with ``config=`` (the tuner may pick any of them): bfloat16, float16 and
float32 at each precision, both input layouts, strided input, and once through the tuner.
"""
from __future__ import annotations

import pytest
import torch

import convt3d
from convt3d.engines.triton import engine as E
from convt3d.core.validate import check_call

import test_gpu


def _check(x, w, b, args, precision, out):
    """test_gpu's accuracy bar; the memory format is checked as "out is laid out as PyTorch's
    rule wants", since with one output channel channels_last_3d and contiguous coincide (and
    test_gpu._check's format test, which asks which one a tensor suggests, cannot tell)."""
    want = torch.channels_last_3d if (suggests_channels_last(x) or suggests_channels_last(w)) \
        else torch.contiguous_format
    assert out.is_contiguous(memory_format=want)
    if out.shape[1] == 1:
        # Checked above; hand test_gpu an output whose format question has one answer.
        x, out = x.contiguous(), out.contiguous()
    test_gpu._check(x, w, b, args, precision, out)

pytestmark = [pytest.mark.gpu]
DEV = "cuda"

# (n, cin, cout, groups, size, kernel, stride, padding, output_padding, dilation): the bench's
# head rows at reduced size, plus groups, 15 channels and odd sizes.
HEADS = {
    "gan-64to1-k4s2p1": (2, 64, 1, 1, (9, 10, 11), 4, 2, 1, 0, 1),
    "video-64to3-k144": (2, 64, 3, 1, (5, 12, 13), (1, 4, 4), (1, 2, 2), (0, 1, 1), 0, 1),
    "tc-side-128to8-k3": (2, 128, 8, 1, (4, 9, 12), 3, (1, 2, 2), 1, (0, 1, 1), 1),
    "free-k2s2-8to2": (2, 8, 2, 1, (9, 10, 11), 2, 2, 0, 0, 1),
    "free-k2s3-fill": (2, 16, 3, 1, (5, 6, 7), 2, 3, 0, 1, 1),
    "video-128to3-k4s2p1": (1, 128, 3, 1, (4, 12, 17), 4, 2, 1, 0, 1),
    "groups2-5-per-group": (2, 32, 10, 2, (5, 6, 7), 3, 2, 1, 1, 1),
    "c15-dilation2": (1, 24, 15, 1, (4, 5, 6), 3, 2, 2, 1, 2),
    "cin200-ksteps": (1, 200, 2, 1, (4, 6, 7), 3, 2, 1, 0, 1),
}


def _inputs(spec, layout, dtype):
    n, cin, cout, g, size, k, s, p, op, d = spec
    k = k if isinstance(k, tuple) else (k,) * 3
    x = torch.randn(n, cin, *size, device=DEV, dtype=dtype)
    if layout == "cl":
        x = x.to(memory_format=torch.channels_last_3d)
    elif layout == "noncontig":
        x = torch.randn(n, cin, *(2 * v for v in size), device=DEV, dtype=dtype)[:, :, ::2, 1::2, ::2]
    w = (torch.randn(cin, cout // g, *k, device=DEV, dtype=torch.float32) / (cin / g) ** 0.5).to(dtype)
    b = torch.randn(cout, device=DEV, dtype=dtype)
    return x, w, b, (s, p, op, g, d)


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    monkeypatch.setenv("CONVT3D_AUTOTUNE", "0")
    yield


def _heads(params, x, w, prec):
    heads = [c for c in E.plan(params, x, w, prec).configs if getattr(c, "head", "")]
    assert heads, "a head layer must have head candidates"
    return heads


def _first_of_each_kind(heads):
    return [next(c for c in heads if getattr(c, "head", "") == kind) for kind in dict.fromkeys(getattr(c, "head", "") for c in heads)]


KIND_HEADS = ["gan-64to1-k4s2p1", "video-64to3-k144", "tc-side-128to8-k3", "free-k2s2-8to2", "free-k2s3-fill",
              "groups2-5-per-group", "c15-dilation2", "cin200-ksteps"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["ncdhw", "cl"])
@pytest.mark.parametrize("name", KIND_HEADS)
def test_every_head_candidate(name, layout, dtype):
    # Every head candidate of the layer (rows where taps meet, shuffle at dilation 1), at the
    # bench's precision (TF32 for fp32): the tuner may pick any of them.
    x, w, b, args = _inputs(HEADS[name], layout, dtype)
    params, _ = check_call(x, w, b, *args)
    for cfg in _heads(params, x, w, "tf32"):
        _check(x, w, b, args, "tf32", E.forward(x, w, b, params, "tf32", config=cfg))


PERSISTENT_HEADS = {
    "k4s2p1-full-width": (4, 64, 1, 1, (16, 32, 33), 4, 2, 1, 0, 1),  # OW = 2 x W
    "k3s2p1-odd-width": (4, 64, 2, 1, (16, 32, 45), 3, 2, 1, 0, 1),  # OW = 2 x W - 1
    # 144 rows columns (8 x 3 x 3 x SW 2): 2 or 3 N tiles fed by each input tile.
    "k3s122-8out-n-tiles": (4, 32, 8, 1, (8, 40, 33), 3, (1, 2, 2), 1, (0, 1, 1), 1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["ncdhw", "cl", "noncontig"])
@pytest.mark.parametrize("name", list(PERSISTENT_HEADS))
def test_persistent_tiles_walk_many_tiles(name, layout, dtype):
    # The persistent rows tiles (Config.persist) on layers with more tiles than programs, so
    # that every program loops: full and partial output widths, flat and strided inputs.
    from convt3d.engines.triton import head as head_engine
    x, w, b, args = _inputs(PERSISTENT_HEADS[name], layout, dtype)
    params, _ = check_call(x, w, b, *args)
    persistent = [c for c in _heads(params, x, w, "tf32") if c.persist]
    assert persistent, "a persistent tile must be offered"
    (d, h, _), ow, sw = params.in_size, params.out_size[2], params.stride[2]
    for cfg in persistent:
        # M: input rows x compact output columns.
        m = d * h * -(-ow // sw)
        tiles = params.batch * -(-m // cfg.BLOCK_M)
        assert tiles > head_engine.persistent_programs(x.device, tiles, cfg.persist)
        _check(x, w, b, args, "tf32", E.forward(x, w, b, params, "tf32", config=cfg))


PACKED_HEADS = {
    # The VQ-VAE decoder's head at reduced size: k4 s2 p3 (pre-padded input), 240 channels
    # (K 240 of 4 x 64 or 8 x 32 with a padded tail), 3 width shifts.
    "vqvae-240to3-k4s2p3": (2, 240, 3, 1, (5, 19, 21), 4, 2, 3, 0, 1),
    "tc-side-128to8-k3": HEADS["tc-side-128to8-k3"],
    "groups2-5-per-group": HEADS["groups2-5-per-group"],
    "c15-dilation2": HEADS["c15-dilation2"],
}


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "tf32"), (torch.float16, "tf32"),
                                              (torch.float32, "tf32"), (torch.float32, "tf32x3")],
                         ids=["bf16", "fp16", "fp32-tf32", "fp32-tf32x3"])
@pytest.mark.parametrize("layout", ["ncdhw", "cl", "noncontig"])
@pytest.mark.parametrize("name", list(PACKED_HEADS))
def test_packed_weight_rows_tiles(name, layout, dtype, precision):
    # The single-sweep rows kind on the packed weight (Config.w_packed), forced on each of the
    # layer's single-sweep rows tiles: what the tuner gets where no persistent tile holds the
    # weight.
    import dataclasses
    x, w, b, args = _inputs(PACKED_HEADS[name], layout, dtype)
    params, _ = check_call(x, w, b, *args)
    rows = [c for c in _heads(params, x, w, precision) if getattr(c, "head", "") == "rows" and not c.persist]
    assert rows, "the layer must have rows tiles"
    for cfg in rows:
        cfg = dataclasses.replace(cfg, w_packed=True)
        _check(x, w, b, args, precision, E.forward(x, w, b, params, precision, config=cfg))


# The shuffle kind's regimes (dilation 1): kernels within the stride with every position reached,
# boxes with bias-only positions (k < s), output padding, cropping padding, anisotropic strides,
# a stride of 3 (box width not a power of two), 15 channels over 4 x 4 boxes, groups, K steps.
SHUFFLE_HEADS = {
    "k2s2-8to2": HEADS["free-k2s2-8to2"],
    "k2s3-op1": HEADS["free-k2s3-fill"],
    "k122-s122-64to3-p": (2, 64, 3, 1, (5, 12, 13), (1, 2, 2), (1, 2, 2), (0, 1, 0), (0, 1, 1), 1),
    "k444-s444-16to15": (1, 16, 15, 1, (4, 5, 7), 4, 4, 0, 0, 1),
    "k213-s423-p": (1, 40, 5, 1, (3, 5, 6), (2, 1, 3), (4, 2, 3), (3, 0, 1), (1, 1, 2), 1),
    "k2s2-groups2-200in": (2, 200, 4, 2, (3, 6, 9), 2, 2, 1, 1, 1),
    # Kernels past the stride (shifts): k4 s2 (8 shifts), k (1, 4, 4) s (1, 2, 2) (4), k3 s (1, 2, 2)
    # with output padding (12, taps j * s + r >= k masked), padding above the stride, stride 1
    # (27 shifts, boxes of one position), k5 s3 with groups, and a width of 16 blocks with
    # output padding (the block past the input in its own W tile).
    "k4s2p1-64to1": HEADS["gan-64to1-k4s2p1"],
    "k144-s122-64to3": HEADS["video-64to3-k144"],
    "k3-s122-op-128to8": HEADS["tc-side-128to8-k3"],
    "k4s2p3-240to3": (1, 240, 3, 1, (5, 7, 9), 4, 2, 3, 0, 1),
    "k3s1p1-48to8": (2, 48, 8, 1, (5, 7, 9), 3, 1, 1, 0, 1),
    "k5s3-groups2-op": (1, 32, 6, 2, (3, 4, 5), 5, 3, 1, 2, 1),
    "k2s2-op-w16": (1, 16, 2, 1, (2, 3, 16), 2, 2, 0, 1, 1),
    # 14 width blocks x 10 height blocks at 256 columns: the flat tile of 64
    "k5s3-groups2-flat-n256": (1, 32, 6, 2, (3, 9, 13), 5, 3, 1, 2, 1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["ncdhw", "cl", "noncontig"])
@pytest.mark.parametrize("name", list(SHUFFLE_HEADS))
def test_shuffle_kind(name, layout, dtype):
    # head_shuffle_kernel: each of its tiles (MMA and FMA) as the plan offers them, at the bench's
    # precision and, for fp32, at tf32x3 and ieee; with and without bias.
    x, w, b, args = _inputs(SHUFFLE_HEADS[name], layout, dtype)
    params, _ = check_call(x, w, b, *args)
    for precision in ["tf32"] + (["tf32x3", "ieee"] if dtype == torch.float32 else []):
        tiles = [c for c in _heads(params, x, w, precision) if getattr(c, "head", "") == "shuffle"]
        assert tiles, "a layer at dilation 1 has shuffle tiles"
        for cfg in tiles:
            _check(x, w, b, args, precision, E.forward(x, w, b, params, precision, config=cfg))
            _check(x, w, None, args, precision, E.forward(x, w, None, params, precision, config=cfg))


@pytest.mark.parametrize("dtype, precision", [(torch.float16, "tf32"), (torch.float32, "tf32x3"),
                                              (torch.float32, "ieee")], ids=["float16", "tf32x3", "ieee"])
@pytest.mark.parametrize("name", ["video-128to3-k4s2p1", "free-k2s2-8to2", "groups2-5-per-group"])
def test_head_precisions(name, dtype, precision):
    x, w, b, args = _inputs(HEADS[name], "ncdhw", dtype)
    params, _ = check_call(x, w, b, *args)
    for cfg in _first_of_each_kind(_heads(params, x, w, precision)):
        _check(x, w, b, args, precision, E.forward(x, w, b, params, precision, config=cfg))


@pytest.mark.parametrize("name", ["gan-64to1-k4s2p1", "free-k2s3-fill"])
def test_noncontiguous_input(name):
    # A strided view: D, H, W are not one stride apart, so the GEMM divides per row.
    x, w, b, args = _inputs(HEADS[name], "noncontig", torch.bfloat16)
    params, _ = check_call(x, w, b, *args)
    for cfg in _heads(params, x, w, "tf32"):
        _check(x, w, b, args, "tf32", E.forward(x, w, b, params, "tf32", config=cfg))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_unbatched_and_no_bias(dtype):
    x, w, _, args = _inputs(HEADS["video-64to3-k144"], "ncdhw", dtype)
    params, _ = check_call(x[:1], w, None, *args)
    head = next(c for c in E.plan(params, x[:1], w, "tf32").configs if getattr(c, "head", ""))
    E.clear_caches()
    try:
        E.seed_tuning(E.plan(params, x[:1], w, "tf32").tune_key, head)
        out = convt3d.conv_transpose3d(x[0], w, None, *args, backend="triton", precision="tf32")
    finally:
        E.clear_caches()
    _check(x[:1], w, None, args, "tf32", out.unsqueeze(0))


@pytest.mark.parametrize("backend", ["triton", None], ids=["triton", "auto"])
@pytest.mark.parametrize("layout", ["cl", "noncontig"])
def test_repeated_inference_calls_take_the_weights_memo(backend, layout, auto_state):
    # From the third call on, the weight's steady.Repeat memo answers a Triton-decided inference
    # call and runs the engine's launcher: the same output as the first call, bit for bit, also
    # after an in-place weight update (read, not remembered) and inside a CUDA graph capture.
    from convt3d.dispatch import select as dispatch

    x, w, b, args = _inputs(HEADS["gan-64to1-k4s2p1"], layout, torch.bfloat16)
    with torch.no_grad():
        first = convt3d.conv_transpose3d(x, w, b, *args, backend=backend)
        for _ in range(3):
            assert torch.equal(convt3d.conv_transpose3d(x, w, b, *args, backend=backend), first)
        memo = dispatch._direct.get(id(w))
        if memo is None or type(memo).__name__ != "Repeat":
            assert backend is None, "backend='triton' must leave a Repeat memo"
            pytest.skip("auto chose PyTorch's op for this layer")
        _check(x, w, b, args, "tf32", first)
        w.mul_(0.5)
        halved = convt3d.conv_transpose3d(x, w, b, *args, backend=backend)
        _check(x, w, b, args, "tf32", halved)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = convt3d.conv_transpose3d(x, w, b, *args, backend=backend)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, halved)


def test_tuner_times_head_candidates(monkeypatch):
    # With tuning on, the first call of a signature times the head configs against the phase
    # ones; whatever it picks must be correct, and the log must show the head candidates timed.
    monkeypatch.setenv("CONVT3D_AUTOTUNE", "1")
    x, w, b, args = _inputs(HEADS["gan-64to1-k4s2p1"], "ncdhw", torch.bfloat16)
    params, _ = check_call(x, w, b, *args)
    E.clear_caches()
    try:
        out = convt3d.conv_transpose3d(x, w, b, *args, backend="triton")
        key = E.plan(params, x, w, "tf32").tune_key
        rec = tuning_log()[key]
    finally:
        E.clear_caches()
    assert any(name.startswith("head-") for name in rec.timings_ms)
    _check(x, w, b, args, "tf32", out)


def test_deterministic_bitwise():
    x, w, b, args = _inputs(HEADS["video-128to3-k4s2p1"], "cl", torch.float32)
    params, _ = check_call(x, w, b, *args)
    head = next(c for c in E.plan(params, x, w, "tf32").configs if getattr(c, "head", ""))
    a = E.forward(x, w, b, params, "tf32", config=head)
    assert torch.equal(a, E.forward(x, w, b, params, "tf32", config=head))


# ---- the head backward (head_backward; kernels/head_grad.py) --------------------------------------
# Accuracy bar as tests/gpu/test_gpu_training.py: per gradient, at most 2x cuDNN's own error against
# float64 for the same inputs, dtype and TF32 flag (for "tf32", 2x the larger of cuDNN's error and
# exact TF32 arithmetic's), plus one unit in the last place of the gradient's largest value.
from convt3d.engines.triton import backward as B  # noqa: E402
from convt3d.engines.triton import head_backward as HB  # noqa: E402
from convt3d.core.flags import cudnn_conv_tf32

from test_gpu_training import _bwd as _conv_bwd  # noqa: E402  -- the same reference
from conftest import round_tf32_reference  # noqa: E402
from convt3d.core.call import suggests_channels_last
from convt3d.engines.triton.configs import tuning_log

# Every head row has >= 8 input and <= 15 output channels per group (the test checks it).
BWD_HEADS = list(HEADS)
BWD_PRECISIONS = [(torch.bfloat16, "tf32"), (torch.float16, "tf32"), (torch.float32, "tf32"),
                  (torch.float32, "tf32x3"), (torch.float32, "ieee")]


def _grad_budgets(dy, x, w, params, precision):
    """(float64 dX, float64 dW, dX budget, dW budget)."""
    ref = _conv_bwd(dy, x, w, params, [True, True, False], dtype64=True)
    with cudnn_conv_tf32(precision == "tf32"):
        cud = _conv_bwd(dy, x, w, params, [True, True, False])
    buds = [(cud[i].double() - ref[i]).abs().max().item() for i in (0, 1)]
    if precision == "tf32" and x.dtype == torch.float32:
        ideal = _conv_bwd(round_tf32_reference(dy), round_tf32_reference(x), round_tf32_reference(w), params,
                          [True, True, False], dtype64=True)
        buds = [max(b_, (ideal[i] - ref[i]).abs().max().item()) for i, b_ in enumerate(buds)]
    return ref[0], ref[1], buds[0], buds[1]


def _assert_within(got, ref, bud, what):
    err = (got.double() - ref).abs().max().item()
    ulp = torch.finfo(got.dtype).eps * ref.abs().max().item()
    assert err <= 2 * bud + ulp, f"{what}: error {err:.3g} > 2 x cuDNN-bar {bud:.3g} + {ulp:.3g}"


@pytest.mark.parametrize("dtype, precision", BWD_PRECISIONS,
                         ids=[f"{str(d).split('.')[-1]}-{p}" for d, p in BWD_PRECISIONS])
@pytest.mark.parametrize("layout", ["ncdhw", "cl"])
@pytest.mark.parametrize("name", BWD_HEADS)
def test_head_backward_every_candidate(name, layout, dtype, precision):
    # Every head dX and dW tile the timed choice may pick, deterministic, in dX's own layout.
    torch.manual_seed(0)
    x, w, b, args = _inputs(HEADS[name], layout, dtype)
    params, _ = check_call(x, w, b, *args)
    assert HB.supports(params), HB.unsupported_reason(params)
    dy = torch.randn(params.out_shape, device=DEV).to(dtype)
    if layout == "cl":
        dy = dy.contiguous(memory_format=torch.channels_last_3d)
    ref_x, ref_w, bud_x, bud_w = _grad_budgets(dy, x, w, params, precision)
    fx = B.grad_formats(x, w)[0]
    for cfg in HB.dgrad_candidates(params, dtype, x.device):
        gx = HB.head_dgrad(dy, w, params, precision, dtype, cfg, fx)
        assert gx.dtype == dtype and gx.is_contiguous(memory_format=fx)
        _assert_within(gx, ref_x, bud_x, f"{cfg.short()} dX")
        assert torch.equal(gx, HB.head_dgrad(dy, w, params, precision, dtype, cfg, fx)), "dX not deterministic"
    for cfg in HB.wgrad_candidates(params, dtype, x.device):
        gw = HB.head_wgrad(dy, x, params, precision, dtype, cfg)
        assert gw.dtype == dtype and gw.shape == w.shape
        _assert_within(gw, ref_w, bud_w, f"{cfg.short()} dW")
        assert torch.equal(gw, HB.head_wgrad(dy, x, params, precision, dtype, cfg)), "dW not deterministic"


@pytest.mark.parametrize("kernel", ["flat", "phases"])
@pytest.mark.parametrize("name", ["gan-64to1-k4s2p1", "free-k2s3-fill"])
def test_head_backward_noncontiguous_input(name, kernel):
    # The first tile of each kernel (dY zero-padded / split by phase) on a strided X and dY.
    x, w, b, args = _inputs(HEADS[name], "noncontig", torch.bfloat16)
    params, _ = check_call(x, w, b, *args)
    n, c, od, oh, ow = params.out_shape
    dy = torch.randn(n, c, od, ow, oh, device=DEV, dtype=torch.bfloat16).transpose(3, 4)  # H and W strides swapped
    ref_x, ref_w, bud_x, bud_w = _grad_budgets(dy, x, w, params, "tf32")
    phased = kernel == "phases"
    cx = next(c for c in HB.dgrad_candidates(params, x.dtype, x.device) if bool(c.BLOCK_W) == phased)
    cw = next(c for c in HB.wgrad_candidates(params, x.dtype, x.device) if bool(c.BLOCK_W) == phased)
    _assert_within(HB.head_dgrad(dy, w, params, "tf32", x.dtype, cx), ref_x, bud_x, f"{cx.short()} dX")
    _assert_within(HB.head_wgrad(dy, x, params, "tf32", x.dtype, cw), ref_w, bud_w, f"{cw.short()} dW")


def test_head_backward_choice_is_timed(monkeypatch, auto_state):
    # On CUDA the first backward of a head signature times cuDNN against every head candidate of
    # dX and of dW; whichever wins, the gradients meet the bar. (auto_state: a fresh cache
    # directory, so the choice is timed here, not read from a file.)
    for env in ("CONVT3D_BWD_INPUT", "CONVT3D_BWD_WEIGHT", "CONVT3D_AUTOTUNE"):
        monkeypatch.delenv(env, raising=False)
    B.clear_caches()
    x, w, b, args = _inputs(HEADS["gan-64to1-k4s2p1"], "ncdhw", torch.bfloat16)
    params, _ = check_call(x, w, b, *args)
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = convt3d.conv_transpose3d(*leaves, *args, backend="triton")
    dy = torch.randn_like(y)
    gx, gw, _ = torch.autograd.grad(y, leaves, dy)
    (rx,), (rw,) = B.dgrad_choices().values(), B.choices().values()
    assert rx.reason.startswith("timed") and rw.reason.startswith("timed")
    assert len(rx.timings_ms) == 1 + len(B.dgrad_choice_candidates(params, x.dtype, x.device, "tf32"))
    assert len(rw.timings_ms) == 1 + len(B.wgrad_choice_candidates(params, x.dtype, x.device))
    ref_x, ref_w, bud_x, bud_w = _grad_budgets(dy, x, w, params, "tf32")
    _assert_within(gx, ref_x, bud_x, f"dX ({rx.reason})")
    _assert_within(gw, ref_w, bud_w, f"dW ({rw.reason})")
    B.clear_caches()
