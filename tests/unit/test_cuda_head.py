"""The CUDA head kernel's plan on the CPU (``convt3d.engines.cuda.head``): the shuffle geometry, the packed
weight and the per-shift n-tile masks, checked against float64 ``F.conv_transpose3d`` by an
emulation of the kernel's GEMM; the tile offer rules; the staging mode; what it refuses. The
kernel itself runs in ``test_gpu_cuda_head.py``."""
from __future__ import annotations

import math
import re
from importlib import resources

import pytest
import torch
import torch.nn.functional as F

from convt3d.engines.cuda import head as ch
from convt3d.core.params import ConvT3dParams


def _params(n, cin, cout, size, k, s=1, p=0, op=0, groups=1, d=1):
    t3 = lambda v: (v,) * 3 if isinstance(v, int) else tuple(v)  # noqa: E731
    return ConvT3dParams.create(n, cin, cout, groups, t3(size), t3(k), t3(s), t3(p), t3(op), t3(d))


def emulate(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, params: ConvT3dParams,
            hp: ch.HeadPlan) -> torch.Tensor:
    """What the kernel computes, in float64 from its plan: per shift j, the input moved by j times
    the packed weight of j (chunks concatenated), summed over the shifts; then block q's column
    (r, co) written to output q * s - p + r where that lies in the output. Masked n-tiles must
    hold only zeros (the kernel skips them)."""
    js, q0, qn = ch.geometry(params)
    g, cin_g, cog = params.groups, params.in_channels_per_group, params.out_channels_per_group
    wp = ch.pack_weight(w.double(), params, hp)  # (g, chunk, shift, column, KC)
    n = x.shape[0]
    strides, pads = params.stride, params.padding
    y = torch.zeros(params.out_shape, dtype=torch.float64)
    idx = [torch.arange(q0[a], q0[a] + qn[a]) for a in range(3)]
    for grp in range(g):
        xg = x[:, grp * cin_g:(grp + 1) * cin_g].double()
        xg = torch.cat([xg, xg.new_zeros(n, hp.nchunks * hp.kc - cin_g, *xg.shape[2:])], 1)
        wj = wp[grp].permute(1, 2, 0, 3).reshape(math.prod(js), wp.shape[3], -1)  # (shift, column, Cin padded)
        acc = torch.zeros(n, *qn, wj.shape[1], dtype=torch.float64)
        j = 0
        for jd in range(js[0]):
            for jh in range(js[1]):
                for jw in range(js[2]):
                    src = [idx[a] - sh for a, sh in enumerate((jd, jh, jw))]
                    ok = [(s_ >= 0) & (s_ < params.in_size[a]) for a, s_ in enumerate(src)]
                    sub = xg[:, :, src[0].clamp(0, params.in_size[0] - 1)]
                    sub = sub[:, :, :, src[1].clamp(0, params.in_size[1] - 1)]
                    sub = sub[:, :, :, :, src[2].clamp(0, params.in_size[2] - 1)]
                    sub = sub * (ok[0][:, None, None] & ok[1][None, :, None] & ok[2][None, None, :])
                    for nt in range(wj.shape[1] // 8):
                        if not (hp.masks[j] >> nt) & 1:
                            assert not wj[j, nt * 8:(nt + 1) * 8].any(), (j, nt)
                    acc += torch.einsum("ncdhw,kc->ndhwk", sub, wj[j])
                    j += 1
        for rd in range(strides[0]):
            for rh in range(strides[1]):
                for rw in range(strides[2]):
                    r = (rd * strides[1] + rh) * strides[2] + rw
                    outs = [idx[a] * strides[a] - pads[a] + res for a, res in enumerate((rd, rh, rw))]
                    keep = [(o >= 0) & (o < params.out_size[a]) for a, o in enumerate(outs)]
                    grid = torch.meshgrid(torch.arange(n), outs[0][keep[0]], outs[1][keep[1]], outs[2][keep[2]],
                                          indexing="ij")
                    for co in range(cog):
                        vals = acc[..., r * cog + co][:, keep[0]][:, :, keep[1]][:, :, :, keep[2]]
                        y[:, grp * cog + co][grid] = vals
    if b is not None:
        y += b.double().view(1, -1, 1, 1, 1)
    return y


def emulate_tiles(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, params: ConvT3dParams,
                  hp: ch.HeadPlan, itemsize: int, cl_out: bool) -> torch.Tensor:
    """The kernel's own index arithmetic, tile by tile, in float64 from ``hp.meta`` and the packed
    weight: each tile's place from its index, the staged box's row offsets (``fill_rtab``), each M
    row's staged row and the shifts' byte offsets (``lane_a``, ``shifts``), the n-tile masks (a
    masked n-tile is skipped, as the kernel skips it), the bias columns, and the epilogue's row
    table and columns (``etab``, ``cs_col``, the width-shift sum where jn > 1), writing into an
    output of NaN in the NCDHW or channels-last layout. An element the kernel would not write
    stays NaN."""
    m = hp.meta
    insz, outsz, st, pad, js, q0 = m[0:3], m[3:6], m[6:9], m[9:12], m[12:15], m[15:18]
    bt, tiles = list(m[18:21]), m[21:24]
    cin_g, cog, groups, np_, nchunks, kc = m[24:30]
    bn, jn = m[32], m[41]
    mw = bt[2]
    bt[2] = mw - jn + 1
    hb = [bt[0] + js[0] - 1, bt[1] + js[1] - 1, mw + js[2] - 1]
    rc = st[0] * st[1] * st[2] * cog
    cp = bn + 4
    jtot = js[0] * js[1] * js[2]
    rp = hp.kc * itemsize + 16
    wp = ch.pack_weight(w.double(), params, hp)  # (g, chunk, shift, column, KC)
    y = torch.full(params.out_shape, float("nan"), dtype=torch.float64)
    if cl_out:
        y = y.contiguous(memory_format=torch.channels_last_3d)
    sy = y.stride()
    yflat = y.as_strided((y.numel(),), (1,))
    xd = x.double()
    bm = bt[0] * bt[1] * mw
    mrow = torch.arange(bm)
    lw_m, r_m = mrow % mw, mrow // mw
    lh_m, ld_m = r_m % bt[1], r_m // bt[1]
    lane_row = ((ld_m + js[0] - 1) * hb[1] + lh_m + js[1] - 1) * hb[2] + lw_m + js[2] - 1
    shoff = hp.shifts[len(hp.masks):]
    ncol = torch.arange(bn)
    bias_col = torch.where(ncol < rc, ncol % cog, torch.full_like(ncol, -1))
    # epilogue geometry
    ld_len, lh_len, lw_len = bt[0] * st[0], bt[1] * st[1], bt[2] * st[2]
    cols = lw_len * cog if cl_out else lw_len
    erows = ld_len * lh_len if cl_out else cog * ld_len * lh_len
    r = torch.arange(erows)
    ohl, t = r % lh_len, r // lh_len
    odl, co_r = t % ld_len, t // ld_len
    lh_e, rh_e = ohl // st[1], ohl % st[1]
    ldd_e, rd_e = odl // st[0], odl % st[0]
    e_cs = (ldd_e * bt[1] + lh_e) * mw * cp + (rd_e * st[1] + rh_e) * st[2] * cog + co_r
    e_yo = co_r * sy[1] + odl * sy[2] + ohl * sy[3]
    col = torch.arange(cols)
    owl, co_c = (col // cog, col % cog) if cl_out else (col, torch.zeros_like(col))
    lw_c, rw_c = owl // st[2], owl % st[2]
    c_cs = (lw_c + jn - 1) * cp + rw_c * cog + co_c
    for tile in range(m[30]):
        tt = tile
        pw = tt % tiles[2]; tt //= tiles[2]
        ph = tt % tiles[1]; tt //= tiles[1]
        pd = tt % tiles[0]; tt //= tiles[0]
        grp, nb = tt % groups, tt // groups
        i0 = (q0[0] + pd * bt[0] - (js[0] - 1), q0[1] + ph * bt[1] - (js[1] - 1),
              q0[2] + pw * bt[2] - (jn - 1) - (js[2] - 1))
        row = torch.arange(hb[0] * hb[1] * hb[2])
        hw, tr = row % hb[2], row // hb[2]
        hh, hd = tr % hb[1], tr // hb[1]
        pos = [i0[0] + hd, i0[1] + hh, i0[2] + hw]
        inside = (pos[0] >= 0) & (pos[0] < insz[0]) & (pos[1] >= 0) & (pos[1] < insz[1]) & (pos[2] >= 0) & (
            pos[2] < insz[2])
        acc = torch.zeros(bm, bn, dtype=torch.float64)
        for chunk in range(nchunks):
            staged = torch.zeros(len(row), kc, dtype=torch.float64)
            ci = torch.arange(chunk * kc, min((chunk + 1) * kc, cin_g))
            xs = xd[nb, grp * cin_g + ci][:, pos[0].clamp(0, insz[0] - 1), pos[1].clamp(0, insz[1] - 1),
                                          pos[2].clamp(0, insz[2] - 1)]
            staged[:, :len(ci)] = (xs * inside).T
            for j in range(jtot):
                assert shoff[j] % rp == 0
                a_rows = staged[lane_row - shoff[j] // rp]
                wj = wp[grp, chunk, j]  # (columns, KC)
                for nt in range(bn // 8):
                    if (hp.masks[j] >> nt) & 1 and nt * 8 < np_:
                        acc[:, nt * 8:nt * 8 + 8] += a_rows @ wj[nt * 8:nt * 8 + 8].T
        cs = torch.full((bm * cp,), float("nan"), dtype=torch.float64)
        bias_v = torch.zeros(bn, dtype=torch.float64)
        if b is not None:
            ok = bias_col >= 0
            bias_v[ok] = b.double()[grp * cog + bias_col[ok]]
        cs.view(bm, cp)[:, :bn] = acc + bias_v
        qd0, qh0, qw0 = q0[0] + pd * bt[0], q0[1] + ph * bt[1], q0[2] + pw * bt[2]
        od0, oh0, ow0 = qd0 * st[0] - pad[0], qh0 * st[1] - pad[1], qw0 * st[2] - pad[2]
        ybase = nb * sy[0] + grp * cog * sy[1] + od0 * sy[2] + oh0 * sy[3]
        ow = ow0 + owl
        od, oh = od0 + odl, oh0 + ohl
        keep_c = (ow >= 0) & (ow < outsz[2])
        keep_r = (od >= 0) & (od < outsz[0]) & (oh >= 0) & (oh < outsz[1])
        idx = (c_cs[keep_c][None, :] + e_cs[keep_r][:, None])
        val = cs[idx]
        for jw in range(1, jn):
            val = val + cs[idx + jw * (rc - cp)]
        yi = ybase + (ow[keep_c] * sy[4] + co_c[keep_c] * sy[1])[None, :] + e_yo[keep_r][:, None]
        yflat[yi.reshape(-1)] = val.reshape(-1)
    return y


# (id, params): the regimes the kernel's geometry must cover.
REGIMES = [
    ("gan-k4s2p1-cout1", _params(2, 8, 1, 4, 4, 2, 1)),
    ("video-k144-s122", _params(1, 6, 3, (3, 5, 4), (1, 4, 4), (1, 2, 2), (0, 1, 1))),
    ("k3-s122-outpad", _params(1, 5, 8, (3, 4, 3), 3, (1, 2, 2), 1, (0, 1, 1))),
    ("k2s2-no-overlap", _params(2, 3, 2, 3, 2, 2)),
    ("k3s1-stride1", _params(1, 4, 5, (3, 4, 5), 3, 1, 1)),
    ("k5s3-odd", _params(1, 7, 2, (2, 3, 4), 5, 3, 2, 2)),
    ("pad-past-stride", _params(1, 3, 3, 4, 4, 2, 3)),
    ("groups3-cout15", _params(1, 6, 45, (2, 2, 3), (2, 1, 2), (2, 1, 2), groups=3)),
    ("cin1", _params(2, 1, 4, (3, 2, 3), 3, 2, 1, 1)),
    ("cin17-two-chunks", _params(1, 17, 2, (2, 3, 2), 2, 2)),
    ("kernel1-any-dilation", _params(1, 4, 3, (2, 3, 3), (1, 3, 3), (1, 2, 2), (0, 1, 1), d=(4, 1, 1))),
    ("size1", _params(1, 3, 2, 1, 4, 2, 1)),
    ("depthwise-g8", _params(1, 8, 8, (3, 4, 5), 3, 2, 1, 1, groups=8)),
    ("deep-narrow-cin256-cout1", _params(1, 256, 1, (2, 3, 3), 2, 2)),
    ("aniso-k133-s111", _params(1, 5, 4, (2, 5, 6), (1, 3, 3), 1, (0, 1, 1))),
]


def _problem(params: ConvT3dParams, seed: int):
    """float64 input, weight and bias of ``params``, and the reference output."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(params.in_shape, dtype=torch.float64, generator=gen)
    w = torch.randn(params.in_channels, params.out_channels_per_group, *params.kernel_size, dtype=torch.float64,
                    generator=gen)
    b = torch.randn(params.out_channels, dtype=torch.float64, generator=gen)
    ref = F.conv_transpose3d(x, w, b, params.stride, params.padding, params.output_padding, params.groups,
                             params.dilation)
    return x, w, b, ref


@pytest.mark.parametrize("params", [r[1] for r in REGIMES], ids=[r[0] for r in REGIMES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plan_computes_the_transposed_convolution(params, dtype):
    assert ch.unsupported_reason(params, dtype, "tf32") is None
    x, w, b, ref = _problem(params, 0)
    for cfg, box in ch.tile_boxes(params, dtype)[:3]:
        out = emulate(x, w, b, params, ch.plan(params, dtype, cfg, box))
        assert (out - ref).abs().max().item() < 1e-9


@pytest.mark.parametrize("cl_out", [False, True], ids=["ncdhw-out", "cl-out"])
@pytest.mark.parametrize("params", [r[1] for r in REGIMES], ids=[r[0] for r in REGIMES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_index_arithmetic_computes_the_transposed_convolution(params, dtype, cl_out):
    """``emulate_tiles`` (the kernel's tile, staging, lane, mask and epilogue arithmetic) on the
    first two offered tiles of each variant (plain, width shifts as columns), in float64 with the
    plan of each dtype (its chunk width and row pitch): every output element written once, equal
    to float64 ``F.conv_transpose3d``."""
    x, w, b, ref = _problem(params, 1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for jn in ch.variants(params):
        for cfg, box in ch.tile_boxes(params, dtype, jn=jn)[:2]:
            out = emulate_tiles(x, w, b, params, ch.plan(params, dtype, cfg, box, jn=jn), itemsize, cl_out)
            assert not out.isnan().any(), (jn, cfg, box, "unwritten outputs")
            assert (out - ref).abs().max().item() < 1e-9 * max(1.0, ref.abs().max().item()), (jn, cfg, box)


def test_width_shifts_as_columns_offered_where_they_fit():
    assert ch.width_shifts(_params(1, 4, 1, 4, 4, 2, 1)) == 2          # k4 s2: J_w 2, 16 columns
    assert ch.width_shifts(_params(1, 4, 3, 4, 3, 1, 1)) == 3          # k3 s1: J_w 3, 9 columns
    assert ch.width_shifts(_params(1, 4, 2, 4, 2, 2)) == 1             # k2 s2: one width shift
    assert ch.width_shifts(_params(1, 4, 15, 4, 4, 2, 1)) == 1         # 2 x 120 columns: past 128
    assert ch.width_shifts(_params(1, 4, 3, 4, (1, 4, 4), (1, 2, 2), (0, 1, 1))) == 2
    with pytest.raises(ValueError, match="width shifts as columns"):
        ch.plan(_params(1, 4, 2, 4, 2, 2), torch.bfloat16, jn=2)


@pytest.mark.parametrize("params,jns", [
    (_params(1, 4, 1, 4, 4, 2, 1), [1, 2]),                      # k4 s2: both variants timed
    (_params(1, 4, 2, 4, 2, 2), [1]),                            # one width shift: plain only
    (_params(1, 4, 3, (3, 5, 4), 3, 1, 1), [1, 3]),              # k3 s1: J_w 3
], ids=["k4s2-both", "k2s2-plain-only", "k3s1-jw3"])
def test_candidate_plans_time_each_offered_variant(params, jns):
    plans = ch.candidate_plans(params, torch.bfloat16, 2)
    assert sorted({hp.jn for hp in plans}) == jns
    offered = [(jn, cfg, box) for jn in jns for cfg, box in ch.tile_boxes(params, torch.bfloat16, jn=jn)[:2]]
    assert [(hp.jn, hp.config, hp.box) for hp in plans] == offered
    for hp in plans:  # each plan's meta carries its variant, and its kernel shifts drop J_w
        js = ch.geometry(params)[0]
        assert hp.meta[41] == hp.jn and hp.meta[14] == (1 if hp.jn > 1 else js[2])


@pytest.mark.parametrize("params", [r[1] for r in REGIMES], ids=[r[0] for r in REGIMES])
def test_offered_tiles_cover_the_blocks_within_shared_memory(params):
    for dtype, jn in ((d, jn) for d in (torch.float32, torch.bfloat16, torch.float16) for jn in ch.variants(params)):
        offered = ch.tile_boxes(params, dtype, jn=jn)
        assert offered
        for cfg, box in offered:
            hp = ch.plan(params, dtype, cfg, box, jn=jn)
            bm, bn = ch._bm_bn(cfg)
            js, q0, qn = ch.geometry(params)
            assert math.prod(box) == bm and bn >= ch.columns(params, jn)
            tiles = hp.meta[21:24]
            outb = (box[0], box[1], box[2] - jn + 1)
            assert all(t * b_ >= q for t, b_, q in zip(tiles, outb, qn))
            assert all((t - 1) * b_ < q for t, b_, q in zip(tiles, outb, qn))  # no tile wholly past the output
            assert hp.meta[31] <= ch.SMEM_LIMIT
            assert hp.meta[30] == params.batch * params.groups * math.prod(tiles)
            assert hp.stages in (1, 2)
            assert len(hp.shifts) == 2 * len(hp.masks)


@pytest.mark.parametrize("params", [r[1] for r in REGIMES], ids=[r[0] for r in REGIMES])
def test_shared_memory_regions_are_disjoint_and_aligned(params):
    """The kernel's regions (stages, resident weights, two row-offset tables, the epilogue's row
    table, the epilogue tile) as the plan lays them out: 16-byte aligned, in order, none past the
    total; the epilogue tile fits in a stage or has its own region; the staged-row offsets of
    the shifts are whole rows of the padded pitch."""
    for dtype in (torch.float32, torch.bfloat16):
        itemsize = torch.empty((), dtype=dtype).element_size()
        for cfg, box in ch.tile_boxes(params, dtype)[:4]:
            for stages in (None, 1, 2):
                lay = ch._smem_layout(params, itemsize, cfg, box, stages)
                js, _, _ = ch.geometry(params)
                bm, bn = ch._bm_bn(cfg)
                rp = ch._row_pitch(params, itemsize)
                hr = math.prod(b + j - 1 for b, j in zip(box, js))
                w_chunk = math.prod(js) * bn * rp
                nchunks = -(-params.in_channels_per_group // ch._kc(params, itemsize))
                assert rp % 16 == 0 and (rp // 16) % 2 == 1  # 8 consecutive rows: 8 bank groups
                assert lay.stage_bytes == hr * rp + (0 if lay.resident else w_chunk)
                assert lay.w_off == lay.stages * lay.stage_bytes
                assert lay.rtab_off == lay.w_off + (nchunks * w_chunk if lay.resident else 0)
                assert lay.etab_off >= lay.rtab_off + 16 * hr
                end = lay.etab_off + 16 * ch._epilogue_rows(params, box)
                cs = bm * (bn + 4) * 4
                if lay.cs_off < 0:
                    assert cs <= lay.stage_bytes and lay.total == end
                else:
                    assert lay.cs_off == end and lay.total == end + cs
                assert all(v % 16 == 0 for v in (lay.stage_bytes, lay.w_off, lay.rtab_off, lay.etab_off))
                assert not lay.resident or params.groups == 1  # a CTA's tiles stay in one group
                assert lay.stages == (stages or lay.stages)
            hp = ch.plan(params, dtype, cfg, box)
            offs = hp.shifts[len(hp.masks):]
            assert offs[0] == 0 and all(o % rp == 0 for o in offs)


def test_blocks_hold_every_output_and_nothing_before_it():
    # o = q * s - p + r belongs to block (o + p) // s: the blocks run from p // s to (O - 1 + p) // s
    for params in (r[1] for r in REGIMES):
        js, q0, qn = ch.geometry(params)
        for a, axis in enumerate(params.axes):
            blocks = {(o + axis.padding) // axis.stride for o in range(axis.out_size)}
            assert blocks == set(range(q0[a], q0[a] + qn[a]))
            assert js[a] == -(-axis.kernel // axis.stride)


def test_shift_masks_name_the_tiles_with_taps():
    # k3 s2: the shift 1, residue 1 tap (3) does not exist, so (with 8 channels a residue per
    # n-tile) the shift (1, 1) feeds the residue-(0, 0) tile only
    params = _params(1, 4, 8, (2, 4, 4), 3, (1, 2, 2), 1, (0, 1, 1))
    masks = ch.shift_masks(params)
    js = ch.geometry(params)[0]
    assert js == (3, 2, 2) and len(masks) == 12
    assert masks[0] == 0b1111  # shift (0, 0, 0): all four residues
    assert masks[3] == 0b0001  # shift (0, 1, 1): residue (0, 0) only
    assert masks[1] == 0b0101 and masks[2] == 0b0011  # (0, 0, 1): rw 0; (0, 1, 0): rh 0


@pytest.mark.parametrize("params,dtype,precision,words", [
    (_params(1, 4, 2, 4, 4, 2, 1), torch.float32, "ieee", "TF32 tensor cores only"),
    (_params(1, 4, 2, 4, 4, 2, 1), torch.float32, "tf32x3", "TF32 tensor cores only"),
    (_params(1, 4, 2, 4, 4, 2, 1), torch.float64, "tf32", "dtype torch.float64"),
    (_params(1, 4, 16, 4, 4, 2, 1), torch.bfloat16, "tf32", "16 output channels per group"),
    (_params(1, 4, 2, 4, 3, 2, 1, d=2), torch.bfloat16, "tf32", "dilation (2, 2, 2)"),
    (_params(1, 4, 15, 4, 4, 4), torch.bfloat16, "tf32", "more than 128 columns"),
    (_params(1, 4, 2, 6, 5, 1, 2), torch.bfloat16, "tf32", "125 shifts"),
], ids=["fp32-ieee", "fp32-tf32x3", "float64", "cout16", "dilation2", "wide-residues", "too-many-shifts"])
def test_refusals_name_the_reason(params, dtype, precision, words):
    why = ch.unsupported_reason(params, dtype, precision)
    assert why is not None and words in why


def test_call_reason_on_cpu_tensors_names_the_device():
    params = _params(1, 4, 2, 4, 4, 2, 1)
    why = ch.call_reason(torch.empty(params.in_shape), params, "tf32")
    assert why is not None and "CPU tensor" in why


@pytest.mark.parametrize("dtype,layout,mode", [
    (torch.bfloat16, "cl", 0), (torch.float32, "cl", 0), (torch.float32, "ncdhw", 1), (torch.bfloat16, "ncdhw", 2),
    (torch.float16, "cl-odd-channels", 2), (torch.float32, "cl-offset-view", 1),
], ids=["bf16-cl", "fp32-cl", "fp32-ncdhw", "bf16-ncdhw", "fp16-cl-cin12", "fp32-cl-misaligned"])
def test_staging_mode_follows_layout_and_alignment(dtype, layout, mode):
    cin = 12 if layout == "cl-odd-channels" else 16
    params = _params(1, cin, 2, 4, 4, 2, 1)
    x = torch.randn(params.in_shape).to(dtype)
    if layout.startswith("cl"):
        x = x.contiguous(memory_format=torch.channels_last_3d)
    if layout == "cl-offset-view":  # channels-last, but starting one element into its storage
        big = torch.randn(1, 4, 4, 4, cin + 1).to(dtype)
        x = big[..., 1:].permute(0, 4, 1, 2, 3)
    assert ch.staging_mode(x, ch.plan(params, dtype)) == mode


def test_kernel_table_matches_the_launcher():
    """The .cu's CONVT3D_HEAD_CONFIGS rows are the launcher's CONFIGS."""
    src = resources.files("convt3d").joinpath("engines/cuda/head_shuffle.cu").read_text()
    rows = re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (\d+)\)", src)
    assert {int(r[0]): tuple(int(v) for v in r[1:]) for r in rows} == ch.CONFIGS
    assert "#include <torch" not in src  # nvcc alone builds it (cuda_head._NVCC_FLAGS)


def _tf32_reference(v: float) -> float:
    """Round-to-nearest, ties away from zero, to 10 mantissa bits, on the float's bits."""
    import struct
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    if bits & 0x7F800000 == 0x7F800000:
        return v
    return struct.unpack("<f", struct.pack("<I", ((bits + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF))[0]


@pytest.mark.parametrize("value", [1.0, 1 + 2**-11, 1 + 2**-11 + 2**-23, -(1 + 2**-11), 1 + 3 * 2**-11, 3.0e38,
                                   3.4028234e38, -0.0, 1e-40, float("inf"), float("-inf")],
                         ids=["one", "tie-up", "above-tie", "negative-tie", "odd-tie", "large", "max-to-inf",
                              "negative-zero", "subnormal", "inf", "minus-inf"])
def test_round_tf32_is_nearest_ties_away(value):
    got = ch.round_tf32(torch.tensor([value], dtype=torch.float32)).item()
    want = _tf32_reference(torch.tensor(value, dtype=torch.float32).item())
    assert got == want or (math.isnan(got) and math.isnan(want))
    assert math.isnan(ch.round_tf32(torch.tensor([float("nan")])).item())


def test_packed_fp32_weight_is_rounded_and_16_bit_is_not():
    params = _params(1, 8, 2, 4, 4, 2, 1)
    w = torch.randn(8, 2, 4, 4, 4)
    hp = ch.plan(params, torch.float32)
    packed = ch.pack_weight(w, params, hp)
    assert torch.equal(packed, ch.round_tf32(packed))
    assert not torch.equal(packed, ch.pack_weight(w.double(), params, hp).float())  # rounding happened
    wb = w.bfloat16()
    assert torch.equal(ch.pack_weight(wb, params, ch.plan(params, torch.bfloat16)).float().sum(), wb.float().sum())


@pytest.mark.parametrize("cin,layout,helps", [(16, "ncdhw", True), (16, "cl", False), (12, "ncdhw", True),
                                              (6, "ncdhw", False)],
                         ids=["ncdhw-cin16", "cl-already", "ncdhw-cin12", "ncdhw-cin6-unaligned"])
def test_channels_last_copy_offered_where_it_makes_whole_units(cin, layout, helps):
    params = _params(1, cin, 2, 4, 4, 2, 1)
    x = torch.randn(params.in_shape)
    if layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    assert ch._copy_helps(x, ch.plan(params, torch.float32)) == helps
