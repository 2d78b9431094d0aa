"""Triton kernels of the backward of an output head: a transposed convolution with few output
channels per group (pure ``@triton.jit``).

A head reads a wide input (Cin/g >= 8) and writes a thin output (Cout/g <= 15). With
``o = i*s - p + t*d`` per dimension (``convt3d.params``) its gradients are

    dX[n, g*Cin/g + ci, i]   = sum_{t, co} dY[n, g*Cout/g + co, i*s - p + t*d] * W[g*Cin/g + ci, co, t]
    dW[g*Cin/g + ci, co, t]  = sum_{n, i}  X[n, g*Cin/g + ci, i] * dY[n, g*Cout/g + co, i*s - p + t*d]

(terms whose dY position falls outside dY are zero). The general kernels (``dgrad_bwd``,
``wgrad_bwd``) step through the taps one at a time with K (dX) or N (dW) = Cout/g per step, padded
to 16 for ``tl.dot``: at one output channel 15/16 of every MMA is padding, and the wide operand
(X for dW) is read once per tap -- 64 times for a 4x4x4 kernel. Here the (tap, output channel)
pairs form one flat GEMM dimension, ``k = tap * Cout/g + co`` (taps x Cout/g: 64 for a 64 -> 1
k4 head, so one or two MMA steps), and the positions are flattened over (n, id, ih, iw):

* ``head_dgrad_kernel``: M = N*D*H*W positions, N = Cin/g, K = taps x Cout/g. The A tile is a
  gather of dY (a few MB for a head: it stays in L2), B is read from the weight in place; each
  dX element is written once (no atomics).
* ``head_wgrad_kernel``: M = Cin/g, N = taps x Cout/g, K = positions, split into SPLITS ranges.
  One program reads its range of X once for every tap and writes an fp32 partial
  ``part[split, g, ci, k]``; the launcher adds the splits in a fixed order (deterministic).

Addresses: a 64-bit base per position (``n*stride_n + (i*s - p)*stride``, computed once per tile)
plus a 64-bit offset per (tap, channel) (``co*stride_c + t*d*stride``); the masks test each
dimension of ``i*s - p + t*d`` against dY's size. The launcher checks that N*D*H*W fits in 32 bits.
"""
import triton
import triton.language as tl

from .phase_gemm import _round_tf32


@triton.jit
def _tap_offsets(k, k_ok, COUT_G, KH, KW, DD, DH, DW, stride_c, stride_d, stride_h, stride_w):
    """(tap, channel) index k -> its dY offset (64-bit) and its per-dimension shifts t*d."""
    co = k % COUT_G
    tap = k // COUT_G
    tw = tap % KW
    th = (tap // KW) % KH
    td = tap // (KW * KH)
    sd = tl.where(k_ok, td * DD, 0)
    sh = tl.where(k_ok, th * DH, 0)
    sw = tl.where(k_ok, tw * DW, 0)
    off = co.to(tl.int64) * stride_c + sd.to(tl.int64) * stride_d + sh.to(tl.int64) * stride_h \
        + sw.to(tl.int64) * stride_w
    return off, sd, sh, sw, co, td, th, tw


@triton.jit
def _positions(p, D, H, W):
    """Flattened position -> (n, id, ih, iw)."""
    iw = p % W
    t = p // W
    ih = t % H
    t = t // H
    id_ = t % D
    nb = t // D
    return nb, id_, ih, iw


@triton.jit
def head_dgrad_kernel(
    dy_ptr, w_ptr, dx_ptr,
    M, CIN_G, COUT_G, KTOT,
    D, H, W,
    OD, OH, OW,
    KH, KW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    stride_wi, stride_wo, stride_wd, stride_wh, stride_ww,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    SD, SH, SW,
    PD, PH, PW,
    DD, DH, DW,
    tiles_n,
    PRECISION: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program -> (position tile, Cin tile), Cin tile fastest: programs that gather the same dY
    # window run together. Axis 1 is the group.
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    pid_n = pid % tiles_n
    pid_m = pid // tiles_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    nb, id_, ih, iw = _positions(offs_m, D, H, W)
    odb = id_ * SD - PD  # output position of tap 0, per dimension
    ohb = ih * SH - PH
    owb = iw * SW - PW
    y_m = dy_ptr + nb.to(tl.int64) * stride_yn + (grp * COUT_G).to(tl.int64) * stride_yc \
        + odb.to(tl.int64) * stride_yd + ohb.to(tl.int64) * stride_yh + owb.to(tl.int64) * stride_yw

    offs_ci = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_ok = offs_ci < CIN_G
    w_n = w_ptr + (grp * CIN_G + offs_ci).to(tl.int64) * stride_wi

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KTOT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < KTOT
        y_k, sd, sh, sw, co, td, th, tw = _tap_offsets(k, k_ok, COUT_G, KH, KW, DD, DH, DW,
                                                       stride_yc, stride_yd, stride_yh, stride_yw)
        od = odb[:, None] + sd[None, :]
        oh = ohb[:, None] + sh[None, :]
        ow = owb[:, None] + sw[None, :]
        a_ok = (m_ok[:, None] & k_ok[None, :] & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH)
                & (ow >= 0) & (ow < OW))
        a_tile = tl.load(y_m[:, None] + y_k[None, :], mask=a_ok, other=0.0)
        w_k = co * stride_wo + td * stride_wd + th * stride_wh + tw * stride_ww
        b_tile = tl.load(w_n[None, :] + w_k[:, None], mask=k_ok[:, None] & ci_ok[None, :], other=0.0)
        if ROUND_TF32:
            # Both operands to nearest TF32, as cuDNN rounds them (tensor cores would truncate).
            a_tile = _round_tf32(a_tile)
            b_tile = _round_tf32(b_tile)
        if TWO_LEVEL:
            # Exact-grade fp32: each K block's dot is summed on its own and then added (as in
            # dgrad_bwd; fma(part, 1, acc) keeps Triton from chaining it into the accumulator).
            acc = tl.fma(tl.dot(a_tile, b_tile, input_precision=PRECISION), 1.0, acc)
        else:
            acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)

    # Store as [channel, position]: for NCDHW dX the threads run along W; for channels-last dX
    # the channel stride is 1.
    x_m = nb.to(tl.int64) * stride_xn + id_.to(tl.int64) * stride_xd + ih.to(tl.int64) * stride_xh \
        + iw.to(tl.int64) * stride_xw
    x_c = (grp * CIN_G + offs_ci).to(tl.int64) * stride_xc
    tl.store(dx_ptr + x_c[:, None] + x_m[None, :], tl.trans(acc).to(dx_ptr.dtype.element_ty),
             mask=ci_ok[:, None] & m_ok[None, :])


