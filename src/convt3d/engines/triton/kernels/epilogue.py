"""``apply_epilogue`` runs a compile-time program (``convt3d.core.epilogue``) over an fp32 tile before its store;
imports only ``triton`` (exported verbatim)."""
import triton
import triton.language as tl


@triton.jit
def _tanh(v):
    # tanh from exp(-2|v|): no cancellation for large |v|, and the interpreter has no tanh.
    e = tl.exp(-2.0 * tl.abs(v))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(v < 0, -t, t)


@triton.jit
def _epilogue_step(v, r, c_idx, c_ok, res_ptrs, mask, epi_ptr, ch_ptr, C, i: tl.constexpr, op: tl.constexpr):
    """Step ``i``, code ``op``, on value ``v`` and register ``r`` (a function: unrolled loops bind a constant once)."""
    if op == 1:
        v = v * tl.load(epi_ptr + i)
    if op == 2:
        v = v * tl.load(ch_ptr + i * C + c_idx, mask=c_ok, other=0.0)
    if op == 3:
        v = v + tl.load(epi_ptr + i)
    if op == 4:
        v = v + tl.load(ch_ptr + i * C + c_idx, mask=c_ok, other=0.0)
    if op == 5:
        v = v + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    if op == 6:
        v = tl.maximum(v, tl.load(epi_ptr + i))
    if op == 7:
        v = tl.minimum(v, tl.load(epi_ptr + i))
    if op == 8:
        v = tl.maximum(v, 0.0)
    if op == 9:
        v = tl.where(v > 0, v, v * tl.load(epi_ptr + i))
    if op == 10:
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    if op == 11:
        v = 0.5 * v * (1.0 + _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    if op == 12:
        v = v * tl.sigmoid(v)
    if op == 13:
        v = v * tl.minimum(tl.maximum(v + 3.0, 0.0), 6.0) / 6.0
    if op == 14:
        v = tl.sigmoid(v)
    if op == 15:
        v = _tanh(v)
    if op == 16:
        r = v
    if op == 17:
        v = v * r
    if op == 18:
        v = v + r
    if op == 19:
        v = v / tl.load(epi_ptr + i)
    if op == 20:
        v = v / tl.load(ch_ptr + i * C + c_idx, mask=c_ok, other=1.0)
    if op == 21:
        # Softmax over the channels, axis 0 of the GEMM's [channels, positions] tile, which holds them all.
        e = tl.where(c_ok, tl.exp(v - tl.max(tl.where(c_ok, v, float("-inf")), axis=0, keep_dims=True)), 0.0)
        v = e / tl.sum(e, axis=0, keep_dims=True)
    return v, r


@triton.jit
def apply_epilogue(v, c_idx, c_ok, res_ptrs, mask, epi_ptr, ch_ptr, C, PROG: tl.constexpr):
    """``v`` after ``PROG`` (5 bits a step, ``core.epilogue.encode``); ``c_idx``/``c_ok``: each element's channel and
    validity, broadcastable to ``v``; ``res_ptrs``: the residual (read by a residual step only); ``epi_ptr``: the
    steps' scalars; ``ch_ptr``: the ``[8, C]`` per-channel operands."""
    r = v
    for i in tl.static_range(8):
        v, r = _epilogue_step(v, r, c_idx, c_ok, res_ptrs, mask, epi_ptr, ch_ptr, C, i, (PROG >> (5 * i)) & 31)
    return v
