"""``TorchEngine``: PyTorch's own call, a peer of our engines (auto's baseline); ``Conv3dEngine``: stride-1 conv3d."""
from __future__ import annotations

from typing import Callable

import torch

from ...core.call import Call
from ...core.flags import at_flags_as_they_are
from ...dispatch.steady import Direct
from .. import op as ops
from ..base import Engine, LaunchedRepeats, memo_check
from .calls import conv3d_form_reasons, torch_autograd_at_precision, torch_forward

# PyTorch's TF32-allowed call is full fp32 where within this fraction of the output's largest magnitude
# of the exact-fp32 call's: fp32 summation order moves results by about 1e-6 of it, TF32 by 1e-4.
FP32_CLASS_TOL = 2e-5


class TorchEngine(Engine):
    """PyTorch's own forward and backward (cuDNN on CUDA)."""

    name = "torch"
    devices = dtypes = None

    def precision_reasons(self, call: Call) -> list[str]:
        if call.requested == "tf32x3":
            return ["precision 'tf32x3' (cuDNN offers 'tf32' or exact fp32 'ieee')"]
        return []

    def precision(self, call: Call) -> str:
        return call.precision if call.dtype != torch.float32 or call.precision == "tf32" else "ieee"

    def forward(self, call: Call) -> torch.Tensor:
        return torch_forward(call.x, call.weight, call.bias, call.params, call.requested)

    def run(self, call: Call) -> torch.Tensor:
        if call.training and not at_flags_as_they_are(call.x, call.requested):
            # An explicit precision holds for the backward too, whatever the flag when it runs.
            return torch_autograd_at_precision(call.x, call.weight, call.bias, call.params, call.requested)
        return self.forward(call)  # differentiable as it is

    @staticmethod
    def precision_class(call: Call) -> str:
        """"fp32" where cuDNN computes this float32 call in full fp32 with TF32 allowed (measured), else "tf32"."""
        gen = torch.Generator(device=call.device).manual_seed(0)
        x = torch.empty_like(call.x).normal_(generator=gen)
        w = torch.empty_like(call.weight).normal_(generator=gen)
        with torch.no_grad():
            y = torch_forward(x, w, None, call.params, "tf32")
            ref = torch_forward(x, w, None, call.params, "ieee")
        scale = float(ref.abs().max()) or 1.0
        return "fp32" if float((y - ref).abs().max()) <= FP32_CLASS_TOL * scale else "tf32"

    def run_arguments(self, input, weight, bias, stride, padding, output_padding, groups, dilation):
        """The steady path at the flags as they are: PyTorch's own op on the caller's arguments, autocast included."""
        return torch.nn.functional.conv_transpose3d(input, weight, bias, stride, padding, output_padding, groups,
                                                    dilation)

    def _timed(self, call: Call, given: tuple, training: bool, repeat: bool) -> torch.Tensor:
        # At the flags as they are, a repeat is PyTorch's own op on the caller's tensors (it casts under autocast).
        if call.sources is None or not at_flags_as_they_are(call.x, call.requested):
            return super()._timed(call, given, training, repeat)
        p = call.params
        y = self.run_arguments(*given, p.stride, p.padding, p.output_padding, p.groups, p.dilation)
        return y.unsqueeze(0) if call.unbatched else y

    def steady_cost(self, call: Call) -> Callable[[], object]:
        """At the flags as they are a repeat costs its direct memo's check (``steady.Direct``), else the key."""
        if not at_flags_as_they_are(call.x, call.requested):
            return super().steady_cost(call)
        return memo_check(call, Direct)


class Conv3dEngine(LaunchedRepeats):
    """A stride-1 call as PyTorch's conv3d (``calls.conv3d_forward``): cuDNN's forward kernels, not its
    slower dgrad kernels; training steps take convt3d's backward (autograd would run dX on those)."""

    name = "conv3d"
    dtypes = None  # any dtype PyTorch's conv3d takes (conv3d_form_reasons has the rest)

    def call_reasons(self, call: Call) -> list[str]:
        return conv3d_form_reasons(call.params, call.dtype, call.precision)

    # Its precision is the call's: not_supported_reasons leaves it TF32 or 16-bit.
    precision_reasons = TorchEngine.precision_reasons

    def forward(self, call: Call) -> torch.Tensor:
        return ops.run_engine("conv3d", call.x, call.weight, call.bias, call.params, call.precision)

    def steady_launcher(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params, precision: str):
        """(run, alive) for ``steady.Repeat``: the conv3d form without the key and the Call, a tiny layer's cost."""
        return (lambda x, weight, bias: ops.run_engine("conv3d", x, weight, bias, params, precision)), lambda: True
