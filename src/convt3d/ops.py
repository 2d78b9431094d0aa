"""``convt3d::conv_transpose3d``: the torch.library custom op around the Triton engine, with its
fake (meta) implementation and autograd formula, so it works under torch.compile, CUDA graphs
and autograd like a native op.

The op takes already-normalised arguments (5-D input, 3-element lists, a concrete precision);
``convt3d.functional`` validates and dispatches before calling it.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import triton_engine
from .validate import check_call

__all__ = ["conv_transpose3d_op"]


@torch.library.custom_op("convt3d::conv_transpose3d", mutates_args=())
def conv_transpose3d_op(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        stride: List[int], padding: List[int], output_padding: List[int], groups: int,
                        dilation: List[int], precision: str) -> torch.Tensor:
    params, _ = check_call(input, weight, bias, stride, padding, output_padding, groups, dilation)
    return triton_engine.forward(input, weight, bias, params, precision)


@conv_transpose3d_op.register_fake
def _fake(input, weight, bias, stride, padding, output_padding, groups, dilation, precision):
    out = [input.shape[0], weight.shape[1] * groups]
    for i in range(3):
        out.append((input.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (weight.shape[2 + i] - 1)
                   + output_padding[i] + 1)
    fmt = triton_engine.output_memory_format(input, weight)
    return torch.empty(out, dtype=input.dtype, device=input.device, memory_format=fmt)


def _setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, output_padding, groups, dilation, precision = inputs
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None
    ctx.args = (stride, padding, output_padding, groups, dilation)


def _backward(ctx, grad_out):
    input, weight = ctx.saved_tensors
    stride, padding, output_padding, groups, dilation = ctx.args
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    # dX is a strided conv3d of dY with the same weight, dW the correlation of dY with X, db the
    # sum of dY: PyTorch's convolution_backward (cuDNN on CUDA) computes exactly these.
    gx, gw, gb = torch.ops.aten.convolution_backward(
        grad_out, input, weight, [weight.shape[1] * groups] if ctx.has_bias else None,
        stride, padding, dilation, True, output_padding, groups,
        [need_x, need_w, need_b and ctx.has_bias])
    return gx, gw, (gb if ctx.has_bias else None), None, None, None, None, None, None


conv_transpose3d_op.register_autograd(_backward, setup_context=_setup_context)
