"""The head backward kernels (``kernels/head_grad.py`` through ``convt3d.engines.triton.head_backward`` and
``convt3d.engines.triton.backward``) on the CPU, through Triton's interpreter: dX and dW of layers with 1-15
output channels per group against float64 ``aten.convolution_backward`` -- strides, dilation,
padding, output_padding, groups, odd sizes, batch; both layouts of X, dY and dX, sliced and
expanded dY, non-contiguous X; the fp32 precisions and fp16; the split reduction of dW; every
tile configuration a GPU would time; autograd with bias and unbatched input; the choice's
candidates and its error paths.

Sizes are tiny (the interpreter costs ~0.1 s per program step). bfloat16 is left out: the
interpreter's bf16 dots are unreliable (tests/gpu/test_gpu_head.py covers bf16 on the GPU).

Why the bounds: the exact fp32 grades sum at most taps x Cout/g = 27 x 15 products (dX) or
N x D x H x W <= 200 products per split (dW): 1e-5 of the gradient's scale is ~100x their
rounding, while a missed tap, channel or position is off by > 1e-2. "tf32" rounds each operand to
11 significant bits (~2^-10 per product): 4e-3 leaves a factor ~4 for cancellation. fp16 rounds
the fp32 result once (2^-11) after exact products and fp32 sums: 2e-3.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import convt3d
from convt3d.engines.triton import backward as B
from convt3d.engines.triton import head_backward as HB
from convt3d.core.errors import BackendUnavailableError
from convt3d.core.params import ConvT3dParams
from convt3d.core.validate import check_call

from conftest import CL, requires_interpreter, round_tf32_reference
from test_dgrad import G, _assert_close  # the same geometry record and checks

pytestmark = requires_interpreter

REL = {"ieee": 1e-5, "tf32x3": 1e-5, "tf32": 4e-3, torch.float16: 2e-3}


def _rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another memory layout (or a strided view of a larger tensor)."""
    if layout == "ncdhw":
        return t.contiguous()
    if layout == "cl":
        return t.contiguous(memory_format=CL)
    if layout == "slice_w":  # every other W element of a wider tensor
        big = torch.zeros(*t.shape[:4], 2 * t.shape[4], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if layout == "transpose_dh":
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    raise ValueError(layout)


def _setup(geo: G, dtype=torch.float32, x_layout="ncdhw", dy_layout="ncdhw"):
    k3 = geo.k if isinstance(geo.k, tuple) else (geo.k,) * 3
    x = _layout(_rnd(geo.n, geo.cin, *geo.size, dtype=dtype), x_layout)
    w = _rnd(geo.cin, geo.cout // geo.g, *k3, dtype=dtype)
    params, _ = check_call(x, w, None, geo.s, geo.p, geo.op, geo.g, geo.d)
    dy = _layout(_rnd(*params.out_shape, dtype=dtype), dy_layout)
    return x, w, dy, params


def _ref(dy, x, w, params, mask, round_tf32=False):
    f = round_tf32_reference if round_tf32 else (lambda t: t)
    return torch.ops.aten.convolution_backward(
        f(dy).double(), f(x).double(), f(w).double(), None, list(params.stride), list(params.padding),
        list(params.dilation), True, list(params.output_padding), params.groups, mask)


# name -> (geometry, X layout, dY layout, precision or 16-bit dtype)
CASES = {
    "cout1-gan-k4s2p1": (G(1, 8, 1, (2, 3, 3), 4, 2, 1), "ncdhw", "ncdhw", "ieee"),
    "cout1-cl": (G(2, 16, 1, (2, 2, 3), 4, 2, 1), "cl", "cl", "ieee"),
    "cout2-k2s2-taps-never-meet": (G(1, 8, 2, (3, 2, 3), 2, 2), "ncdhw", "cl", "ieee"),
    "cout3-video-k144": (G(1, 16, 3, (2, 3, 4), (1, 4, 4), (1, 2, 2), (0, 1, 1)), "cl", "ncdhw", "tf32x3"),
    "cout5-k3s1p1-odd": (G(1, 8, 5, (3, 1, 5), 3, 1, 1), "ncdhw", "ncdhw", "ieee"),
    "cout8-k3s2p1op1": (G(1, 24, 8, (2, 2, 3), 3, 2, 1, 1), "cl", "cl", "ieee"),
    "cout15-dilation2": (G(1, 8, 15, (2, 2, 2), 3, 2, 2, 1, 2), "ncdhw", "ncdhw", "ieee"),
    "aniso-everything": (G(1, 8, 3, (3, 2, 4), (2, 3, 1), (1, 2, 3), (0, 1, 0), (0, 1, 2), (2, 1, 1)), "ncdhw",
                         "cl", "ieee"),
    "stride3-output-gaps": (G(1, 8, 2, (2, 2, 2), 2, 3, 0, 2), "ncdhw", "ncdhw", "ieee"),
    "padding-beyond-reach": (G(1, 8, 1, (3, 3, 3), 2, 2, 1, 1), "ncdhw", "ncdhw", "ieee"),
    "groups2-3-per-group": (G(1, 16, 6, (2, 2, 3), 3, 2, 1, 0, 1, 2), "ncdhw", "ncdhw", "ieee"),
    "groups4-1-per-group-cl": (G(2, 32, 4, (1, 2, 3), 2, 2, 0, 0, 1, 4), "cl", "cl", "tf32x3"),
    "batch3": (G(3, 8, 1, (2, 2, 2), 3, 2, 1), "ncdhw", "ncdhw", "tf32x3"),
    "cin40-channel-tiles": (G(1, 40, 2, (2, 2, 2), 2, 2), "ncdhw", "ncdhw", "ieee"),  # 2 Cin tiles of 32, masked
    # Position tiles of one batch element: S = 60 gives full tiles (stored and loaded without the
    # position mask) and a partial one per element; S = 32, full tiles only.
    "batch2-full-and-partial-tiles": (G(2, 8, 2, (3, 4, 5), 3, 2, 1), "ncdhw", "ncdhw", "ieee"),
    "batch2-full-tiles-cl": (G(2, 8, 1, (2, 4, 4), 4, 2, 1), "cl", "cl", "ieee"),
    "dy-slice-w": (G(1, 8, 3, (2, 2, 3), 3, 2, 1), "ncdhw", "slice_w", "ieee"),
    "x-slice-w": (G(1, 8, 3, (2, 2, 3), 3, 2, 1), "slice_w", "ncdhw", "ieee"),
    "dy-transpose-dh": (G(1, 8, 2, (2, 3, 2), 2, 2), "ncdhw", "transpose_dh", "ieee"),
    "tf32": (G(1, 8, 3, (2, 2, 2), 3, 2, 1, 1), "ncdhw", "ncdhw", "tf32"),
    "tf32-cl": (G(1, 16, 1, (2, 2, 2), 4, 2, 1), "cl", "cl", "tf32"),
    "fp16": (G(1, 8, 3, (2, 2, 2), 3, 2, 1, 1), "cl", "cl", torch.float16),
    "fp16-groups2": (G(2, 16, 4, (2, 2, 2), 2, 2, 0, 0, 1, 2), "ncdhw", "ncdhw", torch.float16),
}


def _dtype_prec(prec):
    return (prec, "ieee") if isinstance(prec, torch.dtype) else (torch.float32, prec)


# The two kernels of each gradient: dY from its zero-padded copy with runs of positions, and
# dY split by phase with tiles of rows along W (the CPU candidates hold one of each, in this order).
KERNELS = {"flat": 0, "phases": 1}


def _dcfg(params, dtype, kernel):
    cfg = HB.dgrad_candidates(params, dtype, torch.device("cpu"))[KERNELS[kernel]]
    assert bool(cfg.BLOCK_W) == (kernel == "phases")
    return cfg


def _wcfg(params, dtype, kernel):
    cfg = HB.wgrad_candidates(params, dtype, torch.device("cpu"))[KERNELS[kernel]]
    assert bool(cfg.BLOCK_W) == (kernel == "phases")
    return cfg


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dx_format", ["ncdhw", "cl"])
@pytest.mark.parametrize("name", list(CASES))
def test_head_dgrad_matches_float64(name, dx_format, kernel):
    geo, x_layout, dy_layout, prec = CASES[name]
    dtype, precision = _dtype_prec(prec)
    x, w, dy, params = _setup(geo, dtype, x_layout, dy_layout)
    assert HB.supports(params), HB.unsupported_reason(params)
    fmt = CL if dx_format == "cl" else torch.contiguous_format
    gx = HB.head_dgrad(dy, w, params, precision, dtype, _dcfg(params, dtype, kernel), fmt)
    assert gx.dtype == dtype and gx.is_contiguous(memory_format=fmt)
    _assert_close(gx, _ref(dy, x, w, params, [True, False, False])[0], REL[prec], f"{name} dX")
    if precision == "tf32":
        # Operands rounded to nearest TF32 (cuDNN's rounding), then exact products and fp32 sums.
        _assert_close(gx, _ref(dy, x, w, params, [True, False, False], round_tf32=True)[0], 1e-5,
                      f"{name} dX vs exact TF32")


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name", list(CASES))
def test_head_wgrad_matches_float64(name, kernel):
    geo, x_layout, dy_layout, prec = CASES[name]
    dtype, precision = _dtype_prec(prec)
    x, w, dy, params = _setup(geo, dtype, x_layout, dy_layout)
    gw = HB.head_wgrad(dy, x, params, precision, dtype, _wcfg(params, dtype, kernel))
    assert gw.dtype == dtype and gw.is_contiguous() and gw.shape == w.shape
    _assert_close(gw, _ref(dy, x, w, params, [False, True, False])[1], REL[prec], f"{name} dW")
    if precision == "tf32":
        _assert_close(gw, _ref(dy, x, w, params, [False, True, False], round_tf32=True)[1], 1e-5,
                      f"{name} dW vs exact TF32")


def test_dgrad_writes_only_ncdhw_or_channels_last():
    x, w, dy, params = _setup(G(1, 8, 2, (2, 2, 2), 3, 2, 1))
    with pytest.raises(ValueError, match="NCDHW or channels-last"):
        HB.head_dgrad(dy, w, params, "ieee", torch.float32, _dcfg(params, torch.float32, "flat"),
                      torch.preserve_format)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_expanded_dy_from_sum_backward(kernel):
    # y.sum().backward() hands the backward an all-zero-stride dY.
    x, w, _, params = _setup(G(1, 8, 2, (2, 2, 2), 3, 2, 1))
    dy = torch.ones((), dtype=torch.float32).expand(params.out_shape)
    _assert_close(HB.head_dgrad(dy, w, params, "ieee", torch.float32, _dcfg(params, torch.float32, kernel)),
                  _ref(dy, x, w, params, [True, False, False])[0], 1e-5, "dX")
    _assert_close(HB.head_wgrad(dy, x, params, "ieee", torch.float32, _wcfg(params, torch.float32, kernel)),
                  _ref(dy, x, w, params, [False, True, False])[1], 1e-5, "dW")


@pytest.mark.parametrize("geo", [G(1, 8, 1, (2, 2, 2), 2, 2), G(1, 8, 2, (2, 2, 3), 4, 2, 1)],
                         ids=["k2s2p0-dy-rounded-in-kernel", "k4s2p1-dy-rounded-in-its-copy"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_tf32_rounds_to_nearest_not_truncates(kernel, geo):
    # Values just above a TF32 rounding boundary: truncation would be off by 2^-11 relative. dY
    # is rounded where its copy is made (the phase kernels always; the flat ones where the copy
    # needs zeros) or, read in place (k2 s2 p0, flat), as the kernel loads it.
    x, w, _, params = _setup(geo)
    w = torch.full_like(w, 1.0 + 2.0 ** -11 + 2.0 ** -20)  # rounds up to 1 + 2^-10
    x = torch.full_like(x, 1.0 + 2.0 ** -11 + 2.0 ** -20)
    dy = torch.full(params.out_shape, 1.0 + 2.0 ** -11 + 2.0 ** -20) + torch.randint(0, 4, params.out_shape)
    assert HB.dy_copied(params, _dcfg(params, torch.float32, kernel)) == (kernel == "phases" or params.padding[0] > 0)
    _assert_close(HB.head_dgrad(dy, w, params, "tf32", torch.float32, _dcfg(params, torch.float32, kernel)),
                  _ref(dy, x, w, params, [True, False, False], round_tf32=True)[0], 1e-6, "dX nearest-TF32")
    _assert_close(HB.head_wgrad(dy, x, params, "tf32", torch.float32, _wcfg(params, torch.float32, kernel)),
                  _ref(dy, x, w, params, [False, True, False], round_tf32=True)[1], 1e-6, "dW nearest-TF32")


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_64bit_offsets_agree(kernel, monkeypatch):
    # The kernels' BIG variant (64-bit offsets, taken when a tensor spans >= 2^31 elements) on a
    # small layer: the same gradients as float64. The sites are rebuilt so that BIG is re-decided.
    from convt3d.engines.triton import sites as triton_sites

    monkeypatch.setattr(HB, "_big", lambda *tensors: True)
    monkeypatch.setattr(triton_sites, "_sites", {})
    x, w, dy, params = _setup(G(1, 8, 3, (2, 3, 3), 4, 2, 1), x_layout="cl")
    ref = _ref(dy, x, w, params, [True, True, False])
    _assert_close(HB.head_dgrad(dy, w, params, "ieee", torch.float32, _dcfg(params, torch.float32, kernel)),
                  ref[0], 1e-5, "dX")
    _assert_close(HB.head_wgrad(dy, x, params, "ieee", torch.float32, _wcfg(params, torch.float32, kernel)),
                  ref[1], 1e-5, "dW")
    if kernel == "phases":
        assert torch.equal(HB.dy_phases(dy, params, torch.float32).double(), _copy_reference(dy, params))


@pytest.mark.parametrize("splits", [1, 5, 300], ids=["one-split", "splits-in-one-block", "splits-over-blocks"])
def test_wgrad_finish_adds_splits_and_lays_out_dw(splits):
    # The finish launch on given partials part[split, g, ci, k] (k = tap * Cout/g + co): their sum
    # over splits, written as dW[g*Cin/g + ci, co, kd, kh, kw] in dW's dtype; 300 splits take
    # several BLOCK_S steps (HB._finish_blocks).
    params = _setup(G(1, 16, 6, (2, 2, 2), 3, 2, 1, 0, 1, 2))[3]  # 2 groups of 8 -> 3, k3
    g, cin_g, cout_g, taps = 2, 8, 3, 27
    part = _rnd(splits, g, cin_g, taps * cout_g)
    block_s, _ = HB._finish_blocks(g * cin_g * taps * cout_g, splits, HB.device_programs(torch.device("cpu"), 1))
    assert (splits > block_s) == (splits == 300)
    dw = torch.empty(16, cout_g, 3, 3, 3, dtype=torch.float32)
    HB._finish_site(params, splits, dw).launch(dw.device, part, dw)
    want = part.double().sum(0).view(g, cin_g, taps, cout_g).permute(0, 1, 3, 2).reshape(16, cout_g, 3, 3, 3)
    _assert_close(dw, want, 1e-6, f"{splits} splits")


def _copy_reference(dy: torch.Tensor, params) -> torch.Tensor:
    """dY split by phase from the definition (``HB.DyPhases``), element by element."""
    lay = HB.dy_phases_layout(params)
    out = torch.zeros(lay.shape, dtype=torch.float64)
    for r in itertools.product(*(range(s) for s in params.stride)):
        for q in itertools.product(*(range(n) for n in lay.length)):
            o = [(qi - c) * s + ri for qi, c, s, ri in zip(q, lay.shift, params.stride, r)]
            if all(0 <= oi < n for oi, n in zip(o, params.out_size)):
                out[r + (slice(None), slice(None)) + q] = dy[(slice(None), slice(None)) + tuple(o)].double()
    return out


@pytest.mark.parametrize("name", ["cout3-video-k144", "cout15-dilation2", "aniso-everything", "stride3-output-gaps",
                                  "padding-beyond-reach", "dy-slice-w", "dy-transpose-dh"])
def test_dy_phases_copy_matches_its_definition(name):
    # Every element of the copy: dY at (q' - c)*s + r where that is inside dY, zero elsewhere
    # (the kernel writes all of them: the copy is allocated uninitialised).
    geo, x_layout, dy_layout, prec = CASES[name]
    _, _, dy, params = _setup(geo, torch.float32, x_layout, dy_layout)
    got = HB.dy_phases(dy, params, torch.float32)
    assert got.shape == HB.dy_phases_layout(params).shape and got.is_contiguous()
    assert torch.equal(got.double(), _copy_reference(dy, params))


def test_phase_kernels_on_rows_longer_than_a_block():
    # W = 140: the copy's rows (141 elements) take two BLOCK_Q steps of 128, and the kernels'
    # position tiles cover a row in several BLOCK_W pieces.
    x, w, dy, params = _setup(G(1, 8, 2, (1, 2, 140), 3, 2, 1), x_layout="cl")
    assert HB.dy_phases_layout(params).length[2] == 141
    assert torch.equal(HB.dy_phases(dy, params, torch.float32).double(), _copy_reference(dy, params))
    ref = _ref(dy, x, w, params, [True, True, False])
    _assert_close(HB.head_dgrad(dy, w, params, "ieee", torch.float32, _dcfg(params, torch.float32, "phases"), CL),
                  ref[0], 1e-5, "dX")
    _assert_close(HB.head_wgrad(dy, x, params, "ieee", torch.float32, _wcfg(params, torch.float32, "phases")),
                  ref[1], 1e-5, "dW")


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_wgrad_splits_are_deterministic_and_agree(kernel):
    # 1, 3 and 7 splits (7 > steps: empty ranges) reduce in different orders: equal to rounding,
    # each bitwise repeatable.
    x, w, dy, params = _setup(G(2, 8, 3, (2, 3, 3), 3, 2, 1))
    ref = _ref(dy, x, w, params, [False, True, False])[1]
    base = _wcfg(params, torch.float32, kernel)
    for splits in (1, 3, 7):
        cfg = HB.HeadWgradConfig(**{**base.__dict__, "splits": splits})
        a = HB.head_wgrad(dy, x, params, "ieee", torch.float32, cfg)
        assert torch.equal(a, HB.head_wgrad(dy, x, params, "ieee", torch.float32, cfg)), f"{splits} splits"
        _assert_close(a, ref, 1e-5, f"{splits} splits")


def test_every_gpu_candidate_config(monkeypatch):
    # The tiles a GPU times (candidates for device "cuda"), run here by the interpreter on a layer
    # whose sizes end inside every tile: 130 positions, 40 input channels, taps x Cout/g = 81.
    monkeypatch.setattr(HB, "device_programs", lambda device, per_sm=4: per_sm * 132)  # the H200's 132 SMs
    x, w, dy, params = _setup(G(1, 40, 3, (2, 5, 13), 3, 2, 1, 1))
    cuda = torch.device("cuda")
    dgrads = HB.dgrad_candidates(params, torch.float32, cuda)
    wgrads = HB.wgrad_candidates(params, torch.float32, cuda)
    assert len(dgrads) >= 2 and len(set(dgrads)) == len(dgrads) and len(wgrads) >= 1
    # Both kernels of each gradient; every flat dW tile in both dY-gather layouts (the timed
    # choice picks one).
    assert {bool(c.BLOCK_W) for c in dgrads} == {False, True} and {bool(c.BLOCK_W) for c in wgrads} == {False, True}
    assert {c.lanes_on_m for c in wgrads if not c.BLOCK_W} == {False, True} and len(set(wgrads)) == len(wgrads)
    # A phase tile's rows along W: W = 13 rounds up to 16 (the rest of a 64-position tile is 4 rows).
    assert {c.BLOCK_W for c in dgrads + wgrads if c.BLOCK_W} == {16}
    ref = _ref(dy, x, w, params, [True, True, False])
    # Tiles that differ only in warps launch the same program on the interpreter: one of them runs.
    launched = set()
    for cfg in dgrads:
        assert cfg.num_stages * (cfg.BLOCK_M * cfg.BLOCK_K + cfg.BLOCK_K * cfg.BLOCK_N) * 4 <= 160 * 1024
        if _first_launch(launched, cfg):
            _assert_close(HB.head_dgrad(dy, w, params, "ieee", torch.float32, cfg), ref[0], 1e-5, cfg.short())
    # Reduction steps: 5 of 32 positions (flat tiles), 4 tiles of 4 x 16 positions
    # (phase tiles), so one split either way (>= 4 steps each).
    for cfg in wgrads:
        assert cfg.splits == 1, cfg.short()
        if _first_launch(launched, cfg):
            _assert_close(HB.head_wgrad(dy, x, params, "ieee", torch.float32, cfg), ref[1], 1e-5, cfg.short())


def _first_launch(launched: set, cfg) -> bool:
    """Whether no tile of ``launched`` equals ``cfg`` but for its warps (then ``cfg`` joins it)."""
    key = dataclasses.replace(cfg, num_warps=4)
    if key in launched:
        return False
    launched.add(key)
    return True


def test_wgrad_splits_bounded_by_partial_buffer(monkeypatch):
    # A large head (16 x 64 -> 1, 32^3, k4): ~4 programs per SM; a wide one (128 -> 15, k3 x 27
    # taps): the fp32 partial sums stay within 2^22 values.
    monkeypatch.setattr(HB, "device_programs", lambda device, per_sm=4: per_sm * 132)  # the H200's 132 SMs
    cuda = torch.device("cuda")
    gan = check_call(torch.empty(16, 64, 32, 32, 32), torch.empty(64, 1, 4, 4, 4), None, 2, 1, 0, 1, 1)[0]
    cfg = HB.wgrad_candidates(gan, torch.bfloat16, cuda)[0]
    assert cfg.splits == 528 and cfg.BLOCK_CI == 64 and cfg.BLOCK_K == 64
    wide = check_call(torch.empty(4, 128, 16, 64, 64), torch.empty(128, 15, 3, 3, 3), None, 2, 1, 1, 1, 1)[0]
    for cfg in HB.wgrad_candidates(wide, torch.bfloat16, cuda):
        assert cfg.splits * 128 * 27 * 15 <= 2**22


# ---- through autograd and the choice --------------------------------------------------------------
@pytest.fixture
def head_calls(monkeypatch):
    """Both gradients forced to Triton; the names of the head kernels' launchers as they run."""
    monkeypatch.setenv("CONVT3D_BWD_INPUT", "triton")
    monkeypatch.setenv("CONVT3D_BWD_WEIGHT", "triton")
    calls = []
    for name in ("head_dgrad", "head_wgrad"):
        real = getattr(HB, name)
        monkeypatch.setattr(HB, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    return calls


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("x_layout", ["ncdhw", "cl"])
def test_forced_head_kernels_through_autograd(x_layout, unbatched, head_calls):
    calls = head_calls
    geo = G(1, 8, 3, (2, 2, 3), 4, 2, 1)
    x, w, _, params = _setup(geo, x_layout=x_layout)
    b = _rnd(3)
    if unbatched:
        x = x[0]
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = convt3d.conv_transpose3d(*leaves, 2, 1, backend="triton", precision="ieee")
    dy = _rnd(*y.shape)
    y.backward(dy)
    assert sorted(calls) == ["head_dgrad", "head_wgrad"]
    x5, dy5 = (x.unsqueeze(0), dy.unsqueeze(0)) if unbatched else (x, dy)
    ref = _ref(dy5, x5, w, params, [True, True, False])
    _assert_close(leaves[0].grad if not unbatched else leaves[0].grad.unsqueeze(0), ref[0], 1e-5, "dX")
    _assert_close(leaves[1].grad, ref[1], 1e-5, "dW")
    _assert_close(leaves[2].grad, dy5.double().sum((0, 2, 3, 4)), 1e-6, "db")
    if x_layout == "cl" and not unbatched:
        assert leaves[0].grad.is_contiguous(memory_format=CL), "dX keeps the input's channels_last_3d layout"


@pytest.mark.parametrize("geo,args,pads", [
    (G(1, 8, 2, (3, 2, 3), 2, 2), (2, 0), 0),
    (G(1, 8, 3, (2, 2, 3), 4, 2, 1), (2, 1), 1),
], ids=["k2s2p0-reads-dy-in-place", "k4s2p1-one-padded-copy"])
def test_head_backward_pads_dy_at_most_once(geo, args, pads, head_calls, monkeypatch):
    # dX and dW share one zero-padded dY, and a layer whose taps reach every dY position with no
    # padding (k2 s2 p0) reads dY itself.
    x, w, _, params = _setup(geo, x_layout="cl")
    leaves = [t.detach().requires_grad_() for t in (x, w)]
    y = convt3d.conv_transpose3d(*leaves, None, *args, backend="triton", precision="ieee")
    dy = _rnd(*y.shape)
    real_pad, count = HB._pad_site, []
    monkeypatch.setattr(HB, "_pad_site", lambda *a, **k: count.append(1) or real_pad(*a, **k))
    y.backward(dy)
    assert sorted(head_calls) == ["head_dgrad", "head_wgrad"] and len(count) == pads
    ref = _ref(dy, x, w, params, [True, True, False])
    _assert_close(leaves[0].grad, ref[0], 1e-5, "dX")
    _assert_close(leaves[1].grad, ref[1], 1e-5, "dW")


def _pad_reference(dy: torch.Tensor, params) -> torch.Tensor:
    """dY zero-padded from the definition: ``p`` zeros before the data along each dimension, and
    after it up to ``(in-1)*s + (k-1)*d + 1``."""
    pads = []
    for a in reversed(params.axes):
        pads += [a.padding, max(0, (a.in_size - 1) * a.stride + (a.kernel - 1) * a.dilation + 1 - a.padding
                                - a.out_size)]
    return torch.nn.functional.pad(dy.double(), pads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16-from-fp32-not-rounded"])
@pytest.mark.parametrize("dy_layout", ["ncdhw", "cl", "slice_w", "transpose_dh"])
@pytest.mark.parametrize("name", ["cout3-video-k144", "cout15-dilation2", "aniso-everything", "padding-beyond-reach",
                                  "groups4-1-per-group-cl"])
def test_padded_dy_copy_matches_its_definition(name, dy_layout, dtype):
    # Every element of the one-launch copy (allocated uninitialised): dY's data at its padding
    # offset, zeros around it, in the copy's dtype and in dY's layout (channels-last stays so;
    # rows of (position, channel) pairs there, of positions in NCDHW). A layer that needs no
    # zero (groups4-1-per-group-cl: k2 s2 p0) gets dY itself, converted.
    geo = CASES[name][0]
    _, _, dy, params = _setup(geo, torch.float32, "ncdhw", dy_layout)
    # Asked to round, a 16-bit copy is not: TF32 is a rounding of fp32 operands only.
    got = HB.padded_dy(dy, params, dtype, round_tf32=dtype != torch.float32)
    want = _pad_reference(dy, params)
    assert got.dtype == dtype and got.shape == want.shape
    if name == "groups4-1-per-group-cl":
        assert got.data_ptr() == dy.data_ptr() or dtype != dy.dtype
    else:
        assert got.is_contiguous(memory_format=CL if dy_layout == "cl" else torch.contiguous_format)
    assert torch.equal(got.double(), want.to(dtype).double())


@pytest.mark.parametrize("name", ["cout3-video-k144", "aniso-everything", "tf32-cl"])
@pytest.mark.parametrize("copy", ["padded", "phases"])
def test_dy_copies_round_to_tf32_when_asked(copy, name):
    # At TF32 the copies hold dY rounded to nearest TF32 (ties away from zero), every element
    # once; the values sit on and around rounding boundaries, and an expanded dY (stride 0) is
    # read through its strides.
    geo, _, dy_layout, _ = CASES[name]
    _, _, dy, params = _setup(geo, torch.float32, "ncdhw", dy_layout)
    dy = (dy.sign() * (1.0 + 2.0 ** -11 * torch.randint(0, 3, dy.shape) + 2.0 ** -22)).to(dy)
    if copy == "padded":
        got, want = HB.padded_dy(dy, params, torch.float32, True), _pad_reference(dy, params)
    else:
        got, want = HB.dy_phases(dy, params, torch.float32, True), _copy_reference(dy, params)
    assert torch.equal(got.double(), round_tf32_reference(want).double())
    assert not torch.equal(got.double(), want), "the values straddle TF32 boundaries"


@pytest.mark.parametrize("kinds", [("phases", "phases"), ("phases", "flat"), ("flat", "phases")],
                         ids=["both-phases-one-copy", "dx-phases-dw-flat", "dx-flat-dw-phases"])
def test_head_backward_makes_each_dy_copy_once(kinds, monkeypatch):
    # Through backward.grads with the choices set to these kernels: dX and dW share one copy of dY
    # when they read the same kind, and each makes its own otherwise.
    geo = G(1, 8, 3, (2, 2, 3), 4, 2, 1)
    x, w, dy, params = _setup(geo, x_layout="cl")
    cfgs = (_dcfg(params, torch.float32, kinds[0]), _wcfg(params, torch.float32, kinds[1]))
    monkeypatch.setattr(B, "_plan", lambda *a: (CL, torch.contiguous_format,
                                                B.Choice("triton", cfgs[0], 0.0, {}, "test"),
                                                B.Choice("triton", cfgs[1], 0.0, {}, "test")))
    made = []
    for name in ("dy_phases", "padded_dy"):
        real = getattr(HB, name)
        monkeypatch.setattr(HB, name, lambda *a, _r=real, _n=name, **k: made.append(_n) or _r(*a, **k))
    gx, gw, _ = B.grads(dy, x, w, params, "ieee", (True, True, False))
    want = ["dy_phases"] if kinds == ("phases", "phases") else ["dy_phases", "padded_dy"]
    assert sorted(made) == want
    ref = _ref(dy, x, w, params, [True, True, False])
    _assert_close(gx, ref[0], 1e-5, "dX")
    _assert_close(gw, ref[1], 1e-5, "dW")


REGIMES = {
    # name -> (geometry, head dX candidates?, general dX candidates?, head dW candidates?)
    "head-64to1": (G(1, 64, 1, (2, 2, 2), 4, 2, 1), True, False, True),
    "head-16to12-both-kernels": (G(1, 16, 12, (2, 2, 2), 3, 2, 1), True, True, True),
    "mid-32to16": (G(1, 32, 16, (2, 2, 2), 2, 2), False, True, False),
    "depthwise": (G(1, 8, 8, (2, 2, 2), 3, 2, 1, 0, 1, 8), False, False, False),
    "narrow-input-4to2": (G(1, 4, 2, (2, 2, 2), 3, 2, 1), False, False, False),
}


@pytest.mark.parametrize("name", list(REGIMES))
def test_choice_candidates_by_regime(name):
    geo, head_x, gen_x, head_w = REGIMES[name]
    x, w, _, params = _setup(geo)
    dx = B.dgrad_choice_candidates(params, torch.float32, x.device, "ieee")
    dw = B.wgrad_choice_candidates(params, torch.float32, x.device)
    assert any(isinstance(c, HB.HeadDgradConfig) for c in dx) == head_x
    assert any(isinstance(c, B.DgradConfig) for c in dx) == gen_x
    assert all(isinstance(c, HB.HeadWgradConfig) for c in dw) and bool(dw) == head_w
    if gen_x:  # the general kernel's default stays the forced default where it runs
        assert isinstance(dx[0], B.DgradConfig)


@pytest.mark.parametrize("name,timed", [("head-64to1", True), ("head-16to12-both-kernels", True),
                                        ("mid-32to16", False)],
                         ids=["head-64to1-timed", "head-16to12-timed", "mid-32to16-not-timed"])
def test_wgrad_timed_only_for_heads(name, timed, auto_state, monkeypatch):
    # dW's timed choice runs where the head kernels can (their tiles are its candidates); a layer
    # that is not a head takes cuDNN untimed.
    monkeypatch.delenv("CONVT3D_BWD_WEIGHT", raising=False)
    monkeypatch.setattr(B, "_can_time", lambda x, supported: supported)
    ran = []

    def fake_time_choice(cands, run_cudnn, run_triton):
        ran.append(cands)
        return B.Choice("cudnn", None, 0.0, {}, "timed (stub)")

    monkeypatch.setattr(B, "_time_choice", fake_time_choice)
    B.clear_caches()
    x, w, dy, params = _setup(REGIMES[name][0])
    try:
        rec = B.choose_wgrad(dy, x, w, params, "ieee")
    finally:
        B.clear_caches()
    assert rec.impl == "cudnn"
    assert bool(ran) == timed
    if timed:
        assert ran[0] and all(isinstance(c, HB.HeadWgradConfig) for c in ran[0])
    else:
        assert rec.reason.startswith("static rule")


def test_static_choice_on_cpu_stays_cudnn_for_heads(monkeypatch):
    monkeypatch.delenv("CONVT3D_BWD_INPUT", raising=False)
    monkeypatch.delenv("CONVT3D_BWD_WEIGHT", raising=False)
    B.clear_caches()
    x, w, dy, params = _setup(G(1, 8, 1, (2, 2, 2), 4, 2, 1))
    assert B.choose_dgrad(dy, x, w, params, "ieee").impl == "cudnn"
    assert B.choose_wgrad(dy, x, w, params, "ieee").impl == "cudnn"
    B.clear_caches()


UNSUPPORTED = {
    "cout16": (G(1, 16, 16, (2, 2, 2), 2, 2), "16 output channels per group"),
    "cin4": (G(1, 4, 2, (2, 2, 2), 2, 2), "4 input channels per group"),
    "depthwise-groups8": (G(1, 8, 8, (2, 2, 2), 2, 2, 0, 0, 1, 8), "1 input channels per group"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_layers_raise_with_the_reason(name):
    geo, reason = UNSUPPORTED[name]
    x, w, dy, params = _setup(geo)
    assert not HB.supports(params) and reason in HB.unsupported_reason(params)
    with pytest.raises(BackendUnavailableError, match=reason):
        HB.head_dgrad(dy, w, params, "ieee", torch.float32, HB.HeadDgradConfig(16, 16, 16, 4, 1))
    with pytest.raises(BackendUnavailableError, match=reason):
        HB.head_wgrad(dy, x, params, "ieee", torch.float32, HB.HeadWgradConfig(16, 16, 16, 4, 1, 1))


def test_too_many_positions_is_unsupported():
    # 2^31 positions would overflow the kernels' 32-bit position index: declined, not wrapped.
    big = ConvT3dParams.create(2**25, 8, 1, 1, (4, 4, 4), (2, 2, 2), (2, 2, 2), (0, 0, 0), (0, 0, 0), (1, 1, 1))
    assert not HB.supports(big) and "32-bit position index" in HB.unsupported_reason(big)


# ---- the timed choice: margin, failures, and the disk cache ---------------------------------------
class _FakeBench:
    """do_bench stand-in: runs the candidate once (so a failing one raises, as on a GPU) and
    returns the injected median of whichever implementation ran last."""

    def __init__(self, times: dict):
        self.times, self.last, self.calls = times, None, 0

    def cudnn(self):
        self.last = "cudnn"

    def triton(self, cfg):
        if self.times.get(cfg) == "raise":
            raise RuntimeError("injected build failure")
        self.last = cfg

    def do_bench(self, fn, **_):
        self.calls += 1
        fn()
        return self.times[self.last]


def _two_head_configs():
    return (HB.HeadDgradConfig(16, 16, 16, 4, 1), HB.HeadDgradConfig(32, 16, 16, 4, 1))


@pytest.mark.parametrize("times,winner", [
    ({"cudnn": 1.0, 0: 0.5, 1: 0.9}, 0),  # clearly faster: the fastest Triton tile
    ({"cudnn": 1.0, 0: 0.985, 1: 0.99}, None),  # within the 3% margin: cuDNN
    ({"cudnn": 1.0, 0: "raise", 1: 0.6}, 1),  # a failing tile is left out
    ({"cudnn": 1.0, 0: "raise", 1: "raise"}, None),  # all fail: cuDNN
], ids=["faster", "within-margin", "one-fails", "all-fail"])
def test_time_choice_margin_and_failures(times, winner, monkeypatch):
    import triton.testing

    cands = _two_head_configs()
    bench = _FakeBench({("cudnn" if k == "cudnn" else cands[k]): v for k, v in times.items()})
    monkeypatch.setattr(triton.testing, "do_bench", bench.do_bench)
    rec = B._time_choice(cands, bench.cudnn, bench.triton)
    assert rec.impl == ("cudnn" if winner is None else "triton")
    assert rec.config == (None if winner is None else cands[winner])
    if "raise" in times.values():
        assert "failed" in rec.reason and "injected build failure" in rec.reason


def test_time_choice_cudnn_failure_raises(monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **_: fn() or 1.0)

    def broken():
        raise RuntimeError("cuDNN failed")

    with pytest.raises(RuntimeError, match="cuDNN failed"):
        B._time_choice(_two_head_configs(), broken, lambda cfg: None)


def test_timed_choice_is_saved_and_read_back_by_a_later_process(auto_state, monkeypatch):
    # A head signature timed once (injected timings; the kernels really run under the
    # interpreter) lands in the disk cache; a "later process" (in-process caches and the cache
    # store reset) reads it back without timing; a changed candidate list or a tampered entry is
    # timed again.
    import triton.testing

    from convt3d.dispatch import cache

    for env in ("CONVT3D_BWD_INPUT", "CONVT3D_BWD_WEIGHT"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(B, "_can_time", lambda x, supported: supported)
    x, w, dy, params = _setup(G(1, 8, 1, (2, 2, 2), 4, 2, 1))
    cands = B.dgrad_choice_candidates(params, torch.float32, x.device, "ieee")
    head = cands[0]
    bench = _FakeBench({"cudnn": 1.0, head: 0.25})
    real_triton = B.dgrad_triton

    def run_and_mark(dy_, w_, params_, precision_, dtype_, cfg, *a, **k):
        bench.last = cfg
        return real_triton(dy_, w_, params_, precision_, dtype_, cfg, *a, **k)

    monkeypatch.setattr(triton.testing, "do_bench", bench.do_bench)
    monkeypatch.setattr(B, "dgrad_triton", run_and_mark)
    real_torch = B._torch_grads
    monkeypatch.setattr(B, "_torch_grads", lambda *a, **k: setattr(bench, "last", "cudnn") or real_torch(*a, **k))

    def later_process():
        B.clear_caches()
        cache.reset()

    B.clear_caches()
    rec = B.choose_dgrad(dy, x, w, params, "ieee")
    assert rec.impl == "triton" and rec.config == head and rec.reason.startswith("timed")
    timed_calls = bench.calls
    assert timed_calls == 1 + len(cands)

    later_process()
    rec2 = B.choose_dgrad(dy, x, w, params, "ieee")
    assert bench.calls == timed_calls, "a cached choice must not be timed again"
    assert rec2.impl == "triton" and rec2.config == head and rec2.reason.startswith("cached")

    # Tampered: the entry names a tile that is not a candidate -> timed again, never run.
    later_process()
    store = cache.store_for("cpu")
    name = next(n for n in store.load().entries["backward"] if n.startswith("bwd-input|"))
    bad = dict(store.entries["backward"][name], config={"type": "HeadDgradConfig",
                                                         "fields": {**head.__dict__, "BLOCK_M": 4096}})
    store.put("backward", name, bad)
    later_process()
    rec3 = B.choose_dgrad(dy, x, w, params, "ieee")
    assert bench.calls == 2 * timed_calls and rec3.reason.startswith("timed")
    B.clear_caches()


def test_choice_entry_needs_the_same_candidates():
    cands = _two_head_configs()
    rec = B.Choice("triton", cands[1], 0.5, {"cudnn": 1.0}, "timed")
    entry = B._entry_from_choice(rec, cands)
    back = B._choice_from_entry(entry, cands)
    assert back.impl == "triton" and back.config == cands[1]
    assert B._choice_from_entry(entry, cands[:1]) is None, "made among other candidates: not trusted"
    assert B._choice_from_entry({**entry, "impl": "magic"}, cands) is None
    assert B._choice_from_entry({**entry, "config": {"type": "DgradConfig", "fields": cands[1].__dict__}},
                                cands) is None, "same fields, other kernel: not the same tile"
    cud = B._choice_from_entry(B._entry_from_choice(B.Choice("cudnn", None, 0.1, {}, "timed"), cands), cands)
    assert cud.impl == "cudnn" and cud.config is None


@pytest.mark.parametrize("name", ["gan3d", "vqvae_video"])
def test_networks_train_with_the_triton_backward(name, head_calls):
    # The bench's 3-D GAN generator and VQ-VAE video decoder at their CPU sizes, patched with the
    # Triton engine and both gradients forced to Triton: their heads (8 -> 1, 8 -> 3) take the
    # head kernels, the wider layers the general ones. Every transposed convolution's weight and
    # bias gradient, and the input gradient, against the float64 model.
    import copy

    from convt3d.bench import networks

    calls = head_calls
    model, shape = networks.select_networks([name])[0].build(True)
    x = _rnd(*shape)
    patched = convt3d.patch(copy.deepcopy(model), backend="triton", precision="ieee")
    ref = copy.deepcopy(model).double()
    xp, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    patched(xp).square().mean().backward()
    ref(xr).square().mean().backward()
    assert {"head_dgrad", "head_wgrad"} <= set(calls), "the head layer did not take the head kernels"
    _assert_close(xp.grad, xr.grad, 1e-5, "input gradient")
    convts = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ConvTranspose3d)]
    params_p, params_r = dict(patched.named_parameters()), dict(ref.named_parameters())
    for layer in convts:
        for kind in ("weight", "bias"):
            key = f"{layer}.{kind}"
            if key in params_p:
                _assert_close(params_p[key].grad, params_r[key].grad, 1e-5, key)
