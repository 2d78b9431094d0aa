"""Triton kernels of an output head's backward (Cin/g >= 8, Cout/g <= 15). (tap, output channel) pairs form one GEMM
dimension, ``k = tap * Cout/g + co`` (the general kernels step a padded tap at a time), positions of one batch element
the other, offset by ``s * stride_w`` so the compiler sees runs. ``head_dgrad_kernel``: M = positions, N = Cin/g;
``head_wgrad_kernel``: M = Cin/g, N = (tap, channel) pairs, K = positions in SPLITS fp32 partials. dY comes
zero-padded (``dy_pad_kernel``): the gather needs no bounds test."""
import triton
import triton.language as tl

from .head_gemm import _mma_step
from .phase_gemm import _round_tf32


@triton.jit
def _wide(v, BIG: tl.constexpr):
    """An index in the offset type: 64-bit for tensors of >= 2^31 elements."""
    if BIG:
        v = v.to(tl.int64)
    return v


@triton.jit
def _tap_offsets(k, COUT_G, KH, KW, DD, DH, DW, stride_c, stride_d, stride_h, stride_w, BIG: tl.constexpr):
    """(tap, channel) index k -> (its offset in the padded dY: t*d per dimension plus the channel, co, td, th, tw)."""
    co = k % COUT_G
    tap = k // COUT_G
    tw = tap % KW
    th = (tap // KW) % KH
    td = tap // (KW * KH)
    off = _wide(co, BIG) * stride_c + _wide(td * DD, BIG) * stride_d + _wide(th * DH, BIG) * stride_h \
        + _wide(tw * DW, BIG) * stride_w
    return off, co, td, th, tw


@triton.jit
def _grad_step(acc, a, b, ROUND_A: tl.constexpr, ROUND_B: tl.constexpr, TWO_LEVEL: tl.constexpr,
               PRECISION: tl.constexpr):
    """acc += a @ b, the gradient kernels' K step, operands optionally TF32-rounded (DY_ROUNDED: dY's copy already)."""
    if ROUND_A:
        a = _round_tf32(a)
    if ROUND_B:
        b = _round_tf32(b)
    return _mma_step(acc, a, b, False, TWO_LEVEL, PRECISION)


@triton.jit
def _spatial(s, H, W):
    """Position s = (id * H + ih) * W + iw of a batch element -> (id, ih, iw)."""
    return s // (W * H), (s // W) % H, s % W


@triton.jit
def dy_pad_kernel(
    dy_ptr, dyp_ptr, PLANE, CHUNKS, C, OD, OH, OW, LD, LW, PD, PH, PW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    CL: tl.constexpr, ROUND_TF32: tl.constexpr, BIG: tl.constexpr, BLOCK: tl.constexpr,
):
    """dY zero-padded (data at (PD, PH, PW)), contiguous NCDHW or (CL) channels-last, each element written once
    (ROUND_TF32: rounded); BLOCK elements of a plane a program, as a head's rows are too short for row tiles."""
    pid = _wide(tl.program_id(0), BIG)
    plane = pid // CHUNKS
    j = (pid - plane * CHUNKS) * BLOCK + tl.arange(0, BLOCK)
    ok = j < PLANE
    d = plane % LD
    t = plane // LD
    if CL:
        nb = t
        row = LW * C
        h = j // row
        r = j - h * row
        w = r // C
        col = _wide(r - w * C, BIG) * stride_yc
    else:
        nb = t // C
        h = j // LW
        w = j - h * LW
        col = _wide(t % C, BIG) * stride_yc
    od = d - PD
    oh = h - PH
    ow = w - PW
    # The plane's depth test once (tl.where: the interpreter rejects scalar & block).
    inside = tl.where((od >= 0) & (od < OD), ok & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW), False)
    src = _wide(nb, BIG) * stride_yn + _wide(od, BIG) * stride_yd + _wide(oh, BIG) * stride_yh \
        + _wide(ow, BIG) * stride_yw + col
    v = tl.load(dy_ptr + src, mask=inside, other=0.0).to(dyp_ptr.dtype.element_ty)
    if ROUND_TF32:
        v = _round_tf32(v)
    tl.store(dyp_ptr + (plane * PLANE + j), v, mask=ok)


