"""The tensor-core engine's Hopper kernel in Gluon: phase GEMMs over boxes of BH x BW output positions, no MMA work
on padding columns (unlike ``flat_gemm_kernel``), TMA ring, barriers and wgmma written out. NCDHW output leaves via a
swizzled shared buffer as whole rows, since stores from the accumulator layout write partial sectors. Hopper only
(wgmma; the interpreter runs no Gluon), timed against the Triton kernels by the tuner."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.runtime.jit import constexpr_function

# Names that differ between triton 3.6 and 3.9 (same arguments).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _row_value(tab_ptr, r, i):
    """Column ``i`` of row ``r`` of the phase table (``phase_table``: 16 int32 per phase)."""
    return gl.load(tab_ptr + r * 16 + i)


@gluon.jit
def _box_tile(tile, N, QD, NUM_GROUPS, tiles_h, tiles_w, tiles_n):
    """(pid_n, phase group, pid_h, pid_w, qd, n, group) of box ``tile``, N tiles fastest, the group slowest."""
    pid_n = tile % tiles_n
    t = tile // tiles_n
    pgrp = t % NUM_GROUPS
    t = t // NUM_GROUPS
    pid_w = t % tiles_w
    t = t // tiles_w
    pid_h = t % tiles_h
    t = t // tiles_h
    qd = t % QD
    t = t // QD
    return pid_n, pgrp, pid_h, pid_w, qd, t % N, t // N


@gluon.jit
def _box_tap_span(qa, qb, off0, ostep, size, taps):
    """As phase_gemm's: (first tap, tap count) of the ``taps`` that read input [0, size) from compact [qa, qb]."""
    a = qa + off0 - size + 1
    lo = (gl.where(a > 0, a, 0) + ostep - 1) // ostep
    b = qb + off0 + ostep
    hi = gl.where(b > 0, b, 0) // ostep
    hi = gl.where(hi < taps, hi, taps)
    return lo, gl.where(hi > lo, hi - lo, 0)


@gluon.jit
def _issue(x_desc, w_desc, a_smem, b_smem, bars, s, nb, d0, h0, w0, c_base, cb, w_row, jd, jh, jw,
           OSD, OSH, OSW, KH, KW, TSD, TSH, TSW, t0d, t0h, t0w, COUT_G, w_base):
    """Start the input and weight boxes of one K step (tap jd, jh, jw; channels from ``cb``) into stage ``s``."""
    bar = bars.index(s)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma_load(x_desc, [nb, d0 - jd * OSD, h0 - jh * OSH, w0 - jw * OSW, c_base + cb], bar,
             a_smem.index(s).reshape(x_desc.block_type.shape))
    kidx = ((t0d + jd * TSD) * KH + (t0h + jh * TSH)) * KW + (t0w + jw * TSW)
    tma_load(w_desc, [w_base + kidx * COUT_G + w_row, cb], bar, b_smem.index(s))


@gluon.jit
def _advance(cb, jw, jh, jd, CIN_G, tw, th, BLOCK_K: gl.constexpr):
    """The next K step, channel block fastest, by carries (divisions cost more issue slots than a wgmma leaves free)."""
    cb += BLOCK_K
    c_wrap = cb >= CIN_G
    cb = gl.where(c_wrap, 0, cb)
    jw += c_wrap.to(gl.int32)
    w_wrap = jw >= tw
    jw = gl.where(w_wrap, 0, jw)
    jh += w_wrap.to(gl.int32)
    h_wrap = jh >= th
    jh = gl.where(h_wrap, 0, jh)
    jd += h_wrap.to(gl.int32)
    return cb, jw, jh, jd


