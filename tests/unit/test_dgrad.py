"""The Triton input-gradient kernel (``kernels/dgrad_bwd.py`` through ``convt3d.engines.triton.backward``) on the
CPU, through Triton's interpreter: dX against float64 ``aten.convolution_backward`` over the
regimes of the geometry (stride 1/2/anisotropic, dilation, padding, output_padding, groups,
channel blocks and position tiles that end inside the data, batch), every dY layout (NCDHW,
channels_last_3d, sliced, permuted, expanded), both dX layouts and the fp32 precisions; then the
choice in ``backward.grads``: $CONVT3D_BWD_INPUT, the static rule on CPU, one cuDNN call when both
gradients go there, and determinism.

Sizes are tiny (the interpreter costs ~0.1 s per program step). bfloat16 is left out: the
interpreter's bf16 dots are unreliable (tests/gpu/test_gpu_training.py covers bf16 on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import convt3d
from convt3d.engines.triton import backward as B
from convt3d.core.errors import BackendUnavailableError
from convt3d.core.validate import check_call

from conftest import CL, PoisonedTorch, requires_interpreter, round_tf32_reference

pytestmark = requires_interpreter


@dataclass(frozen=True)
class G:
    """One call: (N, Cin, Cout, input size, kernel, stride, padding, output_padding, dilation, groups)."""

    n: int
    cin: int
    cout: int
    size: tuple
    k: object
    s: object = 1
    p: object = 0
    op: object = 0
    d: object = 1
    g: int = 1


def _setup(geo: G, dtype=torch.float32, dy_layout="ncdhw"):
    k3 = geo.k if isinstance(geo.k, tuple) else (geo.k,) * 3
    x = torch.randn(geo.n, geo.cin, *geo.size, dtype=torch.float64).to(dtype)
    w = torch.randn(geo.cin, geo.cout // geo.g, *k3, dtype=torch.float64).to(dtype)
    params, _ = check_call(x, w, None, geo.s, geo.p, geo.op, geo.g, geo.d)
    dy = _make_dy(params.out_shape, dtype, dy_layout)
    return x, w, dy, params


def _make_dy(shape, dtype, layout):
    n, c, d, h, w = shape

    def rnd(*s):
        return torch.randn(*s, dtype=torch.float64).to(dtype)

    if layout == "ncdhw":
        return rnd(*shape)
    if layout == "cl":
        return rnd(*shape).contiguous(memory_format=CL)
    if layout == "slice_w":  # every other W element of a wider NCDHW tensor
        return rnd(n, c, d, h, 2 * w)[..., ::2]
    if layout == "slice_c_cl":  # channel stride 2 in channels-last memory: not K-major, copied
        return rnd(n, d, h, w, 2 * c)[..., ::2].permute(0, 4, 1, 2, 3)
    if layout == "cl_slice_w":  # channel stride 1 but a sliced W: read in place
        return rnd(n, d, h, 2 * w, c)[:, :, :, ::2].permute(0, 4, 1, 2, 3)
    if layout == "transpose_dh":
        return rnd(n, c, h, d, w).transpose(2, 3)
    if layout == "expanded":  # y.sum().backward(): all strides 0
        return torch.ones((), dtype=dtype).expand(shape)
    raise ValueError(layout)


def _ref_dx(dy, x, w, params, round_tf32=False):
    f = round_tf32_reference if round_tf32 else (lambda t: t)
    return torch.ops.aten.convolution_backward(
        f(dy).double(), x.double(), f(w).double(), None, list(params.stride), list(params.padding),
        list(params.dilation), True, list(params.output_padding), params.groups, [True, False, False])[0]


def _assert_close(got, ref, rel, what):
    """Max-abs error relative to dX's own scale. fp32 exact grades sum at most Cout/g * taps <= 24*27
    products here: 1e-5 of the scale is ~100x the typical rounding, and an untaken tap or channel
    block would be off by ~1e-1. tf32 rounds each operand to 11 significant bits (2^-11 each,
    ~2^-10 per product): 4e-3 leaves a factor ~4 for cancellation. fp16 rounds the fp32 result once
    to 11 bits (2^-11 = 4.9e-4) after exact products and fp32 sums."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= rel * scale + 1e-12, f"{what}: max error {err:.3g} > {rel:g} x scale {scale:.3g}"


