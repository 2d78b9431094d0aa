"""PyTorch's own forward (cuDNN on CUDA) as convt3d runs it, and the conv3d form of a stride-1 call."""
from __future__ import annotations

import functools

import torch

from ...core.flags import at_precision


def torch_forward(x, weight, bias, params, precision):
    """PyTorch's forward of a validated call. A precision for CUDA float32 sets cuDNN's TF32 flag
    for this call only ("tf32": TF32 on; any exact grade: off); None follows the flag as it is."""
    args = (x, weight, bias, params.stride, params.padding, params.output_padding, params.groups, params.dilation)
    return at_precision(torch.nn.functional.conv_transpose3d, args, precision)


def torch_grads(dy, x, weight, params, precision, mask):
    """(dX, dW, db) for the True entries of ``mask`` by PyTorch's kernels in one call, at the call's precision."""
    args = (dy, x, weight, [params.out_channels] if mask[2] else None, list(params.stride), list(params.padding),
            list(params.dilation), True, list(params.output_padding), params.groups, list(mask))
    return at_precision(torch.ops.aten.convolution_backward, args, precision)


class _AtPrecision(torch.autograd.Function):
    """PyTorch's forward and backward at the call's precision (its autograd would use the flag at backward time)."""

    @staticmethod
    def forward(ctx, x, weight, bias, params, precision):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.precision, ctx.has_bias = params, precision, bias is not None
        return torch_forward(x, weight, bias, params, precision)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.has_bias]
        gx, gw, gb = torch_grads(dy, x, weight, ctx.params, ctx.precision, mask)
        return (gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, None, None)


def torch_autograd_at_precision(x, weight, bias, params, precision):
    """``torch_forward`` recorded for autograd with a backward at the same precision."""
    return _AtPrecision.apply(x, weight, bias, params, precision)


# At stride 1, y[o] = sum_k x[o + p - d k] w[k] is the conv3d of x padded by d (K - 1) - p with the weight flipped and
# its channel axes swapped (per group): cuDNN's forward kernels instead of conv_transpose3d's slower dgrad kernels.


def conv3d_form_reasons(params, dtype: torch.dtype, precision: str) -> list[str]:
    """Why a call has no conv3d form (empty: it has one): it needs stride 1, output_padding 0 (the extra rows
    would pad one side only), and not float32 at exact grade (cuDNN's conv3d errs more there, no faster)."""
    reasons = []
    if params.stride != (1, 1, 1):
        reasons.append(f"stride={params.stride}: the conv3d form needs stride 1")
    elif params.output_padding != (0, 0, 0):
        reasons.append(f"output_padding={params.output_padding}: the conv3d form pads both sides alike")
    if dtype == torch.float32 and precision != "tf32":
        reasons.append(f"precision {precision!r}: the conv3d form is for TF32 and 16-bit calls (cuDNN's exact "
                       "fp32 conv3d errs up to 7x its conv_transpose3d)")
    return reasons


def conv3d_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """The conv3d weight [Cout, Cin/g, kD, kH, kW] of ``weight`` [Cin, Cout/g, kD, kH, kW], flipped
    along the kernel axes, in the weight's memory format (PyTorch's output format follows it)."""
    cin, cout_g, *k = weight.shape
    fmt = (torch.channels_last_3d if not weight.is_contiguous()
           and weight.is_contiguous(memory_format=torch.channels_last_3d) else torch.contiguous_format)
    swapped = weight.flip((2, 3, 4)).reshape(groups, cin // groups, cout_g, *k).transpose(1, 2)
    return swapped.reshape(groups * cout_g, cin // groups, *k).contiguous(memory_format=fmt)


@functools.lru_cache(maxsize=1024)
def conv3d_padding(params) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(padding of the conv3d, elements trimmed off each side of x) per axis: d (K - 1) - p where
    that is not negative, else no padding and x trimmed by p - d (K - 1)."""
    q = [d * (k - 1) - p for d, k, p in zip(params.dilation, params.kernel_size, params.padding)]
    return tuple(max(v, 0) for v in q), tuple(max(-v, 0) for v in q)


def conv3d_forward(x, weight, bias, params, precision):
    """A stride-1 call as PyTorch's conv3d at the call's precision; padding beyond d (K - 1) trims x (a view)."""
    pad, trim = conv3d_padding(params)
    if trim != (0, 0, 0):
        x = x[:, :, trim[0]:x.shape[2] - trim[0], trim[1]:x.shape[3] - trim[1], trim[2]:x.shape[4] - trim[2]]
    args = (x, conv3d_weight(weight, params.groups), bias, 1, pad, params.dilation, params.groups)
    return at_precision(torch.nn.functional.conv3d, args, precision)
