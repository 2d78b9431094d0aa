"""``convt3d::conv_transpose3d`` and ``convt3d::conv_transpose3d_backward``: the torch.library custom
ops around our engines, with fake implementations (exact shapes, strides, memory formats) and the
autograd formula, so the layer works under autograd, torch.compile (no graph break) and CUDA graphs."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .triton import backward as _bwd
from .triton import engine as triton_engine
from .torch.calls import conv3d_forward, torch_forward
from ..core.validate import check_call
from ..core.call import output_memory_format

ENGINES = ("triton", "conv3d")
# The op's name: also the name of an eager call's range under a profiler (functional).
OP_NAME = "convt3d::conv_transpose3d"


def run_engine(engine: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], params,
               precision: str) -> torch.Tensor:
    """The forward of one of our engines on a validated 5-D call."""
    if engine == "triton":
        return triton_engine.forward(x, weight, bias, params, precision)
    if engine == "conv3d":
        # In the op's fake's memory format (on the CPU a channels-last batch of one comes back contiguous).
        fmt = output_memory_format(x, weight)
        return conv3d_forward(x, weight, bias, params, precision).contiguous(memory_format=fmt)
    raise ValueError(f"{OP_NAME}: unknown engine={engine!r}; expected one of {ENGINES}")


@torch.library.custom_op(OP_NAME, mutates_args=())
def conv_transpose3d_op(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        stride: List[int], padding: List[int], output_padding: List[int], groups: int,
                        dilation: List[int], precision: str, engine: str) -> torch.Tensor:
    params, _ = check_call(input, weight, bias, stride, padding, output_padding, groups, dilation)
    return run_engine(engine, input, weight, bias, params, precision)


@conv_transpose3d_op.register_fake
def _fake(input, weight, bias, stride, padding, output_padding, groups, dilation, precision, engine):
    out = [input.shape[0], weight.shape[1] * groups]
    for i in range(3):
        out.append((input.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (weight.shape[2 + i] - 1)
                   + output_padding[i] + 1)
    # PyTorch's convolution rule: channels_last_3d out when the input or the weight suggests it.
    fmt = output_memory_format(input, weight)
    return torch.empty(out, dtype=input.dtype, device=input.device, memory_format=fmt)


@torch.library.custom_op("convt3d::conv_transpose3d_backward", mutates_args=())
def conv_transpose3d_backward_op(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                                 stride: List[int], padding: List[int], output_padding: List[int], groups: int,
                                 dilation: List[int], precision: str,
                                 output_mask: List[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dX, dW, db); an entry whose mask is False is an empty tensor (custom ops cannot return None)."""
    params, _ = check_call(input, weight, None, stride, padding, output_padding, groups, dilation)
    gx, gw, gb = _bwd.grads(grad_output, input, weight, params, precision, tuple(output_mask))
    # Outputs may not alias each other: one fresh empty tensor per missing gradient.
    return tuple(grad_output.new_empty(0) if g is None else g for g in (gx, gw, gb))


@conv_transpose3d_backward_op.register_fake
def _fake_backward(grad_output, input, weight, stride, padding, output_padding, groups, dilation, precision,
                   output_mask):
    fx, fw = _bwd.grad_formats(input, weight)
    gx = torch.empty_like(input, memory_format=fx) if output_mask[0] else grad_output.new_empty(0)
    gw = torch.empty_like(weight, memory_format=fw) if output_mask[1] else grad_output.new_empty(0)
    gb = grad_output.new_empty((weight.shape[1] * groups,)) if output_mask[2] else grad_output.new_empty(0)
    return gx, gw, gb


def _setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, output_padding, groups, dilation, precision, engine = inputs
    # Both kept (as PyTorch does): small next to dY, and a later backward's needs are not known here.
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None
    ctx.args = (stride, padding, output_padding, groups, dilation, precision)


def _backward(ctx, grad_out):
    input, weight = ctx.saved_tensors
    stride, padding, output_padding, groups, dilation, precision = ctx.args
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    mask = [bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)]
    if not any(mask):
        return (None,) * 10
    gx, gw, gb = conv_transpose3d_backward_op(grad_out, input, weight, stride, padding, output_padding, groups,
                                              dilation, precision, mask)
    return (gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None) + (None,) * 7


conv_transpose3d_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerConvT3d(torch.autograd.Function):
    """Eager calls' autograd: the custom op's forward and backward without its dispatch, whose host time makes a
    host-bound training step several times slower (torch.compile traces the custom ops)."""

    @staticmethod
    def forward(ctx, input, weight, bias, params, precision, engine):
        ctx.save_for_backward(input, weight)
        ctx.params, ctx.precision, ctx.has_bias = params, precision, bias is not None
        if engine == "torch":
            # PyTorch's forward with our backward (auto's "torch+bwd"), cuDNN's TF32 flag from the precision.
            return torch_forward(input, weight, bias, params, precision)
        return run_engine(engine, input, weight, bias, params, precision)

    @staticmethod
    def backward(ctx, grad_out):
        input, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        mask = (bool(need_x), bool(need_w), bool(need_b and ctx.has_bias))
        if not any(mask):
            return (None,) * 6
        if torch.is_grad_enabled():
            # create_graph=True: PyTorch's formula, which autograd records (our kernels' grads carry no graph).
            return _bwd.differentiable_grads(grad_out, input, weight, ctx.params, ctx.precision, mask) + (None,) * 3
        gx, gw, gb = _bwd.grads(grad_out, input, weight, ctx.params, ctx.precision, mask)
        return gx, gw, gb, None, None, None


def conv_transpose3d_autograd(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], params,
                              precision: str, engine: str) -> torch.Tensor:
    """Eager forward of a validated 5-D call with autograd; ``engine``: one of ``ENGINES`` or "torch" (our backward)."""
    return _EagerConvT3d.apply(input, weight, bias, params, precision, engine)
