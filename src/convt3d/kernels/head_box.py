"""The output-head path's Hopper kernel in Gluon: the tap products of a head summed in the SM,
so that nothing but the input and the output crosses HBM (``head_box_kernel``).

Why: the head kinds of ``head_gemm.py`` compute Z = X @ W with every (tap, channel) pair in N on
tensor cores, then sum the taps of each output from Z. Z is fp32 and, for k4 s2, larger than the
input, so writing and reading it back keeps those kinds at 6-21% of the memory floor (ncu, bf16
3-D GAN head, H200, 2026-12-01: GEMM 52.8 us at 3.31 TB/s, gather 127.8 us; NOTES.md section 10).
Triton cannot index shared memory at run-time offsets, and a Gluon shared-memory slice must start
at a multiple of its own length ("The split offset may not touch the tile", triton 3.6), so
the shifted reads of the tap sum go through ``gl.gather`` on the accumulator, which the compiler
lowers through shared memory.

A program owns a box of BH x BW compact output positions (height x width) of one (group, batch
element), for a chunk of compact output depths, and walks the input depth slices that chunk
needs, in order:
- the slice's input box (BH x BW positions, all Cin/g channels) arrives by TMA into a ring of
  STAGES slices (zeros outside the input: TMA's bounds fill);
- per TDC depth taps, one wgmma gives the products of the box's positions with the columns of
  those taps, N = TDC x (height tap, width tap) x (height residue, width residue) x channel, the
  weight of every tap resident in shared memory from the program's start;
- ``gl.gather`` along the positions aligns each column with the output position it feeds
  (input = output + tap shift, per column), and a sum over the (height tap, width tap) columns
  of each (residue pair, channel) leaves the tap's share of the outputs of depth residue rd(td);
- those shares accumulate in shared memory, one slot per (pending output depth, depth residue),
  each element owned by one thread (so no barrier between the adds); an output depth whose last
  input slice has been seen is stored (with the bias) and its slot zeroed.

Boxes: along height and width a box either covers the whole input (origin 0: every source
outside it is outside the input, a zero) or overlaps its neighbours by the taps' shift span
(origin = first output + smallest shift, VH = BH - span valid rows). The launcher
(``head_engine``) works that out, packs the weight and the shift table.

Only sm_90 has wgmma, and Triton's interpreter does not run Gluon: this kernel runs on Hopper
GPUs only. The Triton head kinds stay the portable path; the tuner times this one against them.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .gluon_gemm import cta_barrier, tma_load


@gluon.jit
def _issue_slice(x_desc, a_smem, bars, j, nb, i0, h_org, w_org, c0, K_BLOCKS: gl.constexpr, STAGES: gl.constexpr):
    """Start the TMA boxes of input slice ``j`` of the program (depth i0 + j), every channel
    block, into stage j % STAGES."""
    s = j % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, K_BLOCKS * x_desc.block_type.nbytes)
    BK: gl.constexpr = x_desc.block_type.shape[4]
    for kb in gl.static_range(K_BLOCKS):
        tma_load(x_desc, [nb, i0 + j, h_org, w_org, c0 + kb * BK], bar,
                 a_smem.index(s * K_BLOCKS + kb).reshape(x_desc.block_type.shape))


@gluon.jit
def head_box_kernel(
    x_desc, w_desc, b_ptr, y_ptr, tab_ptr,
    N, CIN_G, COUT_G,
    QD, QH, QW, OD, OH, OW,
    VH, VW, OFF_H, OFF_W,
    CHUNK_D, OFF_D, SPAN_D,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    tiles_h, tiles_w, chunks_d,
    KD_P: gl.constexpr,
    TDC: gl.constexpr,
    SD: gl.constexpr,
    SH: gl.constexpr,
    SW: gl.constexpr,
    CO_PAD: gl.constexpr,
    PH_P: gl.constexpr,
    RDP: gl.constexpr,
    K_BLOCKS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One (group, batch element, height box, width box, depth chunk); see the module docstring.

    ``x_desc``: the NDHWC input [N, D, H, W, C] in boxes [1, 1, BH, BW, BK]; ``w_desc``: the packed
    weight [G * KD_P * BN_TD, Cin/g] in boxes [BLOCK_N = TDC * BN_TD, BK]: TDC depth taps per
    wgmma, KD_P depth taps (KD padded to a multiple of TDC with zero taps); column n of a tap:
    height/width tap pair n // (PH_P * CO_PAD), residue pair (n // CO_PAD) % PH_P, channel
    n % CO_PAD, zero rows where a residue has fewer taps. ``tab_ptr``: int32 [KD_P x (rd, depth
    shift), BN_TD x (height shift, width shift)], a shift being input - compact output index.
    (OFF_H, OFF_W):
    box origin - first compact output of the box; VH x VW: the box's valid outputs; OFF_D and
    SPAN_D: the smallest depth shift and the shifts' span; RDP: pending-depth slots (a power of
    two > SPAN_D)."""
    BH: gl.constexpr = x_desc.block_type.shape[2]
    BW: gl.constexpr = x_desc.block_type.shape[3]
    BK: gl.constexpr = x_desc.block_type.shape[4]
    BLOCK_M: gl.constexpr = BH * BW
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    PHCO: gl.constexpr = PH_P * CO_PAD
    BN_TD: gl.constexpr = BLOCK_N // TDC  # columns of one depth tap
    JHW: gl.constexpr = BN_TD // PHCO
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BLOCK_N, 256 // x_desc.dtype.primitive_bitwidth])
    # The gather's layout: one position (row) per thread. gl.gather stages its source in shared
    # memory with the gathered axis contiguous, so lanes along the positions read and write
    # neighbouring words, and the (height tap, width tap) sum stays within a thread. With lanes
    # along the columns instead, ncu (bf16 3-D GAN head, H200, 2026-12-01) counted 26.7-way bank
    # conflicts on the staging stores and 13.8-way on the reads (618 us); with the MMA layout
    # (lanes along 8 rows x 4 column pairs) L1/shared memory ran at 89% of its throughput (148 us);
    # the MMA layout as the source and this one for the indices (no conversion before the gather)
    # gave 4.5-way conflicts on the staging stores and 114.6 us, against 101 us with the
    # conversion.
    col_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_N], [32, 1], [num_warps, 1], [1, 0])
    # The pending-depth slots are read and written in one layout with one owner per element, so
    # their read-modify-writes need no barrier.
    o_layout: gl.constexpr = gl.BlockedLayout([1, PHCO], [32, 1], [num_warps, 1], [1, 0])

    pid = gl.program_id(0)
    t_h = pid % tiles_h
    t = pid // tiles_h
    t_w = t % tiles_w
    t = t // tiles_w
    t_d = t % chunks_d
    t = t // chunks_d
    nb = t % N
    grp = t // N
    qh0 = t_h * VH
    qw0 = t_w * VW
    h_org = qh0 + OFF_H
    w_org = qw0 + OFF_W
    q_lo = t_d * CHUNK_D
    q_hi = gl.minimum(q_lo + CHUNK_D, QD)
    i0 = q_lo + OFF_D
    n_slices = q_hi - q_lo + SPAN_D

    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], x_desc.dtype)
    a_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * K_BLOCKS, BLOCK_M, BK], a_layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [KD_P // TDC * K_BLOCKS, BLOCK_N, BK], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    wbar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    o_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    o_smem = gl.allocate_shared_memory(gl.float32, [RDP * SD, BLOCK_M, PHCO], o_shared)
    share_smem = gl.allocate_shared_memory(gl.float32, [TDC * BLOCK_M, PHCO], o_shared)
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    mbarrier.init(wbar.index(0), count=1)

    # The weight of every depth tap, once per program.
    mbarrier.expect(wbar.index(0), KD_P // TDC * K_BLOCKS * w_desc.block_type.nbytes)
    for c in gl.static_range(KD_P // TDC * K_BLOCKS):
        tma_load(w_desc, [(grp * (KD_P // TDC) + c // K_BLOCKS) * BLOCK_N, (c % K_BLOCKS) * BK], wbar.index(0),
                 b_smem.index(c))
    c0 = grp * CIN_G
    for j in gl.static_range(STAGES):
        if j < n_slices:
            _issue_slice(x_desc, a_smem, bars, j, nb, i0, h_org, w_org, c0, K_BLOCKS, STAGES)

    zeros_o = gl.zeros([BLOCK_M, PHCO], gl.float32, o_layout)
    for st in gl.static_range(RDP * SD):
        o_smem.index(st).store(zeros_o)

    # Gather sources: output position m of the box and column n read box position
    # (h + shift_h(n) - OFF_H, w + shift_w(n) - OFF_W); outside the box it is outside the input
    # (the launcher's boxes guarantee it for valid outputs), a zero.
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, col_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, col_layout)) % BN_TD
    dh = gl.load(tab_ptr + 2 * KD_P + 2 * offs_n)
    dw = gl.load(tab_ptr + 2 * KD_P + 2 * offs_n + 1)
    src_h = gl.expand_dims(offs_m // BW, 1) + gl.expand_dims(dh - OFF_H, 0)
    src_w = gl.expand_dims(offs_m % BW, 1) + gl.expand_dims(dw - OFF_W, 0)
    src_ok = (src_h >= 0) & (src_h < BH) & (src_w >= 0) & (src_w < BW)
    src = gl.where(src_ok, src_h * BW + src_w, 0)

    # Output coordinates of the accumulator slots: row m -> (h, w) of the box, column c ->
    # (height residue, width residue, channel).
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    oc = gl.arange(0, PHCO, layout=gl.SliceLayout(0, o_layout))
    qh = qh0 + om // BW
    qw = qw0 + om % BW
    m_ok = (om // BW < VH) & (om % BW < VW) & (qh < QH) & (qw < QW)
    ph = oc // CO_PAD
    co = oc % CO_PAD
    oh = gl.expand_dims(qh * SH, 1) + gl.expand_dims(ph // SW, 0)
    ow = gl.expand_dims(qw * SW, 1) + gl.expand_dims(ph % SW, 0)
    c_ok = (co < COUT_G) & (ph < SH * SW)
    hw_ok = gl.expand_dims(m_ok, 1) & gl.expand_dims(c_ok, 0) & (oh < OH) & (ow < OW)
    y_hw = (oh.to(gl.int64) * stride_yh + ow.to(gl.int64) * stride_yw
            + gl.expand_dims((grp * COUT_G + co).to(gl.int64) * stride_yc, 0))
    y_n = nb.to(gl.int64) * stride_yn
    bias = gl.zeros([PHCO], gl.float32, gl.SliceLayout(0, o_layout))
    if HAS_BIAS:
        bias = gl.load(b_ptr + grp * COUT_G + co, mask=co < COUT_G, other=0.0).to(gl.float32)

    mbarrier.wait(wbar.index(0), 0)
    for j in range(n_slices):
        s = j % STAGES
        mbarrier.wait(bars.index(s), (j // STAGES) & 1)
        i = i0 + j
        for c in gl.static_range(KD_P // TDC):
            # TDC depth taps in one wgmma: the input box is read from shared memory once per chunk.
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
            for kb in gl.static_range(K_BLOCKS):
                acc = warpgroup_mma(a_smem.index(s * K_BLOCKS + kb), b_smem.index(c * K_BLOCKS + kb).permute((1, 0)),
                                    acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            g = gl.where(src_ok, gl.gather(gl.convert_layout(acc, col_layout), src, axis=0), 0.0)
            shares = gl.sum(gl.reshape(g, [BLOCK_M, TDC, JHW, PHCO]), axis=2)
            share_smem.store(gl.reshape(gl.permute(shares, [1, 0, 2]), [TDC * BLOCK_M, PHCO]))
            cta_barrier()
            for tl_ in gl.static_range(TDC):
                td = c * TDC + tl_
                res_d = gl.load(tab_ptr + 2 * td)
                q = i - gl.load(tab_ptr + 2 * td + 1)
                if (q >= q_lo) & (q < q_hi):
                    slot = o_smem.index((q % RDP) * SD + res_d)
                    slot.store(slot.load(o_layout) + share_smem.slice(tl_ * BLOCK_M, BLOCK_M).load(o_layout))
            cta_barrier()
        # Every warp is past its reads of stage s: refill it with the slice STAGES ahead.
        cta_barrier()
        if j + STAGES < n_slices:
            _issue_slice(x_desc, a_smem, bars, j + STAGES, nb, i0, h_org, w_org, c0, K_BLOCKS, STAGES)
        # Output depth qf has seen its last input slice (shift OFF_D + SPAN_D): store and clear.
        qf = i - OFF_D - SPAN_D
        if (qf >= q_lo) & (qf < q_hi):
            for r in gl.static_range(SD):
                od = qf * SD + r
                slot = o_smem.index((qf % RDP) * SD + r)
                vals = slot.load(o_layout) + gl.expand_dims(bias, 0)
                gl.store(y_ptr + y_n + od.to(gl.int64) * stride_yd + y_hw, vals.to(y_ptr.dtype.element_ty),
                         mask=hw_ok & (od < OD))
                slot.store(zeros_o)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))
    mbarrier.invalidate(wbar.index(0))
