"""Triton kernels of the convt3d engine: pure ``@triton.jit`` functions, no host logic.

This module imports only ``triton`` so that ``convt3d export-kernelbench`` can copy it
verbatim into a self-contained KernelBench file. (Keep it that way: no torch, no package
imports, no try/except, and avoid the bare word for a no-op statement in strings; KernelBench's
static checker rejects it outside comments.)

Vocabulary -- phase, taps of a phase, compact grid, GEMM map -- is defined once in
``convt3d.params``. One program of ``phase_gemm_kernel`` computes one group, one output-channel
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
# rd rh rw | Td Th Tw | t0d t0h t0w | off0d off0h off0w | Qd Qh Qw | unused
PHASE_TABLE_COLUMNS = 16


@triton.jit
def phase_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, tab_ptr,
    N, CIN_G, COUT_G,
    D, H, W,
    QD, OW,
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
    X_CACHE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
):
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
    x_n = x_ptr + nb.to(tl.int64) * stride_xn + (grp * CIN_G).to(tl.int64) * stride_xc
    x_hw = qh * stride_xh + qw * stride_xw
    w_g = w_ptr + grp.to(tl.int64) * stride_wg
    y_n = y_ptr + nb.to(tl.int64) * stride_yn
    y_co = (grp * COUT_G + offs_co).to(tl.int64) * stride_yc
    if HAS_BIAS:
        bias = tl.load(b_ptr + grp * COUT_G + offs_co, mask=co_ok, other=0.0).to(tl.float32)

    k_blocks = (CIN_G + BLOCK_K - 1) // BLOCK_K  # (tl.cdiv is a jit helper: see the note above)
    # Phases come W-residue fastest. With W_GROUP == 2 (stride 2 along W) the two W-residues
    # of a (rd, rh) pair are computed by one program and interleaved in registers, so each
    # store writes whole contiguous output rows (per-phase strided stores ran KB 77 at 250 GB/s);
    # otherwise a program computes one phase (stride-1 rows are contiguous anyway, and
    # channels-last output is contiguous along channels).
    # The launcher's table lists phase groups (W_GROUP rows each); row classes (rd, rh) that no
    # tap reaches may instead be written by fill_rows_kernel and left out of the table.
    for j in tl.static_range(W_GROUP):
        row = tab_ptr + (pgrp * W_GROUP + j) * 16
        rd = tl.load(row + 0)
        rh = tl.load(row + 1)
        rw = tl.load(row + 2)
        td = tl.load(row + 3)
        th = tl.load(row + 4)
        tw = tl.load(row + 5)
        t0d = tl.load(row + 6)
        t0h = tl.load(row + 7)
        t0w = tl.load(row + 8)
        o0d = tl.load(row + 9)
        o0h = tl.load(row + 10)
        o0w = tl.load(row + 11)
        qd_n = tl.load(row + 12)
        qh_n = tl.load(row + 13)
        qw_n = tl.load(row + 14)

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
            ih = qh + dh
            iw = qw + dw
            # The depth test is scalar: fold it into the row bound so every mask term is a
            # vector (mixing scalar and vector booleans also trips Triton's interpreter).
            h_hi = tl.where((id_ >= 0) & (id_ < D), H, 0)
            x_ok = (ih >= 0) & (ih < h_hi) & (iw >= 0) & (iw < W)
            ci = cb + offs_k
            ci_ok = ci < CIN_G
            x_s = x_n + id_.to(tl.int64) * stride_xd + (dh * stride_xh + dw * stride_xw)
            x_tile = tl.load(x_s + x_hw[:, None] + ci[None, :] * stride_xc,
                             mask=x_ok[:, None] & ci_ok[None, :], other=0.0, cache_modifier=X_CACHE)
            kidx = ((t0d + jd * TSD) * KH + (t0h + jh * TSH)) * KW + (t0w + jw * TSW)
            w_tile = tl.load(w_g + kidx * stride_wt + ci[:, None] * stride_wc + offs_co[None, :] * stride_wo,
                             mask=ci_ok[:, None] & co_ok[None, :], other=0.0)
            if USE_DOT:
                if PRECISION == "ieee":
                    # fp32 FMA dot: sum each K block on its own and add it to the total
                    # (two-level summation, ~BLOCK_K + steps roundings deep instead of K).
                    # A chained FMA sum over K = 864 (KB 77 geometry) was 4x cuDNN's error.
                    acc += tl.dot(x_tile, w_tile, input_precision=PRECISION)
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


@triton.jit
def to_channels_last_kernel(
    x_ptr, y_ptr,
    C, S,
    stride_xn, stride_xc, stride_xs,
    ROUND_TF32: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """y[n, s, c] = x[n, c, s] (s = flattened D*H*W with one stride); y is contiguous.

    The GEMM reads its input with channels innermost (K-major operands, which TF32 tensor cores
    require), so NCDHW input is copied once; the copy optionally rounds to TF32.
    """
    pid_s = tl.program_id(0)
    pid_c = tl.program_id(1)
    nb = tl.program_id(2).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_c < C)[:, None] & (offs_s < S)[None, :]
    src = x_ptr + nb * stride_xn + offs_c[:, None].to(tl.int64) * stride_xc + offs_s[None, :].to(tl.int64) * stride_xs
    v = tl.load(src, mask=mask, other=0.0)
    if ROUND_TF32:
        # Tensor cores read the top 19 bits of an fp32 operand (truncation); rounding to the
        # nearest TF32 value first (ties away, inf/NaN kept) removes that bias, as cuDNN does.
        r = ((v.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
        v = tl.where(tl.abs(v) < float("inf"), r, v)
    dst = y_ptr + nb * S * C + offs_s[None, :].to(tl.int64) * C + offs_c[:, None]
    tl.store(dst, v, mask=mask)


@triton.jit
def pack_weight_kernel(
    w_ptr, p_ptr,
    CIN_G, COUT_G, KVOL,
    stride_wi, stride_wo, stride_wt,
    ROUND_TF32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """p[g, tap, co, ci] = w[g*CIN_G + ci, co, tap]: each tap's weights as a K-major tile.

    ``stride_wt`` is the stride of the flattened (kD, kH, kW) index, valid because the weight's
    kernel dimensions are made contiguous by the launcher.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    grp = tl.program_id(1)
    ci = offs % CIN_G
    tmp = offs // CIN_G
    co = tmp % COUT_G
    tap = tmp // COUT_G
    mask = offs < KVOL * COUT_G * CIN_G
    src = (grp * CIN_G + ci) * stride_wi + co * stride_wo + tap * stride_wt
    v = tl.load(w_ptr + src, mask=mask, other=0.0)
    if ROUND_TF32:
        # Same TF32 rounding as to_channels_last_kernel (no nested jit calls: the interpreter
        # path rebuilds each kernel on its own).
        r = ((v.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
        v = tl.where(tl.abs(v) < float("inf"), r, v)
    tl.store(p_ptr + grp.to(tl.int64) * KVOL * COUT_G * CIN_G + offs, v, mask=mask)


@triton.jit
def fill_rows_kernel(
    y_ptr, b_ptr, rows_ptr,
    C, OW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """y[n, c, od, oh, :] = bias[c] (or 0) for the listed (od, oh) rows: rows whose depth or
    height residue no tap reaches (3/4 of KB 77's output). Store-only programs, so they run at
    full occupancy instead of inheriting the GEMM kernel's register budget."""
    r = tl.program_id(0)
    nb = tl.program_id(1).to(tl.int64)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
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