@gluon.jit
def _mainloop(x_desc, w_desc, a_smem, b_smem, bars, g0, n_iter, nb, d0, h0, w0, c_base, w_row, w_base,
              CIN_G, COUT_G, KH, KW, TSD, TSH, TSW, OSD, OSH, OSW,
              th, tw, t0d, t0h, t0w, mma_layout: gl.constexpr, STAGES: gl.constexpr):
    """(accumulator of one phase, next step number): its ``n_iter`` K steps, numbered from ``g0`` in the ring."""
    BLOCK_M: gl.constexpr = a_smem.shape[1]
    BLOCK_K: gl.constexpr = a_smem.shape[2]
    BLOCK_N: gl.constexpr = b_smem.shape[1]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    # The step to issue next, as (channel offset, jw, jh, jd) (``_advance``).
    cb = 0
    jw = 0
    jh = 0
    jd = 0
    for i in gl.static_range(STAGES - 1):
        if i < n_iter:
            _issue(x_desc, w_desc, a_smem, b_smem, bars, (g0 + i) % STAGES, nb, d0, h0, w0, c_base, cb, w_row,
                   jd, jh, jw, OSD, OSH, OSW, KH, KW, TSD, TSH, TSW, t0d, t0h, t0w, COUT_G, w_base)
            cb, jw, jh, jd = _advance(cb, jw, jh, jd, CIN_G, tw, th, BLOCK_K)
    for k in range(n_iter):
        g = g0 + k
        s = g % STAGES
        mbarrier.wait(bars.index(s), (g // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
        # At most this step's wgmma in flight: the stage of the step before is free again.
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_smem.index(s), b_smem.index(s)))
        if k + STAGES - 1 < n_iter:
            _issue(x_desc, w_desc, a_smem, b_smem, bars, (g + STAGES - 1) % STAGES, nb, d0, h0, w0, c_base, cb,
                   w_row, jd, jh, jw, OSD, OSH, OSW, KH, KW, TSD, TSH, TSW, t0d, t0h, t0w, COUT_G, w_base)
            cb, jw, jh, jd = _advance(cb, jw, jh, jd, CIN_G, tw, th, BLOCK_K)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, g0 + n_iter


@gluon.jit
def _position_offsets(y_n, od, oh, ow, OD, OH, OW, stride_yd, stride_yh, stride_yw, OFF32: gl.constexpr):
    """(inside, 64-bit depth-slice base, in-slice offsets) of (od, oh, ow); OFF32: channel + in-slice offsets < 2^31."""
    ok = (od < OD) & (oh < OH) & (ow < OW)
    if OFF32:
        y_m = oh * stride_yh + ow * stride_yw
    else:
        y_m = oh.to(gl.int64) * stride_yh + ow.to(gl.int64) * stride_yw
    return ok, y_n + od.to(gl.int64) * stride_yd, y_m


@gluon.jit
def _channel_offsets(channels, stride_yc, OFF32: gl.constexpr):
    """Offsets of output ``channels`` (32-bit under OFF32, see ``_position_offsets``)."""
    if OFF32:
        offs = channels * stride_yc
    else:
        offs = channels.to(gl.int64) * stride_yc
    return offs


@gluon.jit
def _store(y_ptr, y_n, vals, y_co, co_ok, od, oh, ow, OD, OH, OW, stride_yd, stride_yh, stride_yw,
           OFF32: gl.constexpr):
    """Store ``vals`` [BLOCK_M, BLOCK_N] at positions (od, oh[m], ow[m]) and channel offsets ``y_co[n]`` inside y."""
    ok, y_s, y_m = _position_offsets(y_n, od, oh, ow, OD, OH, OW, stride_yd, stride_yh, stride_yw, OFF32)
    gl.store(y_ptr + y_s + (gl.expand_dims(y_m, 1) + gl.expand_dims(y_co, 0)), vals.to(y_ptr.dtype.element_ty),
             mask=gl.expand_dims(ok, 1) & gl.expand_dims(co_ok, 0))


