"""The flags a call runs under: cuDNN's TF32 switch as PyTorch reads it, set for one call and
restored, also where PyTorch's test harness froze the flags."""
from __future__ import annotations

import torch


def cudnn_conv_allows_tf32() -> bool:
    """The TF32 flag PyTorch's convolutions read: the per-operator ``cudnn.conv.fp32_precision``
    where torch has it (the legacy ``allow_tf32`` getter can raise then), read on every call through
    ``torch._C``'s getter, several times cheaper than the attribute path."""
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


def set_backend_flag(obj, attr: str, value) -> None:
    """``setattr`` on a ``torch.backends`` flag, also where PyTorch's test harness froze them."""
    frozen = getattr(torch.backends, "flags_frozen", None)
    allow = getattr(torch.backends, "__allow_nonbracketed_mutation", None)
    if frozen is not None and allow is not None and frozen():
        with allow():
            setattr(obj, attr, value)
    else:
        setattr(obj, attr, value)


class cudnn_conv_tf32:
    """Context manager: PyTorch's convolutions run with TF32 on or off, restored on exit."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        conv = getattr(torch.backends.cudnn, "conv", None)
        if conv is not None and hasattr(conv, "fp32_precision"):
            self._obj, self._attr, self._value = conv, "fp32_precision", "tf32" if self.enabled else "ieee"
        else:
            self._obj, self._attr, self._value = torch.backends.cudnn, "allow_tf32", self.enabled
        self._old = getattr(self._obj, self._attr)
        # Set only on a change: the flag's setter costs host time every backward would pay twice.
        if self._old != self._value:
            set_backend_flag(self._obj, self._attr, self._value)
        return self

    def __exit__(self, *exc):
        if self._old != self._value:
            set_backend_flag(self._obj, self._attr, self._old)
        return False


def at_flags_as_they_are(x, precision) -> bool:
    """Whether PyTorch's forward runs at cuDNN's flags as they are (all but CUDA float32 with a precision)."""
    return precision is None or x.device.type != "cuda" or x.dtype != torch.float32


def at_precision(op, args: tuple, precision):
    """``op(*args)`` (a PyTorch convolution whose input is ``args[0]``) at the call's precision."""
    if at_flags_as_they_are(args[0], precision):
        return op(*args)
    with cudnn_conv_tf32(precision == "tf32"):
        return op(*args)


def device_name(device: torch.device) -> str:
    """The GPU model a decision or a tuning result holds for ("cpu" off CUDA)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
