"""Triton kernel of the weight gradient of a 3-D transposed convolution (pure ``@triton.jit``).

Per group and tap, dW is a GEMM reducing over batch and input positions; a program computes one
(split, group, tap, Cin tile, Cout tile) block of fp32 partials, added by the launcher in a fixed order.
"""
import triton
import triton.language as tl


@triton.jit
def wgrad_kernel(
    x_ptr, dy_ptr, part_ptr, N, CIN_G, COUT_G, D, H, W, OD, OH, OW, KH, KW, TAPS, GROUPS, SPLITS,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw, stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    SD, SH, SW, PD, PH, PW, DD, DH, DW, tiles_ci, tiles_co, tiles_h, tiles_w,
    PRECISION: tl.constexpr, ROUND_TF32: tl.constexpr, TWO_LEVEL: tl.constexpr,
    BLOCK_CI: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr,
):
    BLOCK_H: tl.constexpr = BLOCK_P // BLOCK_W
    # Program -> (split, group, tap, ci tile, co tile), co tile fastest: one tap's programs share L2.
    pid = tl.program_id(0)
    pid_co = pid % tiles_co
    t = pid // tiles_co
    pid_ci = t % tiles_ci
    t = t // tiles_ci
    tap = t % TAPS
    t = t // TAPS
    grp = t % GROUPS
    split = t // GROUPS
    tw = tap % KW
    th = (tap // KW) % KH
    td = tap // (KW * KH)

    # Input depths whose output depth id*SD - PD + td*DD lies in [0, OD): [id_lo, id_hi).
    num = PD - td * DD
    id_lo = tl.where(num > 0, (num + SD - 1) // SD, 0)
    num2 = OD - 1 + PD - td * DD
    id_hi = tl.where(num2 >= 0, tl.minimum(num2 // SD + 1, D), 0)
    rows = tl.maximum(id_hi - id_lo, 0)
    steps = N * rows * tiles_h * tiles_w
    s_lo = (steps * split) // SPLITS
    s_hi = (steps * (split + 1)) // SPLITS

    offs_ci = pid_ci * BLOCK_CI + tl.arange(0, BLOCK_CI)
    offs_co = pid_co * BLOCK_CO + tl.arange(0, BLOCK_CO)
    ci_ok = offs_ci < CIN_G
    co_ok = offs_co < COUT_G
    x_c = x_ptr + (grp * CIN_G + offs_ci).to(tl.int64) * stride_xc
    y_c = dy_ptr + (grp * COUT_G + offs_co).to(tl.int64) * stride_yc
    offs_p = tl.arange(0, BLOCK_P)
    ph_in = offs_p // BLOCK_W
    pw_in = offs_p % BLOCK_W
    oh_shift = th * DH - PH
    ow_shift = tw * DW - PW
    od_shift = td * DD - PD

    acc = tl.zeros((BLOCK_CI, BLOCK_CO), dtype=tl.float32)
    for step in range(s_lo, s_hi):
        pw_t = step % tiles_w
        r = step // tiles_w
        ph_t = r % tiles_h
        r = r // tiles_h
        id_ = id_lo + r % rows
        nb = r // rows
        ih = ph_t * BLOCK_H + ph_in
        iw = pw_t * BLOCK_W + pw_in
        oh = ih * SH + oh_shift
        ow = iw * SW + ow_shift
        od = id_ * SD + od_shift
        p_ok = (ih < H) & (iw < W) & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
        x_tile = tl.load(x_c[:, None] + (nb.to(tl.int64) * stride_xn + id_.to(tl.int64) * stride_xd)
                         + (ih * stride_xh + iw * stride_xw)[None, :],
                         mask=ci_ok[:, None] & p_ok[None, :], other=0.0)
        y_tile = tl.load(y_c[None, :] + (nb.to(tl.int64) * stride_yn + od.to(tl.int64) * stride_yd)
                         + (oh * stride_yh + ow * stride_yw)[:, None],
                         mask=p_ok[:, None] & co_ok[None, :], other=0.0)
        if ROUND_TF32:
            # Both operands rounded to nearest TF32, as cuDNN does (tensor cores would truncate).
            xr = ((x_tile.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
            x_tile = tl.where(tl.abs(x_tile) < float("inf"), xr, x_tile)
            yr = ((y_tile.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
            y_tile = tl.where(tl.abs(y_tile) < float("inf"), yr, y_tile)
        if TWO_LEVEL:
            # Two-level summation over a long reduction (fma keeps Triton from folding it).
            acc = tl.fma(tl.dot(x_tile, y_tile, input_precision=PRECISION), 1.0, acc)
        else:
            acc = tl.dot(x_tile, y_tile, acc, input_precision=PRECISION)

    # part[split, grp, tap, ci, co], contiguous.
    base = ((split * GROUPS + grp) * TAPS + tap).to(tl.int64) * CIN_G * COUT_G
    dst = part_ptr + base + offs_ci[:, None] * COUT_G + offs_co[None, :]
    tl.store(dst, acc, mask=ci_ok[:, None] & co_ok[None, :])