REL = {"ieee": 1e-5, "tf32x3": 1e-5, "tf32": 4e-3, torch.float16: 2e-3}

# name -> (geometry, dY layout, precision). Channels >= 8 per group unless the name says otherwise
# (the choice sends fewer to cuDNN, but the kernel itself is exact for any count: tested below).
CASES = {
    "stride1-k3p1": (G(1, 8, 8, (2, 3, 3), 3, 1, 1), "ncdhw", "ieee"),
    "stride2-k4p1-gan": (G(1, 8, 16, (1, 2, 3), 4, 2, 1), "cl", "ieee"),
    "stride2-k3p1-op1": (G(1, 8, 8, (2, 3, 2), 3, 2, 1, 1), "ncdhw", "ieee"),
    "aniso-k122-s122": (G(1, 8, 8, (2, 3, 3), (1, 2, 2), (1, 2, 2)), "cl", "tf32x3"),
    "aniso-everything": (G(1, 8, 8, (3, 2, 4), (2, 3, 1), (1, 2, 3), (0, 1, 0), (0, 1, 2), (2, 1, 1)), "ncdhw",
                         "ieee"),
    "dilation2-p2": (G(1, 8, 8, (2, 3, 3), 3, 1, 2, 0, 2), "cl", "ieee"),
    "stride3-dil2-op2": (G(1, 8, 8, (2, 2, 2), 2, 3, 0, 2, 2), "ncdhw", "ieee"),
    "padding-larger-than-kernel-reach": (G(1, 8, 8, (3, 3, 3), 2, 2, 1, 1), "ncdhw", "ieee"),
    "groups2": (G(1, 16, 16, (2, 2, 3), 2, 2, 0, 0, 1, 2), "ncdhw", "ieee"),
    "groups2-dilated-cl": (G(1, 16, 32, (2, 3, 2), 2, 1, 1, 1, 2, 2), "cl", "tf32x3"),
    "batch3": (G(3, 8, 8, (2, 2, 2), 2, 2), "ncdhw", "tf32x3"),
    "channel-blocks-24": (G(1, 24, 24, (2, 2, 2), 2, 2), "cl", "ieee"),  # 2 Cin tiles, 2 Cout blocks, masked
    "dy-slice-w": (G(1, 8, 8, (2, 2, 3), 3, 2, 1), "slice_w", "ieee"),
    "dy-cl-slice-w-in-place": (G(2, 8, 8, (1, 2, 3), 3, 2, 1), "cl_slice_w", "ieee"),
    "dy-slice-c-cl": (G(1, 8, 8, (2, 2, 2), 2, 2), "slice_c_cl", "ieee"),
    "dy-transpose-dh": (G(1, 8, 8, (2, 3, 2), 2, 2), "transpose_dh", "ieee"),
    "dy-expanded": (G(1, 8, 8, (2, 2, 2), 3, 2, 1), "expanded", "ieee"),
    "tf32-ncdhw-dy-copy-rounds": (G(1, 8, 8, (2, 2, 2), 3, 2, 1, 1), "ncdhw", "tf32"),
    "tf32-cl-dy-kernel-rounds": (G(1, 8, 8, (2, 2, 2), 3, 2, 1, 1), "cl", "tf32"),
    "fp16": (G(1, 8, 8, (2, 2, 2), 3, 2, 1, 1), "cl", torch.float16),
    "fp16-ncdhw-groups2": (G(2, 16, 16, (2, 2, 2), 2, 2, 0, 0, 1, 2), "ncdhw", torch.float16),
}


