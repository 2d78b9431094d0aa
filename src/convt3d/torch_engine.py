"""PyTorch's own forward (cuDNN on CUDA), as convt3d runs it: the "torch" engine's work, the
forward of the ``torch+bwd`` training step, and the baseline every "auto" measurement compares
against.

A leaf module (it imports nothing of convt3d), so the dispatcher, the autograd wrappers and the
backward can all use it without importing each other.
"""
from __future__ import annotations

import torch

__all__ = ["cudnn_conv_allows_tf32", "cudnn_conv_tf32", "at_flags_as_they_are", "torch_forward"]


def cudnn_conv_allows_tf32() -> bool:
    """The TF32 flag PyTorch's convolutions read. Since torch 2.9 that is the per-operator
    ``torch.backends.cudnn.conv.fp32_precision`` ("tf32" or not); the legacy
    ``torch.backends.cudnn.allow_tf32`` getter mirrors it but raises RuntimeError once the new
    API has set conv and rnn differently (e.g. ``cudnn.conv.fp32_precision = "ieee"``).

    Read on every call: through ``torch._C``'s getter where it exists (0.4 us; the attribute
    path through ``torch.backends``' module ``__getattr__`` costs ~1.4 us)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is not None and hasattr(conv, "backend"):
        value = getter(conv.backend, conv.op)
        if value in ("tf32", "ieee"):
            return value == "tf32"
    value = getattr(conv, "fp32_precision", None)
    if value in ("tf32", "ieee"):
        return value == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)  # "none": inherited, the legacy flag decides


class cudnn_conv_tf32:
    """Context manager: PyTorch's convolutions run with TF32 on or off, restored on exit (the
    per-operator flag where torch has it, else the legacy one)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        conv = getattr(torch.backends.cudnn, "conv", None)
        if conv is not None and hasattr(conv, "fp32_precision"):
            self._obj, self._attr, self._value = conv, "fp32_precision", "tf32" if self.enabled else "ieee"
        else:
            self._obj, self._attr, self._value = torch.backends.cudnn, "allow_tf32", self.enabled
        self._old = getattr(self._obj, self._attr)
        # Set only on a change: the flag's setter validates and re-derives torch's precision
        # state, host time that every backward of a training step would pay twice.
        if self._old != self._value:
            setattr(self._obj, self._attr, self._value)
        return self

    def __exit__(self, *exc):
        if self._old != self._value:
            setattr(self._obj, self._attr, self._old)
        return False


def at_flags_as_they_are(x, precision) -> bool:
    """Whether PyTorch's forward of a call with this input and requested precision runs at cuDNN's
    flags as they are (True), or sets the TF32 flag for the call (CUDA float32 with a precision)."""
    return precision is None or x.device.type != "cuda" or x.dtype != torch.float32


def torch_forward(x, weight, bias, params, precision):
    """PyTorch's forward of a validated call. A precision for CUDA float32 sets cuDNN's TF32 flag
    for this call only ("tf32": TF32 on; any exact grade: off); None follows the flag as it is."""
    args = (x, weight, bias, params.stride, params.padding, params.output_padding, params.groups, params.dilation)
    if at_flags_as_they_are(x, precision):
        return torch.nn.functional.conv_transpose3d(*args)
    with cudnn_conv_tf32(precision == "tf32"):
        return torch.nn.functional.conv_transpose3d(*args)
