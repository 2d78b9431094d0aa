"""The one ordered dispatcher: which engine runs a call, at which precision.

Order of decisions, for every call:

1. invalid arguments raise (``convt3d.validate.check_call``) -- before any engine is chosen;
2. the backend name is resolved: the ``backend=`` argument, else ``$CONVT3D_BACKEND``, else
   "auto"; an unknown name raises ValueError;
3. the precision is resolved (float32 only): None follows ``torch.backends.cudnn.allow_tf32``
   like PyTorch's convolutions ("tf32" when True, exact grade when False);
4. "auto" picks an engine (unsupported input falls back to "torch" here, and only here);
   an explicitly named engine that cannot run the call raises BackendUnavailableError.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import triton_engine
from .errors import BackendUnavailableError

__all__ = ["BACKENDS", "PRECISIONS", "EXACT_GRADE", "Decision", "resolve_backend_name", "resolve_precision",
           "decide"]

BACKENDS = ("auto", "triton", "torch", "cuda")
PRECISIONS = ("tf32", "tf32x3", "ieee")

# Exact grade = what precision=None means when TF32 is off. tf32x3 (three TF32 MMAs per
# product, split hi/lo operands) is ~2.4x faster than FMA "ieee" at peak (3 x 1/374 vs 1/51
# TFLOP/s) and stays within 2x of cuDNN's own exact-fp32 error (tests/test_gpu.py checks both).
EXACT_GRADE = "tf32x3"

_ENV = "CONVT3D_BACKEND"


@dataclass(frozen=True)
class Decision:
    engine: str  # "triton" or "torch"
    precision: str  # "tf32" | "tf32x3" | "ieee" (meaningful for float32 only)
    reason: str


def resolve_backend_name(backend: str | None) -> str:
    if backend is None:
        env = os.environ.get(_ENV)
        if env is None or env == "":
            return "auto"
        if env not in BACKENDS:
            raise ValueError(f"environment variable {_ENV}={env!r} is not a backend; expected one of {BACKENDS}")
        return env
    if not isinstance(backend, str):
        raise TypeError(f"conv_transpose3d(): argument 'backend' must be str or None, not {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}; expected one of {BACKENDS}")
    return backend


def _cudnn_conv_allows_tf32() -> bool:
    """The TF32 flag PyTorch's convolutions read. Since torch 2.9 that is the per-operator
    ``torch.backends.cudnn.conv.fp32_precision`` ("tf32" or not); the legacy
    ``torch.backends.cudnn.allow_tf32`` getter mirrors it but raises RuntimeError once the new
    API has set conv and rnn differently (e.g. ``cudnn.conv.fp32_precision = "ieee"``)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
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
        setattr(self._obj, self._attr, self._value)
        return self

    def __exit__(self, *exc):
        setattr(self._obj, self._attr, self._old)
        return False


def resolve_precision(precision: str | None) -> str:
    """Map the user's precision to a concrete one (float32 semantics)."""
    if precision is None:
        return "tf32" if _cudnn_conv_allows_tf32() else EXACT_GRADE
    if not isinstance(precision, str):
        raise TypeError(f"conv_transpose3d(): argument 'precision' must be str or None, not {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}; expected None or one of {PRECISIONS}")
    return precision


def decide(input: torch.Tensor, backend: str | None, precision: str | None, params=None) -> Decision:
    """Steps 2-4 of the module docstring (arguments are already validated)."""
    name = resolve_backend_name(backend)
    prec = resolve_precision(precision)
    if name == "auto":
        if input.device.type != "cuda":
            return Decision("torch", prec, "auto: CPU tensors use PyTorch")
        if input.dtype not in triton_engine.SUPPORTED_DTYPES:
            return Decision("torch", prec, f"auto: dtype {input.dtype} is not run by the Triton engine")
        why = triton_engine.unsupported_reason(input, params)
        if why is not None:
            return Decision("torch", prec, f"auto: Triton engine unsupported here ({why})")
        return Decision("triton", prec, "auto: CUDA float32/float16/bfloat16 use the Triton engine")
    if name == "triton":
        why = triton_engine.unsupported_reason(input, params)
        if why is not None:
            raise BackendUnavailableError(f"backend='triton' cannot run this call: {why}")
        return Decision("triton", prec, "backend='triton' requested")
    if name == "torch":
        if precision == "tf32x3":
            raise BackendUnavailableError("backend='torch' cannot run precision='tf32x3' (cuDNN offers 'tf32' or "
                                          "exact fp32 'ieee'); use backend='triton' or 'auto'")
        return Decision("torch", prec, "backend='torch' requested")
    raise BackendUnavailableError("backend='cuda' (the CUDA C++ engine) is not available in this build; "
                                  "use 'auto', 'triton' or 'torch'")
