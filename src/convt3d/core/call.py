"""One validated call of the transposed convolution, as every engine and the dispatcher see it
(``make_call``: the arguments checked once, the precision resolved)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .params import ConvT3dParams
from .flags import cudnn_conv_allows_tf32
from .validate import check_call

PRECISIONS = ("tf32", "tf32x3", "ieee")

# precision=None with TF32 off: tf32x3 is faster than FMA "ieee" and within 2x of cuDNN's exact-fp32 error.
EXACT_GRADE = "tf32x3"


def resolve_precision(precision: str | None) -> str:
    """The user's precision as a concrete one: None follows PyTorch's cuDNN TF32 flag (else exact grade)."""
    if precision is None:
        return "tf32" if cudnn_conv_allows_tf32() else EXACT_GRADE
    if not isinstance(precision, str):
        raise TypeError(f"conv_transpose3d(): argument 'precision' must be str or None, not {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}; expected None or one of {PRECISIONS}")
    return precision


def layout_name(t) -> str:
    if t.is_contiguous():
        return "ncdhw"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "cl"
    return "strided" + "x".join(map(str, t.stride()))


def signature_text(x, weight, bias, params: ConvT3dParams, precision: str, training: bool = False) -> str:
    """The persistent form of a call signature (the GPU model is the cache file's)."""
    p = params

    def t3(v):
        return "x".join(map(str, v))

    return (f"{str(x.dtype).replace('torch.', '')}|x={layout_name(x)}|w={layout_name(weight)}|"
            f"{'bias' if bias is not None else 'nobias'}|N{p.batch} {p.in_channels}->{p.out_channels} g{p.groups} "
            f"in{t3(p.in_size)} k{t3(p.kernel_size)} s{t3(p.stride)} p{t3(p.padding)} op{t3(p.output_padding)} "
            f"d{t3(p.dilation)}|{precision}" + ("|train" if training else ""))


@dataclass(frozen=True, eq=False)
class Call:
    """A validated call: ``x`` 5-D, ``precision`` concrete, ``requested`` as given; ``repeat``: made by the steady
    path (engines skip first-sight work); ``sources``: the caller's tensors where autocast cast any (timed from)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    params: ConvT3dParams
    precision: str
    requested: str | None = None
    training: bool = False
    unbatched: bool = False
    repeat: bool = False
    sources: tuple | None = None

    @property
    def given(self) -> tuple:
        """The (input, weight, bias) as the caller passed them (before autocast and batching)."""
        if self.sources is not None:
            return self.sources
        return self.x.squeeze(0) if self.unbatched else self.x, self.weight, self.bias

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @functools.cached_property
    def key(self) -> tuple:
        """The in-process signature: everything an engine's speed or result depends on."""
        return (self.x.device, self.x.dtype, self.x.stride(), self.weight.stride(), self.bias is not None,
                self.params, self.precision, self.training)

    @functools.cached_property
    def text(self) -> str:
        """The persistent signature (``convt3d.dispatch.cache`` keys decisions by it)."""
        return signature_text(self.x, self.weight, self.bias, self.params, self.precision, self.training)


def make_call(input, weight, bias, stride, padding, output_padding, groups, dilation, precision=None,
              autograd: bool = False, sources: tuple | None = None) -> Call:
    """Validate a call (raises as PyTorch does) and resolve its precision, once."""
    params, unbatched = check_call(input, weight, bias, stride, padding, output_padding, groups, dilation)
    prec = resolve_precision(precision)
    # Recorded when grad mode is on and a tensor requires grad (the arguments are tensors by now).
    training = autograd and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, weight, bias))
    x = input.unsqueeze(0) if unbatched else input
    return Call(x, weight, bias, params, prec, precision, training, unbatched, sources=sources)


def autocast_inputs(input, weight, bias):
    """Under ``torch.autocast``, the floating-point tensors cast (differentiably) as PyTorch casts them."""
    if not isinstance(input, torch.Tensor):
        return input, weight, bias  # check_call raises the TypeError
    dev = input.device.type
    if dev not in ("cuda", "cpu") or not torch.is_autocast_enabled(dev):
        return input, weight, bias
    dtype = torch.get_autocast_dtype(dev)

    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == dev and t.dtype != dtype \
                and t.dtype != torch.float64:
            return t.to(dtype)
        return t

    return cast(input), cast(weight), cast(bias)


def suggests_channels_last(t: torch.Tensor) -> bool:
    """PyTorch's rule for a 5-D tensor's preferred memory format (channels_last_3d vs contiguous)."""
    if t.dim() != 5 or t.is_contiguous():
        return False
    if t.is_contiguous(memory_format=torch.channels_last_3d):
        return True
    # Non-contiguous views: channels_last if the channel stride is the smallest.
    dims = [i for i in range(5) if t.shape[i] > 1]
    return 1 in dims and t.stride(1) == min(t.stride(i) for i in dims)


def output_memory_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """As PyTorch's convolutions: channels_last_3d out if the input or the weight suggests it."""
    if suggests_channels_last(x) or suggests_channels_last(weight):
        return torch.channels_last_3d
    return torch.contiguous_format
