"""Finishing steps after a transposed convolution that need statistics or windows (reductions, each plane less its
mean, pooling, BatchNorm, GroupNorm; kernels in ``kernels/finish.py``), all Triton: PyTorch only allocates (and fills
subtract_mean's unit scale). Each takes a 5-D NCDHW float32, float16 or bfloat16 tensor (on the CPU through Triton's
interpreter), computes in float32 and returns its dtype. ``pre`` (a ``core.epilogue`` program) applies to every input
element first, ``post`` to every output element, per-channel operands by the element's channel (one for an output
reduced over channels); a residual step is refused, as the finishing kernels read one tensor."""
from __future__ import annotations

import math
import numbers

import torch
import triton

from ...core.epilogue import Epilogue, as_epilogue
from ...core.memo import memo
from ...core.validate import check_call
from .kernels import finish as FK

REDUCE_OPS = ("sum", "mean", "max", "logsumexp", "softmax", "layer_norm")  # the axis kernel's MODE codes
FINISH_TILE = 4096  # elements a program holds at once
FINISH_BLOCK = 1024  # elements per step of the elementwise, moments and pooling kernels
MOMENTS_CHUNK = 16 * FINISH_BLOCK  # elements per moments program: long rows split, so few rows fill the GPU
_PROGRAMS = memo("finish.programs")  # (device, channels, signature, operands) -> a program's kernel operands
DIRECT_REDUCE = ("sum", "max", "logsumexp")  # the direct kernel's RED codes 1-3
DIRECT_MAX_CHANNELS = 64  # output channels a direct program holds: all of a position's
DIRECT_MAX_PRODUCTS = 512  # input channels x taps: the direct kernel's FMA work per output, kept small
DIRECT_CELLS, DIRECT_WARPS = 128, 4  # cells and warps of a direct program (fewer cells for many channels)


def _finish_input(y, name: str) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{name}(): argument 'input' must be Tensor, not {type(y).__name__}")
    if y.dim() != 5:
        raise ValueError(f"{name}: expected a 5-D (N, C, D, H, W) tensor, but got a {y.dim()}-D one")
    if y.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, but got {y.dtype}")
    return y.contiguous()


def _finish_programs(y, pre, post, out_shape, post_channels: int, name: str):
    """The kernel operands of ``pre`` on ``y`` and ``post`` on the output (scalars and per-channel table
    of each) and their codes."""
    args, codes = _programs_of(y, ((pre, y.shape[1], y.shape, "pre"), (post, post_channels, out_shape, "post")), name)
    return args, *codes


def _programs_of(y, programs, name: str):
    """Per (program, channels, shape, role): its kernel operands and code (``y``: the device); an
    ``Epilogue`` validated elsewhere is checked again against this call's shapes."""
    args, codes = [], []
    for p, channels, shape, what in programs:
        if isinstance(p, Epilogue):
            p = [(s.name, s.operand) if s.form else s.name for s in p.steps]
        epi = as_epilogue(p, channels, tuple(shape))
        if epi.residual is not None or epi.over_channels:
            raise ValueError(f"{name}: a {'residual' if epi.residual is not None else 'softmax'} step is not allowed "
                             f"in {what} (these kernels read one tensor, the channel softmax is a reduction's)")
        # A program of numbers is made once per device: its tables would be a host-to-device copy a call.
        key = None if any(isinstance(st.operand, torch.Tensor) for st in epi.steps) else \
            (str(y.device), channels, epi.signature, tuple(st.operand for st in epi.steps))
        made = _PROGRAMS.get(key) if key is not None else None
        if made is None:
            made = [epi.scalars(y.device), epi.channels(channels, y.device)]
            if key is not None:
                if len(_PROGRAMS) >= 256:  # programs of ever new numbers: bounded, as the engine's scalars
                    _PROGRAMS.clear()
                _PROGRAMS[key] = made
        args += made
        codes.append(epi.code)
    return args, codes


def _finish_vector(t, n: int, what: str, name: str):
    if t is not None and t.numel() != n:
        raise RuntimeError(f"{name}: {what} should contain {n} elements not {t.numel()}")
    return None if t is None else t.contiguous()


