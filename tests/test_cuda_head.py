"""The CUDA head kernel's plan on the CPU (``convt3d.cuda_head``): the shuffle geometry, the packed
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

from convt3d import cuda_head as ch
from convt3d.params import ConvT3dParams


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


@pytest.mark.parametrize("params", [r[1] for r in REGIMES], ids=[r[0] for r in REGIMES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plan_computes_the_transposed_convolution(params, dtype):
    assert ch.unsupported_reason(params, dtype, "tf32") is None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(params.in_shape, dtype=torch.float64, generator=gen)
    w = torch.randn(params.in_channels, params.out_channels_per_group, *params.kernel_size, dtype=torch.float64,
                    generator=gen)
    b = torch.randn(params.out_channels, dtype=torch.float64, generator=gen)
    ref = F.conv_transpose3d(x, w, b, params.stride, params.padding, params.output_padding, params.groups,
                             params.dilation)
    for cfg, box in ch.tile_boxes(params, dtype)[:3]:
        out = emulate(x, w, b, params, ch.plan(params, dtype, cfg, box))
        assert (out - ref).abs().max().item() < 1e-9


@pytest.mark.parametrize("params", [r[1] for r in REGIMES], ids=[r[0] for r in REGIMES])
def test_offered_tiles_cover_the_blocks_within_shared_memory(params):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        offered = ch.tile_boxes(params, dtype)
        assert offered
        for cfg, box in offered:
            hp = ch.plan(params, dtype, cfg, box)
            bm, bn = ch._bm_bn(cfg)
            js, q0, qn = ch.geometry(params)
            assert math.prod(box) == bm and bn >= ch.columns(params)
            tiles = hp.meta[21:24]
            assert all(t * b_ >= q for t, b_, q in zip(tiles, box, qn))
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
    src = resources.files("convt3d").joinpath("csrc/head_shuffle.cu").read_text()
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
