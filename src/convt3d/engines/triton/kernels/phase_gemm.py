"""Triton kernels of the convt3d engine: pure ``@triton.jit`` functions, no host logic.

This module imports only ``triton`` so that ``convt3d export-kernelbench`` can copy it
verbatim into a self-contained KernelBench file. (Keep it that way: no torch, no package
imports, no try/except, and avoid the bare word for a no-op statement in strings; KernelBench's
static checker rejects it outside comments.)

Vocabulary -- phase, taps of a phase, compact grid, GEMM map -- is defined once in
``convt3d.core.params``. One program of ``phase_gemm_kernel`` computes one group, one output-channel
tile, one tile of compact positions and one phase (two phases, interleaved, for stride 2 along
W into NCDHW output):

    acc[m, co] = sum_{tap of phase, ci}  X[n, id(tap), ih(m, tap), iw(m, tap), ci] * W[tap, ci, co]

A tile of compact positions is a (BLOCK_M // BLOCK_W) x BLOCK_W block of the compact (h, w)
plane at one batch index n and one compact depth qd, so n, qd and every depth offset are
scalars and the in-tile coordinates derive from ``tl.arange`` with constexpr divisors (no
per-element division, few live registers). Every output element is written exactly once, by
the program of its phase: bias/zero for empty phases, the GEMM result otherwise.
"""
import triton
import triton.language as tl

# Columns of the per-phase table built by the launcher (int32, one row of 16 per phase).
# rd rh rw | Td Th Tw | t0d t0h t0w | off0d off0h off0w | Qd Qh Qw | companion mask
# (the mask, read from the first row of a phase group, has bit dd * SH + hh set for each empty
# row class -- depth residue dd, height residue hh -- whose rows this group's programs write).
PHASE_TABLE_COLUMNS = 16


@triton.jit
def _phase_row(tab_ptr, r):
    """Row r of the phase table: rd, rh, rw, Td, Th, Tw, t0d, t0h, t0w, off0d, off0h, off0w,
    Qd, Qh, Qw (the companion mask, column 15, is read where it is used)."""
    row = tab_ptr + r * 16
    return (tl.load(row + 0), tl.load(row + 1), tl.load(row + 2),
            tl.load(row + 3), tl.load(row + 4), tl.load(row + 5),
            tl.load(row + 6), tl.load(row + 7), tl.load(row + 8),
            tl.load(row + 9), tl.load(row + 10), tl.load(row + 11),
            tl.load(row + 12), tl.load(row + 13), tl.load(row + 14))


