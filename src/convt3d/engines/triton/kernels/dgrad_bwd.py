"""The input gradient, dX, a strided conv3d of dY with the same weight: ``dgrad_kernel`` is an implicit GEMM per group
(M = positions of one (n, id) plane, N = Cin/g, K = Cout/g x the taps reaching the tile) on K-major operands (NDHWC
dY, weight packed by ``pack_dgrad_weight_kernel``), each dX written once."""
import triton
import triton.language as tl

from .phase_gemm import _round_tf32


@triton.jit
def _tap_range(i_lo, i_hi, S, P, DIL, O, K):
    """Taps [t_lo, t_hi) (a superset: loads are masked) with output i*S - P + t*DIL in [0, O) for an i in [i_lo, i_hi];
    only non-negative numbers are divided (Triton truncates)."""
    num = P - i_hi * S
    t_lo = tl.where(num > 0, (num + DIL - 1) // DIL, 0)
    num2 = O - 1 + P - i_lo * S
    t_hi = tl.where(num2 >= 0, tl.minimum(num2 // DIL + 1, K), 0)
    return t_lo, tl.maximum(t_hi, t_lo)


@triton.jit
def dgrad_kernel(
    dy_ptr, w_ptr, dx_ptr, N, CIN_G, COUT_G, D, H, W, OD, OH, OW, KD, KH, KW, GROUPS,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw, stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    SD, SH, SW, PD, PH, PW, DD, DH, DW, tiles_m, tiles_n,
    PRECISION: tl.constexpr, ROUND_A: tl.constexpr, TWO_LEVEL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program -> (group, n, id, position tile, Cin tile), Cin tile fastest: dY rows shared in L2.
    pid = tl.program_id(0)
    pid_n = pid % tiles_n
    t = pid // tiles_n
    pid_m = t % tiles_m
    t = t // tiles_m
    id_ = t % D
    t = t // D
    nb = t % N
    grp = t // N

    HW = H * W
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < HW
    ih = offs_m // W
    iw = offs_m % W
    offs_ci = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_ok = offs_ci < CIN_G
    offs_k = tl.arange(0, BLOCK_K)

    # Taps reaching the tile: depth exactly (scalar id), height over its rows, width over its columns (all if rows).
    td_lo, td_hi = _tap_range(id_, id_, SD, PD, DD, OD, KD)
    m_last = tl.minimum(m0 + BLOCK_M, HW) - 1
    ih_lo = m0 // W
    ih_hi = m_last // W
    one_row = ih_lo == ih_hi
    iw_lo = tl.where(one_row, m0 % W, 0)
    iw_hi = tl.where(one_row, m_last % W, W - 1)
    th_lo, th_hi = _tap_range(ih_lo, ih_hi, SH, PH, DH, OH, KH)
    tw_lo, tw_hi = _tap_range(iw_lo, iw_hi, SW, PW, DW, OW, KW)
    nd = td_hi - td_lo
    nh = th_hi - th_lo
    nw = tw_hi - tw_lo
    k_blocks = (COUT_G + BLOCK_K - 1) // BLOCK_K
    n_iter = nd * nh * nw * k_blocks

    # 64-bit scalar bases per program; 32-bit offsets inside one depth slice (the launcher checks).
    y_n = dy_ptr + nb.to(tl.int64) * stride_yn + (grp * COUT_G).to(tl.int64) * stride_yc
    ohb = ih * SH - PH  # output row of tap 0, per position
    owb = iw * SW - PW
    y_m = ohb * stride_yh + owb * stride_yw
    w_g = w_ptr + grp.to(tl.int64) * (KD * KH * KW) * CIN_G * COUT_G
    w_n = offs_ci * COUT_G

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # (tap, channel block) counters advanced by carries; kc counts blocks, so kc * BLOCK_K stays divisible (vectors).
    kc = 0
    jw = 0
    jh = 0
    jd = 0
    for kk in range(n_iter):
        td = td_lo + jd
        th = th_lo + jh
        tw = tw_lo + jw
        od = id_ * SD - PD + td * DD  # inside [0, OD) by the depth tap range
        dh = th * DH
        dw = tw * DW
        a_ok = m_ok & (ohb >= -dh) & (ohb < OH - dh) & (owb >= -dw) & (owb < OW - dw)
        co = kc * BLOCK_K + offs_k
        co_ok = co < COUT_G
        a_tile = tl.load(y_n + od.to(tl.int64) * stride_yd + (dh * stride_yh + dw * stride_yw)
                         + (y_m[:, None] + co[None, :] * stride_yc),
                         mask=a_ok[:, None] & co_ok[None, :], other=0.0)
        tap = (td * KH + th) * KW + tw
        b_tile = tl.load(w_g + tap * CIN_G * COUT_G + (co[:, None] + w_n[None, :]),
                         mask=co_ok[:, None] & ci_ok[None, :], other=0.0)
        if ROUND_A:
            # dY read in place: rounded to TF32 here (the packing kernel rounded the weight).
            a_tile = _round_tf32(a_tile)
        if TWO_LEVEL:
            # Two-level summation (fma keeps Triton from folding it into a chained dot).
            acc = tl.fma(tl.dot(a_tile, b_tile, input_precision=PRECISION), 1.0, acc)
        else:
            acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)
        kc += 1
        c_wrap = kc >= k_blocks
        kc = tl.where(c_wrap, 0, kc)
        jw += c_wrap.to(tl.int32)
        w_wrap = jw >= nw
        jw = tl.where(w_wrap, 0, jw)
        jh += w_wrap.to(tl.int32)
        h_wrap = jh >= nh
        jh = tl.where(h_wrap, 0, jh)
        jd += h_wrap.to(tl.int32)

    # Stored [channel, position] along the W stride; a tile inside the plane stores unmasked, as 16-byte vectors.
    x_s = dx_ptr + nb.to(tl.int64) * stride_xn + id_.to(tl.int64) * stride_xd
    x_c = (grp * CIN_G + offs_ci).to(tl.int64) * stride_xc
    x_m = offs_m * stride_xw
    out = tl.trans(acc).to(dx_ptr.dtype.element_ty)
    if m0 + BLOCK_M <= HW:
        tl.store(x_s + x_c[:, None] + x_m[None, :], out, mask=ci_ok[:, None])
    else:
        tl.store(x_s + x_c[:, None] + x_m[None, :], out, mask=ci_ok[:, None] & m_ok[None, :])


@triton.jit
def pack_dgrad_weight_kernel(
    w_ptr, p_ptr, CIN_G, COUT_G, TAPS, stride_wi, stride_wo,
    ROUND_TF32: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """p[g, tap, ci, co] = w[g*CIN_G + ci, co, tap], contiguous, optionally TF32-rounded; a program transposes one
    input channel's [BLOCK_CO, BLOCK_T] block in shared memory: loads run along taps, stores along co."""
    t_blocks = tl.cdiv(TAPS, BLOCK_T)
    blocks = tl.cdiv(COUT_G, BLOCK_CO) * t_blocks
    ci = tl.program_id(0) // blocks
    pid = tl.program_id(0) % blocks
    grp = tl.program_id(1)
    co = (pid // t_blocks) * BLOCK_CO + tl.arange(0, BLOCK_CO)
    tap = (pid % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (co < COUT_G)[:, None] & (tap < TAPS)[None, :]
    row = (grp.to(tl.int64) * CIN_G + ci) * stride_wi
    v = tl.load(w_ptr + row + co[:, None].to(tl.int64) * stride_wo + tap[None, :], mask=mask, other=0.0)
    if ROUND_TF32:
        v = _round_tf32(v)
    dst = ((grp.to(tl.int64) * TAPS + tap[None, :]) * CIN_G + ci) * COUT_G + co[:, None]
    tl.store(p_ptr + dst, v, mask=mask)
