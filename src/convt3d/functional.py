"""``convt3d.conv_transpose3d``: a drop-in for ``torch.nn.functional.conv_transpose3d``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_engine
from .dispatch import cudnn_conv_tf32, decide
from .ops import conv_transpose3d_op
from .validate import check_call

__all__ = ["conv_transpose3d"]


def _needs_op(tensors) -> bool:
    """Autograd or torch.compile need the registered custom op; plain inference calls the
    engine directly and skips the dispatcher round trip (~10 us per call)."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     backend=None, precision=None):
    """3-D transposed convolution with the signature and semantics of
    ``torch.nn.functional.conv_transpose3d``.

    Args (beyond PyTorch's):
        backend: "auto" (default; ``$CONVT3D_BACKEND`` overrides the default), "triton" (our
            engine; on CPU tensors it runs through Triton's interpreter), "torch" (PyTorch's
            own implementation) or "cuda" (not built yet). A named backend that cannot run the
            call raises :class:`convt3d.BackendUnavailableError`; only "auto" falls back.
        precision: float32 only. None follows ``torch.backends.cudnn.allow_tf32`` as PyTorch's
            convolutions do (True: "tf32", False: exact grade); or "tf32", "tf32x3", "ieee".
            float16/bfloat16 multiply in their own type and accumulate in float32.
    """
    params, unbatched = check_call(input, weight, bias, stride, padding, output_padding, groups, dilation)
    d = decide(input, backend, precision, params)
    if d.engine == "torch":
        return _torch_forward(input, weight, bias, params, precision)
    x = input.unsqueeze(0) if unbatched else input
    if _needs_op((x, weight, bias)):
        y = conv_transpose3d_op(x, weight, bias, list(params.stride), list(params.padding),
                                list(params.output_padding), params.groups, list(params.dilation), d.precision)
    else:
        y = triton_engine.forward(x, weight, bias, params, d.precision)
    return y.squeeze(0) if unbatched else y


def _torch_forward(input, weight, bias, params, precision):
    args = (input, weight, bias, params.stride, params.padding, params.output_padding, params.groups,
            params.dilation)
    if precision is None or input.device.type != "cuda" or input.dtype != torch.float32:
        return F.conv_transpose3d(*args)
    # An explicit precision for cuDNN: set its TF32 flag for this call only.
    with cudnn_conv_tf32(precision == "tf32"):
        return F.conv_transpose3d(*args)
