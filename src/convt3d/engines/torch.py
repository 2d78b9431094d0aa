"""PyTorch's own forward (cuDNN on CUDA), as convt3d runs it: the "torch" engine's work, the
forward of the ``torch+bwd`` training step, and the baseline every "auto" measurement compares
against.

A leaf module (it imports nothing of convt3d), so the dispatcher, the autograd wrappers and the
backward can all use it without importing each other.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["cudnn_conv_allows_tf32", "cudnn_conv_tf32", "set_backend_flag", "at_flags_as_they_are", "torch_forward",
           "conv3d_form_reasons", "conv3d_padding", "conv3d_weight", "conv3d_forward"]


def cudnn_conv_allows_tf32() -> bool:
    """The TF32 flag PyTorch's convolutions read. Since torch 2.9 that is the per-operator
    ``torch.backends.cudnn.conv.fp32_precision`` ("tf32" or not); the legacy
    ``torch.backends.cudnn.allow_tf32`` getter mirrors it but raises RuntimeError once the new
    API has set conv and rnn differently (e.g. ``cudnn.conv.fp32_precision = "ieee"``).

    Read on every call: through ``torch._C``'s getter where it exists (the attribute path
    through ``torch.backends``' module ``__getattr__`` costs several times more)."""
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
    """``setattr(obj, attr, value)`` on a ``torch.backends`` flag, also where PyTorch's own test
    harness froze those flags (``torch.backends.disable_global_flags()``, which importing
    ``torch.testing._internal.common_utils`` calls): a plain assignment then raises RuntimeError
    ("not allowed to set torch.backends.cudnn flags"). The bracketed mutation is the context
    PyTorch's own ``flags()`` managers set them in; our changes are bracketed too (restored on
    exit)."""
    frozen = getattr(torch.backends, "flags_frozen", None)
    allow = getattr(torch.backends, "__allow_nonbracketed_mutation", None)
    if frozen is not None and allow is not None and frozen():
        with allow():
            setattr(obj, attr, value)
    else:
        setattr(obj, attr, value)


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
            set_backend_flag(self._obj, self._attr, self._value)
        return self

    def __exit__(self, *exc):
        if self._old != self._value:
            set_backend_flag(self._obj, self._attr, self._old)
        return False


def at_flags_as_they_are(x, precision) -> bool:
    """Whether PyTorch's forward of a call with this input and requested precision runs at cuDNN's
    flags as they are (True), or sets the TF32 flag for the call (CUDA float32 with a precision)."""
    return precision is None or x.device.type != "cuda" or x.dtype != torch.float32


def torch_forward(x, weight, bias, params, precision):
    """PyTorch's forward of a validated call. A precision for CUDA float32 sets cuDNN's TF32 flag
    for this call only ("tf32": TF32 on; any exact grade: off); None follows the flag as it is."""
    args = (x, weight, bias, params.stride, params.padding, params.output_padding, params.groups, params.dilation)
    return _at_precision(torch.nn.functional.conv_transpose3d, args, precision)


def _at_precision(op, args: tuple, precision):
    """``op(*args)`` (a PyTorch convolution whose input is ``args[0]``) at the call's precision:
    cuDNN's flags as they are, or its TF32 flag set for this call (``at_flags_as_they_are``)."""
    if at_flags_as_they_are(args[0], precision):
        return op(*args)
    with cudnn_conv_tf32(precision == "tf32"):
        return op(*args)


# ---- the conv3d form of a stride-1 call ----------------------------------------------------------
# At stride 1 a transposed convolution is a plain one: y[o] = sum_k x[o + p - d k] w[k] is the
# cross-correlation of x, padded by d (K - 1) - p, with the weight flipped along every kernel
# axis and its two channel axes swapped (per group). cuDNN runs that conv3d on its forward
# kernels, and runs conv_transpose3d on its dgrad kernels, which are several times slower at
# TF32 on such calls (docs/design.md, "The conv3d form of stride-1 calls").


def conv3d_form_reasons(params, dtype: torch.dtype, precision: str) -> list[str]:
    """Why a call has no conv3d form (empty: it has one). It needs stride 1, and then an
    output_padding of 0: the extra rows would need padding on one side only (a copy of x).

    Not for float32 at exact grade: with TF32 off, cuDNN's conv3d can pick an algorithm whose
    error is several times its conv_transpose3d's, beyond the error budget of twice cuDNN's
    own; at exact grade the two run equally fast (docs/design.md, "The conv3d form of stride-1 calls"), so nothing is lost."""
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
    """The conv3d weight of a transposed convolution's ``weight`` [Cin, Cout/g, kD, kH, kW]:
    [Cout, Cin/g, kD, kH, kW], flipped along the kernel axes, in the weight's memory format
    (PyTorch picks channels-last output when the weight is channels-last, for either op).
    Two copies (flip, then the channel swap): PyTorch has no negative strides, and a flipped
    view is what one copy would need."""
    cin, cout_g = weight.shape[0], weight.shape[1]
    k = tuple(weight.shape[2:])
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
    """A stride-1 call (``conv3d_form_reasons`` empty) as PyTorch's conv3d, at the call's
    precision as ``torch_forward``. Padding beyond d (K - 1) trims x instead (a view): the conv3d's padding
    would be negative there."""
    pad, trim = conv3d_padding(params)
    if trim != (0, 0, 0):
        x = x[:, :, trim[0]:x.shape[2] - trim[0], trim[1]:x.shape[3] - trim[1], trim[2]:x.shape[4] - trim[2]]
    args = (x, conv3d_weight(weight, params.groups), bias, 1, pad, params.dilation, params.groups)
    return _at_precision(torch.nn.functional.conv3d, args, precision)
