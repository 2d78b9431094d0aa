"""KernelBench level 2's nineteen problems that start with ``nn.ConvTranspose3d``, and convt3d's solution to each.

:class:`Reference` is a :class:`Problem`'s ``Model``; :class:`ModelNew` creates the same attributes in the same order
and runs the problem's ``pipeline``: the transposed convolution with the elementwise steps after it as its epilogue,
then convt3d's finishing kernels (``engines/triton/finish.py``) with ``pre``/``post`` programs. An operand is a number
or the name of a forward input or model attribute (``"leaky_relu.negative_slope"``); ``"-name"`` negates it."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import convt3d

from ..core.epilogue import apply_torch, as_epilogue
from ..core.flags import cudnn_conv_allows_tf32
from ..engines.triton import finish
from .problems import bind, find


def _convt(x, weight, bias, stride, padding, output_padding, groups, dilation, program):
    """convt3d's transposed convolution of ``x`` with ``program`` as its epilogue (the exporter traces this call)."""
    return convt3d.conv_transpose3d(x, weight, bias, stride, padding, output_padding, groups, dilation,
                                    epilogue=program or None)


def _triple(v) -> tuple[int, int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * 3


def _resolve(program, m: nn.Module, env: dict, channels: int) -> list | None:
    """``program`` with its named operands looked up, a one-element tensor repeated per channel (the kernels
    take a number or one value per channel; a tensor needs no host sync); None for no steps."""
    steps = []
    for step in program:
        name, *operand = (step,) if isinstance(step, str) else step
        if operand and isinstance(operand[0], str):
            ref = operand[0].lstrip("-")
            v = env[ref] if ref in env else functools.reduce(getattr, ref.split("."), m)
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.reshape(1).expand(channels)
            operand = [-v if operand[0].startswith("-") else v]
        steps.append((name, *operand))
    return steps or None


# ---- the stages of a ModelNew's forward ----------------------------------------------------------
class Conv:
    """The model's ``conv_transpose`` with ``steps`` as its epilogue."""

    def __init__(self, *steps):
        self.steps = steps

    def __call__(self, m, x, env):
        c = m.conv_transpose
        return _convt(x, c.weight, c.bias, c.stride, c.padding, c.output_padding, c.groups, c.dilation,
                      _resolve(self.steps, m, env, c.out_channels))


def depth_reach(c: nn.ConvTranspose3d, n: int) -> tuple[int, list[tuple[int, int]]]:
    """The layer's output depth for ``n`` input depths, and per depth tap j the input depths [lo, hi) it
    reaches: those i with 0 <= i * stride - padding + j * dilation < the output depth."""
    (s, p, op, dl), k = (v[0] for v in (c.stride, c.padding, c.output_padding, c.dilation)), c.kernel_size[0]
    out = (n - 1) * s - 2 * p + dl * (k - 1) + op + 1
    reach = []
    for j in range(k):
        lo = min(n, max(0, -((j * dl - p) // s)))
        reach.append((lo, max(lo, min(n, (out - 1 + p - j * dl) // s + 1))))
    return out, reach


class DepthMeanConv(Conv):
    """``conv_transpose(x).mean(dim=2, keepdim=True)``, then ``steps``, as one convolution of one output depth: the
    mean over depth of tap k's contributions is tap k on the sum of the input depths it reaches, so the K depth
    sums, stacked in reverse, go through the layer at depth stride 1 and depth padding K - 1."""

    def __call__(self, m, x, env):
        c = m.conv_transpose
        (_, *sh), (_, *ph), (_, *oph), (_, *dh) = c.stride, c.padding, c.output_padding, c.dilation
        out, reach = depth_reach(c, x.shape[2])
        z = torch.stack([x[:, :, lo:hi].sum(2) for lo, hi in reach[::-1]], 2)
        program = [("div", out)] + ([("add", c.bias)] if c.bias is not None else [])
        program += _resolve(self.steps, m, env, c.out_channels) or []
        return _convt(z, c.weight, None, (1, *sh), (len(reach) - 1, *ph), (0, *oph), c.groups, (1, *dh), program)


def _plain_pool(p: nn.Module) -> bool:
    """A max or average pool without padding, ceil mode, dilation, indices or divisor override."""
    return (isinstance(p, (nn.MaxPool3d, nn.AvgPool3d)) and _triple(p.padding) == (0, 0, 0) and not p.ceil_mode
            and _triple(getattr(p, "dilation", 1)) == (1, 1, 1) and not getattr(p, "return_indices", False)
            and getattr(p, "divisor_override", None) is None)


class Pool:
    """The model's pools ``names``, applied in a row, as one finishing pool with ``pre``/``post``. Windows
    that do not overlap (stride = kernel), of k1 then k2, cover what one window of k1 * k2 covers
    (floor(floor(n / k1) / k2) = floor(n / (k1 * k2))); other pools run as PyTorch's modules."""

    def __init__(self, *names, pre=(), post=()):
        self.names, self.pre, self.post = names, pre, post

    def __call__(self, m, y, env):
        pools = [getattr(m, n) for n in self.names]
        pre, post = (_resolve(p, m, env, y.shape[1]) for p in (self.pre, self.post))
        if not all(map(_plain_pool, pools)) or len({type(p) for p in pools}) > 1 or \
                (len(pools) > 1 and any(_triple(p.stride) != _triple(p.kernel_size) for p in pools)):
            y = apply_torch(y, as_epilogue(pre, y.shape[1]))
            for p in pools:
                y = p(y)
            return apply_torch(y, as_epilogue(post, y.shape[1]))
        kernel = tuple(map(math.prod, zip(*(_triple(p.kernel_size) for p in pools))))
        stride = kernel if len(pools) > 1 else _triple(pools[0].stride)
        kind = "max" if isinstance(pools[0], nn.MaxPool3d) else "avg"
        return finish.pool(y, kind, kernel, stride, pre=pre, post=post)


class PooledConv(Conv):
    """``avg_pool(conv_transpose(x))``, then ``steps`` (affine ones commute with the average), as one stride-1
    transposed convolution whose kernel is the zero-padded weight average-pooled by the stride s, where the
    pool's windows are s (no padding, no dilation); other pools run after the layer."""

    def __init__(self, pool: str, *steps):
        self.pool, self.steps = pool, steps

    def __call__(self, m, x, env):
        c, pool = m.conv_transpose, getattr(m, self.pool)
        s, k = c.stride, c.kernel_size
        if not (isinstance(pool, nn.AvgPool3d) and _plain_pool(pool) and _triple(pool.kernel_size) == s
                and _triple(pool.stride) == s and c.dilation == (1, 1, 1)):
            return Pool(self.pool, post=self.steps)(m, Conv()(m, x, env), env)
        pads, padding = [], []
        for n, si, ki, p, op in zip(x.shape[2:], s, k, c.padding, c.output_padding):
            out = ((n - 1) * si - 2 * p + ki + op) // si  # the pooled size
            t_min, t_max = -((si + p - 1) // si), (ki - 1 - p) // si  # where w' is not zero
            q = max(0, -t_min, t_max + n - out)
            taps = out - n + 1 + 2 * q  # with padding q, the stride-1 layer's output is `out` long
            first = p - si * q  # w's index of the first tap's first element
            pads = [-first, first + si * taps - ki] + pads  # F.pad lists the last dimension first
            padding.append(q)
        w = F.avg_pool3d(F.pad(c.weight, pads).flatten(0, 1).unsqueeze(1), s).squeeze(1)
        w = w.unflatten(0, c.weight.shape[:2])
        return _convt(x, w, c.bias, 1, tuple(padding), 0, c.groups, 1, _resolve(self.steps, m, env, c.out_channels))


class DirectConv(Conv):
    """The model's ``conv_transpose`` of few channels computed directly with what follows it done in registers
    (``finish.direct``), so that only the result is stored: ``steps`` on each output element, the pool ``pool``
    (a module's name) where its windows are the stride's, softmax over the channels then ``mid``, ``channel_op``
    over them, each plane's ``mean``, ``post`` last; ``keepdim=False`` drops the channel a channel_op leaves.
    Layers the direct kernel does not take run as the stages this one stands for."""

    def __init__(self, *steps, pool=None, softmax=False, mid=(), channel_op=None, mean=False, post=(), keepdim=True):
        if mid and not softmax:
            raise ValueError("DirectConv: mid steps follow the softmax")
        self.steps, self.pool, self.softmax, self.mid, self.channel_op = steps, pool, softmax, mid, channel_op
        self.mean, self.post, self.keepdim = mean, post, keepdim

    pre = property(lambda self: self.steps)  # the program on each output element, as finishing stages name it

    def __call__(self, m, x, env):
        c, pool = m.conv_transpose, getattr(m, self.pool) if self.pool else None
        fits = finish.direct_reason(x, c.weight, c.groups) is None and (pool is None or (
            _plain_pool(pool) and _triple(pool.kernel_size) == _triple(pool.stride) == tuple(c.stride)))
        if fits:
            out = finish.direct(
                x, c.weight, c.bias, c.stride, c.padding, c.output_padding, c.dilation,
                tf32=x.is_cuda and x.dtype == torch.float32 and cudnn_conv_allows_tf32(),  # as cuDNN's
                pool=pool and ("max" if isinstance(pool, nn.MaxPool3d) else "avg"),
                pre=_resolve(self.steps, m, env, c.out_channels), softmax=self.softmax,
                mid=_resolve(self.mid, m, env, c.out_channels), channel_op=self.channel_op, mean=self.mean,
                post=_resolve(self.post, m, env, 1 if self.channel_op else c.out_channels))
        else:  # the stages it stands for, ``post`` with the last
            stages = ([Pool(self.pool)] if pool else []) + \
                ([Reduce(1, "softmax", post=self.mid)] if self.softmax else []) + \
                ([Reduce(1, self.channel_op)] if self.channel_op else []) + \
                ([Reduce((2, 3, 4), "mean")] if self.mean else [])
            if stages:
                stages[-1].post = tuple(stages[-1].post) + tuple(self.post)
            out = Conv(*self.steps, *(() if stages else self.post))(m, x, env)
            for stage in stages:
                out = stage(m, out, env)
        return out if self.keepdim else out.squeeze(1)


class Reduce:
    """``finish.reduce`` of ``op`` over ``dim`` with ``pre``/``post``, with the weight, bias and eps of the
    LayerNorm ``norm`` for "layer_norm"; ``keepdim=False`` drops ``dim`` afterwards, as ``torch.max(x, dim)[0]``."""

    def __init__(self, dim, op: str, *, pre=(), post=(), norm: str | None = None, keepdim: bool = True):
        self.dim, self.op, self.pre, self.post, self.norm, self.keepdim = dim, op, pre, post, norm, keepdim

    def __call__(self, m, y, env):
        out_c = 1 if self.dim == 1 and self.op not in ("softmax", "layer_norm") else y.shape[1]
        affine = {k: getattr(getattr(m, self.norm), k) for k in ("weight", "bias", "eps")} if self.norm else {}
        out = finish.reduce(y, self.dim, self.op, pre=_resolve(self.pre, m, env, y.shape[1]),
                            post=_resolve(self.post, m, env, out_c), **affine)
        return out if self.keepdim else out.squeeze(self.dim)


class SubtractMean:
    """``finish.subtract_mean`` with ``pre``/``post``: each (n, c) plane less its mean over (2, 3, 4)."""

    def __init__(self, *, pre=(), post=()):
        self.pre, self.post = pre, post

    def __call__(self, m, y, env):
        return finish.subtract_mean(y, pre=_resolve(self.pre, m, env, y.shape[1]),
                                    post=_resolve(self.post, m, env, y.shape[1]))


class Norm:
    """The model's BatchNorm3d or GroupNorm ``name`` as a finishing kernel with ``pre``/``post``; a BatchNorm
    counts the batch, picks momentum and statistics and updates the running ones as ``nn.BatchNorm3d`` does."""

    def __init__(self, name: str, *, pre=(), post=()):
        self.name, self.pre, self.post = name, pre, post

    def __call__(self, m, y, env, sums=None):
        mod, pre, post = getattr(m, self.name), *(_resolve(p, m, env, y.shape[1]) for p in (self.pre, self.post))
        if isinstance(mod, nn.GroupNorm):
            return finish.group_norm(y, mod.num_groups, mod.weight, mod.bias, mod.eps, pre=pre, post=post)
        momentum = 0.0 if mod.momentum is None else mod.momentum
        if mod.training and mod.track_running_stats:
            mod.num_batches_tracked.add_(1)
            if mod.momentum is None:
                momentum = 1.0 / float(mod.num_batches_tracked)
        keep = not mod.training or mod.track_running_stats
        return finish.batch_norm(y, mod.weight, mod.bias, mod.running_mean if keep else None,
                                 mod.running_var if keep else None, mod.training or mod.running_mean is None,
                                 momentum, mod.eps, pre=pre, post=post, sums=sums)


class NormPooledConv(DirectConv):
    """The model's ``conv_transpose``, its BatchNorm3d ``name``, then its average pools ``pools`` in a row, where
    their windows do not overlap and make a multiple of the stride: one direct pass pools the layer's output and
    sums every output element and its square for the batch statistics, then the norm's per-channel affine applies
    to the pooled tensor (it commutes with the average). Other layers run as Conv, Norm and Pool."""

    def __init__(self, name: str, *pools: str):
        super().__init__(pool=pools)
        self.name = name

    def __call__(self, m, x, env):
        c, bn, pools = m.conv_transpose, getattr(m, self.name), [getattr(m, p) for p in self.pool]
        window = tuple(map(math.prod, zip(*(_triple(p.kernel_size) for p in pools))))
        fits = finish.direct_reason(x, c.weight, c.groups) is None and isinstance(bn, nn.BatchNorm3d) and all(
            isinstance(p, nn.AvgPool3d) and _plain_pool(p) and _triple(p.stride) == _triple(p.kernel_size)
            for p in pools) and not any(k % s for k, s in zip(window, c.stride))
        if not fits:
            return Pool(*self.pool)(m, Norm(self.name)(m, Conv()(m, x, env), env), env)
        stats = bn.training or bn.running_mean is None
        out = finish.direct(x, c.weight, c.bias, c.stride, c.padding, c.output_padding, c.dilation, pool="avg",
                            tf32=x.is_cuda and x.dtype == torch.float32 and cudnn_conv_allows_tf32(), window=window,
                            stats=stats)
        out, sums = out if stats else (out, None)
        return Norm(self.name)(m, out, env, sums)


# ---- the problems --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    id: int
    name: str  # KernelBench level-2 file name without ".py"
    signature: str  # Model.__init__'s parameters after in_channels, out_channels, kernel_size ("stride, bias=True")
    init_inputs: tuple  # get_init_inputs()
    input_shapes: tuple  # get_inputs(): torch.rand of each shape, in order
    small: tuple  # (init_inputs, input_shapes) at the interpreter's size
    creates: Callable[[SimpleNamespace], list[tuple[str, Any]]]  # what Model.__init__ assigns, in order
    forward: Callable  # Model.forward as forward(model, *inputs)
    pipeline: tuple  # ModelNew's forward: stages called as stage(model, y, the inputs by name)
    tf32_sensitive: bool = False  # a normalisation right after the conv magnifies its TF32 rounding

    file_name = property(lambda self: self.name + ".py")
    inputs = property(lambda self: tuple(inspect.signature(self.forward).parameters)[1:])  # the forward's input names

    def bind(self, init_inputs: tuple | None = None, **overrides) -> SimpleNamespace:
        """``Model(*init_inputs, **overrides)``'s arguments by name (a TypeError as Python's binding raises)."""
        return SimpleNamespace(**bind(CHANNELS + self.signature, init_inputs or self.init_inputs, overrides))

    def reduced(self) -> "Problem":
        """The problem at the interpreter's size, its ops and layer geometry kept."""
        return dataclasses.replace(self, init_inputs=self.small[0], input_shapes=self.small[1])


def _ct(a, *forwarded) -> nn.ConvTranspose3d:
    """``nn.ConvTranspose3d(in_channels, out_channels, kernel_size, <name>=<name>, ...)`` as Model calls it."""
    return nn.ConvTranspose3d(a.in_channels, a.out_channels, a.kernel_size, **{k: getattr(a, k) for k in forwarded})


CHANNELS = "in_channels, out_channels, kernel_size, "  # every Model's first parameters, left out of its signature
SP, SPO = ("stride", "padding"), ("stride", "padding", "output_padding")
_LEAKY = ("leaky_relu", "leaky_relu.negative_slope")
_CLAMP = (("clamp_min", "clamp_min"), ("clamp_max", "clamp_max"))
_IN = ((2, 3, 2, 3, 4),)  # most problems' interpreter input: batch 2, 3 channels, odd and even sizes
_P, _Tensor = nn.Parameter, torch.tensor

PROBLEMS: tuple[Problem, ...] = (
    Problem(3, "3_ConvTranspose3d_Sum_LayerNorm_AvgPool_GELU",
            "stride, padding, output_padding, sum_weight, norm_shape, pool_kernel_size",
            (32, 64, (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), 1.0, (64,), (2, 2, 2)), ((32, 32, 16, 32, 32),),
            ((3, 4, (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), 1.0, (8,), (2, 2, 2)), _IN),  # LayerNorm over W = 8
            lambda a: [("conv_transpose", _ct(a, *SPO)), ("sum_weight", _P(_Tensor(a.sum_weight))),
                       ("norm", nn.LayerNorm(a.norm_shape)), ("avg_pool", nn.AvgPool3d(kernel_size=a.pool_kernel_size)),
                       ("gelu", nn.GELU())],
            lambda m, x: m.gelu(m.avg_pool(m.norm(m.conv_transpose(x) + m.sum_weight))),
            (Conv(("add", "sum_weight")), Reduce(4, "layer_norm", norm="norm"), Pool("avg_pool", post=("gelu",))),
            tf32_sensitive=True),
    Problem(13, "13_ConvTranspose3d_Mean_Add_Softmax_Tanh_Scaling", "stride, padding, scaling_factor",
            (16, 64, 3, 1, 1, 2.0), ((16, 16, 32, 128, 128),), ((3, 4, 3, 1, 1, 2.0), ((2, 3, 4, 3, 5),)),
            lambda a: [("conv_transpose", _ct(a, *SP)), ("bias", _P(torch.randn(1, a.out_channels, 1, 1, 1))),
                       ("scaling_factor", a.scaling_factor)],
            lambda m, x: torch.tanh(torch.softmax(m.conv_transpose(x).mean(dim=2, keepdim=True) + m.bias, dim=1))
            * m.scaling_factor,
            (DepthMeanConv(("add", "bias")), Reduce(1, "softmax", post=("tanh", ("mul", "scaling_factor"))))),
    Problem(15, "15_ConvTranspose3d_BatchNorm_Subtract", "stride, padding, bias=True",
            (16, 32, 3, 2, 1), ((16, 16, 16, 32, 32),), ((3, 4, 3, 2, 1), _IN),
            lambda a: [("conv_transpose", _ct(a, *SP, "bias")), ("batch_norm", nn.BatchNorm3d(a.out_channels))],
            lambda m, x: (y := m.batch_norm(m.conv_transpose(x))) - torch.mean(y, dim=(2, 3, 4), keepdim=True),
            (Conv(), Norm("batch_norm"), SubtractMean()), tf32_sensitive=True),
    Problem(20, "20_ConvTranspose3d_Sum_ResidualAdd_Multiply_ResidualAdd",
            "stride, padding, output_padding, bias_shape",
            (32, 64, 3, 2, 1, 1, (64, 1, 1, 1)), ((16, 32, 16, 32, 32),), ((3, 4, 3, 2, 1, 1, (4, 1, 1, 1)), _IN),
            lambda a: [("conv_transpose", _ct(a, *SPO)), ("bias", _P(torch.randn(a.bias_shape)))],
            lambda m, x: ((y := m.conv_transpose(x)) + m.bias + (o := y.clone().detach())) * o + o,
            (Conv("save", ("add", "bias"), "add_saved", "mul_saved", "add_saved"),)),
    Problem(26, "26_ConvTranspose3d_Add_HardSwish", "stride, padding, output_padding, bias_shape",
            (32, 64, 3, 2, 1, 1, (64, 1, 1, 1, 1)), ((128, 32, 16, 16, 16), (128, 64, 32, 32, 32)),
            ((3, 4, 3, 2, 1, 1, (4, 1, 1, 1, 1)), (*_IN, (2, 4, 4, 6, 8))),
            lambda a: [("conv_transpose", _ct(a, *SPO)), ("bias", _P(torch.randn(a.bias_shape)))],
            lambda m, x, add_input: (y := m.conv_transpose(x) + add_input) * F.hardswish(y),
            (Conv(("add", "add_input"), "save", "hardswish", "mul_saved"),)),
    Problem(34, "34_ConvTranspose3d_LayerNorm_GELU_Scaling", "stride, padding, bias=True, eps=1e-5, scaling_factor=1.0",
            (32, 64, 4, 2, 1, True, 1e-5, 1.0), ((32, 32, 16, 32, 32),),
            ((3, 8, 4, 2, 1, True, 1e-5, 2.0), _IN),  # LayerNorm(out_channels) over W = 8
            lambda a: [("conv_transpose", _ct(a, *SP, "bias")), ("layer_norm", nn.LayerNorm(a.out_channels, eps=a.eps)),
                       ("scaling_factor", a.scaling_factor)],
            lambda m, x: F.gelu(m.layer_norm(m.conv_transpose(x))) * m.scaling_factor,
            (Conv(), Reduce(4, "layer_norm", norm="layer_norm", post=("gelu", ("mul", "scaling_factor")))),
            tf32_sensitive=True),
    Problem(38, "38_ConvTranspose3d_AvgPool_Clamp_Softmax_Multiply",
            "stride, padding, output_padding, pool_kernel_size, clamp_min, clamp_max",
            (32, 64, 3, 2, 1, 1, 2, 0.0, 1.0), ((32, 32, 32, 64, 64),),
            ((3, 4, 3, 2, 1, 1, 2, 0.0, 1.0), ((2, 3, 4, 6, 9),)),
            lambda a: [("avg_pool", nn.AvgPool3d(a.pool_kernel_size)), ("conv_transpose", _ct(a, *SPO)),
                       ("clamp_min", a.clamp_min), ("clamp_max", a.clamp_max),
                       ("scale", _P(torch.ones(1, a.out_channels, 1, 1, 1)))],
            lambda m, x: torch.softmax((y := torch.clamp(m.conv_transpose(m.avg_pool(x)), m.clamp_min, m.clamp_max))
                                       .view(*y.shape[:2], -1), dim=2).view(y.shape) * m.scale,
            (Pool("avg_pool"), Conv(*_CLAMP), Reduce((2, 3, 4), "softmax", post=(("mul", "scale"),)))),
    Problem(49, "49_ConvTranspose3d_Softmax_Sigmoid", "stride, padding, output_padding, bias=True",
            (32, 64, 3, 2, 1, 1), ((16, 32, 16, 32, 32),), ((3, 4, 3, 2, 1, 1), _IN),
            lambda a: [("conv_transpose", _ct(a, *SPO, "bias")), ("softmax", nn.Softmax(dim=1)),
                       ("sigmoid", nn.Sigmoid())],
            lambda m, x: m.sigmoid(m.softmax(m.conv_transpose(x))),
            (Conv("softmax", "sigmoid"),)),
    Problem(50, "50_ConvTranspose3d_Scaling_AvgPool_BiasAdd_Scaling", "stride, padding, scale1, scale2, bias_shape",
            (3, 16, 3, 2, 1, 0.5, 1.0, (16, 1, 1, 1)), ((128, 3, 16, 32, 32),),
            ((3, 4, 3, 2, 1, 0.5, 1.5, (4, 1, 1, 1)), _IN),
            lambda a: [("conv_transpose", _ct(a, *SP)), ("scale1", _P(_Tensor(a.scale1))),
                       ("avg_pool", nn.AvgPool3d(kernel_size=2)), ("bias", _P(torch.randn(a.bias_shape))),
                       ("scale2", _P(_Tensor(a.scale2)))],
            lambda m, x: (m.avg_pool(m.conv_transpose(x) * m.scale1) + m.bias) * m.scale2,
            # x * scale1 commutes with the average: it follows the pool folded into the layer
            (PooledConv("avg_pool", ("mul", "scale1"), ("add", "bias"), ("mul", "scale2")),)),
    Problem(58, "58_ConvTranspose3d_LogSumExp_HardSwish_Subtract_Clamp", "stride, padding, bias_shape",
            (3, 16, 3, 2, 1, (1, 1, 1, 1)), ((128, 3, 16, 32, 32),), ((3, 4, 3, 2, 1, (1, 1, 1, 1)), _IN),
            lambda a: [("conv_transpose", _ct(a, *SP)), ("bias", _P(torch.randn(1, 1, 1, 1)))],
            lambda m, x: torch.clamp((y := torch.logsumexp(m.conv_transpose(x), dim=1, keepdim=True))
                                     * torch.sigmoid(y + 3) / 6 - m.bias, min=-1, max=1),
            (DirectConv(channel_op="logsumexp", post=("save", ("add", 3), "sigmoid", "mul_saved", ("div", 6),
                                                       ("add", "-bias"), ("clamp_min", -1), ("clamp_max", 1))),)),
    Problem(60, "60_ConvTranspose3d_Swish_GroupNorm_HardSwish", "stride, padding, groups, eps, bias=True",
            (3, 16, 3, 2, 1, 4, 1e-5), ((128, 3, 16, 32, 32),), ((3, 8, 3, 2, 1, 4, 1e-5), _IN),
            lambda a: [("conv_transpose", _ct(a, *SP, "bias")),
                       ("group_norm", nn.GroupNorm(num_groups=a.groups, num_channels=a.out_channels, eps=a.eps))],
            lambda m, x: F.hardswish(m.group_norm(torch.sigmoid(y := m.conv_transpose(x)) * y)),
            (Conv("silu"), Norm("group_norm", post=("hardswish",))), tf32_sensitive=True),
    Problem(61, "61_ConvTranspose3d_ReLU_GroupNorm", "groups, bias=False",
            (64, 128, 3, 8, False), ((16, 64, 32, 32, 32),), ((3, 8, 3, 4, False), _IN),
            lambda a: [("conv_transpose", _ct(a, "bias")), ("relu", nn.ReLU()),
                       ("group_norm", nn.GroupNorm(num_groups=a.groups, num_channels=a.out_channels))],
            lambda m, x: m.group_norm(m.relu(m.conv_transpose(x))),
            (Conv("relu"), Norm("group_norm")), tf32_sensitive=True),
    Problem(72, "72_ConvTranspose3d_BatchNorm_AvgPool_AvgPool", "stride, padding, bias_shape",
            (3, 16, 3, 2, 1, (16, 1, 1, 1)), ((64, 3, 32, 32, 32),),
            ((3, 4, 3, 2, 1, (4, 1, 1, 1)), ((2, 3, 4, 5, 6),)),
            lambda a: [("conv_transpose", _ct(a, *SP)), ("batch_norm", nn.BatchNorm3d(a.out_channels)),
                       ("avg_pool1", nn.AvgPool3d(kernel_size=2)), ("avg_pool2", nn.AvgPool3d(kernel_size=2))],
            lambda m, x: m.avg_pool2(m.avg_pool1(m.batch_norm(m.conv_transpose(x)))),
            (NormPooledConv("batch_norm", "avg_pool1", "avg_pool2"),), tf32_sensitive=True),
    Problem(74, "74_ConvTranspose3d_LeakyReLU_Multiply_LeakyReLU_Max",
            "stride, padding, output_padding, multiplier_shape",
            (16, 32, 3, 2, 1, 1, (32, 1, 1, 1)), ((16, 16, 16, 32, 32),), ((3, 4, 3, 2, 1, 1, (4, 1, 1, 1)), _IN),
            lambda a: [("conv_transpose", _ct(a, *SPO)), ("multiplier", _P(torch.randn(a.multiplier_shape))),
                       ("leaky_relu", nn.LeakyReLU(negative_slope=0.2)), ("max_pool", nn.MaxPool3d(kernel_size=2))],
            lambda m, x: m.max_pool(m.leaky_relu(m.leaky_relu(m.conv_transpose(x)) * m.multiplier)),
            (Conv(_LEAKY, ("mul", "multiplier"), _LEAKY), Pool("max_pool"))),
    Problem(77, "77_ConvTranspose3d_Scale_BatchNorm_GlobalAvgPool", "scale_factor, eps=1e-5, momentum=0.1",
            (64, 128, 5, 2.0), ((16, 64, 16, 32, 32),), ((3, 4, 3, 2.0), _IN),
            lambda a: [("conv_transpose", _ct(a)), ("scale_factor", a.scale_factor),
                       ("batch_norm", nn.BatchNorm3d(a.out_channels, eps=a.eps, momentum=a.momentum)),
                       ("global_avg_pool", nn.AdaptiveAvgPool3d((1, 1, 1)))],
            lambda m, x: m.global_avg_pool(m.batch_norm(m.conv_transpose(x) * m.scale_factor)),
            (Conv(("mul", "scale_factor")), Norm("batch_norm"), Reduce((2, 3, 4), "mean"))),
    Problem(78, "78_ConvTranspose3d_Max_Max_Sum", "stride, padding",
            (32, 64, 5, 2, 2), ((16, 32, 32, 32, 32),), ((3, 4, 5, 2, 2), ((2, 3, 6, 7, 8),)),
            lambda a: [("conv_transpose", _ct(a, *SP)), ("max_pool1", nn.MaxPool3d(kernel_size=2)),
                       ("max_pool2", nn.MaxPool3d(kernel_size=3))],
            lambda m, x: torch.sum(m.max_pool2(m.max_pool1(m.conv_transpose(x))), dim=1, keepdim=True),
            (Conv(), Pool("max_pool1", "max_pool2"), Reduce(1, "sum"))),
    Problem(89, "89_ConvTranspose3d_MaxPool_Softmax_Subtract_Swish_Max",
            "stride, padding, output_padding, pool_kernel_size, pool_stride, pool_padding",
            (3, 16, 3, 2, 1, 1, 2, 2, 0), ((128, 3, 16, 32, 32),), ((3, 4, 3, 2, 1, 1, 2, 2, 0), _IN),
            lambda a: [("conv_transpose", _ct(a, *SPO)), ("max_pool", nn.MaxPool3d(
                kernel_size=a.pool_kernel_size, stride=a.pool_stride, padding=a.pool_padding)),
                ("subtract", _P(torch.randn(a.out_channels)))],
            lambda m, x: torch.max(torch.sigmoid(y := torch.softmax(m.max_pool(m.conv_transpose(x)), dim=1)
                                                 - m.subtract.view(1, -1, 1, 1, 1)) * y, dim=1)[0],
            (DirectConv(pool="max_pool", softmax=True, mid=(("add", "-subtract"), "save", "sigmoid", "mul_saved"),
                        channel_op="max", keepdim=False),)),
    Problem(96, "96_ConvTranspose3d_Multiply_Max_GlobalAvgPool_Clamp", "stride, padding, scale, maxpool_kernel_size",
            (3, 16, 3, 2, 1, 0.5, 2), ((128, 3, 16, 32, 32),), ((3, 4, 3, 2, 1, 0.5, 2), _IN),
            lambda a: [("conv_transpose", _ct(a, *SP)), ("scale", a.scale),
                       ("maxpool", nn.MaxPool3d(kernel_size=a.maxpool_kernel_size)),
                       ("global_avg_pool", nn.AdaptiveAvgPool3d((1, 1, 1))), ("clamp_min", 0), ("clamp_max", 1)],
            lambda m, x: torch.clamp(m.global_avg_pool(m.maxpool(m.conv_transpose(x) * m.scale)), min=m.clamp_min,
                                     max=m.clamp_max),
            (DirectConv(("mul", "scale"), pool="maxpool", mean=True, post=_CLAMP),)),
    Problem(100, "100_ConvTranspose3d_Clamp_Min_Divide", "stride, padding, min_value, divisor",
            (64, 128, 3, 2, 1, -1.0, 2.0), ((16, 64, 24, 48, 48),), ((3, 4, 3, 2, 1, -1.0, 2.0), _IN),
            lambda a: [("conv_transpose", _ct(a, *SP)), ("min_value", a.min_value), ("divisor", a.divisor)],
            lambda m, x: torch.clamp(m.conv_transpose(x), min=m.min_value) / m.divisor,
            (Conv(("clamp_min", "min_value"), ("div", "divisor")),)),
)

def by_id(problem_id: int) -> Problem:
    return find(PROBLEMS, problem_id, "level-2 ")


def parse_ids(text: str | None) -> list[Problem]:
    """'3,100' -> those problems (all nineteen for None or empty)."""
    return [by_id(int(v)) for v in text.split(",") if v.strip()] if text else list(PROBLEMS)


class _Built(nn.Module):
    """What ``problem``'s Model creates, in its order: the RNG draws and the state_dict are Model's."""

    def __init__(self, problem: Problem, *init_inputs, **overrides):
        super().__init__()
        self._problem = problem
        for name, value in problem.creates(problem.bind(init_inputs, **overrides)):
            setattr(self, name, value)


class Reference(_Built):
    """KernelBench's ``Model`` of ``problem``."""

    def forward(self, *inputs):
        return self._problem.forward(self, *inputs)


class ModelNew(_Built):
    """convt3d's solution to ``problem``: Model's parameters, the problem's pipeline as its forward."""

    def forward(self, *inputs):
        env = dict(zip(self._problem.inputs, inputs))
        return functools.reduce(lambda y, stage: stage(self, y, env), self._problem.pipeline, inputs[0])