@gluon.jit
def _buffer_rows(rows, PAIRS: gl.constexpr, num_warps: gl.constexpr):
    """A chunk of the epilogue buffer as rows [CHUNK, BLOCK_M x W_GROUP] (column p: position p // W_GROUP, residue
    p % W_GROUP), a lane a column (PAIRS: both residues of a position), so a warp reads 32 distinct banks."""
    CHUNK: gl.constexpr = rows.shape[0]
    BLOCK_M: gl.constexpr = rows.shape[1]
    W_GROUP: gl.constexpr = rows.shape[2]
    if PAIRS:
        layout: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0])
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32 // W_GROUP, W_GROUP], [num_warps, 1, 1], [2, 1, 0])
    return gl.reshape(rows.load(layout), [CHUNK, BLOCK_M * W_GROUP])


@gluon.jit
def _store_rows(c_smem, y_ptr, y_n, b_ptr, grp, pid_n, COUT_G, stride_yc, qh0, qw0, od, rh, rw0, OD, OH, OW, SH, SW,
                stride_yd, stride_yh, stride_yw, HAS_BIAS: gl.constexpr, BW: gl.constexpr, W_GROUP: gl.constexpr,
                OFF32: gl.constexpr, FROM_SMEM: gl.constexpr, PAIRS: gl.constexpr, num_warps: gl.constexpr):
    """Store the box's rows from ``c_smem`` plus bias (not FROM_SMEM: bias alone, rows of residue ``rh``), 16 channels
    at a time, lane i column i (PAIRS: a position's two residues, one 8-byte store): warps store whole sectors."""
    BLOCK_N: gl.constexpr = c_smem.shape[0]
    BLOCK_M: gl.constexpr = c_smem.shape[1]
    COLS: gl.constexpr = BLOCK_M * W_GROUP
    CHUNK: gl.constexpr = 16
    V: gl.constexpr = 2 if PAIRS else 1
    rows_layout: gl.constexpr = gl.BlockedLayout([1, V], [1, 32], [num_warps, 1], [1, 0])
    p = gl.arange(0, COLS, layout=gl.SliceLayout(0, rows_layout))
    m = p // W_GROUP
    qh = qh0 + m // BW
    qw = qw0 + m % BW
    if W_GROUP == 1:
        ow = qw * SW + rw0
    else:
        ow = qw * SW + p % W_GROUP
    oh = qh * SH + rh
    ok, y_s, y_m = _position_offsets(y_n, od, oh, ow, OD, OH, OW, stride_yd, stride_yh, stride_yw, OFF32)
    if PAIRS:
        y_s = gl.multiple_of(y_s, 2)
    for c in gl.static_range(BLOCK_N // CHUNK):
        co = pid_n * BLOCK_N + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, rows_layout))
        co_ok = co < COUT_G
        if FROM_SMEM:
            vals = gl.convert_layout(_buffer_rows(c_smem.slice(c * CHUNK, CHUNK, dim=0), PAIRS, num_warps),
                                     rows_layout)
        else:
            vals = gl.zeros([CHUNK, COLS], gl.float32, rows_layout)
        if HAS_BIAS:
            vals += gl.expand_dims(gl.load(b_ptr + grp * COUT_G + co, mask=co_ok, other=0.0).to(gl.float32), 1)
        offs = gl.expand_dims(_channel_offsets(grp * COUT_G + co, stride_yc, OFF32), 1) + gl.expand_dims(y_m, 0)
        mask = gl.expand_dims(co_ok, 1) & gl.expand_dims(ok, 0)
        if PAIRS:
            offs = gl.max_contiguous(gl.multiple_of(offs, [1, 2]), [1, 2])
            mask = gl.max_constancy(mask, [1, 2])
        gl.store(y_ptr + y_s + offs, vals.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _ncdhw_epilogue(c_smem, acc0, acc1, y_ptr, y_n, b_ptr, tab_ptr, row0, grp, pid_n, COUT_G, stride_yc, qd, qh0, qw0,
                    OD, OH, OW, SD, SH, SW, stride_yd, stride_yh, stride_yw, HAS_BIAS: gl.constexpr,
                    BW: gl.constexpr, W_GROUP: gl.constexpr, W_SKIP: gl.constexpr, OFF32: gl.constexpr,
                    PAIRS: gl.constexpr, num_warps: gl.constexpr):
    """One box's NCDHW output via ``c_smem`` [BLOCK_N, W_GROUP, BLOCK_M] (``_store_rows``: whole rows a warp), then
    the companion rows of its row class."""
    BLOCK_N: gl.constexpr = c_smem.shape[0]
    BLOCK_M: gl.constexpr = c_smem.shape[2]
    if W_GROUP == 1:
        c_smem.store(gl.reshape(gl.permute(acc0, [1, 0]), [BLOCK_N, 1, BLOCK_M]))
    else:
        # Both residues in one store (the XOR forbids a slice per residue), a tapless one as zeros (no select on reads).
        if W_SKIP == 0:
            both = gl.join(gl.zeros_like(acc1), acc1)
        elif W_SKIP == 1:
            both = gl.join(acc0, gl.zeros_like(acc0))
        else:
            both = gl.join(acc0, acc1)
        c_smem.store(gl.permute(both, [1, 2, 0]))
    cta_barrier()  # every warp's part of the buffer written before any warp reads rows
    c_rows = c_smem.permute((0, 2, 1))  # [BLOCK_N, BLOCK_M, W_GROUP]: sliced by channels only
    od = qd * SD + _row_value(tab_ptr, row0, 0)
    rh = _row_value(tab_ptr, row0, 1)
    rw0 = _row_value(tab_ptr, row0, 2)  # W_GROUP=1: the phase's W residue
    _store_rows(c_rows, y_ptr, y_n, b_ptr, grp, pid_n, COUT_G, stride_yc, qh0, qw0, od, rh, rw0, OD, OH, OW, SH, SW,
                stride_yd, stride_yh, stride_yw, HAS_BIAS, BW, W_GROUP, OFF32, True, PAIRS, num_warps)
    # Companion rows (as flat_gemm_kernel): bias/zero rows of empty row classes at these columns.
    cmask = _row_value(tab_ptr, row0, 15)
    for rc in range(SD * SH):
        if ((cmask >> rc) & 1) != 0:
            _store_rows(c_rows, y_ptr, y_n, b_ptr, grp, pid_n, COUT_G, stride_yc, qh0, qw0, qd * SD + rc // SH, rc % SH,
                        rw0, OD, OH, OW, SH, SW, stride_yd, stride_yh, stride_yw, HAS_BIAS, BW, W_GROUP, OFF32, False,
                        PAIRS, num_warps)


@constexpr_function
def _epilogue_layout(block_n, w_group, block_m):
    """``_epilogue_buffer``'s layout: BLOCK_M words per (channel n, residue j), column m at m ^ (8 x ((n >> 1) & 3))
    ^ (16 x j): no bank conflicts in the accumulator's stores (channels 8 apart) or row reads (residues 16 apart)."""
    def log2(v):
        return v.bit_length() - 1
    bases = [[0, 0, 1 << b] for b in range(log2(block_m))]
    if w_group == 2:
        bases.append([0, 1, 16 if block_m >= 32 else 0])
    for b in range(log2(block_n)):
        xor = {1: 8, 2: 16}.get(b, 0) if block_m >= 32 else 0
        bases.append([1 << b, 0, xor])
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _epilogue_buffer(BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, W_GROUP: gl.constexpr):
    """``_ncdhw_epilogue``'s buffer [BLOCK_N, W_GROUP, BLOCK_M] fp32 (``_epilogue_layout``)."""
    layout: gl.constexpr = _epilogue_layout(BLOCK_N, W_GROUP, BLOCK_M)
    return gl.allocate_shared_memory(gl.float32, [BLOCK_N, W_GROUP, BLOCK_M], layout)


@gluon.jit
def _acc_epilogue(y_ptr, y_n, acc0, acc1, bias, y_co, co_ok, tab_ptr, row0, qd, qh, qw, OD, OH, OW, SD, SH, SW,
                  stride_yd, stride_yh, stride_yw, W_GROUP: gl.constexpr, OFF32: gl.constexpr):
    """One box's accumulators and companion rows stored from the accumulator layout (channels-last output: a thread's
    two columns are adjacent channels, so stores fill sectors)."""
    od = qd * SD + _row_value(tab_ptr, row0, 0)
    rh = _row_value(tab_ptr, row0, 1)
    rw0 = _row_value(tab_ptr, row0, 2)  # W_GROUP=1: the phase's W residue
    oh = qh * SH + rh
    for j in gl.static_range(W_GROUP):
        ow = qw * SW + (rw0 if W_GROUP == 1 else j)
        vals = acc0 if j == 0 else acc1
        _store(y_ptr, y_n, vals + gl.expand_dims(bias, 0), y_co, co_ok, od, oh, ow, OD, OH, OW,
               stride_yd, stride_yh, stride_yw, OFF32)
    # Companion rows (as flat_gemm_kernel): bias/zero rows of empty row classes at these columns.
    cmask = _row_value(tab_ptr, row0, 15)
    if cmask != 0:
        fill = gl.zeros_like(acc0) + gl.expand_dims(bias, 0)
        for rc in range(SD * SH):
            if ((cmask >> rc) & 1) != 0:
                od_f = qd * SD + rc // SH
                oh_f = qh * SH + rc % SH
                for j in gl.static_range(W_GROUP):
                    ow_f = qw * SW + (rw0 if W_GROUP == 1 else j)
                    _store(y_ptr, y_n, fill, y_co, co_ok, od_f, oh_f, ow_f, OD, OH, OW, stride_yd,
                           stride_yh, stride_yw, OFF32)


@gluon.jit
def box_gemm_kernel(
    x_desc, w_desc, b_ptr, y_ptr, tab_ptr, N, CIN_G, COUT_G, PD, PH, PW, D, H, W, QD, OD, OH, OW, NUM_GROUPS, KVOL, KH, KW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw, SD, SH, SW, TSD, TSH, TSW, OSD, OSH, OSW,
    tiles_h, tiles_w, tiles_n,
    HAS_BIAS: gl.constexpr, W_GROUP: gl.constexpr, W_SKIP: gl.constexpr, OFF32: gl.constexpr, CL_OUT: gl.constexpr,
    PAIRS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """A box of one phase group: ``x_desc`` the zero-haloed input [N, DP, HP, WP, C] in boxes [1, 1, BH, BW, BLOCK_K],
    ``w_desc`` the weight [G * taps * Cout/g, Cin/g] in boxes [BLOCK_N, BLOCK_K]; the rest as flat_gemm_kernel."""
    BH: gl.constexpr = x_desc.block_type.shape[2]
    BW: gl.constexpr = x_desc.block_type.shape[3]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[4]
    BLOCK_M: gl.constexpr = BH * BW
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    # wgmma's accumulator: one warpgroup along M per 4 warps, instruction [16, BLOCK_N, 32 bytes of K].
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BLOCK_N, 256 // x_desc.dtype.primitive_bitwidth])
    m_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    n_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    pid_n, pgrp, pid_h, pid_w, qd, nb, grp = _box_tile(gl.program_id(0), N, QD, NUM_GROUPS, tiles_h, tiles_w,
                                                       tiles_n)
    qh0 = pid_h * BH
    qw0 = pid_w * BW

    offs_m = gl.arange(0, BLOCK_M, layout=m_layout)
    qh = qh0 + offs_m // BW
    qw = qw0 + offs_m % BW
    offs_co = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=n_layout)
    co_ok = offs_co < COUT_G
    y_co = _channel_offsets(grp * COUT_G + offs_co, stride_yc, OFF32)
    y_n = nb.to(gl.int64) * stride_yn
    bias = gl.zeros([BLOCK_N], gl.float32, n_layout)
    if HAS_BIAS:
        bias = gl.load(b_ptr + grp * COUT_G + offs_co, mask=co_ok, other=0.0).to(gl.float32)

    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], x_desc.dtype)
    a_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    # The row class (rd, rh) and its compact bounds are those of the group's first phase.
    row0 = pgrp * W_GROUP
    g = 0  # K steps this program has put through its ring
    acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)  # residue 0 (W_GROUP=2) / the phase
    acc1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)  # residue 1 (W_GROUP=2)
    for j in gl.static_range(W_GROUP):
        if j != W_SKIP:
            r = row0 + j
            o0d = _row_value(tab_ptr, r, 9)
            o0h = _row_value(tab_ptr, r, 10)
            o0w = _row_value(tab_ptr, r, 11)
            qh_n = _row_value(tab_ptr, row0, 13)
            qw_n = _row_value(tab_ptr, r, 14)
            # Only the taps that reach the input from some position of this box (0 past the compact grid).
            jd0, nd = _box_tap_span(qd, qd, o0d, OSD, D, _row_value(tab_ptr, r, 3))
            jh0, nh = _box_tap_span(qh0, gl.where(qh0 + BH < qh_n, qh0 + BH, qh_n) - 1, o0h, OSH, H,
                                _row_value(tab_ptr, r, 4))
            jw0, nw = _box_tap_span(qw0, gl.where(qw0 + BW < qw_n, qw0 + BW, qw_n) - 1, o0w, OSW, W,
                                _row_value(tab_ptr, r, 5))
            active = (qd < _row_value(tab_ptr, row0, 12)) & (qh0 < qh_n) & (qw0 < qw_n)
            n_iter = gl.where(active, nd * nh * nw * ((CIN_G + BLOCK_K - 1) // BLOCK_K), 0)
            # The span's first taps become the K loop's origin.
            acc, g = _mainloop(
                x_desc, w_desc, a_smem, b_smem, bars, g, n_iter, nb,
                qd + PD + o0d - jd0 * OSD, qh0 + PH + o0h - jh0 * OSH, qw0 + PW + o0w - jw0 * OSW, grp * CIN_G,
                pid_n * BLOCK_N, grp * KVOL * COUT_G, CIN_G, COUT_G, KH, KW, TSD, TSH, TSW, OSD, OSH, OSW, nh, nw,
                _row_value(tab_ptr, r, 6) + jd0 * TSD, _row_value(tab_ptr, r, 7) + jh0 * TSH,
                _row_value(tab_ptr, r, 8) + jw0 * TSW, mma_layout, STAGES)
            if j == 0:
                acc0 = acc
            else:
                acc1 = acc
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if CL_OUT:
        _acc_epilogue(y_ptr, y_n, acc0, acc1, bias, y_co, co_ok, tab_ptr, row0, qd, qh, qw, OD, OH, OW, SD, SH, SW,
                      stride_yd, stride_yh, stride_yw, W_GROUP, OFF32)
    else:
        # Positions innermost (NCDHW): through shared memory (``_ncdhw_epilogue``).
        c_smem = _epilogue_buffer(BLOCK_N, BLOCK_M, W_GROUP)
        _ncdhw_epilogue(c_smem, acc0, acc1, y_ptr, y_n, b_ptr, tab_ptr, row0, grp, pid_n, COUT_G, stride_yc, qd, qh0,
                        qw0, OD, OH, OW, SD, SH, SW, stride_yd, stride_yh, stride_yw, HAS_BIAS, BW, W_GROUP, W_SKIP,
                        OFF32, PAIRS, num_warps)