@triton.jit
def head_wgrad_kernel(
    x_ptr, dy_ptr, part_ptr,
    M, CIN_G, COUT_G, KTOT,
    D, H, W,
    OD, OH, OW,
    KH, KW, GROUPS, SPLITS,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    SD, SH, SW,
    PD, PH, PW,
    DD, DH, DW,
    tiles_ci, tiles_k,
    PRECISION: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BLOCK_CI: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # Program -> (split, Cin tile, (tap, channel) tile), the last fastest: programs of one split
    # read the same X range (once from DRAM, then from L2). Axis 1 is the group.
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    pid_k = pid % tiles_k
    t = pid // tiles_k
    pid_ci = t % tiles_ci
    split = t // tiles_ci
    steps = tl.cdiv(M, BLOCK_P).to(tl.int64)  # steps x split can pass 2^31
    s_lo = ((steps * split) // SPLITS).to(tl.int32)
    s_hi = ((steps * (split + 1)) // SPLITS).to(tl.int32)

    offs_ci = pid_ci * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = offs_ci < CIN_G
    x_c = x_ptr + (grp * CIN_G + offs_ci).to(tl.int64) * stride_xc
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < KTOT
    y_k, sd, sh, sw, co, td, th, tw = _tap_offsets(k, k_ok, COUT_G, KH, KW, DD, DH, DW,
                                                   stride_yc, stride_yd, stride_yh, stride_yw)
    y_g = dy_ptr + (grp * COUT_G).to(tl.int64) * stride_yc

    acc = tl.zeros((BLOCK_CI, BLOCK_K), dtype=tl.float32)
    for step in range(s_lo, s_hi):
        p = step * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = p < M
        nb, id_, ih, iw = _positions(p, D, H, W)
        x_p = nb.to(tl.int64) * stride_xn + id_.to(tl.int64) * stride_xd + ih.to(tl.int64) * stride_xh \
            + iw.to(tl.int64) * stride_xw
        x_tile = tl.load(x_c[:, None] + x_p[None, :], mask=ci_ok[:, None] & p_ok[None, :], other=0.0)
        odb = id_ * SD - PD
        ohb = ih * SH - PH
        owb = iw * SW - PW
        y_p = nb.to(tl.int64) * stride_yn + odb.to(tl.int64) * stride_yd + ohb.to(tl.int64) * stride_yh \
            + owb.to(tl.int64) * stride_yw
        od = odb[:, None] + sd[None, :]
        oh = ohb[:, None] + sh[None, :]
        ow = owb[:, None] + sw[None, :]
        y_ok = (p_ok[:, None] & k_ok[None, :] & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH)
                & (ow >= 0) & (ow < OW))
        y_tile = tl.load(y_g + y_p[:, None] + y_k[None, :], mask=y_ok, other=0.0)
        if ROUND_TF32:
            x_tile = _round_tf32(x_tile)
            y_tile = _round_tf32(y_tile)
        if TWO_LEVEL:
            # Exact-grade fp32: a head's reduction runs over every input position (524288 on a
            # 16 x 32^3 GAN head); each step's BLOCK_P-term dot is summed on its own, then added.
            acc = tl.fma(tl.dot(x_tile, y_tile, input_precision=PRECISION), 1.0, acc)
        else:
            acc = tl.dot(x_tile, y_tile, acc, input_precision=PRECISION)

    # part[split, grp, ci, k], contiguous.
    base = (split * GROUPS + grp).to(tl.int64) * CIN_G * KTOT
    dst = part_ptr + base + offs_ci[:, None].to(tl.int64) * KTOT + k[None, :]
    tl.store(dst, acc, mask=ci_ok[:, None] & k_ok[None, :])