@triton.jit
def head_dgrad_kernel(
    dyp_ptr, wp_ptr, dx_ptr, S, CIN_G, COUT_G, KTOT, D, H, W, KH, KW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw, stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    SD, SH, SW, DD, DH, DW, tiles_s, tiles_n,
    PRECISION: tl.constexpr, ROUND_TF32: tl.constexpr, DY_ROUNDED: tl.constexpr, TWO_LEVEL: tl.constexpr,
    BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program -> (batch element, position tile, Cin tile), Cin tile fastest; axis 1 is the group.
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    pid_n = pid % tiles_n
    t = pid // tiles_n
    pid_s = t % tiles_s
    nb = t // tiles_s

    offs_s = pid_s * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_s < S
    id_, ih, iw = _spatial(offs_s, H, W)
    # Padded dY position of tap 0: i * s per dimension.
    y_m = _wide(id_ * SD, BIG) * stride_yd + _wide(ih * SH, BIG) * stride_yh + _wide(iw * SW, BIG) * stride_yw
    y_g = dyp_ptr + nb.to(tl.int64) * stride_yn + (grp * COUT_G).to(tl.int64) * stride_yc

    offs_ci = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_ok = offs_ci < CIN_G
    # The weight packed as [G, KTOT, CIN_G] (k-major rows, ci contiguous: vector loads).
    w_g = wp_ptr + grp.to(tl.int64) * KTOT * CIN_G

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KTOT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < KTOT
        y_k, co, td, th, tw = _tap_offsets(k, COUT_G, KH, KW, DD, DH, DW, stride_yc, stride_yd, stride_yh,
                                           stride_yw, BIG)
        # The gather built as [K, M] and transposed: Triton runs lanes along the last axis.
        a_tile = tl.trans(tl.load(y_g + (y_k[:, None] + y_m[None, :]), mask=k_ok[:, None] & m_ok[None, :],
                                  other=0.0))
        b_tile = tl.load(w_g + (k[:, None] * CIN_G + offs_ci[None, :]), mask=k_ok[:, None] & ci_ok[None, :],
                         other=0.0)
        # TWO_LEVEL (exact-grade fp32): each K block's dot summed on its own, then added.
        acc = _grad_step(acc, a_tile, b_tile, ROUND_TF32 and not DY_ROUNDED, ROUND_TF32, TWO_LEVEL, PRECISION)

    # Stored as [channel, position] at s * the W stride; a tile inside S without the position mask.
    x_m = _wide(offs_s, BIG) * stride_xw
    x_c = _wide(offs_ci, BIG) * stride_xc
    x_g = dx_ptr + nb.to(tl.int64) * stride_xn + (grp * CIN_G).to(tl.int64) * stride_xc
    out = tl.trans(acc).to(dx_ptr.dtype.element_ty)
    if pid_s * BLOCK_M + BLOCK_M <= S:
        tl.store(x_g + (x_c[:, None] + x_m[None, :]), out, mask=ci_ok[:, None])
    else:
        tl.store(x_g + (x_c[:, None] + x_m[None, :]), out, mask=ci_ok[:, None] & m_ok[None, :])


@triton.jit
def head_wgrad_kernel(
    x_ptr, dyp_ptr, part_ptr, NB, S, CIN_G, COUT_G, KTOT, D, H, W, KH, KW, GROUPS, SPLITS,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw, stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    SD, SH, SW, DD, DH, DW, tiles_ci, tiles_k,
    PRECISION: tl.constexpr, ROUND_TF32: tl.constexpr, DY_ROUNDED: tl.constexpr, TWO_LEVEL: tl.constexpr,
    BIG: tl.constexpr, LANES_ON_M: tl.constexpr, FLAT_X: tl.constexpr,
    BLOCK_CI: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # Program -> (split, Cin tile, (tap, channel) tile), the last fastest; axis 1 is the group.
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    pid_k = pid % tiles_k
    t = pid // tiles_k
    pid_ci = t % tiles_ci
    split = t // tiles_ci
    # Steps of BLOCK_P positions of one batch element, so X offsets are s * stride_xw (FLAT_X).
    steps_s = tl.cdiv(S, BLOCK_P)
    steps = steps_s.to(tl.int64) * NB  # steps x split can pass 2^31
    s_lo = ((steps * split) // SPLITS).to(tl.int32)
    s_hi = ((steps * (split + 1)) // SPLITS).to(tl.int32)

    offs_ci = pid_ci * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = offs_ci < CIN_G
    x_g = x_ptr + (grp * CIN_G).to(tl.int64) * stride_xc
    x_c = _wide(offs_ci, BIG) * stride_xc
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < KTOT
    y_k, co, td, th, tw = _tap_offsets(k, COUT_G, KH, KW, DD, DH, DW, stride_yc, stride_yd, stride_yh, stride_yw,
                                       BIG)
    y_g = dyp_ptr + (grp * COUT_G).to(tl.int64) * stride_yc

    acc = tl.zeros((BLOCK_CI, BLOCK_K), dtype=tl.float32)
    for step in range(s_lo, s_hi):
        nb = step // steps_s
        s0 = (step - nb * steps_s) * BLOCK_P
        p = s0 + tl.arange(0, BLOCK_P)
        p_ok = p < S
        id_, ih, iw = _spatial(p, H, W)
        if FLAT_X:
            x_p = _wide(p, BIG) * stride_xw
        else:
            x_p = _wide(id_, BIG) * stride_xd + _wide(ih, BIG) * stride_xh + _wide(iw, BIG) * stride_xw
        x_n = x_g + nb.to(tl.int64) * stride_xn
        # A step wholly inside S loads without the position mask (module docstring).
        if s0 + BLOCK_P <= S:
            x_tile = tl.load(x_n + (x_c[:, None] + x_p[None, :]), mask=ci_ok[:, None], other=0.0)
        else:
            x_tile = tl.load(x_n + (x_c[:, None] + x_p[None, :]), mask=ci_ok[:, None] & p_ok[None, :], other=0.0)
        y_p = _wide(nb, BIG) * stride_yn + _wide(id_ * SD, BIG) * stride_yd + _wide(ih * SH, BIG) * stride_yh \
            + _wide(iw * SW, BIG) * stride_yw
        if LANES_ON_M:  # the dY gather with lanes along positions (see head_dgrad_kernel; timed)
            y_tile = tl.trans(tl.load(y_g + (y_k[:, None] + y_p[None, :]), mask=k_ok[:, None] & p_ok[None, :],
                                      other=0.0))
        else:
            y_tile = tl.load(y_g + (y_p[:, None] + y_k[None, :]), mask=p_ok[:, None] & k_ok[None, :], other=0.0)
        # TWO_LEVEL: each step's BLOCK_P-term dot summed on its own, then added (long reductions).
        acc = _grad_step(acc, x_tile, y_tile, ROUND_TF32, ROUND_TF32 and not DY_ROUNDED, TWO_LEVEL, PRECISION)

    # part[split, grp, ci, k], contiguous.
    base = (split * GROUPS + grp).to(tl.int64) * CIN_G * KTOT
    dst = part_ptr + base + offs_ci[:, None].to(tl.int64) * KTOT + k[None, :]
    tl.store(dst, acc, mask=ci_ok[:, None] & k_ok[None, :])