# dX channels_last_3d on a subset (the store differs only in its strides).
DX_CL = ("stride2-k4p1-gan", "aniso-everything", "groups2", "tf32-cl-dy-kernel-rounds", "fp16", "channel-blocks-24")


@pytest.mark.parametrize("name,x_format", [(n, "ncdhw") for n in CASES] + [(n, "cl") for n in DX_CL],
                         ids=[f"{n}-dx_ncdhw" for n in CASES] + [f"{n}-dx_cl" for n in DX_CL])
def test_dgrad_matches_float64(name, x_format):
    geo, dy_layout, prec = CASES[name]
    dtype = prec if isinstance(prec, torch.dtype) else torch.float32
    precision = "ieee" if isinstance(prec, torch.dtype) else prec
    x, w, dy, params = _setup(geo, dtype, dy_layout)
    fmt = CL if x_format == "cl" else torch.contiguous_format
    gx = B.dgrad_triton(dy, w, params, precision, dtype, None, fmt)
    assert gx.dtype == dtype and gx.is_contiguous(memory_format=fmt)
    _assert_close(gx, _ref_dx(dy, x, w, params), REL[prec], f"{name} dX")
    if precision == "tf32":
        # Operands rounded to nearest TF32 (cuDNN's rounding), then exact products and fp32 sums.
        _assert_close(gx, _ref_dx(dy, x, w, params, round_tf32=True), 1e-5, f"{name} dX vs exact TF32")


# pack_dgrad_weight_kernel: the weight as [G, taps, Cin/g, Cout/g], bitwise, with the packed
# buffer NaN-filled (every element written): channel and tap counts past one block and below it,
# groups, and a weight whose kernel dimensions are not contiguous (the launcher copies it).
PACK_DGRAD = {
    "one-channel-k1": (1, 1, 1, (1, 1, 1)),
    "odd-channels-k232": (3, 5, 1, (2, 3, 2)),
    "k3-cout-past-one-block": (8, 40, 1, (3, 3, 3)),
    "groups2-k4-cout-70": (16, 70, 2, (4, 4, 4)),
    "depthwise": (8, 8, 8, (1, 2, 1)),
    "k5-taps-past-one-block": (5, 33, 1, (5, 5, 5)),
}