@triton.jit
def _round_tf32(v):
    """fp32 -> nearest TF32 value (ties away, inf/NaN kept). Tensor cores read the top 19 bits
    of an fp32 operand (truncation); rounding first removes that bias, as cuDNN does."""
    r = ((v.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < float("inf"), r, v)


@triton.jit
def phase_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, tab_ptr,
    N, CIN_G, COUT_G,
    D, H, W,
    QD, OW, OD, OH,
    NUM_GROUPS,
    KH, KW,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_wg, stride_wt, stride_wo, stride_wc,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    SD, SH, SW,
    TSD, TSH, TSW,
    OSD, OSH, OSW,
    tiles_h, tiles_w, tiles_n,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    W_GROUP: tl.constexpr,
    W_SKIP: tl.constexpr,
    X_CACHE: tl.constexpr,
    X_TMA: tl.constexpr,
    W_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # X_TMA / W_TMA: ``x_ptr`` / ``w_ptr`` are tensor descriptors (TMA on Hopper) instead of
    # pointers. x: 5-D over the NDHWC input, block [1, 1, BLOCK_H, BLOCK_W, BLOCK_K]; its
    # out-of-range coordinates (padding, halo, negative offsets) read as zeros in hardware, so the
    # per-element address and mask arithmetic of the pointer path disappears from the K loop.
    # w: 4-D over the packed weight [G, taps, Cout/g, Cin/g], block [1, 1, BLOCK_N, BLOCK_K].
    BLOCK_H: tl.constexpr = BLOCK_M // BLOCK_W
    # Program -> (group, n, qd, h tile, w tile, phase group, channel tile), fastest last: the
    # programs of one tile (all its phases and channel tiles) run together and share input rows
    # in L2. The packed weights are at most a few MB and stay in L2 regardless, so no GROUP_M
    # swizzle is needed. Empty phases make store-only programs that interleave with GEMM ones,
    # so the output is written while the tensor cores work.
    pid = tl.program_id(0)
    pid_n = pid % tiles_n
    t = pid // tiles_n
    pgrp = t % NUM_GROUPS
    t = t // NUM_GROUPS
    pid_w = t % tiles_w
    t = t // tiles_w
    pid_h = t % tiles_h
    t = t // tiles_h
    qd = t % QD
    t = t // QD
    nb = t % N
    grp = t // N

    offs_m = tl.arange(0, BLOCK_M)
    qh = pid_h * BLOCK_H + offs_m // BLOCK_W
    qw = pid_w * BLOCK_W + offs_m % BLOCK_W
    offs_co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    co_ok = offs_co < COUT_G
    offs_k = tl.arange(0, BLOCK_K)

    # 64-bit scalar bases per program; 32-bit offsets inside one depth slice (the launcher
    # checks that a slice holds < 2^31 elements), so tensors beyond 2^31 elements are fine.
    if not X_TMA:
        x_n = x_ptr + nb.to(tl.int64) * stride_xn + (grp * CIN_G).to(tl.int64) * stride_xc
        x_hw = qh * stride_xh + qw * stride_xw
    if not W_TMA:
        w_g = w_ptr + grp.to(tl.int64) * stride_wg
    y_n = y_ptr + nb.to(tl.int64) * stride_yn
    y_co = (grp * COUT_G + offs_co).to(tl.int64) * stride_yc
    if HAS_BIAS:
        bias = tl.load(b_ptr + grp * COUT_G + offs_co, mask=co_ok, other=0.0).to(tl.float32)

    k_blocks = (CIN_G + BLOCK_K - 1) // BLOCK_K
    # Phases come W-residue fastest. With W_GROUP == 2 (stride 2 along W) the two W-residues
    # of a (rd, rh) pair are computed by one program and interleaved in registers, so each
    # store writes whole contiguous output rows (per-phase strided stores fill half of each
    # sector they touch and run far below the copy bandwidth);
    # otherwise a program computes one phase (stride-1 rows are contiguous anyway, and
    # channels-last output is contiguous along channels).
    # The launcher's table lists phase groups (W_GROUP rows each); row classes (rd, rh) that no
    # tap reaches may instead be written by fill_rows_kernel and left out of the table.
    for j in tl.static_range(W_GROUP):
        if j != W_SKIP:
            (rd, rh, rw, td, th, tw, t0d, t0h, t0w, o0d, o0h, o0w,
             qd_n, qh_n, qw_n) = _phase_row(tab_ptr, pgrp * W_GROUP + j)

            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # Tiles are laid on the largest compact grid (residue 0); a phase whose grid is one
            # row or column smaller (KB 77: 16x32x32 inside 17x33x33) skips the GEMM on tiles it
            # does not reach and only stores its bias/zero share there.
            active = (qd < qd_n) & (pid_h * BLOCK_H < qh_n) & (pid_w * BLOCK_W < qw_n)
            n_iter = tl.where(active, td * th * tw * k_blocks, 0)
            # One flat loop over (tap, channel block) so that num_stages pipelines loads across
            # taps too: KB 77 has 27 taps of one channel block each; a nested loop would not.
            for kk in range(n_iter):
                tap = kk // k_blocks
                cb = (kk - tap * k_blocks) * BLOCK_K
                jw = tap % tw
                jh = (tap // tw) % th
                jd = tap // (tw * th)
                id_ = qd + o0d - jd * OSD
                dh = o0h - jh * OSH
                dw = o0w - jw * OSW
                kidx = ((t0d + jd * TSD) * KH + (t0h + jh * TSH)) * KW + (t0w + jw * TSW)
                ci = cb + offs_k
                ci_ok = ci < CIN_G
                if X_TMA:
                    # The launcher uses TMA only where a channel block never crosses into the next
                    # group (groups == 1, whose channel overhang reads as zeros, or Cin/g % BLOCK_K == 0).
                    x_blk = x_ptr.load([nb, id_, pid_h * BLOCK_H + dh, pid_w * BLOCK_W + dw, grp * CIN_G + cb])
                    x_tile = tl.reshape(x_blk, (BLOCK_M, BLOCK_K))
                else:
                    ih = qh + dh
                    iw = qw + dw
                    # The depth test is scalar: fold it into the row bound so every mask term is a
                    # vector (mixing scalar and vector booleans also trips Triton's interpreter).
                    h_hi = tl.where((id_ >= 0) & (id_ < D), H, 0)
                    x_ok = (ih >= 0) & (ih < h_hi) & (iw >= 0) & (iw < W)
                    x_s = x_n + id_.to(tl.int64) * stride_xd + (dh * stride_xh + dw * stride_xw)
                    x_tile = tl.load(x_s + x_hw[:, None] + ci[None, :] * stride_xc,
                                     mask=x_ok[:, None] & ci_ok[None, :], other=0.0, cache_modifier=X_CACHE)
                if W_TMA:
                    w_blk = w_ptr.load([grp, kidx, pid_n * BLOCK_N, cb])
                    w_tile = tl.trans(tl.reshape(w_blk, (BLOCK_N, BLOCK_K)))
                else:
                    w_tile = tl.load(w_g + kidx * stride_wt + ci[:, None] * stride_wc + offs_co[None, :] * stride_wo,
                                     mask=ci_ok[:, None] & co_ok[None, :], other=0.0)
                if USE_DOT:
                    if PRECISION == "ieee":
                        # fp32 FMA dot: sum each K block on its own and add it to the total
                        # (two-level summation, ~BLOCK_K + steps roundings deep instead of K).
                        # A chained FMA sum over K = 864 (KB 77 geometry) was 4x cuDNN's error.
                        # Written as fma(part, 1, acc): Triton's combiner rewrites a plain
                        # `acc + dot(a, b)` back into the chained `dot(a, b, acc)`.
                        acc = tl.fma(tl.dot(x_tile, w_tile, input_precision=PRECISION), 1.0, acc)
                    else:
                        acc = tl.dot(x_tile, w_tile, acc, input_precision=PRECISION)
                else:
                    # Channel counts below the tensor-core minimum of 16 (depthwise, tiny groups):
                    # one input channel per step (BLOCK_K == 1), an exact fp32 outer-product
                    # update [BLOCK_M, 1] x [1, BLOCK_N], with no padding of K or N to 16.
                    tl.static_assert(BLOCK_K == 1)
                    acc += x_tile.to(tl.float32) * w_tile.to(tl.float32)
            if HAS_BIAS:
                acc += bias[None, :]
            if j == 0:
                acc_first = acc
    # A W residue with no taps (W_SKIP; KB 77's even columns) is bias/zero in every phase:
    # its half of the interleaved tile is made here, after the GEMM loop, instead of holding
    # BLOCK_M x BLOCK_N zero accumulators through it (255 registers and spills at BLOCK_M=256).
    if W_SKIP == 0:
        acc_first = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:
            acc_first += bias[None, :]
    if W_SKIP == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:
            acc += bias[None, :]

    y_s = y_n + (qd * SD + rd).to(tl.int64) * stride_yd
    h_lim = tl.where(qd < qd_n, qh_n, 0)
    if W_GROUP == 1:
        oh = qh * SH + rh
        ow = qw * SW + rw
        st_ok = (qh < h_lim) & (qw < qw_n)
        out = tl.trans(acc)
        y_m = oh * stride_yh + ow * stride_yw
        # Store as [channel, position]: with no provable contiguity Triton lays threads along
        # the last dimension, i.e. along W for NCDHW output; channels-last output has channel
        # stride 1, which Triton sees, so its threads run along channels instead.
        tl.store(y_s + y_co[:, None] + y_m[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=co_ok[:, None] & st_ok[None, :])
    else:
        # Interleave the two W-residues: [M, N] x 2 -> [N, 2M] with output W contiguous.
        out = tl.reshape(tl.permute(tl.join(acc_first, acc), (1, 0, 2)), (BLOCK_N, 2 * BLOCK_M))
        offs2 = tl.arange(0, 2 * BLOCK_M)
        qh2 = pid_h * BLOCK_H + offs2 // (2 * BLOCK_W)
        ow2 = pid_w * (2 * BLOCK_W) + offs2 % (2 * BLOCK_W)
        st_ok = (qh2 < h_lim) & (ow2 < OW)
        y_m = (qh2 * SH + rh) * stride_yh + ow2 * stride_yw
        tl.store(y_s + y_co[:, None] + y_m[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=co_ok[:, None] & st_ok[None, :])

    # Companion rows: rows of empty row classes (bias or zero only) that the launcher assigned
    # to this phase group, written by this program over its own tile of columns. A separate fill
    # kernel writes such rows far below the copy bandwidth where many are short isolated rows
    # between GEMM rows (KB 77, 7 of 8 phases empty); here they are written next to the GEMM
    # rows of the same tile, overlapping other programs' MMAs.
    cmask = tl.load(tab_ptr + pgrp * W_GROUP * 16 + 15)
    if cmask != 0:
        offs_f = tl.arange(0, W_GROUP * BLOCK_W)
        if W_GROUP == 1:
            ow_f = (pid_w * BLOCK_W + offs_f) * SW + rw
        else:
            ow_f = pid_w * (2 * BLOCK_W) + offs_f
        fill = tl.zeros((BLOCK_N, W_GROUP * BLOCK_W), dtype=tl.float32)
        if HAS_BIAS:
            fill += bias[:, None]
        fill = fill.to(y_ptr.dtype.element_ty)
        y_f = y_n + y_co[:, None] + ow_f[None, :] * stride_yw
        for rc in range(SD * SH):
            if ((cmask >> rc) & 1) != 0:
                od = qd * SD + rc // SH
                y_fd = y_f + od.to(tl.int64) * stride_yd
                for r in range(BLOCK_H):
                    oh_f = (pid_h * BLOCK_H + r) * SH + rc % SH
                    # Row bounds folded into the column bound (vector masks only).
                    w_lim = tl.where((od < OD) & (oh_f < OH), OW, 0)
                    tl.store(y_fd + oh_f * stride_yh, fill, mask=co_ok[:, None] & (ow_f < w_lim)[None, :])


@triton.jit
def to_channels_last_kernel(
    x_ptr, y_ptr,
    C, S, S_BLOCKS, C_BLOCKS,
    stride_xn, stride_xc, stride_xs,
    ROUND_TF32: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """y[n, s, c] = x[n, c, s] (s = flattened D*H*W with one stride); y is contiguous.

    The GEMM reads its input with channels innermost (K-major operands, which TF32 tensor cores
    require), so NCDHW input is copied once; the copy optionally rounds to TF32. Grid: (S_BLOCKS x
    C_BLOCKS x N,), positions fastest (one axis: the batch may exceed 65535).
    """
    pid = tl.program_id(0)
    pid_s = pid % S_BLOCKS
    pid_c = (pid // S_BLOCKS) % C_BLOCKS
    nb = (pid // S_BLOCKS // C_BLOCKS).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_c < C)[:, None] & (offs_s < S)[None, :]
    src = x_ptr + nb * stride_xn + offs_c[:, None].to(tl.int64) * stride_xc + offs_s[None, :].to(tl.int64) * stride_xs
    v = tl.load(src, mask=mask, other=0.0)
    if ROUND_TF32:
        v = _round_tf32(v)
    dst = y_ptr + nb * S * C + offs_s[None, :].to(tl.int64) * C + offs_c[:, None]
    tl.store(dst, v, mask=mask)


@triton.jit
def _pack_block(w_ptr, p_ptr, pid, grp,
                CIN_G, COUT_G, KVOL, FOLD, stride_wi,
                ROUND_TF32: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_J: tl.constexpr):
    """One [BLOCK_CI, BLOCK_J] block of pack_weight_kernel's transpose, program ``pid`` of
    group ``grp``: rows ci of the merged group, columns j = co * KVOL + tap (the weight's own
    contiguous order). Loads run along j and stores along ci, so both are coalesced; Triton
    moves the tile between the two layouts through shared memory.

    Why a tile: gathering p's elements one by one in p's order read the weight at a stride of
    Cout/g x taps elements, one 32-byte sector per 2- or 4-byte element (docs/design.md, "The GEMM operands in one launch").

    Merged groups (``FOLD`` > 1): a row ci of original group f = ci // (CIN_G / FOLD) has
    weights only in the columns of that group, j in [f * span, (f + 1) * span) with span =
    (COUT_G / FOLD) x KVOL, read from the row's own columns j - f * span; every other element
    of p is zero (the block-diagonal weight)."""
    j_blocks = tl.cdiv(COUT_G * KVOL, BLOCK_J)
    ci = (pid // j_blocks) * BLOCK_CI + tl.arange(0, BLOCK_CI)
    j = (pid % j_blocks) * BLOCK_J + tl.arange(0, BLOCK_J)
    ci_ok = ci < CIN_G
    span = (COUT_G // FOLD) * KVOL
    src_j = j[None, :] - ((ci // (CIN_G // FOLD)) * span)[:, None]
    row = (grp.to(tl.int64) * CIN_G + ci) * stride_wi
    v = tl.load(w_ptr + row[:, None] + src_j, mask=ci_ok[:, None] & (src_j >= 0) & (src_j < span), other=0.0)
    if ROUND_TF32:
        v = _round_tf32(v)
    co = j // KVOL
    tap = j % KVOL
    dst = ((grp.to(tl.int64) * KVOL + tap) * COUT_G + co) * CIN_G
    tl.store(p_ptr + dst[None, :] + ci[:, None], v, mask=ci_ok[:, None] & (j < COUT_G * KVOL)[None, :])


@triton.jit
def pack_weight_kernel(
    w_ptr, p_ptr,
    CIN_G, COUT_G, KVOL, FOLD,
    stride_wi,
    ROUND_TF32: tl.constexpr,
    BLOCK_CI: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """p[g, tap, co, ci] = w[g*CIN_G + ci, co, tap]: each tap's weights as a K-major tile, for a
    contiguous weight (stride_wi: its input-channel stride; (co, tap) flattened has stride 1).
    Grid: (ci blocks x j blocks, groups); see ``_pack_block``.

    ``FOLD`` > 1 packs for merged groups (ConvT3dParams.fold_groups): CIN_G / COUT_G are the
    merged group's channels, and a weight (ci, co) is w[g*CIN_G + ci, co % (COUT_G/FOLD), tap]
    where ci and co belong to the same original group, else zero (the block-diagonal weight)."""
    _pack_block(w_ptr, p_ptr, tl.program_id(0), tl.program_id(1), CIN_G, COUT_G, KVOL, FOLD, stride_wi,
                ROUND_TF32, BLOCK_CI, BLOCK_J)


@triton.jit
def fill_rows_kernel(
    y_ptr, b_ptr, rows_ptr,
    C, OW, ROWS, C_BLOCKS,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """y[n, c, od, oh, :] = bias[c] (or 0) for the listed (od, oh) rows: rows whose depth or
    height residue no tap reaches (3/4 of KB 77's output). Store-only programs, so they run at
    full occupancy instead of inheriting the GEMM kernel's register budget. Grid: (ROWS x
    C_BLOCKS x N,), row fastest (one axis: the batch may exceed 65535)."""
    pid = tl.program_id(0)
    r = pid % ROWS
    rest = pid // ROWS
    nb = (rest // C_BLOCKS).to(tl.int64)
    offs_c = (rest % C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    od = tl.load(rows_ptr + 2 * r)
    oh = tl.load(rows_ptr + 2 * r + 1)
    base = y_ptr + nb * stride_yn + od.to(tl.int64) * stride_yd + oh.to(tl.int64) * stride_yh
    tile = tl.zeros((BLOCK_C, BLOCK_W), dtype=tl.float32)
    if HAS_BIAS:
        tile += tl.load(b_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    tile = tile.to(y_ptr.dtype.element_ty)
    y_c = offs_c.to(tl.int64) * stride_yc
    for w0 in range(0, OW, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        tl.store(base + y_c[:, None] + offs_w[None, :] * stride_yw, tile,
                 mask=c_ok[:, None] & (offs_w < OW)[None, :])


@triton.jit
def fill_planes_kernel(
    y_ptr, b_ptr, planes_ptr,
    C, SEG, PLANES,
    stride_yn, stride_yc, stride_yd,
    CHANNELS_LAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    """Bias/zero for whole output depth planes that no tap reaches (empty depth residues;
    17 of KB 77's 33 planes, 294 MB). Each program writes one contiguous segment of SEG
    elements: a (n, c, od) plane of OH * OW for NCDHW output (bias[c]), a (n, od) plane of
    OH * OW * C for channels-last output (bias[e % C]). Long contiguous runs write at full
    bandwidth; the same bytes written as per-tile pieces by the GEMM programs do not.

    NCDHW planes of odd size (KB 77: 65 * 65) start at addresses that are not 16-byte aligned,
    and a store masked per element compiles to 4-byte stores, well below full bandwidth.
    So the aligned interior is written as rows of VEC elements (16 bytes) masked per row, which
    compiles to 16-byte stores, and the fewer than VEC elements at either end separately.

    Grid: (PLANES x outer,), plane fastest, outer = the batch element (channels-last) or (batch
    element, channel) pair (NCDHW): one axis, since N x C may exceed the 65535 of a second one
    (batch 128 x 512 channels)."""
    pid = tl.program_id(0)
    od = tl.load(planes_ptr + pid % PLANES)
    outer = pid // PLANES
    if CHANNELS_LAST:
        base = y_ptr + outer.to(tl.int64) * stride_yn + od.to(tl.int64) * stride_yd
        offs = tl.arange(0, BLOCK)
        for e0 in range(0, SEG, BLOCK):
            e = e0 + offs
            v = tl.zeros((BLOCK,), dtype=tl.float32)
            if HAS_BIAS:
                v += tl.load(b_ptr + e % C, mask=e < SEG, other=0.0).to(tl.float32)
            tl.store(base + e, v.to(y_ptr.dtype.element_ty), mask=e < SEG)
    else:
        nb = outer // C
        c = outer % C
        # Element offsets from y_ptr (int64): the plane is [s, end); [s_up, e_dn) its
        # VEC-aligned interior.
        s = nb.to(tl.int64) * stride_yn + c.to(tl.int64) * stride_yc + od.to(tl.int64) * stride_yd
        end = s + SEG
        s_up = (s + (VEC - 1)) // VEC * VEC
        e_dn = end // VEC * VEC
        value = 0.0
        if HAS_BIAS:
            value = tl.load(b_ptr + c).to(tl.float32)
        rows = tl.arange(0, BLOCK // VEC)
        lanes = tl.arange(0, VEC)
        tile = (tl.zeros((BLOCK // VEC, VEC), dtype=tl.float32) + value).to(y_ptr.dtype.element_ty)
        # A counted loop (not range(s_up, e_dn, BLOCK)) so the start keeps its known
        # divisibility by VEC; a negative count (segment inside one VEC group) runs no step.
        for i in range(0, (e_dn - s_up + BLOCK - 1) // BLOCK):
            start = s_up + i * BLOCK + rows * VEC
            tl.store(y_ptr + start[:, None] + lanes[None, :], tile, mask=(start < e_dn)[:, None])
        edge = (tl.zeros((VEC,), dtype=tl.float32) + value).to(y_ptr.dtype.element_ty)
        head = s_up - VEC + lanes
        tl.store(y_ptr + head, edge, mask=(head >= s) & (head < end))
        tail = e_dn + lanes
        tl.store(y_ptr + tail, edge, mask=(tail >= s_up) & (tail < end))


@triton.jit
def flat_gemm_kernel(
    x_desc, w_desc, b_ptr, y_ptr, tab_ptr,
    N, CIN_G, COUT_G,
    DP, HP, WP,
    PD, PH, PW,
    QD, OW, OD, OH,
    NUM_GROUPS, KVOL,
    KH, KW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    SD, SH, SW,
    TSD, TSH, TSW,
    OSD, OSH, OSW,
    tiles_m, tiles_n,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    W_GROUP: tl.constexpr,
    W_SKIP: tl.constexpr,
    OFF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The tensor-core engine on Hopper: the same phase GEMMs as ``phase_gemm_kernel``, with
    every operand tile a plain 2-D TMA box.

    The input was copied into a zero-haloed NDHWC buffer of padded size (DP, HP, WP) (see
    ``to_padded_kernel``), viewed as a 2-D [rows, channels] matrix. A tile is BLOCK_M
    consecutive positions ``m = qh * WP + qw`` of one compact (h, w) plane, padding columns
    included, so every tap's input rows are the same tile shifted by one scalar offset: a single
    [BLOCK_M, BLOCK_K] box that lands in shared memory in the layout wgmma reads, with no
    reshape and no per-element address or mask arithmetic in the K loop. The halo makes every
    tap of a valid position read in bounds; rows that wrap into padding or the next plane only
    feed positions the epilogue discards (about (WP - QW) / WP of the MMA work, 9% on KB 77).
    The weight is the packed [G * taps * Cout/g, Cin/g] matrix: a [BLOCK_N, BLOCK_K] box,
    transposed in shared memory for free; rows past Cout/g only feed masked columns.
    """
    pid = tl.program_id(0)
    pid_n = pid % tiles_n
    t = pid // tiles_n
    pgrp = t % NUM_GROUPS
    t = t // NUM_GROUPS
    pid_m = t % tiles_m
    t = t // tiles_m
    qd = t % QD
    t = t // QD
    nb = t % N
    grp = t // N

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qh = offs_m // WP
    qw = offs_m % WP
    offs_co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    co_ok = offs_co < COUT_G
    y_n = y_ptr + nb.to(tl.int64) * stride_yn
    # OFF32 (the launcher checked that channel + in-slice offsets stay below 2^31): 32-bit
    # offset tiles in the epilogue. A [BLOCK_N, 2 * BLOCK_M] tile of 64-bit pointers alone took
    # 128 registers per thread at 4 warps (242 in all on KB 77), capping occupancy at 2 CTAs.
    if OFF32:
        y_co = (grp * COUT_G + offs_co) * stride_yc
    else:
        y_co = (grp * COUT_G + offs_co).to(tl.int64) * stride_yc
    if HAS_BIAS:
        bias = tl.load(b_ptr + grp * COUT_G + offs_co, mask=co_ok, other=0.0).to(tl.float32)
    plane = HP * WP
    row_n = nb * DP * plane  # the launcher keeps N * DP * HP * WP below 2^31 (TMA coordinates)
    k_blocks = (CIN_G + BLOCK_K - 1) // BLOCK_K

    for j in tl.static_range(W_GROUP):
        if j != W_SKIP:
            (rd, rh, rw, td, th, tw, t0d, t0h, t0w, o0d, o0h, o0w,
             qd_n, qh_n, qw_n) = _phase_row(tab_ptr, pgrp * W_GROUP + j)

            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            active = (qd < qd_n) & (m0 < qh_n * WP)
            n_iter = tl.where(active, td * th * tw * k_blocks, 0)
            base = row_n + (qd + PD) * plane + PH * WP + PW + m0
            # (tap, channel block) counters advanced by carries instead of divisions: five
            # runtime integer divisions per step cost ~100 issue slots of a 128-clock MMA.
            cb = 0
            jw = 0
            jh = 0
            jd = 0
            for kk in range(n_iter):
                shift = (o0d - jd * OSD) * plane + (o0h - jh * OSH) * WP + (o0w - jw * OSW)
                x_tile = x_desc.load([base + shift, grp * CIN_G + cb])
                kidx = ((t0d + jd * TSD) * KH + (t0h + jh * TSH)) * KW + (t0w + jw * TSW)
                w_tile = tl.trans(w_desc.load([(grp * KVOL + kidx) * COUT_G + pid_n * BLOCK_N, cb]))
                if PRECISION == "ieee":
                    # Two-level summation, as in phase_gemm_kernel (fma keeps Triton from
                    # folding the add back into a chained dot).
                    acc = tl.fma(tl.dot(x_tile, w_tile, input_precision=PRECISION), 1.0, acc)
                else:
                    acc = tl.dot(x_tile, w_tile, acc, input_precision=PRECISION)
                cb += BLOCK_K
                c_wrap = cb >= CIN_G
                cb = tl.where(c_wrap, 0, cb)
                jw += c_wrap.to(tl.int32)
                w_wrap = jw >= tw
                jw = tl.where(w_wrap, 0, jw)
                jh += w_wrap.to(tl.int32)
                h_wrap = jh >= th
                jh = tl.where(h_wrap, 0, jh)
                jd += h_wrap.to(tl.int32)
            if HAS_BIAS:
                acc += bias[None, :]
            if j == 0:
                acc_first = acc
    if W_SKIP == 0:
        acc_first = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:
            acc_first += bias[None, :]
    if W_SKIP == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:
            acc += bias[None, :]

    y_s = y_n + (qd * SD + rd).to(tl.int64) * stride_yd
    h_lim = tl.where(qd < qd_n, qh_n, 0)
    if W_GROUP == 1:
        qh_o = qh
        ow_o = qw * SW + rw
        st_ok = (qh < h_lim) & (qw < qw_n)
        out = tl.trans(acc)
    else:
        # Interleave the two W residues: column 2 m + r of the stored tile is position m, residue r.
        out = tl.reshape(tl.permute(tl.join(acc_first, acc), (1, 0, 2)), (BLOCK_N, 2 * BLOCK_M))
        offs2 = tl.arange(0, 2 * BLOCK_M)
        m2 = m0 + offs2 // 2
        qh_o = m2 // WP
        ow_o = (m2 % WP) * 2 + offs2 % 2
        st_ok = (qh_o < h_lim) & (ow_o < OW)
    y_m = (qh_o * SH + rh) * stride_yh + ow_o * stride_yw
    tl.store(y_s + (y_co[:, None] + y_m[None, :]), out.to(y_ptr.dtype.element_ty),
             mask=co_ok[:, None] & st_ok[None, :])

    # Companion rows (see phase_gemm_kernel): bias/zero rows of empty row classes, at the
    # columns of this tile. Padding columns give ow_o >= OW and are masked.
    cmask = tl.load(tab_ptr + pgrp * W_GROUP * 16 + 15)
    if cmask != 0:
        fill = tl.zeros((BLOCK_N, W_GROUP * BLOCK_M), dtype=tl.float32)
        if HAS_BIAS:
            fill += bias[:, None]
        fill = fill.to(y_ptr.dtype.element_ty)
        for rc in range(SD * SH):
            if ((cmask >> rc) & 1) != 0:
                od = qd * SD + rc // SH
                oh_f = qh_o * SH + rc % SH
                w_lim = tl.where(od < OD, OW, 0)
                f_ok = (oh_f < OH) & (ow_o < w_lim)
                y_fd = y_n + od.to(tl.int64) * stride_yd
                tl.store(y_fd + (y_co[:, None] + (oh_f * stride_yh + ow_o * stride_yw)[None, :]), fill, mask=co_ok[:, None] & f_ok[None, :])


@triton.jit
def _pad_block(x_ptr, y_ptr, pid,
               C, D, H, W,
               DP, HP, WP,
               PD, PH, PW,
               stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
               R_BLOCKS, C_BLOCKS,
               ROUND_TF32: tl.constexpr, SRC_CL: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """Block ``pid`` of to_padded_kernel, of R_BLOCKS x C_BLOCKS x N (one grid axis, whose
    2^31 - 1 programs no batch reaches, where the other axes stop at 65535): BLOCK_W positions of
    one padded row (dp, hp) -- row block pid % R_BLOCKS of DP x HP x cdiv(WP, BLOCK_W), width
    fastest -- by BLOCK_C channels of channel block (pid // R_BLOCKS) % C_BLOCKS, of batch element
    pid // (R_BLOCKS x C_BLOCKS).

    Why rows: the source offset along a row is (wp - PW) x stride_xw, which Triton's contiguity
    analysis follows when the stride is 1 (it specialises an integer argument of 1). A block of
    flattened positions had its width as position % WP, whose contiguity it cannot prove, so the
    load of an NCDHW input took the store's layout, threads along channels: each warp's load
    touched 32 sectors of 4 useful bytes (the sm_90a TTGIR of triton 3.6; docs/design.md, "The GEMM operands in one launch").
    Now the NCDHW load runs along W and the store along channels, with the transpose through
    shared memory."""
    pid_r = pid % R_BLOCKS
    pid_c = (pid // R_BLOCKS) % C_BLOCKS
    nb = (pid // R_BLOCKS // C_BLOCKS).to(tl.int64)
    w_blocks = tl.cdiv(WP, BLOCK_W)
    wp = (pid_r % w_blocks) * BLOCK_W + tl.arange(0, BLOCK_W)
    row = pid_r // w_blocks
    hp = row % HP
    dp = row // HP
    d = dp - PD
    h = hp - PH
    w = wp - PW
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    w_ok = wp < WP
    # The row's depth and height test once per program (a scalar: tl.where, which Triton's
    # interpreter takes where `&` between a scalar and a block it does not).
    inside = tl.where((d >= 0) & (d < D) & (h >= 0) & (h < H), w_ok & (w >= 0) & (w < W), False)
    x_row = x_ptr + nb * stride_xn + d.to(tl.int64) * stride_xd + h.to(tl.int64) * stride_xh
    x_w = w.to(tl.int64) * stride_xw
    x_c = offs_c.to(tl.int64) * stride_xc
    y_w = (((nb * DP + dp) * HP + hp) * WP + wp.to(tl.int64)) * C
    if SRC_CL:
        v = tl.load(x_row + x_w[:, None] + x_c[None, :], mask=inside[:, None] & c_ok[None, :], other=0.0)
    else:
        v = tl.load(x_row + x_c[:, None] + x_w[None, :], mask=c_ok[:, None] & inside[None, :], other=0.0)
    if ROUND_TF32:
        v = _round_tf32(v)
    if SRC_CL:
        tl.store(y_ptr + y_w[:, None] + offs_c[None, :], v, mask=w_ok[:, None] & c_ok[None, :])
    else:
        tl.store(y_ptr + y_w[None, :] + offs_c[:, None], v, mask=c_ok[:, None] & w_ok[None, :])


@triton.jit
def to_padded_kernel(
    x_ptr, y_ptr,
    C, D, H, W,
    DP, HP, WP,
    PD, PH, PW,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    R_BLOCKS, C_BLOCKS,
    ROUND_TF32: tl.constexpr,
    SRC_CL: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """y[n, dp, hp, wp, c] = x[n, c, dp - PD, hp - PH, wp - PW], zero outside x (the halo);
    y is contiguous. Optional TF32 rounding as in to_channels_last_kernel. SRC_CL (x has channel
    stride 1): the tile is [positions, channels], so loads and stores both run along channels;
    otherwise [channels, positions], loads along W and stores along channels. Grid: (R_BLOCKS x
    C_BLOCKS x N,); see ``_pad_block``."""
    _pad_block(x_ptr, y_ptr, tl.program_id(0),
               C, D, H, W, DP, HP, WP, PD, PH, PW,
               stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
               R_BLOCKS, C_BLOCKS, ROUND_TF32, SRC_CL, BLOCK_C, BLOCK_W)


@triton.jit
def gemm_operands_kernel(
    x_ptr, xp_ptr, w_ptr, wp_ptr,
    C, D, H, W,
    DP, HP, WP,
    PD, PH, PW,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    CIN_G, COUT_G, KVOL, FOLD,
    stride_wi,
    PAD_R_BLOCKS, PAD_C_BLOCKS, PAD_PROGRAMS, PACK_PROGRAMS,
    ROUND_TF32: tl.constexpr,
    SRC_CL: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_CI: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """Both operands of a GEMM that reads a copy of x, in one launch: programs below PAD_PROGRAMS
    make to_padded_kernel's copy of x (zero-haloed for the flat and box GEMMs, without a halo
    for the others), the rest pack the weight as pack_weight_kernel (PACK_PROGRAMS per group).
    Grid: (PAD_PROGRAMS + PACK_PROGRAMS x groups,).

    Why one launch: every launch costs host time (docs/design.md, "Host time and the steady path"), and in two launches the
    pack runs after the copy instead of beside it; on a host-bound layer the second launch's
    host time alone can keep PyTorch faster (docs/design.md, "The GEMM operands in one launch")."""
    pid = tl.program_id(0)
    if pid < PAD_PROGRAMS:
        _pad_block(x_ptr, xp_ptr, pid,
                   C, D, H, W, DP, HP, WP, PD, PH, PW,
                   stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
                   PAD_R_BLOCKS, PAD_C_BLOCKS, ROUND_TF32, SRC_CL, BLOCK_C, BLOCK_W)
    else:
        q = pid - PAD_PROGRAMS
        _pack_block(w_ptr, wp_ptr, q % PACK_PROGRAMS, q // PACK_PROGRAMS, CIN_G, COUT_G, KVOL, FOLD, stride_wi,
                    ROUND_TF32, BLOCK_CI, BLOCK_J)
