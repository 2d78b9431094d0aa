"""Finishing kernels (reductions, pooling, normalisations) on contiguous NCDHW (channel ``(offset // DHW) % C``) with
elementwise programs on input (``PRE``) and output (``POST``; ``.epilogue``), and the direct transposed convolution
of few channels with them fused, exported verbatim: they import only ``triton``, ``.epilogue`` and TF32 rounding."""
import triton
import triton.language as tl

from .epilogue import apply_epilogue
from .phase_gemm import _round_tf32


@triton.jit
def _chan(n, mean, m2, nb, mean_b, m2_b):
    """Chan's formula: mean, centred square sum of n values joined by nb more (centred: big means lose no digits)."""
    d = mean_b - mean
    w = nb / (n + nb)
    return mean + d * w, m2 + m2_b + d * d * n * w


@triton.jit
def axis_kernel(x_ptr, out_ptr, w_ptr, b_ptr, pre_s, pre_c, post_s, post_c, R, I, n_iblk,
                stride_o, stride_r, stride_i, DHW, C, C_POST, eps,
                MODE: tl.constexpr, PRE: tl.constexpr, POST: tl.constexpr, HAS_W: tl.constexpr,
                HAS_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """Reduce ``x`` viewed ``[O, R, I]`` over R, a program one o and BLOCK_I values of i: MODE 0-3 (sum, mean, max,
    logsumexp) write ``out[o * I + i]``; 4 (softmax), 5 (layer norm, then ``w``/``b`` by r) reread the row and write at
    ``x``'s offsets. ``C_POST``: the output's channels (1 when the reduction spans them)."""
    pid = tl.program_id(0)
    o = (pid // n_iblk).to(tl.int64)
    i = (pid % n_iblk) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < I
    base = o * stride_o + i.to(tl.int64) * stride_i
    rr = tl.arange(0, BLOCK_R)
    m = tl.full([BLOCK_I], float("-inf"), tl.float32)  # running max
    s = tl.zeros([BLOCK_I], tl.float32)  # sum, softmax denominator or layer norm's mean
    q = tl.zeros([BLOCK_I], tl.float32)  # layer norm's centred sum of squares
    for r0 in range(0, R, BLOCK_R):
        r = r0 + rr
        ok = (r < R)[:, None] & i_ok[None, :]
        off = base[None, :] + r.to(tl.int64)[:, None] * stride_r
        v = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
        v = apply_epilogue(v, (off // DHW) % C, ok, x_ptr + off, ok, pre_s, pre_c, C, PRE)
        if MODE <= 1:
            s += tl.sum(tl.where(ok, v, 0.0), axis=0)
        if MODE == 2:
            m = tl.maximum(m, tl.max(tl.where(ok, v, float("-inf")), axis=0))
        if MODE == 3 or MODE == 4:
            # Online softmax: rescale the sum to the new max (a safe 0 while a column has seen none).
            mx = tl.maximum(m, tl.max(tl.where(ok, v, float("-inf")), axis=0))
            ms = tl.where(mx == float("-inf"), 0.0, mx)
            s = s * tl.exp(m - ms) + tl.sum(tl.where(ok, tl.exp(v - ms[None, :]), 0.0), axis=0)
            m = mx
        if MODE == 5:
            nb = tl.minimum(R - r0, BLOCK_R).to(tl.float32)
            mb = tl.sum(tl.where(ok, v, 0.0), axis=0) / nb
            d = tl.where(ok, v - mb[None, :], 0.0)
            s, q = _chan(r0 * 1.0, s, q, nb, mb, tl.sum(d * d, axis=0))
    s = tl.where(i_ok, s, 1.0)  # columns past I: no division by zero
    if MODE <= 3:
        res = s
        if MODE == 1:
            res = s / R
        if MODE == 2:
            res = m
        if MODE == 3:
            res = m + tl.log(s)
        res = apply_epilogue(res, (base // DHW) % C_POST, i_ok, x_ptr, i_ok, post_s, post_c, C_POST, POST)
        tl.store(out_ptr + o * I + i, res.to(out_ptr.dtype.element_ty), mask=i_ok)
    else:
        ms = tl.where(m == float("-inf"), 0.0, m)
        rstd = 1.0 / tl.sqrt(q / R + eps)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + rr
            ok = (r < R)[:, None] & i_ok[None, :]
            off = base[None, :] + r.to(tl.int64)[:, None] * stride_r
            c = (off // DHW) % C
            v = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
            v = apply_epilogue(v, c, ok, x_ptr + off, ok, pre_s, pre_c, C, PRE)
            if MODE == 4:
                v = tl.exp(v - ms[None, :]) / s[None, :]
            if MODE == 5:
                v = (v - s[None, :]) * rstd[None, :]
                if HAS_W:
                    v = v * tl.load(w_ptr + r, mask=r < R, other=0.0).to(tl.float32)[:, None]
                if HAS_B:
                    v = v + tl.load(b_ptr + r, mask=r < R, other=0.0).to(tl.float32)[:, None]
            v = apply_epilogue(v, c, ok, x_ptr + off, ok, post_s, post_c, C, POST)
            tl.store(out_ptr + off, v.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def moments_kernel(x_ptr, part_ptr, pre_s, pre_c, L, K, CHUNK, DHW, C,
                   PRE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``row * K + k``: mean and centred sum of squares of chunk k (CHUNK of L) into ``part[2 * pid + 0/1]``."""
    pid = tl.program_id(0)
    row = (pid // K).to(tl.int64)
    start = (pid % K) * CHUNK
    end = tl.minimum(start + CHUNK, L)
    mean = 0.0
    m2 = 0.0
    for j0 in range(start, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < end
        off = row * L + j
        v = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
        v = apply_epilogue(v, (off // DHW) % C, ok, x_ptr + off, ok, pre_s, pre_c, C, PRE)
        nb = tl.minimum(end - j0, BLOCK).to(tl.float32)
        mb = tl.sum(tl.where(ok, v, 0.0), axis=0) / nb
        d = tl.where(ok, v - mb, 0.0)
        mean, m2 = _chan((j0 - start) * 1.0, mean, m2, nb, mb, tl.sum(d * d, axis=0))
    tl.store(part_ptr + 2 * pid, mean)
    tl.store(part_ptr + 2 * pid + 1, m2)


@triton.jit
def stats_kernel(part_ptr, a_ptr, b_ptr, w_ptr, bias_ptr, rm_ptr, rv_ptr, J, SJ, K, L, CHUNK, C, CPU,
                 eps, momentum, TRAIN: tl.constexpr, UPDATE: tl.constexpr, HAS_W: tl.constexpr,
                 HAS_B: tl.constexpr, RAW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Unit ``u`` (a BatchNorm channel, a GroupNorm (n, group)) joins the partials of rows ``j * SJ + u`` (j < J) and
    writes ``a``, ``b`` (``x * a + b`` normalises) at ``u * CPU + cc``, channel ``(u * CPU + cc) % C``. TRAIN: from
    the partials (UPDATE: running statistics follow, unbiased variance); else from ``rm``/``rv``. RAW partials are
    sums of values and of their squares, of chunks of any size that make L a row: taken as L / K values each."""
    u = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    c_ok = cc < CPU
    idx = u * CPU + cc
    ch = idx % C
    if TRAIN:
        n = 0.0
        mean = 0.0
        m2 = 0.0
        for t0 in range(0, J * K, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            ok = t < J * K
            k = t % K
            p = ((t // K) * SJ + u).to(tl.int64) * K + k
            cnt = tl.where(ok, tl.minimum(CHUNK, L - k * CHUNK), 0).to(tl.float32)
            pm = tl.load(part_ptr + 2 * p, mask=ok, other=0.0)
            pq = tl.load(part_ptr + 2 * p + 1, mask=ok, other=0.0)
            if RAW:  # the same n, sum and sum of squares, so the same mean and centred sum (Chan's terms cancel)
                cnt = tl.where(ok, L / K, 0.0)
                pm = pm / (L / K)
                pq = pq - cnt * pm * pm
            nb = tl.sum(cnt, axis=0)
            mb = tl.sum(cnt * pm, axis=0) / nb
            mean, m2 = _chan(n, mean, m2, nb, mb, tl.sum(pq + cnt * (pm - mb) * (pm - mb), axis=0))
            n += nb
        var = m2 / n
        if UPDATE:
            rm = tl.load(rm_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
            rv = tl.load(rv_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
            rm = (1.0 - momentum) * rm + momentum * mean
            rv = (1.0 - momentum) * rv + momentum * (m2 / (n - 1.0))
            tl.store(rm_ptr + ch, rm.to(rm_ptr.dtype.element_ty), mask=c_ok)
            tl.store(rv_ptr + ch, rv.to(rv_ptr.dtype.element_ty), mask=c_ok)
    else:
        mean = tl.load(rm_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
        var = tl.load(rv_ptr + ch, mask=c_ok, other=1.0).to(tl.float32)
    a = 1.0 / tl.sqrt(var + eps) + tl.zeros([BLOCK_C], tl.float32)
    if HAS_W:
        a = a * tl.load(w_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
    b = -mean * a
    if HAS_B:
        b = b + tl.load(bias_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(a_ptr + idx, a, mask=c_ok)
    tl.store(b_ptr + idx, b, mask=c_ok)


@triton.jit
def affine_kernel(x_ptr, out_ptr, a_ptr, b_ptr, pre_s, pre_c, post_s, post_c, numel, DHW, C, A_N,
                  PRE: tl.constexpr, POST: tl.constexpr, BLOCK: tl.constexpr):
    """``out = post(a[s] * pre(x) + b[s])``, ``s`` the (n, c) row modulo ``A_N`` (C: per channel; N * C: per sample)."""
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = off < numel
    nc = off // DHW
    c = nc % C
    v = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
    v = apply_epilogue(v, c, ok, x_ptr + off, ok, pre_s, pre_c, C, PRE)
    v = v * tl.load(a_ptr + nc % A_N, mask=ok, other=0.0) + tl.load(b_ptr + nc % A_N, mask=ok, other=0.0)
    v = apply_epilogue(v, c, ok, x_ptr + off, ok, post_s, post_c, C, POST)
    tl.store(out_ptr + off, v.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def pool_kernel(x_ptr, out_ptr, pre_s, pre_c, post_s, post_c, C, D, H, W, OD, OH, OW, n_blk, SD, SH, SW,
                KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, MAX: tl.constexpr,
                PRE: tl.constexpr, POST: tl.constexpr, BLOCK: tl.constexpr):
    """Max (MAX) or average pooling, no padding, BLOCK positions of one (n, c) plane a program; ``pre`` on every window
    element, ``post`` on the result."""
    pid = tl.program_id(0)
    plane = (pid // n_blk).to(tl.int64)
    p = (pid % n_blk) * BLOCK + tl.arange(0, BLOCK)
    ok = p < OD * OH * OW
    c = plane % C
    od = p // (OH * OW)
    oh = (p // OW) % OH
    ow = p % OW
    base = plane * D * H * W + ((od * SD) * H + oh * SH).to(tl.int64) * W + ow * SW
    acc = tl.full([BLOCK], float("-inf") if MAX else 0.0, tl.float32)
    for kd in range(KD):
        for kh in range(KH):
            for kw in range(KW):
                ptrs = x_ptr + base + (kd * H + kh) * W + kw
                v = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
                v = apply_epilogue(v, c, c < C, ptrs, ok, pre_s, pre_c, C, PRE)
                acc = tl.maximum(acc, v) if MAX else acc + v
    if not MAX:
        acc = acc / (KD * KH * KW)
    acc = apply_epilogue(acc, c, c < C, x_ptr, ok, post_s, post_c, C, POST)
    tl.store(out_ptr + plane * OD * OH * OW + p, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _direct_offset(x_ptr, w_ptr, x_base, qd, qh, qw, q_ok, c, c_ok, C_in, D, H, W, C_out,
                   RD: tl.constexpr, RH: tl.constexpr, RW: tl.constexpr,
                   KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SD: tl.constexpr, SH: tl.constexpr,
                   SW: tl.constexpr, PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DD: tl.constexpr,
                   DH: tl.constexpr, DW: tl.constexpr, TF32: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """The layer's output at offset (RD, RH, RW) of cells (qd, qh, qw) (output ``q * S + R``), all channels: only the
    taps j with ``R + P - j * dilation`` a multiple of S reach it, from input ``q + (R + P - j * dilation) // S``, so
    the taps are chosen at compile time and each is an outer product of an input column and a weight row. The input
    channels are a run-time loop: unrolled, the compiler hoists every load at once and spills."""
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for ci in range(C_in):
        x_c = x_ptr + x_base + ci * D * H * W
        w_c = w_ptr + (ci * C_out + c) * (KD * KH * KW)
        for jd in tl.static_range(KD):
            if (RD + PD - jd * DD) % SD == 0:
                idd = qd + (RD + PD - jd * DD) // SD
                for jh in tl.static_range(KH):
                    if (RH + PH - jh * DH) % SH == 0:
                        ihh = qh + (RH + PH - jh * DH) // SH
                        for jw in tl.static_range(KW):
                            if (RW + PW - jw * DW) % SW == 0:
                                iww = qw + (RW + PW - jw * DW) // SW
                                ok = q_ok & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H) & (iww >= 0) & (iww < W)
                                xv = tl.load(x_c + (idd * H + ihh) * W + iww, mask=ok, other=0.0).to(tl.float32)
                                wv = tl.load(w_c + (jd * KH + jh) * KW + jw, mask=c_ok, other=0.0).to(tl.float32)
                                if TF32:
                                    xv = _round_tf32(xv)
                                    wv = _round_tf32(wv)
                                acc += xv[:, None] * wv[None, :]
    return acc


@triton.jit
def _direct_tail(v, c, c_ok, cr, pos_ok, mid_s, mid_c, post_s, post_c, C_out, C_res,
                 SOFTMAX: tl.constexpr, RED: tl.constexpr, MID: tl.constexpr, POST: tl.constexpr,
                 POST_HERE: tl.constexpr):
    """After pooling: softmax over the channels, ``mid``, a reduction over them (RED 1-3: sum, max, logsumexp, into
    channel ``cr`` = [0]), then ``post`` where it is not left to the mean (POST_HERE)."""
    ok = pos_ok[:, None] & c_ok[None, :]
    if SOFTMAX:
        m = tl.max(tl.where(c_ok[None, :], v, float("-inf")), axis=1)
        e = tl.where(c_ok[None, :], tl.exp(v - m[:, None]), 0.0)
        v = e / tl.sum(e, axis=1)[:, None]
    v = apply_epilogue(v, c[None, :], ok, mid_s, ok, mid_s, mid_c, C_out, MID)
    if RED == 1:
        v = tl.sum(tl.where(c_ok[None, :], v, 0.0), axis=1)[:, None]
    if RED == 2:
        v = tl.max(tl.where(c_ok[None, :], v, float("-inf")), axis=1)[:, None]
    if RED == 3:
        m = tl.max(tl.where(c_ok[None, :], v, float("-inf")), axis=1)
        v = (m + tl.log(tl.sum(tl.where(c_ok[None, :], tl.exp(v - m[:, None]), 0.0), axis=1)))[:, None]
    if POST_HERE:
        ok = pos_ok[:, None] & (cr < C_res)[None, :]
        v = apply_epilogue(v, cr[None, :], ok, post_s, ok, post_s, post_c, C_res, POST)
    return v


@triton.jit
def direct_kernel(x_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, pre_s, pre_c, mid_s, mid_c, post_s, post_c,
                  C_in, D, H, W, OD, OH, OW, QD, QH, QW, GD, GH, GW, MD, MH, MW, n_qblk, C_out, C_res, inv_count,
                  KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                  SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PD: tl.constexpr, PH: tl.constexpr,
                  PW: tl.constexpr, DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                  HAS_B: tl.constexpr, TF32: tl.constexpr, POOL: tl.constexpr, SOFTMAX: tl.constexpr,
                  RED: tl.constexpr, MEAN: tl.constexpr, STATS: tl.constexpr, PRE: tl.constexpr,
                  MID: tl.constexpr, POST: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """A transposed convolution of few channels (NCDHW, groups 1), a program BLOCK_P cells of sample n's grid
    (GD, GH, GW) (a cell: M x S outputs per dim, M stride spans) by all output channels, ``pre`` on each output
    element, then per cell a max (POOL 1) or average (POOL 2) over it or (POOL 0, M 1) each output alone, then
    ``_direct_tail``; the cells in (QD, QH, QW) are the result's. Stores the result, or (MEAN) the block's sum of it
    times ``inv_count`` at ``out[(n * C_res + c) * n_qblk + block]``; STATS: the block's sums of every output element
    and of its square at ``sum[2 * ((n * C_out + c) * n_qblk + block) + 0/1]`` (the grid then covers the output)."""
    pid = tl.program_id(0)
    n = pid // n_qblk
    qb = pid % n_qblk
    q = qb * BLOCK_P + tl.arange(0, BLOCK_P)
    g_ok = q < GD * GH * GW
    qd = q // (GH * GW)
    qh = (q // GW) % GH
    qw = q % GW
    q_ok = g_ok & (qd < QD) & (qh < QH) & (qw < QW)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C_out
    x_base = n.to(tl.int64) * C_in * D * H * W
    if POOL > 0:
        out_base = out_ptr + n.to(tl.int64) * C_res * (QD * QH * QW)
    else:
        out_base = out_ptr + n.to(tl.int64) * C_res * (OD * OH * OW)
    cr = tl.arange(0, BLOCK_R)  # the result's channels: all, or the one a reduction leaves
    cr_ok = cr < C_res
    bias = tl.zeros([BLOCK_C], tl.float32)
    if HAS_B:
        bias = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    ok = g_ok[:, None] & c_ok[None, :]
    total = tl.zeros([BLOCK_R], tl.float32)
    s1 = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)  # STATS: sums per cell, reduced once at the end
    s2 = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    pooled = tl.full([BLOCK_P, BLOCK_C], float("-inf") if POOL == 1 else 0.0, tl.float32)
    for m in range(MD * MH * MW):  # the cell's stride spans
        sd = qd * MD + m // (MH * MW)
        sh = qh * MH + (m // MW) % MH
        sw = qw * MW + m % MW
        for rd in tl.static_range(SD):
            for rh in tl.static_range(SH):
                for rw in tl.static_range(SW):
                    od = sd * SD + rd
                    oh = sh * SH + rh
                    ow = sw * SW + rw
                    o_ok = g_ok & (od < OD) & (oh < OH) & (ow < OW)
                    v = _direct_offset(x_ptr, w_ptr, x_base, sd, sh, sw, o_ok if STATS else g_ok, c, c_ok, C_in, D, H,
                                       W, C_out, rd, rh, rw, KD, KH, KW, SD, SH, SW, PD, PH, PW, DD, DH, DW, TF32,
                                       BLOCK_P, BLOCK_C)
                    v = apply_epilogue(v + bias[None, :], c[None, :], ok, pre_s, ok, pre_s, pre_c, C_out, PRE)
                    if STATS:  # an average pool's sums are the plain ones
                        s2 += v * v
                        if POOL != 2:
                            s1 += v
                    if POOL == 1:
                        pooled = tl.maximum(pooled, v)
                    if POOL == 2:
                        pooled += v
                    if POOL == 0:
                        r = _direct_tail(v, c, c_ok, cr, o_ok, mid_s, mid_c, post_s, post_c, C_out, C_res, SOFTMAX,
                                         RED, MID, POST, MEAN == 0)
                        st = o_ok[:, None] & cr_ok[None, :]
                        if MEAN:
                            total += tl.sum(tl.where(st, r, 0.0), axis=0)
                        else:
                            o = (od * OH + oh) * OW + ow
                            tl.store(out_base + cr[None, :] * (OD * OH * OW) + o[:, None],
                                     r.to(out_ptr.dtype.element_ty), mask=st)
    if STATS:  # an output past the layer's reads no input (a mask, not a select: fewer registers): pre(bias) each
        if POOL == 2:
            s1 = pooled
        n_in = (tl.minimum(OD - qd * (MD * SD), MD * SD) * tl.minimum(OH - qh * (MH * SH), MH * SH)
                * tl.minimum(OW - qw * (MW * SW), MW * SW))
        past = (BLOCK_P * MD * SD * MH * SH * MW * SW - tl.sum(tl.where(g_ok, n_in, 0), axis=0)).to(tl.float32)
        vb = tl.sum(apply_epilogue(bias[None, :], c[None, :], c_ok[None, :], pre_s, c_ok[None, :], pre_s, pre_c,
                                   C_out, PRE), axis=0)
        at = sum_ptr + 2 * ((n * C_out + c).to(tl.int64) * n_qblk + qb)
        tl.store(at, tl.sum(s1, axis=0) - past * vb, mask=c_ok)
        tl.store(at + 1, tl.sum(s2, axis=0) - past * vb * vb, mask=c_ok)
    if POOL > 0:
        q = (qd * QH + qh) * QW + qw
        if POOL == 2:
            pooled = pooled / (SD * SH * SW * MD * MH * MW)
        r = _direct_tail(pooled, c, c_ok, cr, q_ok, mid_s, mid_c, post_s, post_c, C_out, C_res, SOFTMAX, RED,
                         MID, POST, MEAN == 0)
        st = q_ok[:, None] & cr_ok[None, :]
        if MEAN:
            total += tl.sum(tl.where(st, r, 0.0), axis=0)
        else:
            tl.store(out_base + cr[None, :] * (QD * QH * QW) + q[:, None], r.to(out_ptr.dtype.element_ty), mask=st)
    if MEAN:
        tl.store(out_ptr + (n * C_res + cr).to(tl.int64) * n_qblk + qb, total * inv_count, mask=cr_ok)