@pytest.mark.parametrize("layout", ["contiguous", "kernel-dims-strided"])
@pytest.mark.parametrize("round_tf32", [False, True], ids=["as-is", "tf32-rounded"])
@pytest.mark.parametrize("name", list(PACK_DGRAD))
def test_pack_dgrad_weight_packs_every_tap_k_major(name, round_tf32, layout, monkeypatch):
    cin, cout, groups, k = PACK_DGRAD[name]
    w = torch.randn(cin, cout // groups, *k) * 3
    if layout != "contiguous":
        w = w.transpose(3, 4).contiguous().transpose(3, 4)
    params = check_call(torch.empty(1, cin, 2, 2, 2), w, None, 2, 0, 0, groups, 1)[0]
    monkeypatch.setattr(B, "torch", PoisonedTorch(torch))
    packed = B._pack_dgrad(w, params, round_tf32)
    expect = w.reshape(groups, cin // groups, cout // groups, -1).permute(0, 3, 1, 2)
    assert torch.equal(packed, round_tf32_reference(expect) if round_tf32 else expect)


def test_tf32_rounds_to_nearest_not_truncates():
    # Values just above a TF32 rounding boundary: truncation would be off by 2^-11 relative.
    geo = G(1, 8, 8, (2, 2, 2), 1, 1)
    x, w, _, params = _setup(geo)
    w = torch.full_like(w, 1.0 + 2.0 ** -11 + 2.0 ** -20)  # rounds up to 1 + 2^-10
    for layout in ("ncdhw", "cl"):
        dy = _make_dy(params.out_shape, torch.float32, layout).abs() + 1.0
        gx = B.dgrad_triton(dy, w, params, "tf32", torch.float32)
        _assert_close(gx, _ref_dx(dy, x, w, params, round_tf32=True), 1e-6, f"{layout} nearest-TF32")


@pytest.mark.parametrize("cfg", [B.DgradConfig(16, 16, 16, 4, 1), B.DgradConfig(64, 32, 32, 4, 2)],
                         ids=["M16-tiles-span-rows", "M64-one-tile"])
def test_dgrad_tile_shapes(cfg):
    # W = 5: the first 16-position tile spans four rows and ends mid-row, the second starts
    # mid-row and stays in one (its width tap range is that of its columns only); Cout/g = 20 with
    # BLOCK_K 16 ends a channel block inside the data.
    geo = G(1, 8, 20, (1, 4, 5), (1, 3, 3), (1, 2, 2), (0, 1, 2), (0, 1, 0), (1, 1, 2))
    x, w, dy, params = _setup(geo, dy_layout="cl")
    gx = B.dgrad_triton(dy, w, params, "ieee", torch.float32, cfg)
    _assert_close(gx, _ref_dx(dy, x, w, params), 1e-5, cfg.short())


TAP_RANGE_EDGES = {
    # k4 s2 p1 along W = 17, H = 2, 16-position tiles: the last tile is row 1, columns 15..16, and
    # column 15 needs tap 3 (output 32 of 34) that column 16 does not: the width tap range of a
    # one-row tile must start from its first column.
    "one-row-tile-first-column": G(1, 8, 16, (1, 2, 17), (1, 4, 4), (1, 2, 2), (0, 1, 1)),
    # k7 p5 along H = 6, W = 3: the first tile ends at row 5, column 0, the only row that reaches
    # tap 0 (output 0 of 2): the height tap range must include the tile's last row.
    "tile-last-row-first-tap": G(1, 8, 8, (1, 6, 3), (1, 7, 1), 1, (0, 5, 0)),
    # k5 p4 along W = 5, H = 4: the second tile is row 3, columns 1..4, and only column 4 reaches
    # tap 0 (output 0 of 2): the width tap range of a one-row tile must end at its last column.
    "one-row-tile-last-column": G(1, 8, 8, (1, 4, 5), (1, 1, 5), 1, (0, 0, 4)),
}


@pytest.mark.parametrize("name", list(TAP_RANGE_EDGES))
def test_dgrad_tap_range_edges(name):
    x, w, dy, params = _setup(TAP_RANGE_EDGES[name], dy_layout="cl")
    gx = B.dgrad_triton(dy, w, params, "ieee", torch.float32, B.DgradConfig(16, 16, 16, 4, 1))
    _assert_close(gx, _ref_dx(dy, x, w, params), 1e-5, name)


@pytest.mark.parametrize("geo", [G(1, 1, 8, (2, 2, 2), 2, 2), G(1, 4, 2, (2, 2, 2), 3, 2, 1),
                                 G(1, 2, 2, (2, 2, 2), 2, 2, 0, 0, 1, 2)], ids=["cin1", "cin4-cout2", "depthwise"])
def test_few_channels_kernel_exact_but_choice_is_cudnn(geo, monkeypatch):
    # The kernel is exact for any channel count (masked operands)...
    x, w, dy, params = _setup(geo)
    _assert_close(B.dgrad_triton(dy, w, params, "ieee", torch.float32), _ref_dx(dy, x, w, params), 1e-5, "dX")
    # ...but below 8 channels per group most of every MMA would be padding: declared unsupported,
    # by the general kernel and by the head kernel (which needs >= 8 input channels per group).
    assert not B._triton_dgrad_ok(params) and B.dgrad_choice_candidates(params, torch.float32, x.device, "ieee") == ()
    monkeypatch.delenv("CONVT3D_BWD_INPUT", raising=False)
    assert B.choose_dgrad(dy, x, w, params, "ieee").impl == "cudnn"
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "triton")
    with pytest.raises(BackendUnavailableError, match="CONVT3D_BWD_INPUT=triton"):
        B.choose_dgrad(dy, x, w, params, "ieee")


def test_narrow_output_goes_to_the_head_kernel_when_forced(monkeypatch):
    # 8 -> 1: the general kernel declines (1 output channel), the head kernel takes it.
    x, w, dy, params = _setup(G(1, 8, 1, (2, 2, 2), 3, 2, 1))
    assert not B._triton_dgrad_ok(params)
    cands = B.dgrad_choice_candidates(params, torch.float32, x.device, "ieee")
    assert cands and all(isinstance(c, B.HB.HeadDgradConfig) for c in cands)
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "triton")
    rec = B.choose_dgrad(dy, x, w, params, "ieee")
    assert rec.impl == "triton" and isinstance(rec.config, B.HB.HeadDgradConfig)
    _assert_close(B.dgrad_triton(dy, w, params, "ieee", torch.float32, rec.config), _ref_dx(dy, x, w, params),
                  1e-5, "head dX")


