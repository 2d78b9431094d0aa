"""The steady path's memos: how a repeated call is recognised without validation or the dispatcher's pass."""
from __future__ import annotations

import functools
import os
import weakref

import torch

from ..core.flags import cudnn_conv_allows_tf32
from ..core.validate import memo_arguments

BACKEND_ENV = "CONVT3D_BACKEND"


@functools.cache
def _precision_reader():
    """A reader of cuDNN convolution's fp32_precision through torch._C's getter, or None without one."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is None or not hasattr(conv, "backend"):
        return None
    return functools.partial(getter, conv.backend, conv.op)


def _tf32() -> bool:
    """``cudnn_conv_allows_tf32`` without ``torch.backends``' module ``__getattr__``: read on every steady call."""
    read = _precision_reader()
    value = read() if read is not None else None
    if value in ("tf32", "ieee"):
        return value == "tf32"
    return cudnn_conv_allows_tf32()  # inherited ("none"), or a torch without the getter


def _autocast_state(device_type: str):
    """None outside autocast; the autocast dtype inside it (devices autocast knows: cuda, cpu)."""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def steady_key(input, weight, bias, stride, padding, output_padding, groups, dilation, backend,
               precision) -> tuple | None:
    """Everything validation and the pass read from a call (layouts, geometry, backend, precision,
    ``$CONVT3D_BACKEND``, the TF32 flag, grad mode, autocast), or None where it takes the full pass."""
    if not (backend is None or type(backend) is str) or not (precision is None or type(precision) is str):
        return None
    geometry = memo_arguments(input, weight, bias, stride, padding, output_padding, groups, dilation)
    if geometry is None:
        return None
    dev = input.device
    return (input.shape, input.stride(), input.dtype, dev, input.requires_grad,
            weight.shape, weight.stride(), weight.dtype, weight.device, weight.requires_grad,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device, bias.requires_grad),
            geometry, backend, precision, os.environ.get(BACKEND_ENV) if backend is None else None,
            _tf32(), torch.is_grad_enabled(), _autocast_state(dev.type))


def _same(args: tuple, memo: tuple) -> bool:
    """``args == memo`` for a memo of ints and tuples of ints; False where an argument compares as
    a tensor (a tensor stride: F.conv_transpose3d then raises its own TypeError)."""
    try:
        return bool(args == memo)
    except (RuntimeError, TypeError):
        return False


class Direct:
    """The memo of one call that went straight to ``F.conv_transpose3d``; ``fits`` says whether another
    call may too. Holds its weight and bias weakly (a dropped model frees them)."""

    __slots__ = ("weight", "bias", "x_type", "shape", "strides", "dtype", "device", "x_grad", "w_grad", "b_grad",
                 "args", "backend", "precision", "env", "tf32", "grad", "autocast", "__weakref__")

    def __init__(self, input, weight, bias, args: tuple, backend, precision):
        self.weight = weakref.ref(weight)
        self.bias = (lambda: None) if bias is None else weakref.ref(bias)
        self.x_type = type(input)
        self.shape, self.strides, self.dtype, self.device = input.shape, input.stride(), input.dtype, input.device
        self.x_grad, self.w_grad = input.requires_grad, weight.requires_grad
        self.b_grad = None if bias is None else bias.requires_grad
        self.args, self.backend, self.precision = args, backend, precision
        self.env = os.environ.get(BACKEND_ENV) if backend is None else None
        self.tf32, self.grad = _tf32(), torch.is_grad_enabled()
        self.autocast = _autocast_state(input.device.type)

    def fits(self, input, weight, bias, args: tuple, backend, precision) -> bool:
        """Whether these arguments decide as this call's did: cheap, discriminating checks first, the type first."""
        return (type(input) is self.x_type and self.weight() is weight and self.bias() is bias
                and input.shape == self.shape and input.dtype is self.dtype and input.stride() == self.strides
                and _same(args, self.args) and backend == self.backend and precision == self.precision
                and input.requires_grad is self.x_grad and weight.requires_grad is self.w_grad
                and (bias is None or bias.requires_grad is self.b_grad)
                and torch.is_grad_enabled() is self.grad and input.device == self.device
                and _tf32() is self.tf32 and _autocast_state(self.device.type) == self.autocast
                and (backend is not None or os.environ.get(BACKEND_ENV) == self.env))


def _layout(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


class Repeat(Direct):
    """The memo of an inference call decided for one of our engines: ``Direct``'s check, the weight's
    and bias's layouts, and the launcher's ``alive()``. ``hit``: the dispatcher's ``Steady`` entry."""

    __slots__ = ("w_layout", "b_layout", "alive", "hit")

    def __init__(self, input, weight, bias, args: tuple, backend, precision, alive, hit=None):
        super().__init__(input, weight, bias, args, backend, precision)
        self.w_layout, self.b_layout = _layout(weight), _layout(bias)
        self.alive, self.hit = alive, hit

    def fits(self, input, weight, bias, args: tuple, backend, precision) -> bool:
        return (super().fits(input, weight, bias, args, backend, precision)
                and _layout(weight) == self.w_layout and _layout(bias) == self.b_layout and self.alive())