def _axis(y, out, ds, mode: int, args, pre_code: int, post_code: int, c_post: int, weight=None, bias=None,
          eps: float = 1e-5) -> None:
    """Launch the axis kernel: ``REDUCE_OPS[mode]`` of ``y`` over the consecutive dims ``ds`` into ``out``,
    whose channels number ``c_post``."""
    shape = tuple(y.shape)
    O, R, I = math.prod(shape[:ds[0]]), math.prod(shape[ds[0]:ds[-1] + 1]), math.prod(shape[ds[-1] + 1:])
    so, sr, si = R * I, I, 1
    if I == 1 and R <= 256:  # a short contiguous axis: a program takes many rows instead of one
        O, I, so, sr, si = 1, O, 0, 1, R
    block_r = min(triton.next_power_of_2(R), 128 if I > 1 else FINISH_TILE)
    block_i = min(triton.next_power_of_2(I), FINISH_TILE // block_r)
    n_iblk = triton.cdiv(I, block_i)
    FK.axis_kernel[(O * n_iblk,)](
        y, out, y if weight is None else weight, y if bias is None else bias, *args, R, I, n_iblk, so, sr, si,
        math.prod(shape[2:]), shape[1], c_post, float(eps), MODE=mode, PRE=pre_code, POST=post_code,
        HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_R=block_r, BLOCK_I=block_i)


def reduce(y, dim, op: str, *, pre=None, post=None, weight=None, bias=None, eps: float = 1e-5):
    """``op`` over ``dim`` (1, 2, 3, 4 or consecutive ones, as (2, 3, 4)): "sum", "mean", "max",
    "logsumexp" keep ``dim`` with size 1; "softmax" and "layer_norm" (population variance, ``eps``,
    then ``weight``/``bias`` of the reduced dims' size, as F.layer_norm) keep the shape."""
    y = _finish_input(y, "reduce")
    ds = list(dim) if isinstance(dim, (tuple, list)) else [dim]
    if not ds or not all(isinstance(d, int) and not isinstance(d, bool) for d in ds):
        raise TypeError(f"reduce: dim must be an int or a tuple of ints, but got {dim!r}")
    ds = sorted(d + 5 if d < 0 else d for d in ds)
    if ds[0] < 1 or ds[-1] > 4 or ds != list(range(ds[0], ds[-1] + 1)):
        raise ValueError(f"reduce: dim must be one of 1-4 or consecutive ones (as (2, 3, 4)), but got {dim!r}")
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce: op must be one of {REDUCE_OPS}, but got {op!r}")
    if op != "layer_norm" and (weight is not None or bias is not None):
        raise ValueError(f"reduce: weight and bias belong to 'layer_norm', not {op!r}")
    shape = tuple(y.shape)
    keep = REDUCE_OPS.index(op) <= 3
    out_shape = tuple(1 if k in ds else s for k, s in enumerate(shape)) if keep else shape
    c_post = 1 if keep and 1 in ds else shape[1]
    args, pre_code, post_code = _finish_programs(y, pre, post, out_shape, c_post, "reduce")
    R = math.prod(shape[ds[0]:ds[-1] + 1])
    weight, bias = (_finish_vector(t, R, what, "reduce") for t, what in ((weight, "weight"), (bias, "bias")))
    out = torch.empty(out_shape, dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    _axis(y, out, ds, REDUCE_OPS.index(op), args, pre_code, post_code, c_post, weight, bias, eps)
    return out


def _ones(n: int, device) -> torch.Tensor:
    """A float32 vector of ``n`` ones (the affine kernel's unit scale; the level-2 exporter replaces it)."""
    return torch.ones(n, dtype=torch.float32, device=device)


NEGATE = (("mul", -1.0),)  # the post program of subtract_mean's mean: the affine kernel adds its shift


def subtract_mean(y, *, pre=None, post=None):
    """``post(v - v.mean((2, 3, 4), keepdim=True))`` with ``v = pre(y)``: each (n, c) plane less its mean.
    The axis kernel writes the negated means in float32 and the affine kernel adds them with a unit
    scale: its scale and shift are per (n, c) row, which a program's per-channel operands cannot be."""
    y = _finish_input(y, "subtract_mean")
    N, C = y.shape[:2]
    args, pre_code, post_code = _finish_programs(y, pre, post, y.shape, C, "subtract_mean")
    neg, _, neg_code = _finish_programs(y, None, NEGATE, (N, C, 1, 1, 1), C, "subtract_mean")
    out = torch.empty_like(y)
    if y.numel() == 0:
        return out
    shift = torch.empty((N, C, 1, 1, 1), dtype=torch.float32, device=y.device)
    _axis(y, shift, [2, 3, 4], REDUCE_OPS.index("mean"), args[:2] + neg[2:], pre_code, neg_code, C)
    dhw = y.numel() // (N * C)
    FK.affine_kernel[(triton.cdiv(y.numel(), FINISH_BLOCK),)](
        y, out, _ones(N * C, y.device), shift, *args, y.numel(), dhw, C, N * C, PRE=pre_code, POST=post_code,
        BLOCK=FINISH_BLOCK)
    return out


def _pool_triple(v, what: str) -> tuple[int, int, int]:
    t = tuple(v) if isinstance(v, (tuple, list)) else (v, v, v)
    if len(t) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
        raise TypeError(f"pool: {what} must be a single int, or a tuple of three ints, but got {v!r}")
    if min(t) <= 0:
        raise ValueError(f"pool: {what} must be greater than zero, but got {v!r}")
    return t


def pool(y, kind: str, kernel_size, stride=None, *, pre=None, post=None):
    """``kind`` ("max" or "avg") pooling with no padding and floor mode, as F.max_pool3d/F.avg_pool3d."""
    y = _finish_input(y, "pool")
    if kind not in ("max", "avg"):
        raise ValueError(f"pool: kind must be 'max' or 'avg', but got {kind!r}")
    k = _pool_triple(kernel_size, "kernel_size")
    s = k if stride is None else _pool_triple(stride, "stride")
    N, C, D, H, W = y.shape
    od, oh, ow = ((x - kk) // ss + 1 for x, kk, ss in zip((D, H, W), k, s))
    if min(od, oh, ow) <= 0:
        raise RuntimeError(f"Given input size: ({C}x{D}x{H}x{W}). Calculated output size: "
                           f"({C}x{od}x{oh}x{ow}). Output size is too small")
    out = torch.empty((N, C, od, oh, ow), dtype=y.dtype, device=y.device)
    args, pre_code, post_code = _finish_programs(y, pre, post, out.shape, C, "pool")
    if out.numel() == 0:
        return out
    block = min(triton.next_power_of_2(od * oh * ow), FINISH_BLOCK)
    n_blk = triton.cdiv(od * oh * ow, block)
    FK.pool_kernel[(N * C * n_blk,)](y, out, *args, C, D, H, W, od, oh, ow, n_blk, *s, KD=k[0], KH=k[1], KW=k[2],
                                     MAX=kind == "max", PRE=pre_code, POST=post_code, BLOCK=block)
    return out


def _finish_normalize(y, units: int, rows: int, J: int, SJ: int, cpu: int, a_n: int, weight, bias, rm, rv,
               train: bool, momentum: float, eps: float, pre, post, name: str, sums=None) -> torch.Tensor:
    """Moments of ``rows`` contiguous rows (train; or ``sums``: per row, K sums of values and of their squares, and
    L, the values a row), per-unit scale and shift (``stats_kernel``), then ``post(a * pre(y) + b)``."""
    C, numel = y.shape[1], y.numel()
    dhw = numel // (y.shape[0] * C)
    args, pre_code, post_code = _finish_programs(y, pre, post, y.shape, C, name)
    out = torch.empty_like(y)
    if numel == 0:
        return out
    ab = torch.empty((2, a_n), dtype=torch.float32, device=y.device)
    raw = train and sums is not None
    if raw:  # K sums per row, each over L / K of the row's L values
        part, L = sums
        k = part.numel() // (2 * rows)
    else:
        L = numel // rows
        k = triton.cdiv(L, MOMENTS_CHUNK) if train else 1
        part = torch.empty(2 * rows * k if train else 1, dtype=torch.float32, device=y.device)
    if train and not raw:
        FK.moments_kernel[(rows * k,)](y, part, *args[:2], L, k, MOMENTS_CHUNK, dhw, C, PRE=pre_code,
                                       BLOCK=min(triton.next_power_of_2(L), FINISH_BLOCK))
    FK.stats_kernel[(units,)](
        part, ab[0], ab[1], *(ab if t is None else t for t in (weight, bias, rm, rv)), J, SJ, k, L, MOMENTS_CHUNK, C,
        cpu, float(eps), float(momentum or 0.0), TRAIN=train, UPDATE=train and rm is not None,
        HAS_W=weight is not None, HAS_B=bias is not None, RAW=raw,
        BLOCK_T=min(triton.next_power_of_2(J * k), FINISH_BLOCK), BLOCK_C=triton.next_power_of_2(cpu))
    FK.affine_kernel[(triton.cdiv(numel, FINISH_BLOCK),)](y, out, ab[0], ab[1], *args, numel, dhw, C, a_n,
                                                          PRE=pre_code, POST=post_code, BLOCK=FINISH_BLOCK)
    return out


def batch_norm(y, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float,
               *, pre=None, post=None, sums=None):
    """``post(F.batch_norm(pre(y), running_mean, running_var, weight, bias, training, momentum, eps))``;
    in training the running statistics are updated in place as PyTorch does (nn.BatchNorm3d with
    ``momentum=None`` passes ``1 / num_batches_tracked``). ``sums`` (``direct(stats=True)``'s) gives the batch
    statistics of another tensor instead, y its average pooled: the affine commutes with the average."""
    y = _finish_input(y, "batch_norm")
    N, C = y.shape[:2]
    if not training and (running_mean is None or running_var is None):
        raise RuntimeError("running_mean must be defined in evaluation mode")
    if training and y.numel() // C <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {y.shape}")
    update = training and running_mean is not None and running_var is not None
    if update and not isinstance(momentum, numbers.Real):
        raise TypeError(f"batch_norm(): argument 'momentum' must be float, not {type(momentum).__name__}")
    if update and not (running_mean.is_contiguous() and running_var.is_contiguous()):
        raise ValueError("batch_norm: running_mean and running_var must be contiguous (updated in place)")
    if training and not update:  # batch statistics only
        running_mean = running_var = None
    vectors = (weight, bias, running_mean, running_var)
    weight, bias, running_mean, running_var = (_finish_vector(t, C, what, "batch_norm") for t, what in
                                               zip(vectors, ("weight", "bias", "running_mean", "running_var")))
    return _finish_normalize(y, C, N * C, N, C, 1, C, weight, bias, running_mean, running_var, training,
                      momentum, eps, pre, post, "batch_norm", sums)


def group_norm(y, groups: int, weight=None, bias=None, eps: float = 1e-5, *, pre=None, post=None):
    """``post(F.group_norm(pre(y), groups, weight, bias, eps))``."""
    y = _finish_input(y, "group_norm")
    N, C = y.shape[:2]
    if not isinstance(groups, int) or groups <= 0 or C % groups:
        raise RuntimeError("Expected number of channels in input to be divisible by num_groups, but got "
                           f"input of shape {list(y.shape)} and num_groups={groups}")
    weight, bias = (_finish_vector(t, C, what, "group_norm") for t, what in ((weight, "weight"), (bias, "bias")))
    return _finish_normalize(y, N * groups, N * groups, 1, 0, C // groups, N * C, weight, bias, None, None, True,
                      0.0, eps, pre, post, "group_norm")


def direct_reason(x, weight, groups: int = 1) -> str | None:
    """Why ``direct`` does not compute this layer (it loops over every input channel and tap and holds
    every output channel of a position), or None."""
    cin, cout = weight.shape[0], weight.shape[1] * groups
    if groups != 1:
        return f"groups={groups}: the direct kernel computes groups=1"
    if cout > DIRECT_MAX_CHANNELS:
        return f"{cout} output channels: the direct kernel holds at most {DIRECT_MAX_CHANNELS}"
    if cin * math.prod(weight.shape[2:]) > DIRECT_MAX_PRODUCTS:
        return (f"{cin} input channels x {math.prod(weight.shape[2:])} taps: the direct kernel takes at most "
                f"{DIRECT_MAX_PRODUCTS}")
    return None


def direct(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, *, tf32: bool = False,
           pool: str | None = None, window=None, pre=None, softmax: bool = False, mid=None,
           channel_op: str | None = None, post=None, mean: bool = False, stats: bool = False):
    """``conv_transpose3d(x, weight, bias, stride, padding, output_padding, 1, dilation)`` of few channels
    (``direct_reason``), computed directly in float32 (``tf32``: operands rounded to TF32 first) and
    finished in registers: ``pre`` on every output element, ``pool`` ("max", "avg") over windows of the
    stride (no overlap, floor mode), ``softmax`` over the channels, ``mid``, ``channel_op`` ("sum", "max",
    "logsumexp") over the channels keeping a channel of one, then ``post``; ``mean`` averages each
    (n, c) plane (the result is (N, C, 1, 1, 1), ``post`` after the mean). Only the result is stored. ``window``:
    the pool's windows, multiples of the stride (the stride's by default). ``stats``: also returns batch_norm's
    ``sums`` of every output element after ``pre`` (all outputs, also those the pool leaves out)."""
    x = _finish_input(x, "direct")
    params, _ = check_call(x, weight, bias, stride, padding, output_padding, 1, dilation)  # PyTorch's checks
    why = direct_reason(x, weight)
    if why is not None:
        raise ValueError(f"direct: {why}")
    if pool not in (None, "max", "avg"):
        raise ValueError(f"direct: pool must be None, 'max' or 'avg', but got {pool!r}")
    if channel_op is not None and channel_op not in DIRECT_REDUCE:
        raise ValueError(f"direct: channel_op must be None or one of {DIRECT_REDUCE}, but got {channel_op!r}")
    s, p, d, k, o = params.stride, params.padding, params.dilation, params.kernel_size, params.out_size
    N, cin, D, H, W = x.shape
    cout = params.out_channels
    win = s if window is None or not pool else _pool_triple(window, "window")
    if any(wi % st for wi, st in zip(win, s)):
        raise ValueError(f"direct: the pool's window {win} must be a multiple of the stride {s}")
    q = tuple(n // wi if pool else -(-n // st) for n, wi, st in zip(o, win, s))  # pooled positions, or stride spans
    g = tuple(-(-n // wi) for n, wi in zip(o, win)) if stats else q  # the cells computed
    if min(q) <= 0:
        raise RuntimeError(f"direct: output size {o} pooled to {q} is too small")
    c_res = 1 if channel_op else cout
    conv_shape, res_shape = (N, cout, *o), (N, c_res, *(q if pool else o))
    args, codes = _programs_of(x, ((pre, cout, conv_shape, "pre"), (mid, cout, conv_shape, "mid"),
                                   (None if mean else post, c_res, res_shape, "post")), "direct")
    block_c = triton.next_power_of_2(cout)
    block_p = max(16, min(FINISH_TILE // block_c, DIRECT_CELLS, triton.next_power_of_2(math.prod(g))))
    n_qblk = triton.cdiv(math.prod(g), block_p)
    out = torch.empty((N, c_res, n_qblk, 1, 1) if mean else res_shape, dtype=torch.float32 if mean else x.dtype,
                      device=x.device)
    sums = torch.empty((N, cout, n_qblk, 2) if stats else 1, dtype=torch.float32, device=x.device)
    if out.numel() > 0:
        FK.direct_kernel[(N * n_qblk,)](
            x, weight.contiguous(), x if bias is None else bias.contiguous(), out, sums, *args, cin, D, H, W, *o, *q,
            *g, *(wi // st for wi, st in zip(win, s)), n_qblk, cout, c_res, 1.0 / math.prod(q if pool else o),
            KD=k[0], KH=k[1], KW=k[2], SD=s[0], SH=s[1],
            SW=s[2], PD=p[0], PH=p[1], PW=p[2], DD=d[0], DH=d[1], DW=d[2], HAS_B=bias is not None, TF32=tf32,
            POOL=(None, "max", "avg").index(pool), SOFTMAX=softmax, RED=0 if channel_op is None else
            1 + DIRECT_REDUCE.index(channel_op), MEAN=mean, STATS=stats, PRE=codes[0], MID=codes[1], POST=codes[2],
            BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_R=1 if channel_op else block_c, num_warps=DIRECT_WARPS)
    out = reduce(out, (2, 3, 4), "sum", post=post).to(x.dtype) if mean else out
    return (out, (sums, math.prod(o))) if stats else out
