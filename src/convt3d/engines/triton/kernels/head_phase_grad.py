"""Backward of an output head from dY split by phase: tap ``t`` sends input ``i`` to output ``i*s + t*d - p``, phase
``(t*d - p) mod s`` at compact index ``i + floor((t*d - p) / s)``. ``dy_phases_kernel`` copies dY so (zeros outside),
each (tap, channel) row of a GEMM operand a run along W; ``wgrad_finish_kernel`` adds both head wgrad kernels' dW
partials in a fixed order."""
import triton
import triton.language as tl

from .head_grad import _grad_step, _wide as _big
from .phase_gemm import _round_tf32


@triton.jit
def _axis_tap(t, DIL, S, LIFT):
    """Tap -> (residue, copy index - input index); LIFT = c*s - p >= 0 keeps dividends >= 0 (// and % truncate)."""
    u = t * DIL + LIFT
    return u % S, u // S


@triton.jit
def _rows(k, COUT_G, KH, KW, SD, SH, SW, DD, DH, DW, LIFT_D, LIFT_H, LIFT_W,
          stride_rd, stride_rh, stride_rw, stride_qc, stride_qd, stride_qh, BIG: tl.constexpr):
    """(tap, channel) pair k = tap * Cout/g + co -> its row's offset in the copy at input (0, 0, 0) of element 0."""
    co = k % COUT_G
    tap = k // COUT_G
    tw = tap % KW
    th = (tap // KW) % KH
    td = tap // (KW * KH)
    rd, qd = _axis_tap(td, DD, SD, LIFT_D)
    rh, qh = _axis_tap(th, DH, SH, LIFT_H)
    rw, qw = _axis_tap(tw, DW, SW, LIFT_W)
    return _big(rd, BIG) * stride_rd + _big(rh, BIG) * stride_rh + _big(rw, BIG) * stride_rw \
        + _big(co, BIG) * stride_qc + _big(qd, BIG) * stride_qd + _big(qh, BIG) * stride_qh + qw


@triton.jit
def _tile(t, D, H, W, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Position tile t (along W, then H, D, batch) -> (n, d, rows ih, columns iw, mask), BLOCK_W positions a row."""
    tiles_w = tl.cdiv(W, BLOCK_W)
    tiles_h = tl.cdiv(H, BLOCK_M // BLOCK_W)
    tw_ = t % tiles_w
    t = t // tiles_w
    th_ = t % tiles_h
    t = t // tiles_h
    id_ = t % D
    nb = t // D
    p = tl.arange(0, BLOCK_M)
    ih = th_ * (BLOCK_M // BLOCK_W) + p // BLOCK_W
    iw = tw_ * BLOCK_W + p % BLOCK_W
    return nb, id_, ih, iw, (ih < H) & (iw < W)


@triton.jit
def dy_phases_kernel(
    dy_ptr, dyq_ptr, ROWS, NB, C, QD, QH, QW, OD, OH, OW, SD, SH, SW, CD, CH, CW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    ROUND_TF32: tl.constexpr, BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    # Program -> BLOCK_R rows of the copy, decoded once per row; ROUND_TF32 rounds the copy once.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    qh = rows % QH
    t = rows // QH
    qd = t % QD
    t = t // QD
    ch = t % C
    t = t // C
    nb = t % NB
    t = t // NB
    rw = t % SW
    t = t // SW
    rh = t % SH
    rd = t // SH
    od = (qd - CD) * SD + rd
    oh = (qh - CH) * SH + rh
    inside = row_ok & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH)
    src = _big(nb, BIG) * stride_yn + _big(ch, BIG) * stride_yc + _big(od, BIG) * stride_yd \
        + _big(oh, BIG) * stride_yh
    dst = _big(rows, BIG) * QW
    for q0 in range(0, QW, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        ow = (q - CW) * SW + rw[:, None]
        ok = inside[:, None] & (q < QW)[None, :] & (ow >= 0) & (ow < OW)
        v = tl.load(dy_ptr + (src[:, None] + _big(ow, BIG) * stride_yw), mask=ok, other=0.0)
        v = v.to(dyq_ptr.dtype.element_ty)
        if ROUND_TF32:
            v = _round_tf32(v)
        tl.store(dyq_ptr + (dst[:, None] + q[None, :]), v, mask=row_ok[:, None] & (q < QW)[None, :])


@triton.jit
def head_dgrad_phase_kernel(
    dyq_ptr, wp_ptr, dx_ptr, CIN_G, COUT_G, KTOT, D, H, W, KH, KW, SD, SH, SW, DD, DH, DW, LIFT_D, LIFT_H, LIFT_W,
    stride_rd, stride_rh, stride_rw, stride_qn, stride_qc, stride_qd, stride_qh,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw, tiles_n,
    PRECISION: tl.constexpr, ROUND_TF32: tl.constexpr, DY_ROUNDED: tl.constexpr, TWO_LEVEL: tl.constexpr,
    BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # Program -> (position tile, Cin tile), Cin tile fastest; axis 1 is the group.
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    pid_n = pid % tiles_n
    nb, id_, ih, iw, m_ok = _tile(pid // tiles_n, D, H, W, BLOCK_M, BLOCK_W)
    q_m = _big(nb, BIG) * stride_qn + _big(id_, BIG) * stride_qd + _big(ih, BIG) * stride_qh + iw
    q_g = dyq_ptr + (grp * COUT_G).to(tl.int64) * stride_qc

    offs_ci = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_ok = offs_ci < CIN_G
    # The weight packed as [G, KTOT, CIN_G] (k-major rows, ci contiguous).
    w_g = wp_ptr + grp.to(tl.int64) * KTOT * CIN_G

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KTOT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < KTOT
        q_k = _rows(k, COUT_G, KH, KW, SD, SH, SW, DD, DH, DW, LIFT_D, LIFT_H, LIFT_W,
                    stride_rd, stride_rh, stride_rw, stride_qc, stride_qd, stride_qh, BIG)
        # Loaded as [K, M] (each row a run of consecutive copy elements along W), then transposed.
        a_tile = tl.trans(tl.load(q_g + (q_k[:, None] + q_m[None, :]), mask=k_ok[:, None] & m_ok[None, :],
                                  other=0.0))
        b_tile = tl.load(w_g + (k[:, None] * CIN_G + offs_ci[None, :]), mask=k_ok[:, None] & ci_ok[None, :],
                         other=0.0)
        acc = _grad_step(acc, a_tile, b_tile, ROUND_TF32 and not DY_ROUNDED, ROUND_TF32, TWO_LEVEL, PRECISION)

    x_m = _big(nb, BIG) * stride_xn + _big(id_, BIG) * stride_xd + _big(ih, BIG) * stride_xh \
        + _big(iw, BIG) * stride_xw
    x_c = _big(offs_ci, BIG) * stride_xc
    x_g = dx_ptr + (grp * CIN_G).to(tl.int64) * stride_xc
    tl.store(x_g + (x_m[:, None] + x_c[None, :]), acc.to(dx_ptr.dtype.element_ty),
             mask=m_ok[:, None] & ci_ok[None, :])


@triton.jit
def head_wgrad_phase_kernel(
    x_ptr, dyq_ptr, part_ptr, CIN_G, COUT_G, KTOT, D, H, W, KH, KW, GROUPS, SPLITS, TILES, SD, SH, SW, DD, DH, DW,
    LIFT_D, LIFT_H, LIFT_W, stride_rd, stride_rh, stride_rw, stride_qn, stride_qc, stride_qd, stride_qh,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw, tiles_ci, tiles_k,
    PRECISION: tl.constexpr, ROUND_TF32: tl.constexpr, DY_ROUNDED: tl.constexpr, TWO_LEVEL: tl.constexpr,
    BIG: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # Program -> (split, Cin tile, (tap, channel) tile), the last fastest; axis 1 is the group.
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    pid_k = pid % tiles_k
    t = pid // tiles_k
    pid_ci = t % tiles_ci
    split = t // tiles_ci
    lo = ((TILES.to(tl.int64) * split) // SPLITS).to(tl.int32)
    hi = ((TILES.to(tl.int64) * (split + 1)) // SPLITS).to(tl.int32)

    offs_ci = pid_ci * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = offs_ci < CIN_G
    x_c = _big(offs_ci, BIG) * stride_xc
    x_g = x_ptr + (grp * CIN_G).to(tl.int64) * stride_xc
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < KTOT
    q_k = _rows(k, COUT_G, KH, KW, SD, SH, SW, DD, DH, DW, LIFT_D, LIFT_H, LIFT_W,
                stride_rd, stride_rh, stride_rw, stride_qc, stride_qd, stride_qh, BIG)
    q_g = dyq_ptr + (grp * COUT_G).to(tl.int64) * stride_qc

    acc = tl.zeros((BLOCK_K, BLOCK_CI), dtype=tl.float32)
    for tile in range(lo, hi):
        nb, id_, ih, iw, p_ok = _tile(tile, D, H, W, BLOCK_P, BLOCK_W)
        q_p = _big(nb, BIG) * stride_qn + _big(id_, BIG) * stride_qd + _big(ih, BIG) * stride_qh + iw
        y_tile = tl.load(q_g + (q_k[:, None] + q_p[None, :]), mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        x_p = _big(nb, BIG) * stride_xn + _big(id_, BIG) * stride_xd + _big(ih, BIG) * stride_xh \
            + _big(iw, BIG) * stride_xw
        x_tile = tl.load(x_g + (x_p[:, None] + x_c[None, :]), mask=p_ok[:, None] & ci_ok[None, :], other=0.0)
        # TWO_LEVEL (exact-grade fp32): each tile's BLOCK_P-term dot summed on its own, then added.
        acc = _grad_step(acc, y_tile, x_tile, ROUND_TF32 and not DY_ROUNDED, ROUND_TF32, TWO_LEVEL, PRECISION)

    # part[split, grp, ci, k], contiguous (the layout of head_grad.head_wgrad_kernel's partials).
    base = (split * GROUPS + grp).to(tl.int64) * CIN_G * KTOT
    dst = part_ptr + base + offs_ci[None, :].to(tl.int64) * KTOT + k[:, None]
    tl.store(dst, acc, mask=k_ok[:, None] & ci_ok[None, :])


@triton.jit
def wgrad_finish_kernel(
    part_ptr, dw_ptr, E, SPLITS, COUT_G, KTOT, TAPS,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # BLOCK_E elements a program, splits added BLOCK_S at a time in a fixed order (deterministic); SPLITS x E < 2^22.
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        v = tl.load(part_ptr + (s[:, None] * E + e[None, :]), mask=(s < SPLITS)[:, None] & e_ok[None, :], other=0.0)
        acc += tl.sum(v, axis=0)
    # k = tap * Cout/g + co  ->  dW[g*Cin/g + ci, co, tap]
    row = e // KTOT
    k = e % KTOT
    co = k % COUT_G
    tap = k // COUT_G
    tl.store(dw_ptr + ((row * COUT_G + co) * TAPS + tap), acc.to(dw_ptr.dtype.element_ty), mask=e_ok)
