"""Triton kernels of output heads (1-15 output channels per group; ``convt3d.engines.triton.head``), importing only
``triton`` and the phase kernels (exported verbatim). A head's phase GEMM has a tiny N and re-reads its input per tap,
so the taps go into N: ``head_rows_kernel`` sums the width taps into Z (output rows, fp32, or bf16 for bf16 calls),
``head_gather_tile_kernel`` the depth and height taps of Z; ``head_shuffle_kernel`` (dilation 1) is one launch."""
import triton
import triton.language as tl

from .phase_gemm import _round_tf32


@triton.jit
def _mma_step(acc, a, b, ROUND_TF32: tl.constexpr, TWO_LEVEL: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a @ b at the call's precision: the K step of every head kernel."""
    if ROUND_TF32:
        # cuDNN's TF32 numerics: operands rounded to nearest (tensor cores would truncate).
        a = _round_tf32(a)
        b = _round_tf32(b)
    if TWO_LEVEL:
        # Two-level summation (fma keeps Triton from folding it into a chained dot).
        acc = tl.fma(tl.dot(a, b, input_precision=PRECISION), 1.0, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _rows_weight_tile(w_g, nt, j, k0, CIN_G, NCOL, KW, KVOL, SW, PW, DW, SHIFT0, stride_wc,
                      SW_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """head_rows_kernel's [BLOCK_K, BLOCK_N] weight tile (N tile ``nt``, width shift ``j``, channels
    from ``k0``): column (co, td, th, rw) holds tap tw = (rw + PW - delta * SW) / DW, or zero."""
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = cols % SW_C
    gcol = cols // SW_C  # (co, td, th)
    w_col = (gcol // (KVOL // KW)) * KVOL + (gcol % (KVOL // KW)) * KW  # tap (td, th, 0) of the column
    twn = rw + PW - (SHIFT0 + j) * SW
    tw = twn // DW
    t_ok = (cols < NCOL) & (twn >= 0) & ((twn % DW) == 0) & (tw < KW)
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_g + ks.to(tl.int64)[:, None] * stride_wc + (w_col + tw)[None, :],
                   mask=(ks < CIN_G)[:, None] & t_ok[None, :], other=0.0)


@triton.jit
def _rows_packed_base(w_ptr, grp, NSHIFT: tl.constexpr, N_TILES: tl.constexpr, K_STEPS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Group ``grp``'s part of the packed weight: NSHIFT x K_STEPS x N_TILES tiles."""
    return w_ptr + grp.to(tl.int64) * (NSHIFT * K_STEPS * BLOCK_K * N_TILES * BLOCK_N)


@triton.jit
def _rows_packed_offsets(nt, j, k0, N_TILES: tl.constexpr, K_STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """Offsets of packed tile (nt, j, k0): one contiguous block, K fastest, because TF32 tensor
    cores read B only K-major (wgmma cannot transpose 32-bit types)."""
    tile = (j * K_STEPS + k0 // BLOCK_K) * N_TILES + nt
    kk = tl.arange(0, BLOCK_K)
    nn = tl.arange(0, BLOCK_N)
    return tile * (BLOCK_N * BLOCK_K) + nn[None, :] * BLOCK_K + kk[:, None]


@triton.jit
def _rows_packed_tile(w_g, nt, j, k0, N_TILES: tl.constexpr, K_STEPS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_rows_weight_tile`` from the packed copy (zero-filled, so the load is unmasked)."""
    return tl.load(w_g + _rows_packed_offsets(nt, j, k0, N_TILES, K_STEPS, BLOCK_N, BLOCK_K))


@triton.jit
def head_rows_pack_kernel(
    w_ptr, wp_ptr, CIN_G, NCOL, KW, KVOL, SW, PW, DW, SHIFT0, stride_wc,
    ROUND_TF32: tl.constexpr,
    SW_C: tl.constexpr, NSHIFT: tl.constexpr, N_TILES: tl.constexpr, K_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The rows kernel's weight tiles gathered once per call into a dense copy (``W_PACKED``, ROUND_TF32: rounded) that
    spares the GEMM a tap gather per K step. Grid (NSHIFT x K_STEPS x N_TILES, groups)."""
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    nt = pid % N_TILES
    kk = (pid // N_TILES) % K_STEPS
    j = pid // (N_TILES * K_STEPS)
    w_g = w_ptr + (grp * CIN_G).to(tl.int64) * stride_wc
    t = _rows_weight_tile(w_g, nt, j, kk * BLOCK_K, CIN_G, NCOL, KW, KVOL, SW, PW, DW, SHIFT0, stride_wc,
                          SW_C, BLOCK_N, BLOCK_K)
    if ROUND_TF32:
        t = _round_tf32(t)
    offs = _rows_packed_offsets(nt, j, kk * BLOCK_K, N_TILES, K_STEPS, BLOCK_N, BLOCK_K)
    wp_g = _rows_packed_base(wp_ptr, grp, NSHIFT, N_TILES, K_STEPS, BLOCK_N, BLOCK_K)
    # The grid covers the copy exactly; the mask is its size.
    tl.store(wp_g + offs, t.to(wp_ptr.dtype.element_ty),
             mask=offs < NSHIFT * K_STEPS * BLOCK_K * N_TILES * BLOCK_N)


@triton.jit
def _rows_x_tile(x_n, x_r, q, m_ok, j, k0, CIN_G, W, SHIFT0, stride_xc, stride_xw,
                 ROUND_X: tl.constexpr, BLOCK_K: tl.constexpr):
    """The input tile [BLOCK_M, BLOCK_K] at width shift ``j``, channels from ``k0`` (ROUND_X: TF32)."""
    iw = q + (SHIFT0 + j)
    ks = k0 + tl.arange(0, BLOCK_K)
    x_t = tl.load(x_n + (x_r + iw * stride_xw)[:, None] + ks.to(tl.int64)[None, :] * stride_xc,
                  mask=(m_ok & (iw >= 0) & (iw < W))[:, None] & (ks < CIN_G)[None, :], other=0.0)
    if ROUND_X:
        x_t = _round_tf32(x_t)
    return x_t


@triton.jit
def _rows_mma(acc, w_t, x_n, x_r, q, m_ok, j, k0, CIN_G, W, SHIFT0, stride_xc, stride_xw,
              ROUND_X: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += the input tile at width shift ``j`` @ its (already rounded) weight tile ``w_t``."""
    x_t = _rows_x_tile(x_n, x_r, q, m_ok, j, k0, CIN_G, W, SHIFT0, stride_xc, stride_xw, ROUND_X, BLOCK_K)
    return _mma_step(acc, x_t, w_t, False, PRECISION == "ieee", PRECISION)


@triton.jit
def _rows_gathered_w(w_g, nt, j, k0, CIN_G, NCOL, KW, KVOL, SW, PW, DW, SHIFT0, stride_wc,
                     ROUND_W: tl.constexpr, SW_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_rows_weight_tile``, rounded to TF32 in registers with ROUND_W."""
    w_t = _rows_weight_tile(w_g, nt, j, k0, CIN_G, NCOL, KW, KVOL, SW, PW, DW, SHIFT0, stride_wc,
                            SW_C, BLOCK_N, BLOCK_K)
    if ROUND_W:
        w_t = _round_tf32(w_t)
    return w_t


@triton.jit
def _rows_store(acc, nt, pid_m, z_g, S, D, H, OW, QW, NCOL,
                SW_C: tl.constexpr, FULL_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """N tile ``nt`` of an M tile into Z, the W residues interleaved in registers so stores write contiguous columns."""
    G_N: tl.constexpr = BLOCK_N // SW_C
    out = tl.reshape(tl.permute(tl.reshape(acc, (BLOCK_M, G_N, SW_C)), (1, 0, 2)), (G_N, BLOCK_M * SW_C))
    e = tl.arange(0, BLOCK_M * SW_C)
    em = pid_m * BLOCK_M + e // SW_C
    g_e = nt * G_N + tl.arange(0, G_N)
    if FULL_W:
        # OW = QW * SW: column (em // QW) * OW + (em % QW) * SW + rw is em * SW + rw, a run (no per-element division).
        ok = (g_e < NCOL // SW_C)[:, None] & (em < S)[None, :]
        z_e = g_e.to(tl.int64)[:, None] * (D * H * OW) + (pid_m * (BLOCK_M * SW_C) + e)[None, :]
    else:
        ow = (em % QW) * SW_C + e % SW_C
        ok = (g_e < NCOL // SW_C)[:, None] & ((em < S) & (ow < OW))[None, :]
        z_e = g_e.to(tl.int64)[:, None] * (D * H * OW) + ((em // QW) * OW + ow)[None, :]
    tl.store(z_g + z_e, out.to(z_g.dtype.element_ty), mask=ok)


@triton.jit
def head_rows_kernel(
    x_ptr, w_ptr, z_ptr, N, CIN_G, NCOL, D, H, W, OW, QW, KH, KW, KVOL, SW, PW, DW, SHIFT0,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw, stride_wc, tiles_m, num_tiles,
    ROUND_X: tl.constexpr, ROUND_W: tl.constexpr, PRECISION: tl.constexpr, SW_C: tl.constexpr,
    FLAT_DH: tl.constexpr, FULL_W: tl.constexpr, UNROLL: tl.constexpr, W_ONCE: tl.constexpr,
    W_PACKED: tl.constexpr, N_JOINT: tl.constexpr,
    NSHIFT: tl.constexpr, N_TILES: tl.constexpr, K_STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The "rows" kind: Z[g, n, (co, td, th), id, ih, ow] = sum over ci and the width taps of X * W; M = (id, ih, qw)
    with ow = qw * SW + rw, N = (co, td, th, rw), K = Cin/g per width shift iw - qw. Grid (programs, groups), each
    walking its group's (n, M tile) tiles: one a tile with runtime loops (W_PACKED: head_rows_pack_kernel's copy;
    N_JOINT: an input tile steps every N tile), or a few an SM (UNROLL, ``Config.persist``) with constexpr loops so
    Triton pipelines the tile loop (W_ONCE: weight held per program). ROUND_X / ROUND_W: each operand rounded once
    where made, which keeps the wgmma asynchronous."""
    grp = tl.program_id(1)
    S = D * H * QW
    x_g = x_ptr + (grp * CIN_G).to(tl.int64) * stride_xc
    if W_PACKED:  # w_ptr is head_rows_pack_kernel's dense copy
        w_g = _rows_packed_base(w_ptr, grp, NSHIFT, N_TILES, K_STEPS, BLOCK_N, BLOCK_K)
    else:
        w_g = w_ptr + (grp * CIN_G).to(tl.int64) * stride_wc
    # The packed weight serves the single sweep only (a persistent tile uses W_ONCE).
    tl.static_assert(not (W_PACKED and UNROLL), "W_PACKED is a single-sweep option")
    ws = ()
    if W_ONCE:
        for nt in tl.static_range(N_TILES):
            for j in tl.static_range(NSHIFT):
                for kk in tl.static_range(K_STEPS):
                    ws = ws + (_rows_gathered_w(w_g, nt, j, kk * BLOCK_K, CIN_G, NCOL, KW, KVOL, SW, PW, DW, SHIFT0,
                                                stride_wc, ROUND_W, SW_C, BLOCK_N, BLOCK_K),)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        pid_m = tile % tiles_m
        nb = tile // tiles_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < S
        q = offs_m % QW
        r = offs_m // QW  # id * H + ih
        if FLAT_DH:
            x_r = r * stride_xh
        else:
            x_r = (r // H) * stride_xd + (r % H) * stride_xh
        x_n = x_g + nb.to(tl.int64) * stride_xn
        z_g = z_ptr + (grp * N + nb).to(tl.int64) * (NCOL // SW_C) * (D * H * OW)
        if UNROLL:
            # Each input tile loaded once per (shift, K step), into every N tile's accumulator.
            accs = ()
            for nt in tl.static_range(N_TILES):
                accs = accs + (tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),)
            for j in tl.static_range(NSHIFT):
                for kk in tl.static_range(K_STEPS):
                    x_t = _rows_x_tile(x_n, x_r, q, m_ok, j, kk * BLOCK_K, CIN_G, W, SHIFT0, stride_xc, stride_xw,
                                       ROUND_X, BLOCK_K)
                    stepped = ()
                    for nt in tl.static_range(N_TILES):
                        if W_ONCE:
                            w_t = ws[(nt * NSHIFT + j) * K_STEPS + kk]
                        else:
                            w_t = _rows_gathered_w(w_g, nt, j, kk * BLOCK_K, CIN_G, NCOL, KW, KVOL, SW, PW, DW,
                                                   SHIFT0, stride_wc, ROUND_W, SW_C, BLOCK_N, BLOCK_K)
                        stepped = stepped + (_mma_step(accs[nt], x_t, w_t, False, PRECISION == "ieee",
                                                       PRECISION),)
                    accs = stepped
            for nt in tl.static_range(N_TILES):
                _rows_store(accs[nt], nt, pid_m, z_g, S, D, H, OW, QW, NCOL, SW_C, FULL_W, BLOCK_M, BLOCK_N)
        elif W_PACKED and N_JOINT:
            accs = ()
            for nt in tl.static_range(N_TILES):
                accs = accs + (tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),)
            for step in range(NSHIFT * K_STEPS):
                j = step // K_STEPS
                k0 = (step % K_STEPS) * BLOCK_K
                x_t = _rows_x_tile(x_n, x_r, q, m_ok, j, k0, CIN_G, W, SHIFT0, stride_xc, stride_xw, ROUND_X, BLOCK_K)
                stepped = ()
                for nt in tl.static_range(N_TILES):
                    w_t = _rows_packed_tile(w_g, nt, j, k0, N_TILES, K_STEPS, BLOCK_N, BLOCK_K)
                    stepped = stepped + (_mma_step(accs[nt], x_t, w_t, False, PRECISION == "ieee", PRECISION),)
                accs = stepped
            for nt in tl.static_range(N_TILES):
                _rows_store(accs[nt], nt, pid_m, z_g, S, D, H, OW, QW, NCOL, SW_C, FULL_W, BLOCK_M, BLOCK_N)
        else:
            # N tiles outermost, one accumulator live at a time (two 128 x 128 fp32 ones spill).
            for nt in tl.static_range(N_TILES):
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if W_PACKED:
                    # One runtime loop over (shift, K step) pairs, pipelined as a whole.
                    for step in range(NSHIFT * K_STEPS):
                        j = step // K_STEPS
                        k0 = (step % K_STEPS) * BLOCK_K
                        w_t = _rows_packed_tile(w_g, nt, j, k0, N_TILES, K_STEPS, BLOCK_N, BLOCK_K)
                        acc = _rows_mma(acc, w_t, x_n, x_r, q, m_ok, j, k0, CIN_G, W, SHIFT0, stride_xc, stride_xw,
                                        ROUND_X, PRECISION, BLOCK_K)
                else:
                    for j in range(NSHIFT):
                        for k0 in range(0, CIN_G, BLOCK_K):
                            w_t = _rows_gathered_w(w_g, nt, j, k0, CIN_G, NCOL, KW, KVOL, SW, PW, DW, SHIFT0,
                                                   stride_wc, ROUND_W, SW_C, BLOCK_N, BLOCK_K)
                            acc = _rows_mma(acc, w_t, x_n, x_r, q, m_ok, j, k0, CIN_G, W, SHIFT0, stride_xc,
                                            stride_xw, ROUND_X, PRECISION, BLOCK_K)
                _rows_store(acc, nt, pid_m, z_g, S, D, H, OW, QW, NCOL, SW_C, FULL_W, BLOCK_M, BLOCK_N)


@triton.jit
def _shuffle_shift(it, bh, iw, bd, x_n, CIN_G, D, H, W, stride_xd, stride_xh, stride_xw,
                   JH: tl.constexpr, JW: tl.constexpr, JVOL: tl.constexpr, BLOCK_K: tl.constexpr):
    """K step ``it`` of head_shuffle_kernel: its channels and mask, its shift (jd, jh, jw), and
    the input q - j of every block q (depth-slice base, in-slice offsets, mask)."""
    k0 = (it // JVOL) * BLOCK_K
    jd = it % JVOL // (JH * JW)
    jh = it % (JH * JW) // JW
    jw = it % JW
    ci = k0 + tl.arange(0, BLOCK_K)
    ih = bh - jh
    ix = iw - jw
    # The depth test broadcast as a tensor: the interpreter rejects a scalar & tensor mask.
    i_d = bd - jd + 0 * bh
    m_in = (ih >= 0) & (ih < H) & (ix >= 0) & (ix < W) & (i_d >= 0) & (i_d < D)
    x_d = x_n + (bd - jd).to(tl.int64) * stride_xd
    return ci, ci < CIN_G, jd, jh, jw, x_d, ih * stride_xh + ix * stride_xw, m_in


@triton.jit
def head_shuffle_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, CIN_G, COUT_G, D, H, W, OD, OH, OW, PD, PH, PW,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw, stride_wc,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw, blocks_d, blocks_w, tiles_h, tiles_w,
    HAS_BIAS: tl.constexpr, ROUND_TF32: tl.constexpr, PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    JD: tl.constexpr, JH: tl.constexpr, JW: tl.constexpr, NJH: tl.constexpr, NJW: tl.constexpr, NS_P: tl.constexpr,
    FLAT: tl.constexpr, R_P: tl.constexpr, SW_P: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, Y64: tl.constexpr,
):
    """The shuffle kind (dilation 1): tap t = j * s + r sends input i to output (i + j) * s - p + r, so block q sums
    taps (j, r) of inputs q - j: a 3-D pixel shuffle of a stride-1 convolution in one sweep, no Z, no fill. A program:
    one (n, g), a depth block, BLOCK_H x BLOCK_W blocks (FLAT: BLOCK_W consecutive in row order). USE_DOT: an MMA per
    K step (two-level at "ieee"), else exact fp32 FMA. NJH, NJW > 1: those shifts are MMA columns, block q taking its
    column block from tile row q - (nh, nw); the first rows are a halo read, not written. Y64: 64-bit output offsets."""
    pid = tl.program_id(0)
    pid_w = pid % tiles_w
    t = pid // tiles_w
    pid_h = t % tiles_h
    t = t // tiles_h
    bd = t % blocks_d
    t = t // blocks_d
    nb = t % N
    grp = t // N
    J: tl.constexpr = R_P * BLOCK_C
    M: tl.constexpr = BLOCK_H * BLOCK_W
    KVOL: tl.constexpr = KD * KH * KW
    JVOL: tl.constexpr = JD * JH * JW

    m = tl.arange(0, M)
    # Shifts in N: the first NJH - 1 rows and NJW - 1 columns of blocks (FLAT: halo blocks) are read, not `own`.
    if FLAT:
        halo = (NJH - 1) * blocks_w + (NJW - 1)
        blk = pid_h * (M - halo) - halo + m
        bh = blk // blocks_w
        iw = blk % blocks_w
        own = m >= halo
    else:
        bh = pid_h * (BLOCK_H - (NJH - 1)) - (NJH - 1) + m // BLOCK_W
        iw = pid_w * (BLOCK_W - (NJW - 1)) - (NJW - 1) + m % BLOCK_W
        own = (m // BLOCK_W >= NJH - 1) & (m % BLOCK_W >= NJW - 1)
    x_n = x_ptr + nb.to(tl.int64) * stride_xn + (grp * CIN_G).to(tl.int64) * stride_xc
    w_g = w_ptr + (grp * CIN_G).to(tl.int64) * stride_wc
    # K steps: channel blocks outside, the shifts of a block inside (its input tiles overlap).
    steps = tl.cdiv(CIN_G, BLOCK_K) * JVOL

    # Rows j of the box: (a, b) = divmod(r, SH) for r = j // BLOCK_C, channel co = j % BLOCK_C.
    j = tl.arange(0, J)
    r = j // BLOCK_C
    co = j % BLOCK_C
    a = r // SH
    b = r % SH
    c = tl.arange(0, SW_P)
    j_row = (r < SD * SH) & (co < COUT_G)
    od = bd * SD + a - PD
    j_ok = j_row & (od >= 0) & (od < OD)

    if USE_DOT:
        # Columns n = (shift in N, row j, residue c): NS_P blocks of NC0, block sn the shift (nh, nw) = divmod(sn, NJW)
        # (past NJH x NJW: zero columns of the power of two).
        NC0: tl.constexpr = J * SW_P
        NCOL: tl.constexpr = NS_P * NC0
        n = tl.arange(0, NCOL)
        sn = n // NC0
        nh_n = sn // NJW
        nw_n = sn % NJW
        n_j = n % NC0 // SW_P
        n_c = n % SW_P
        r_n = n_j // BLOCK_C
        co_n = n_j % BLOCK_C
        a_n = r_n // SH
        b_n = r_n % SH
        n_row = (r_n < SD * SH) & (co_n < COUT_G) & (n_c < SW) & (sn < NJH * NJW)
        acc = tl.zeros((M, NCOL), dtype=tl.float32)
        for it in range(0, steps):
            ci, ci_ok, jd, jh, jw, x_d, x_m, m_in = _shuffle_shift(
                it, bh, iw, bd, x_n, CIN_G, D, H, W, stride_xd, stride_xh, stride_xw, JH, JW, JVOL, BLOCK_K)
            xt = tl.load(x_d + x_m[:, None] + ci[None, :] * stride_xc, mask=m_in[:, None] & ci_ok[None, :], other=0.0)
            td = jd * SD + a_n
            th = (jh + nh_n) * SH + b_n
            tw = (jw + nw_n) * SW + n_c
            n_ok = n_row & (td < KD) & (th < KH) & (tw < KW)
            wt = tl.load(w_g + ci[:, None] * stride_wc + (co_n * KVOL + (td * KH + th) * KW + tw)[None, :],
                         mask=ci_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _mma_step(acc, xt, wt, ROUND_TF32, PRECISION == "ieee", PRECISION)
        if NS_P > 1:
            # Block q sums column block (nh, nw) of row q - (nh, nw); a flat tile's row q - nw may wrap into the row
            # above, whose blocks lie past the input or feed only cropped outputs: no mask. Halo rows are not stored.
            if FLAT:
                src = m[:, None] - (nh_n * blocks_w + nw_n)[None, :]
            else:
                src = m[:, None] - (nh_n * BLOCK_W + nw_n)[None, :]
            acc = tl.gather(acc, tl.maximum(src, 0), axis=0)
            acc = tl.sum(tl.reshape(acc, (M, NS_P, NC0)), axis=1)
        out = tl.permute(tl.reshape(acc, (M, J, SW_P)), (1, 0, 2))
    else:
        out = tl.zeros((J, M, SW_P), dtype=tl.float32)
        for it in range(0, steps):
            ci, ci_ok, jd, jh, jw, x_d, x_m, m_in = _shuffle_shift(
                it, bh, iw, bd, x_n, CIN_G, D, H, W, stride_xd, stride_xh, stride_xw, JH, JW, JVOL, BLOCK_K)
            xv = tl.load(x_d + ci[:, None] * stride_xc + x_m[None, :], mask=ci_ok[:, None] & m_in[None, :],
                         other=0.0).to(tl.float32)
            td = jd * SD + a
            th = jh * SH + b
            tw = jw * SW + c
            j_tap = j_row & (td < KD) & (th < KH)
            wv = tl.load(w_g + ci[:, None, None] * stride_wc + (co * KVOL + (td * KH + th) * KW)[None, :, None]
                         + tw[None, None, :],
                         mask=ci_ok[:, None, None] & j_tap[None, :, None] & ((tw < KW) & (c < SW))[None, None, :],
                         other=0.0).to(tl.float32)
            if ROUND_TF32:
                xv = _round_tf32(xv)
                wv = _round_tf32(wv)
            out += tl.sum(xv[:, None, :, None] * wv[:, :, None, :], axis=0)
    if HAS_BIAS:
        out += tl.load(b_ptr + grp * COUT_G + co, mask=co < COUT_G, other=0.0).to(tl.float32)[:, None, None]

    oh = bh[None, :] * SH + b[:, None] - PH  # [rows, positions]
    ow = (iw * SW - PW)[:, None] + c[None, :]  # [positions, residues]
    ow_ok = (ow >= 0) & (ow < OW) & (c < SW)[None, :]
    jm_ok = j_ok[:, None] & (oh >= 0) & (oh < OH) & own[None, :]
    y_s = y_ptr + nb.to(tl.int64) * stride_yn
    if Y64:
        y_jm = ((grp * COUT_G + co).to(tl.int64) * stride_yc + od.to(tl.int64) * stride_yd)[:, None] \
            + oh.to(tl.int64) * stride_yh
        y_mc = ow.to(tl.int64) * stride_yw
    else:
        # 32-bit offsets inside a batch element (Y64 where one spans 2^31): half the integer work.
        y_jm = ((grp * COUT_G + co) * stride_yc + od * stride_yd)[:, None] + oh * stride_yh
        y_mc = ow * stride_yw
    tl.store(y_s + y_jm[:, :, None] + y_mc[None, :, :], out.to(y_ptr.dtype.element_ty),
             mask=jm_ok[:, :, None] & ow_ok[None, :, :])


@triton.jit
def head_gather_tile_kernel(
    z_ptr, b_ptr, y_ptr, N, COUT_G, D, H, W, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw, tiles_q, tiles_w,
    HAS_BIAS: tl.constexpr, KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """out[n, g * COUT_G + co, od, oh, ow] = bias + the Z rows of every (depth, height) tap reaching (od, oh), any
    output strides. A program: one (n, g, od), BLOCK_R rows of one height residue, BLOCK_W columns, every channel,
    each output written once in a fixed order; Z read evict_first so that it does not evict the output from L2."""
    pid = tl.program_id(0)
    pid_w = pid % tiles_w
    t = pid // tiles_w
    pid_q = t % tiles_q
    t = t // tiles_q
    rh = t % SH
    t = t // SH
    od = t % OD
    t = t // OD
    nb = t % N
    grp = t // N

    offs_i = tl.arange(0, BLOCK_C * BLOCK_R)
    co = offs_i // BLOCK_R
    q = pid_q * BLOCK_R + offs_i % BLOCK_R
    oh = q * SH + rh
    i_ok = (co < COUT_G) & (oh < OH)
    ow = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = ow < OW
    kvol: tl.constexpr = KD * KH * KW
    S = D * H * W
    S64 = S.to(tl.int64)
    acc = tl.zeros((BLOCK_C * BLOCK_R, BLOCK_W), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + grp * COUT_G + co, mask=co < COUT_G, other=0.0).to(tl.float32)[:, None]
    # Z of (g, n) and of each row's channel.
    z_g = z_ptr + (grp * N + nb).to(tl.int64) * COUT_G * kvol * S
    z_i = co.to(tl.int64) * kvol * S64
    for td in tl.static_range(KD):
        dn = od + PD - td * DD
        id_ = dn // SD  # exact where dn % SD == 0 (the only case used), whatever the rounding
        if ((dn % SD) == 0) & (dn >= 0) & (id_ < D):
            for th in tl.static_range(KH):
                hn = rh + PH - th * DH
                if (hn % SH) == 0:
                    # ih = q + hn / SH for every row of the tile (same residue).
                    ih = q + hn // SH
                    row_ok = i_ok & (ih >= 0) & (ih < H)
                    z_row = z_g + z_i + ((td * KH + th) * KW) * S64 + (id_ * H + ih).to(tl.int64) * W
                    for tw in tl.static_range(KW):
                        wn = ow + PW - tw * DW
                        iw = wn // SW
                        ok = ((wn % SW) == 0) & (wn >= 0) & (iw < W) & w_ok
                        acc += tl.load(z_row[:, None] + tw * S64 + iw[None, :],
                                       mask=row_ok[:, None] & ok[None, :], other=0.0,
                                       eviction_policy="evict_first").to(tl.float32)
    st_ok = i_ok[:, None] & w_ok[None, :]
    y_i = (grp * COUT_G + co).to(tl.int64) * stride_yc + oh.to(tl.int64) * stride_yh
    y_s = y_ptr + nb.to(tl.int64) * stride_yn + od.to(tl.int64) * stride_yd
    tl.store(y_s + y_i[:, None] + ow[None, :] * stride_yw, acc.to(y_ptr.dtype.element_ty), mask=st_ok)
