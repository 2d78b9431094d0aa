"""Launcher of ``head_box_kernel`` (``kernels/head_box.py``), the output-head kind "box": the tap
products of a head summed in shared memory and registers instead of an fp32 buffer in HBM.

Plan, per call signature (``BoxPlan``):
- per dimension, the shifts (input index - compact output index) of every (residue, tap) pair;
- boxes along height and width (``_box_dim``): a box either covers the whole input, origin 0,
  or overlaps its neighbours by the shifts' span;
- the weight packed as [G, KD, BLOCK_N, Cin/g] with the columns the kernel sums (zero where a
  residue has fewer taps), and the int32 shift table;
- depth chunks, so that the grid fills the GPU (``_depth_chunk``).

The candidates (``box_tiles``) are Hopper-only (wgmma, and Triton's interpreter does not run
Gluon); the tuner times them against the other head kinds and the phase GEMM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels import head_box
from .params import Axis, ConvT3dParams

__all__ = ["box_tiles", "BoxPlan", "BoxSteps"]

# Shared memory a program may take (H100/H200: 227 KB per block); the gather's scratch
# (BLOCK_M x BLOCK_N fp32, placed by the compiler) is counted in.
_BOX_SMEM_BYTES = 220 << 10
# wgmma's accumulator for one warpgroup: BLOCK_M x BLOCK_N fp32 over 128 threads. At M x N =
# 128 x 64 ptxas gives 189 registers (sm_90a, triton 3.6, 2026-12-01), so at most that product.
_BOX_MAX_MN = 128 * 64
# Boxes of 64 positions (one wgmma of 64 rows) lost to the other head kinds by 2.2-5.4x on every
# bench head row where they were the only fit or a candidate (H200, 2026-12-01: 3-D GAN video
# head 64->3 560-729 us against 183-356, 128->8 1274-1934 against 309-332, video k4s2p1 406-420
# against 128-131): the halo rows and the per-slice chain (MMA, staging, gather, slots) weigh on
# half as many positions. So boxes start at 128 positions.
_BOX_MIN_M = 128


def _box_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def _box_shifts(a: Axis) -> list[list[int]]:
    """Per residue, the shift (input - compact output index) of each of its taps."""
    return [[ph.first_offset - j * a.offset_step for j in range(ph.num_taps)] for ph in a.phases]


def _box_span(a: Axis) -> tuple[int, int]:
    """(smallest shift, largest - smallest) over every (residue, tap) of the axis."""
    flat = [d for r in _box_shifts(a) for d in r]
    return min(flat), max(flat) - min(flat)


def _box_dim(a: Axis, extent: int) -> tuple[int, int, int] | None:
    """(valid outputs per box, box origin - first output, boxes) along one axis for a box of
    ``extent`` input positions, or None when no output would be valid.

    A box that holds the whole input (extent >= input and >= compact outputs) starts at 0:
    every source it lacks lies outside the input, where the kernel reads a zero. Otherwise
    boxes overlap by the shifts' span, so that each valid output finds all its sources inside."""
    q = a.phases[0].size  # residue 0 has the most compact positions
    lo, span = _box_span(a)
    if extent >= a.in_size and extent >= q:
        return q, 0, 1
    valid = extent - span
    if valid < 1:
        return None
    return valid, lo, -(-q // valid)


def _box_block_k(params: ConvT3dParams, dtype: torch.dtype) -> int:
    return max(16 if dtype.itemsize == 2 else 8, min(64 if dtype.itemsize == 2 else 32,
                                                      _box_pow2(params.in_channels_per_group)))


# Columns of one wgmma: depth taps are merged into one MMA up to this N. The first version ran
# one MMA per depth tap, with its accumulator converted to a row-per-thread layout before the
# gather: ncu (bf16 3-D GAN head, H200, 2026-12-01) put it at 78.7% of L1/shared-memory
# throughput (L2 16%, DRAM 11%) and 143.9 us, the box's input tile read from shared memory once
# per tap and every product passing through shared memory three times.
_BOX_MMA_N = 64


def _box_columns(params: ConvT3dParams) -> tuple[int, int, int]:
    """(CO_PAD, PH_P, BN_TD) of one depth tap's columns: (height tap, width tap) pairs x
    (height residue, width residue) x channels, each factor a power of two; padded with zero
    (height, width) tap pairs so that the wgmma of ``_depth_taps_per_mma`` has N >= 16."""
    _, ah, aw = params.axes
    jhw = _box_pow2(max(p.num_taps for p in ah.phases) * max(p.num_taps for p in aw.phases))
    co_pad, ph_p = _box_pow2(params.out_channels_per_group), _box_pow2(ah.stride * aw.stride)
    raw = jhw * ph_p * co_pad
    return co_pad, ph_p, max(raw, 16 // _taps_per_mma(raw, params.kernel_size[0]))


def _taps_per_mma(bn_td: int, kd: int) -> int:
    tdc = 1
    while tdc * 2 * bn_td <= _BOX_MMA_N and tdc < kd:
        tdc *= 2
    return tdc


def _depth_taps_per_mma(params: ConvT3dParams) -> tuple[int, int, int]:
    """(TDC, KD_P, BLOCK_N): depth taps per wgmma (a power of two, TDC x BN_TD <= _BOX_MMA_N where
    one tap is narrower), the depth taps padded to a multiple of it, and the MMA's N."""
    bn_td = _box_columns(params)[2]
    kd = params.kernel_size[0]
    tdc = _taps_per_mma(bn_td, kd)
    return tdc, -(-kd // tdc) * tdc, tdc * bn_td


def _box_smem(params: ConvT3dParams, dtype: torch.dtype, bm: int, stages: int) -> int:
    co_pad, ph_p, _ = _box_columns(params)
    tdc, kd_p, bn = _depth_taps_per_mma(params)
    bk = _box_block_k(params, dtype)
    kb = -(-params.in_channels_per_group // bk)
    ad = params.axes[0]
    rdp = _box_pow2(_box_span(ad)[1] + 1)
    es = dtype.itemsize
    return ((stages * kb * bm * bk + kd_p // tdc * kb * bn * bk) * es
            + ((rdp * ad.stride + tdc) * bm * ph_p * co_pad + bm * bn) * 4)


def box_unsupported(params: ConvT3dParams, dtype: torch.dtype, precision: str) -> str | None:
    """Why the box kind cannot take this call (None: it can, given a Hopper GPU)."""
    es = dtype.itemsize
    if es == 4 and precision != "tf32":
        return "wgmma multiplies fp32 only as TF32"
    if (params.in_channels * es) % 16:
        return "TMA needs the input's channel stride in multiples of 16 bytes"
    bk = _box_block_k(params, dtype)
    if params.groups > 1 and params.in_channels_per_group % bk:
        return "a channel block would read the next group's channels"
    bn = _depth_taps_per_mma(params)[2]
    if bn * _BOX_MIN_M > _BOX_MAX_MN:
        return f"{bn} columns per wgmma (accumulator beyond {_BOX_MAX_MN // _BOX_MIN_M})"
    if _box_smem(params, dtype, _BOX_MIN_M, 2) > _BOX_SMEM_BYTES:
        return "shared memory"
    return None


def box_tiles(params: ConvT3dParams, dtype: torch.dtype, precision: str) -> list[dict]:
    """Config fields of the box candidates: BLOCK_M = BOX_H x BLOCK_W positions per box, two
    input slices in flight (a third would cost the 3-D GAN head's M-128 box its second program
    per SM: 98 KB of shared memory per program at two stages, ncu, H200, 2026-12-01).

    Boxes of M 128 or 256 positions (_BOX_MIN_M; one warpgroup, 64 rows per wgmma) whose accumulator
    fits (M x N <= _BOX_MAX_MN), with a width of the smallest power of two holding the whole input
    row (up to 64), or 32 or 16 with overlapping boxes. Each computes ``boxes x M`` positions
    for the compact outputs; the two that compute the fewest (the larger M on a tie: fewer,
    longer programs) are offered, and the tuner times them."""
    if box_unsupported(params, dtype, precision) is not None:
        return []
    _, ah, aw = params.axes
    bn = _depth_taps_per_mma(params)[2]
    need_w = max(aw.in_size, aw.phases[0].size)
    widths = {w for w in (max(8, _box_pow2(need_w)), 32, 16) if w <= 64}
    outputs = ah.phases[0].size * aw.phases[0].size
    scored = []
    for bw in sorted(widths):
        for bm in (_BOX_MIN_M, 2 * _BOX_MIN_M):
            bh = bm // bw
            dims = (_box_dim(aw, bw), _box_dim(ah, bh)) if bh >= 1 else (None, None)
            if bm * bn > _BOX_MAX_MN or None in dims or _box_smem(params, dtype, bm, 2) > _BOX_SMEM_BYTES:
                continue
            work = dims[0][2] * dims[1][2] * bm / outputs
            scored.append((work, -bm, bw, bh))
    return [dict(BLOCK_M=-neg_bm, BLOCK_N=bn, BLOCK_K=_box_block_k(params, dtype), BLOCK_W=bw, BOX_H=bh,
                 num_warps=4, num_stages=2, use_dot=True, head="box", BLOCK_R=0)
            for _, neg_bm, bw, bh in sorted(scored)[:2]]


@dataclass(frozen=True)
class BoxPlan:
    """Integer geometry of one (call signature, box config)."""

    vh: int
    vw: int
    off_h: int
    off_w: int
    tiles_h: int
    tiles_w: int
    off_d: int
    span_d: int
    rdp: int
    co_pad: int
    ph_p: int
    k_blocks: int
    tdc: int  # depth taps per wgmma
    kd_p: int  # depth taps padded to a multiple of tdc
    table: tuple[int, ...]  # KD_P x (rd, depth shift), BN_TD x (height shift, width shift)
    columns: tuple[int, ...]  # per (td, n): index into the weight's (Cout/g, kd, kh, kw) or -1


def box_plan(params: ConvT3dParams, cfg) -> BoxPlan:
    ad, ah, aw = params.axes
    vh, off_h, tiles_h = _box_dim(ah, cfg.BOX_H)
    vw, off_w, tiles_w = _box_dim(aw, cfg.BLOCK_W)
    off_d, span_d = _box_span(ad)
    co_pad, ph_p, bn = _box_columns(params)
    tdc, kd_p, _ = _depth_taps_per_mma(params)
    cout_g = params.out_channels_per_group
    kd, kh, kw = params.kernel_size
    sh_h, sh_w = _box_shifts(ah), _box_shifts(aw)
    jw = max(p.num_taps for p in aw.phases)
    jh = max(p.num_taps for p in ah.phases)
    td_rows = []
    for td in range(kd_p):  # padded taps (zero weights) add zeros to residue 0 at shift 0
        r = (td * ad.dilation - ad.padding) % ad.stride if td < kd else 0
        td_rows += [r, (r + ad.padding - td * ad.dilation) // ad.stride if td < kd else 0]
    col_rows, cols = [], []
    for n in range(bn):
        co, ph, jhw = n % co_pad, (n // co_pad) % ph_p, n // (co_pad * ph_p)
        rh, rw, j_h, j_w = ph // aw.stride, ph % aw.stride, jhw // jw, jhw % jw
        ok = (co < cout_g and ph < ah.stride * aw.stride and jhw < jh * jw
              and j_h < ah.phases[rh].num_taps and j_w < aw.phases[rw].num_taps)
        col_rows += [sh_h[rh][j_h], sh_w[rw][j_w]] if ok else [0, 0]
        th = ah.phases[rh].first_tap + j_h * ah.tap_step if ok else 0
        tw = aw.phases[rw].first_tap + j_w * aw.tap_step if ok else 0
        cols.append((co, th, tw) if ok else None)
    columns = tuple(-1 if c is None or td >= kd else ((c[0] * kd + td) * kh + c[1]) * kw + c[2]
                    for td in range(kd_p) for c in cols)
    return BoxPlan(vh, vw, off_h, off_w, tiles_h, tiles_w, off_d, span_d, _box_pow2(span_d + 1), co_pad, ph_p,
                   -(-params.in_channels_per_group // cfg.BLOCK_K), tdc, kd_p, tuple(td_rows + col_rows), columns)


def _depth_chunk(qd: int, span: int, boxes: int, sms: int) -> int:
    """Compact output depths per program: few enough for ~3 programs per SM over the grid
    (one or two are resident at a time), but at least twice the depth shifts' span, since a
    chunk reads span more input slices than it has outputs."""
    chunks = max(1, min(qd, -(-3 * sms // max(1, boxes))))
    return max(min(qd, 2 * max(1, span)), -(-qd // chunks))


def _box_round_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32 (10 mantissa bits, to nearest, ties to even), as the engine's copy
    kernels round: wgmma would otherwise drop the low 13 bits."""
    bits = t.view(torch.int32)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)


class BoxSteps:
    """The launch of one (call signature, box config): plan and site on the first run.

    ``make_site`` is the engine's site factory (``head_engine.HeadSteps``); ``prepare_input(x,
    round_tf32, copy)`` its NDHWC copy (TF32-rounded where asked); ``descriptor(tensor, box)`` its
    Gluon TMA descriptor over a contiguous tensor (``triton_sites.gluon_descriptor``)."""

    def __init__(self, params: ConvT3dParams, cfg, precision: str, has_bias: bool, make_site, prepare_input,
                 descriptor):
        self.params, self.cfg, self.has_bias = params, cfg, has_bias
        self.make_site, self.prepare_input, self.descriptor = make_site, prepare_input, descriptor
        self.plan = box_plan(params, cfg)
        self.site = None
        self.tab = None
        self.index = None

    def _site(self, x: torch.Tensor, y: torch.Tensor):
        p, cfg, bp = self.params, self.cfg, self.plan
        qd = p.axes[0].phases[0].size
        qh, qw = p.axes[1].phases[0].size, p.axes[2].phases[0].size
        boxes = p.groups * p.batch * bp.tiles_h * bp.tiles_w
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        chunk = _depth_chunk(qd, bp.span_d, boxes, sms)
        chunks = -(-qd // chunk)
        ints = (p.batch, p.in_channels_per_group, p.out_channels_per_group, qd, qh, qw, *p.out_size,
                bp.vh, bp.vw, bp.off_h, bp.off_w, chunk, bp.off_d, bp.span_d, *y.stride(),
                bp.tiles_h, bp.tiles_w, chunks)
        consts = dict(KD_P=bp.kd_p, TDC=bp.tdc, SD=p.stride[0], SH=p.stride[1], SW=p.stride[2], CO_PAD=bp.co_pad,
                      PH_P=bp.ph_p, RDP=bp.rdp, K_BLOCKS=bp.k_blocks, HAS_BIAS=self.has_bias,
                      STAGES=cfg.num_stages, num_warps=cfg.num_warps)
        key = ("head_box", p, cfg, y.stride(), self.has_bias, x.dtype)
        return self.make_site(key, "head_box_kernel", (boxes * chunks,), ints, consts, head_box)

    def packed_weight(self, w: torch.Tensor, round_tf32: bool) -> torch.Tensor:
        """[G * KD_P * BN_TD, Cin/g]: the kernel's columns of the weight [Cin, Cout/g, kd, kh, kw],
        by two elementwise kernels per call (a gather through a cached flat index, zeros where a
        column has no tap): the weight's values may change between calls, its layout may not."""
        p = self.params
        if self.index is None:
            g, cin_g = p.groups, p.in_channels_per_group
            per_c = w[0].numel()  # Cout/g x kd x kh x kw
            cols = torch.tensor(self.plan.columns, dtype=torch.int64)  # [KD_P * BN_TD]
            rows = (torch.arange(g)[:, None, None] * cin_g + torch.arange(cin_g)[None, None, :]) * per_c
            flat = rows + cols.clamp_min(0)[None, :, None]  # [G, KD_P * BN_TD, Cin/g]
            keep = (cols >= 0)[None, :, None].expand_as(flat)
            self.index = (flat.reshape(-1, cin_g).to(w.device), keep.reshape(-1, cin_g).to(w.device))
        flat, keep = self.index
        wp = torch.where(keep, w.reshape(-1)[flat], 0.0)
        return _box_round_tf32(wp) if round_tf32 else wp

    def run(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
        cfg = self.cfg
        round_tf32 = x.dtype == torch.float32
        ndhwc = x.permute(0, 2, 3, 4, 1)
        if round_tf32 or not ndhwc.is_contiguous():
            ndhwc = self.prepare_input(x, round_tf32, True).permute(0, 2, 3, 4, 1)
        if self.tab is None:
            self.tab = torch.tensor(self.plan.table, dtype=torch.int32, device=x.device)
        if self.site is None:
            self.site = self._site(x, y)
        wp = self.packed_weight(w, round_tf32)
        x_desc = self.descriptor(ndhwc, (1, 1, cfg.BOX_H, cfg.BLOCK_W, cfg.BLOCK_K))
        w_desc = self.descriptor(wp, (cfg.BLOCK_N, cfg.BLOCK_K))
        return self.site.launch(x.device, x_desc, w_desc, b, y, self.tab)