def test_candidates_are_capped_by_channels():
    x, w, _, params = _setup(G(1, 24, 8, (2, 2, 2), 2, 2))
    for cfg in B.dgrad_candidates(params, torch.float32, torch.device("cuda")):
        assert cfg.BLOCK_N <= 32 and cfg.BLOCK_K == 16 and cfg.BLOCK_M in (64, 128)
        assert cfg.num_stages * (cfg.BLOCK_M * cfg.BLOCK_K + cfg.BLOCK_K * cfg.BLOCK_N) * 4 <= 160 * 1024
    cands = B.dgrad_candidates(params, torch.float32, torch.device("cuda"))
    assert len(set(cands)) == len(cands)
    big = check_call(torch.empty(1, 256, 2, 2, 2), torch.empty(256, 128, 4, 4, 4), None, 2, 1, 0, 1, 1)[0]
    cuda = torch.device("cuda")
    # The tiles the choice times (backward.dgrad_candidates): 128x64 K32 first, then the two 128x128 tiles.
    assert B.dgrad_candidates(big, torch.bfloat16, cuda) == (
        B.DgradConfig(128, 64, 32, 4, 4), B.DgradConfig(128, 128, 64, 8, 3), B.DgradConfig(128, 128, 32, 8, 4))
    assert B.DgradConfig(128, 128, 32, 8, 4) in B.dgrad_candidates(big, torch.float32, cuda, "ieee")
    # fp32 TF32 MMAs: 128x128 tiles on 4 warps (on 8, ptxas serialises the wgmma chain).
    assert B.DgradConfig(128, 128, 32, 4, 4) in B.dgrad_candidates(big, torch.float32, cuda, "tf32")


# ---- the choice in grads() ------------------------------------------------------------------------
def _layer_call(dy_layout="cl", x_cl=True, bias=True):
    geo = G(2, 8, 8, (2, 2, 1), 2, 2)
    x, w, dy, params = _setup(geo, dy_layout=dy_layout)
    if x_cl:
        x = x.contiguous(memory_format=CL)
    b = torch.randn(8) if bias else None
    return x, w, b, dy, params


