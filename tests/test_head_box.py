"""The output-head box kind (head_box_engine, kernels/head_box.py) without a GPU.

Triton's interpreter does not run Gluon, so the kernel's numerics are GPU tests
(tests/test_gpu_head.py, test_box_kind). Here:
- the plan (boxes, shift table, packed weight, depth chunks) drives a float64 emulation of the
  kernel's algorithm, step for step: slices in order, one GEMM per depth tap, the gather, the sum
  over (height tap, width tap) columns, the pending-depth slots, the stores. It is compared with
  PyTorch's float64 transposed convolution on geometries the bench does not hold (strides 1-3,
  dilation, output padding, groups, 1-15 channels, odd sizes, boxes of both kinds);
- the kernel compiles for sm_90 on the Triton installed here;
- the candidates are offered exactly where the kind can compute the call.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

from convt3d import head_box_engine as B
from convt3d import head_engine
from convt3d.params import ConvT3dParams
from convt3d.triton_configs import Config


def _params(n, cin, cout, g, size, k, s, p, op=0, d=1):
    t3 = lambda v: v if isinstance(v, tuple) else (v,) * 3  # noqa: E731
    return ConvT3dParams.create(n, cin, cout, g, size, t3(k), t3(s), t3(p), t3(op), t3(d))


def _emulate(params: ConvT3dParams, cfg: Config, x, w, b, sms: int = 4):
    """head_box_kernel's algorithm in float64 on the CPU, from the launcher's own plan."""
    bp = B.box_plan(params, cfg)
    g_, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    kd = bp.kd_p  # depth taps, padded with zero taps to whole wgmma chunks
    sd, sh, sw = params.stride
    bh, bw, bn = cfg.BOX_H, cfg.BLOCK_W, cfg.BLOCK_N // bp.tdc  # columns of one depth tap
    bm, phco = bh * bw, bp.ph_p * bp.co_pad
    steps = B.BoxSteps(params, cfg, "tf32", b is not None, None, None, None)
    wp = steps.packed_weight(w.double(), False).view(g_, kd, bn, cin_g)
    tab = bp.table
    td_rd, td_shift = tab[0:2 * kd:2], tab[1:2 * kd:2]
    dh = torch.tensor(tab[2 * kd::2])
    dw = torch.tensor(tab[2 * kd + 1::2])
    qd, qh, qw = (a.phases[0].size for a in params.axes)
    od_, oh_, ow_ = params.out_size
    boxes = g_ * params.batch * bp.tiles_h * bp.tiles_w
    chunk = B._depth_chunk(qd, bp.span_d, boxes, sms)
    chunks = -(-qd // chunk)
    m = torch.arange(bm)
    src_h = (m // bw)[:, None] + dh[None, :] - bp.off_h
    src_w = (m % bw)[:, None] + dw[None, :] - bp.off_w
    ok = (src_h >= 0) & (src_h < bh) & (src_w >= 0) & (src_w < bw)
    src = torch.where(ok, src_h * bw + src_w, 0)
    y = torch.zeros(params.out_shape, dtype=torch.float64)
    xd = x.double()
    _, _, D, H, W = x.shape
    for grp in range(g_):
        for nb in range(params.batch):
            for t_h in range(bp.tiles_h):
                for t_w in range(bp.tiles_w):
                    for t_d in range(chunks):
                        qh0, qw0 = t_h * bp.vh, t_w * bp.vw
                        h_org, w_org = qh0 + bp.off_h, qw0 + bp.off_w
                        q_lo = t_d * chunk
                        q_hi = min(q_lo + chunk, qd)
                        i0 = q_lo + bp.off_d
                        slots = torch.zeros(bp.rdp * sd, bm, phco, dtype=torch.float64)
                        for j in range(q_hi - q_lo + bp.span_d):
                            i = i0 + j
                            a = torch.zeros(bh, bw, cin_g, dtype=torch.float64)  # TMA's zero fill
                            if 0 <= i < D:
                                h0, h1 = max(h_org, 0), min(h_org + bh, H)
                                w0, w1 = max(w_org, 0), min(w_org + bw, W)
                                if h0 < h1 and w0 < w1:
                                    a[h0 - h_org:h1 - h_org, w0 - w_org:w1 - w_org] = \
                                        xd[nb, grp * cin_g:(grp + 1) * cin_g, i, h0:h1, w0:w1].permute(1, 2, 0)
                            a = a.reshape(bm, cin_g)
                            for td in range(kd):
                                acc = a @ wp[grp, td].T
                                gat = torch.where(ok, torch.gather(acc, 0, src), 0.0)
                                share = gat.view(bm, bn // phco, phco).sum(1)
                                q = i - td_shift[td]
                                if q_lo <= q < q_hi:
                                    slots[(q % bp.rdp) * sd + td_rd[td]] += share
                            qf = i - bp.off_d - bp.span_d
                            if q_lo <= qf < q_hi:
                                for r in range(sd):
                                    vals = slots[(qf % bp.rdp) * sd + r].clone()
                                    slots[(qf % bp.rdp) * sd + r] = 0
                                    for mm in range(bm):
                                        hl, wl = mm // bw, mm % bw
                                        qh_, qw_ = qh0 + hl, qw0 + wl
                                        if hl >= bp.vh or wl >= bp.vw or qh_ >= qh or qw_ >= qw:
                                            continue
                                        for c in range(phco):
                                            ph, co = c // bp.co_pad, c % bp.co_pad
                                            o_d, o_h = qf * sd + r, qh_ * sh + ph // sw
                                            o_w = qw_ * sw + ph % sw
                                            if (co < cout_g and ph < sh * sw and o_d < od_ and o_h < oh_
                                                    and o_w < ow_):
                                                bias = 0.0 if b is None else float(b[grp * cout_g + co])
                                                y[nb, grp * cout_g + co, o_d, o_h, o_w] = vals[mm, c] + bias
    return y


# (n, cin, cout, groups, size, kernel, stride, padding, output_padding, dilation)
GEOMETRIES = {
    "gan-k4s2p1-1ch": (1, 16, 1, 1, (4, 5, 6), 4, 2, 1, 0, 1),
    "video-k144-3ch": (2, 16, 3, 1, (3, 5, 7), (1, 4, 4), (1, 2, 2), (0, 1, 1), 0, 1),
    "k3-s122-op-8ch": (1, 32, 8, 1, (3, 4, 5), 3, (1, 2, 2), 1, (0, 1, 1), 1),
    "k2s2-collision-free": (1, 16, 2, 1, (3, 4, 5), 2, 2, 0, 0, 1),
    "stride3-k5-p2": (1, 16, 2, 1, (3, 4, 4), 5, 3, 2, 1, 1),
    "stride1-k3": (1, 16, 1, 1, (3, 4, 5), 3, 1, 1, 0, 1),
    "k2s2-15ch": (1, 16, 15, 1, (3, 3, 4), 2, 2, 0, 1, 1),
    "dilation2-k3s2": (1, 16, 2, 1, (3, 4, 5), 3, 2, 2, 1, 2),
    "k2s3-empty-residue": (1, 16, 1, 1, (3, 4, 5), 2, 3, 0, 0, 1),
    "groups2-3-per-group": (1, 32, 6, 2, (3, 4, 5), 4, 2, 1, 0, 1),
    "aniso-k(3,2,4)-s(2,1,3)": (1, 16, 2, 1, (3, 4, 5), (3, 2, 4), (2, 1, 3), (1, 0, 1), 0, 1),
}


def _box_cfg(params, dtype=torch.bfloat16, bh=None, bw=None):
    """The launcher's first box tile, or (where it offers none, e.g. 128 columns per wgmma, or
    with ``bh``/``bw``) a box of that shape: the algorithm is the same for any box."""
    tiles = B.box_tiles(params, dtype, "tf32")
    t = dict(tiles[0]) if tiles else dict(BLOCK_N=B._depth_taps_per_mma(params)[2],
                                           BLOCK_K=B._box_block_k(params, dtype), num_warps=4, num_stages=2,
                                           use_dot=True, head="box", BLOCK_R=0, BLOCK_W=16, BOX_H=4, BLOCK_M=64)
    if bw is not None:  # smaller boxes than the launcher's: the overlapping-box regime
        t.update(BLOCK_W=bw, BOX_H=bh, BLOCK_M=bh * bw)
    return Config(**t)


@pytest.mark.parametrize("boxes", ["launcher", "overlapping-8x8", "overlapping-4x16"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_emulated_kernel_matches_float64(name, boxes):
    from conftest import reference  # not at import: the compile test's clean process runs this file

    n, cin, cout, g, size, k, s, p, op, d = GEOMETRIES[name]
    params = _params(n, cin, cout, g, size, k, s, p, op, d)
    bh, bw = {"launcher": (None, None), "overlapping-8x8": (8, 8), "overlapping-4x16": (4, 16)}[boxes]
    if bw is not None and (B._box_dim(params.axes[2], bw) is None or B._box_dim(params.axes[1], bh) is None):
        pytest.skip("no valid output in a box this small")
    cfg = _box_cfg(params, bh=bh, bw=bw)
    torch.manual_seed(0)
    kk = params.kernel_size
    x = torch.randn(n, cin, *size, dtype=torch.float64)
    w = torch.randn(cin, cout // g, *kk, dtype=torch.float64)
    b = torch.randn(cout, dtype=torch.float64)
    want = reference(x, w, b, params.stride, params.padding, params.output_padding, g, params.dilation)
    got = _emulate(params, cfg, x, w, b)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10), (got - want).abs().max()


def test_halo_regime_is_exercised():
    """The small boxes above do overlap (more than one box along height and width)."""
    params = _params(*GEOMETRIES["gan-k4s2p1-1ch"])
    assert B._box_dim(params.axes[2], 8)[2] == 1  # 6 input columns fit one box of 8
    big = _params(1, 16, 1, 1, (4, 12, 20), 4, 2, 1)
    vh, off, tiles = B._box_dim(big.axes[1], 8)
    assert (vh, off, tiles) == (6, -1, 2)  # shifts -1..1: 6 valid of 8, origin one row above


@pytest.mark.parametrize("span", [0, 1, 2, 4], ids=lambda v: f"span{v}")
@pytest.mark.parametrize("qd", [1, 5, 32, 64], ids=lambda v: f"qd{v}")
def test_depth_chunks(qd, span):
    sms = 132
    floor = min(qd, 2 * max(1, span))  # a chunk reads span more slices than it has outputs
    # A grid of boxes that fills the GPU three times over keeps whole depths per program.
    assert B._depth_chunk(qd, span, 3 * sms, sms) == qd
    # One box: depth splits into chunks of about qd / (3 x SMs) outputs, but never below the floor.
    assert B._depth_chunk(qd, span, 1, sms) == floor
    # In between, more boxes never mean shorter chunks.
    chunks = [B._depth_chunk(qd, span, boxes, sms) for boxes in (1, 8, 40, 100, 500)]
    assert chunks == sorted(chunks) and all(floor <= c <= qd for c in chunks)


def test_site_launches_the_box_kernel_of_its_module(monkeypatch):
    """BoxSteps hands the engine's site factory the Gluon kernel's own module and a grid of
    boxes x depth chunks."""
    from convt3d.kernels import head_box

    params = _params(*GEOMETRIES["gan-k4s2p1-1ch"])
    cfg = _box_cfg(params)
    seen = {}

    def make_site(key, name, grid, ints, consts, module=None):
        seen.update(name=name, grid=grid, module=module, consts=consts)
        return "site"

    class _Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props())
    steps = B.BoxSteps(params, cfg, "tf32", True, make_site, None, None)
    y = torch.empty(params.out_shape)
    assert steps._site(torch.empty(params.in_shape), y) == "site"
    assert seen["module"] is head_box and hasattr(head_box, seen["name"])
    bp = steps.plan
    qd = params.axes[0].phases[0].size
    chunk = B._depth_chunk(qd, bp.span_d, params.batch * bp.tiles_h * bp.tiles_w, 132)
    assert seen["grid"] == (params.batch * bp.tiles_h * bp.tiles_w * -(-qd // chunk),)
    assert (seen["consts"]["KD_P"], seen["consts"]["TDC"]) == (bp.kd_p, bp.tdc)


@pytest.mark.parametrize("dtype, precision, offered", [
    (torch.bfloat16, "tf32", True), (torch.float16, "tf32", True), (torch.float32, "tf32", True),
    (torch.float32, "ieee", False), (torch.float32, "tf32x3", False),
], ids=["bf16", "fp16", "fp32-tf32", "fp32-ieee", "fp32-tf32x3"])
def test_offered_by_dtype_and_precision(dtype, precision, offered):
    params = _params(2, 64, 1, 1, (8, 8, 8), 4, 2, 1)
    kinds = {t["head"] for t in head_engine.head_tiles(params, dtype, precision, gluon=True)}
    assert ("box" in kinds) == offered
    assert "box" not in {t["head"] for t in head_engine.head_tiles(params, dtype, precision)}


@pytest.mark.parametrize("spec, why", [
    ((2, 12, 1, 1, (8, 8, 8), 4, 2, 1, 0, 1), "16 bytes"),         # 12 bf16 channels: 24-byte stride
    ((2, 48, 6, 2, (8, 8, 8), 4, 2, 1, 0, 1), "next group"),       # 24 per group, blocks of 32
    ((2, 64, 15, 1, (8, 8, 8), 5, 2, 2, 0, 1), "columns"),         # 3 x 3 taps x 4 residues x 16
    ((2, 64, 8, 1, (8, 8, 8), 3, (1, 2, 2), 1, 0, 1), "columns"),  # 128 per depth tap: M 64 only
], ids=["channel-stride", "group-straddle", "too-many-columns", "128-columns"])
def test_not_offered_where_it_cannot_compute(spec, why):
    n, cin, cout, g, size, k, s, p, op, d = spec
    params = _params(n, cin, cout, g, size, k, s, p, op, d)
    reason = B.box_unsupported(params, torch.bfloat16, "tf32")
    assert reason is not None and why in reason
    assert B.box_tiles(params, torch.bfloat16, "tf32") == []


def test_tf32_rounding_is_to_nearest_even():
    t = torch.tensor([1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -11 + 2 ** -20, -(1.0 + 2 ** -10)])
    got = B._box_round_tf32(t.clone())
    assert got.tolist() == [1.0, 1.0 + 2 ** -9, 1.0 + 2 ** -10, -(1.0 + 2 ** -10)]


def _compile(dtype: str, bh: int, bw: int, bk: int, bn: int, consts: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from convt3d.kernels import head_box as HB

    g = getattr(gl, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    box = [1, 1, bh, bw, bk]
    a = gl.NVMMASharedLayout.get_default_for(box, g)
    b = gl.NVMMASharedLayout.get_default_for([bn, bk], g)
    sig = {"x_desc": f"tensordesc<{dtype}[{','.join(map(str, box))}],{a!r}>",
           "w_desc": f"tensordesc<{dtype}[{bn},{bk}],{b!r}>", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}",
           "tab_ptr": "*i32"}
    fn = HB.head_box_kernel
    signature = {n: sig.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    return triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": consts["num_warps"]})


@pytest.mark.parametrize("dtype, bh, bw, bk, bn, consts", [
    ("bf16", 8, 32, 64, 64, dict(KD_P=4, TDC=4, SD=2, SH=2, SW=2, CO_PAD=1, PH_P=4, RDP=4, K_BLOCKS=1, HAS_BIAS=True,
                                  STAGES=2)),
    ("fp32", 4, 32, 32, 64, dict(KD_P=4, TDC=1, SD=2, SH=2, SW=2, CO_PAD=4, PH_P=4, RDP=4, K_BLOCKS=2, HAS_BIAS=False,
                                  STAGES=2)),
    ("fp16", 1, 64, 64, 128, dict(KD_P=3, TDC=1, SD=1, SH=2, SW=2, CO_PAD=8, PH_P=4, RDP=4, K_BLOCKS=2, HAS_BIAS=True,
                                   STAGES=3)),
], ids=["gan-bf16", "video-fp32-two-k-blocks", "k3-fp16-stride1-depth"])
def test_kernel_compiles_for_sm90(dtype, bh, bw, bk, bn, consts):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from test_gluon_spike import compile_in_clean_process

    out = compile_in_clean_process([__file__, json.dumps([dtype, bh, bw, bk, bn, dict(consts, num_warps=4)])])
    assert "wgmma.mma_async" in out
    assert "cp.async.bulk.tensor.5d" in out


if __name__ == "__main__":  # the compile test's clean process: print the PTX of one configuration
    dtype_, bh_, bw_, bk_, bn_, consts_ = json.loads(sys.argv[1])
    print(_compile(dtype_, bh_, bw_, bk_, bn_, consts_).asm["ptx"])
