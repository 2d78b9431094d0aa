"""Triton kernels of the backward of an output head: a transposed convolution with few output
channels per group (pure ``@triton.jit``).

A head reads a wide input (Cin/g >= 8) and writes a thin output (Cout/g <= 15). With
``o = i*s - p + t*d`` per dimension (``convt3d.core.params``) its gradients are

    dX[n, g*Cin/g + ci, i]   = sum_{t, co} dY[n, g*Cout/g + co, i*s - p + t*d] * W[g*Cin/g + ci, co, t]
    dW[g*Cin/g + ci, co, t]  = sum_{n, i}  X[n, g*Cin/g + ci, i] * dY[n, g*Cout/g + co, i*s - p + t*d]

(terms whose dY position falls outside dY are zero). The general kernels (``dgrad_bwd``,
``wgrad_bwd``) step through the taps one at a time with K (dX) or N (dW) = Cout/g per step, padded
to 16 for ``tl.dot``: at one output channel 15/16 of every MMA is padding, and the wide operand
(X for dW) is read once per tap -- 64 times for a 4x4x4 kernel. Here the (tap, output channel)
pairs form one flat GEMM dimension, ``k = tap * Cout/g + co`` (taps x Cout/g: 64 for a 64 -> 1
k4 head, so one or two MMA steps), and the other dimension is input positions (n, id, ih, iw),
taken in tiles of one batch element: a tile is a run of ``s = (id * H + ih) * W + iw`` whose
offsets are ``s * stride_w`` where the tensor's D, H, W are walked by one stride (NCDHW or
channels-last), so in NCDHW the compiler sees runs of positions and moves them as 16-byte
vectors. A tile wholly inside S = D*H*W is moved without the position mask, whose runs would
otherwise end at any element (S is rarely a multiple of 16: 78408 on the VQ-VAE head). Positions
flattened over the batch instead hide those runs: the stores then use a fraction of each
32-byte sector.

* ``head_dgrad_kernel``: M = positions, N = Cin/g, K = taps x Cout/g. The A tile is a gather of
  dY (a few MB for a head: it stays in L2), B the weight packed by the launcher as ``[G, K,
  Cin/g]`` (rows contiguous along Cin: vector loads); each dX element is written once (no
  atomics). dX is the launcher's, NCDHW or channels-last.
* ``head_wgrad_kernel``: M = Cin/g, N = taps x Cout/g, K = positions, split into SPLITS ranges.
  One program reads its range of X (any strides; ``FLAT_X`` where walked by one stride) once for
  every tap and writes an fp32 partial ``part[split, g, ci, k]``; the launcher adds the splits
  in a fixed order (deterministic).

dY is read from a zero-padded copy (``dyp``, made by ``dy_pad_kernel`` in one launch, a few MB;
at TF32 rounded to TF32 there, once per element, so that the kernels round only the other operand,
``DY_ROUNDED``, instead of rounding dY at every load): its data sits at offset
``p`` along each dimension, so the dY position of (i, t) is ``i*s + t*d`` in the copy, always
inside it, and the gather needs no bounds test -- its offset is a sum of a part per position and
a part per (tap, channel), and its mask a product of a position mask and a (tap, channel) mask.
(Testing the three dimensions of every gathered element against dY's bounds instead holds six
comparisons and three 2-D index tensors live per element, which spills on every dX tile.) Offsets are 32-bit where the tensors they index
span fewer than 2^31 elements (``BIG`` False, the launcher's test), 64-bit otherwise.
"""
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
    """(tap, channel) index k -> its offset in the padded dY (t*d along each dimension, plus the
    channel), and its (co, td, th, tw)."""
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
    """acc += a @ b, the K step of the gradient kernels. At TF32 the operands are rounded to
    nearest TF32 (cuDNN's numerics); the callers skip dY's rounding where its copy was rounded
    when it was made (their DY_ROUNDED)."""
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
    dy_ptr, dyp_ptr,
    PLANE, CHUNKS, C, OD, OH, OW,
    LD, LW, PD, PH, PW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    CL: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    BIG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The zero-padded copy of dY (``dyp``: dY's data at offset (PD, PH, PW), zeros around it),
    contiguous, NCDHW or (``CL``) channels-last, in dyp's dtype, every element written once (data
    or zero), and at TF32 (``ROUND_TF32``) rounded to TF32 here, once, so that the gradient kernels
    read dY ready for the tensor cores. A program writes BLOCK consecutive elements of one plane
    of the copy (CHUNKS programs a plane): an (n, c, d) plane of LH x LW positions in NCDHW, an
    (n, d) plane of LH x LW x C (position, channel) pairs in channels-last, PLANE elements. Whole
    planes rather than rows: a head's rows are short (C = 1-15 channels; 66 positions for the
    3-D GAN head), and row tiles of a power-of-two width left up to half their lanes idle."""
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
    # The plane's depth test is one per program (a scalar: tl.where, which Triton's interpreter
    # takes where `&` between a scalar and a block it does not).
    inside = tl.where((od >= 0) & (od < OD), ok & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW), False)
    src = _wide(nb, BIG) * stride_yn + _wide(od, BIG) * stride_yd + _wide(oh, BIG) * stride_yh \
        + _wide(ow, BIG) * stride_yw + col
    v = tl.load(dy_ptr + src, mask=inside, other=0.0).to(dyp_ptr.dtype.element_ty)
    if ROUND_TF32:
        v = _round_tf32(v)
    tl.store(dyp_ptr + (plane * PLANE + j), v, mask=ok)


@triton.jit
def head_dgrad_kernel(
    dyp_ptr, wp_ptr, dx_ptr,
    S, CIN_G, COUT_G, KTOT,
    D, H, W,
    KH, KW,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    SD, SH, SW,
    DD, DH, DW,
    tiles_s, tiles_n,
    PRECISION: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    DY_ROUNDED: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program -> (batch element, position tile of its S = D*H*W, Cin tile), Cin tile fastest:
    # programs that gather the same dY window run together. Axis 1 is the group.
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
        # The gather is built as [K, M] and transposed: where no axis is provably contiguous
        # (positions step by the stride, (tap, channel) pairs by a division), Triton runs the
        # lanes along the last axis, so neighbouring lanes read dY elements s apart instead of
        # other rows; faster than an [M, K] gather on every head timed.
        a_tile = tl.trans(tl.load(y_g + (y_k[:, None] + y_m[None, :]), mask=k_ok[:, None] & m_ok[None, :],
                                  other=0.0))
        b_tile = tl.load(w_g + (k[:, None] * CIN_G + offs_ci[None, :]), mask=k_ok[:, None] & ci_ok[None, :],
                         other=0.0)
        # TWO_LEVEL (exact-grade fp32): each K block's dot summed on its own, then added.
        acc = _grad_step(acc, a_tile, b_tile, ROUND_TF32 and not DY_ROUNDED, ROUND_TF32, TWO_LEVEL, PRECISION)

    # Stored as [channel, position], a position's offset s * the W stride (dX is the launcher's,
    # walked by one stride): in NCDHW runs of positions, in channels-last runs of channels. A
    # tile wholly inside S stores without the position mask (16-byte vectors; module docstring).
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
    x_ptr, dyp_ptr, part_ptr,
    NB, S, CIN_G, COUT_G, KTOT,
    D, H, W,
    KH, KW, GROUPS, SPLITS,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    SD, SH, SW,
    DD, DH, DW,
    tiles_ci, tiles_k,
    PRECISION: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    DY_ROUNDED: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    BIG: tl.constexpr,
    LANES_ON_M: tl.constexpr,
    FLAT_X: tl.constexpr,
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
    # Reduction steps: BLOCK_P positions of one batch element each (steps_s per element), so that
    # a step's X offsets are s * stride_xw where X is walked by one stride (FLAT_X).
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
        # TWO_LEVEL (exact-grade fp32): a head's reduction runs over every input position (524288
        # on a 16 x 32^3 GAN head); each step's BLOCK_P-term dot is summed on its own, then added.
        acc = _grad_step(acc, x_tile, y_tile, ROUND_TF32, ROUND_TF32 and not DY_ROUNDED, TWO_LEVEL, PRECISION)

    # part[split, grp, ci, k], contiguous.
    base = (split * GROUPS + grp).to(tl.int64) * CIN_G * KTOT
    dst = part_ptr + base + offs_ci[:, None].to(tl.int64) * KTOT + k[None, :]
    tl.store(dst, acc, mask=ci_ok[:, None] & k_ok[None, :])