@pytest.mark.parametrize("wgrad", ["cudnn", "triton"])
def test_forced_triton_input_gradient_through_autograd(wgrad, monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "triton")
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", wgrad)
    calls = []
    real = B.dgrad_triton
    monkeypatch.setattr(B, "dgrad_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, b, dy, params = _layer_call()
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = convt3d.conv_transpose3d(*leaves, 2, backend="triton", precision="ieee")
    y.backward(dy)
    assert calls == [1]
    _assert_close(leaves[0].grad, _ref_dx(dy, x, w, params), 1e-5, "dX")
    assert leaves[0].grad.is_contiguous(memory_format=CL), "dX keeps the input's channels_last_3d layout"
    ref_w = torch.ops.aten.convolution_backward(dy.double(), x.double(), w.double(), None, [2] * 3, [0] * 3, [1] * 3,
                                                True, [0] * 3, 1, [False, True, False])[1]
    _assert_close(leaves[1].grad, ref_w, 1e-5, "dW")
    _assert_close(leaves[2].grad, dy.double().sum((0, 2, 3, 4)), 1e-6, "db")


@pytest.mark.parametrize("mask", [(True, False, False), (True, True, False), (True, True, True), (False, True, True)],
                         ids=["x", "xw", "xwb", "wb"])
def test_grads_masks_with_forced_triton_input(mask, monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "triton")
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "cudnn")
    x, w, _, dy, params = _layer_call(dy_layout="ncdhw", x_cl=False)
    gx, gw, gb = B.grads(dy, x, w, params, "tf32x3", mask)
    assert (gx is not None, gw is not None, gb is not None) == mask
    if mask[0]:
        _assert_close(gx, _ref_dx(dy, x, w, params), 1e-5, "dX")
        assert gx.is_contiguous()


def test_both_cudnn_is_one_call(monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "cudnn")
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "cudnn")
    calls = []
    real = B._torch_grads
    monkeypatch.setattr(B, "_torch_grads", lambda *a: calls.append(a[5:8]) or real(*a))
    x, w, _, dy, params = _layer_call()
    gx, gw, gb = B.grads(dy, x, w, params, "ieee", (True, True, True))
    assert calls == [(True, True, True)]  # db rides along, as in PyTorch's own autograd
    _assert_close(gx, _ref_dx(dy, x, w, params), 1e-5, "dX")
    _assert_close(gb, dy.double().sum((0, 2, 3, 4)), 1e-6, "db")
    # Mixed: dX on Triton, dW on cuDNN -> one cuDNN call for dW (and db) only.
    calls.clear()
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "triton")
    B.grads(dy, x, w, params, "ieee", (True, True, False))
    assert calls == [(False, True, False)]


def test_forced_dgrad_name_is_validated(monkeypatch):
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "magic")
    x = torch.randn(1, 8, 2, 2, 2, requires_grad=True)
    w = torch.randn(8, 8, 2, 2, 2, requires_grad=True)
    y = convt3d.conv_transpose3d(x, w, backend="triton", precision="ieee")
    with pytest.raises(ValueError, match="CONVT3D_BWD_INPUT='magic'"):
        y.sum().backward()


def test_static_dgrad_choice_on_cpu_is_cudnn_and_cached(monkeypatch):
    monkeypatch.delenv("CONVT3D_BWD_INPUT", raising=False)
    monkeypatch.delenv("CONVT3D_BWD_WEIGHT", raising=False)
    B.clear_caches()
    x, w, _, dy, params = _layer_call()
    B.grads(dy, x, w, params, "ieee", (True, False, False))
    recs = list(B.dgrad_choices().values())
    assert len(recs) == 1 and recs[0].impl == "cudnn" and "static" in recs[0].reason
    assert recs[0].config is None and recs[0].timings_ms == {}
    assert B.choices() == {}, "a dX-only backward must not record a dW choice"
    key = next(iter(B.dgrad_choices()))
    assert key[3] == params and key[1] == x.dtype  # the fields scripts read
    B.grads(dy, x, w, params, "ieee", (True, True, False))
    assert len(B.dgrad_choices()) == 1 and len(B.choices()) == 1
    B.clear_caches()
    assert B.dgrad_choices() == {} and B.choices() == {}


def test_dgrad_is_deterministic():
    x, w, dy, params = _setup(G(2, 8, 24, (1, 2, 3), 3, 2, 1, 1), dy_layout="ncdhw")
    cfg = B.DgradConfig(16, 16, 16, 4, 1)
    a = B.dgrad_triton(dy, w, params, "tf32x3", torch.float32, cfg)
    b = B.dgrad_triton(dy, w, params, "tf32x3", torch.float32, cfg)
    assert torch.equal(a, b)
