"""The CUDA engine as the dispatcher sees it: the head kernel (``convt3d.engines.cuda.head``) for
output heads at dilation 1, float32 at TF32, bfloat16 and float16, built with nvcc."""
from __future__ import annotations

import torch

from ...core.call import Call
from .. import op as ops
from ..base import Engine

__all__ = ["CudaEngine"]


class CudaEngine(Engine):
    """The CUDA head kernel: output heads (few output channels per group) at dilation 1."""

    name = "cuda"
    _autograd_engine = "cuda"
    devices = ("cuda",)
    min_capability = (8, 0)  # bf16 mma.sync and cp.async

    def call_reasons(self, call: Call) -> list[str]:
        from . import build, head

        why = head.call_reason(call.x, call.params, call.precision)
        if why is None and (failed := build.failure(call.device, call.dtype)):
            why = f"its library failed to build: {failed}"
        return [] if why is None else [why]

    @staticmethod
    def not_ready(call: Call) -> str | None:
        """Why auto does not time it yet: its library for this GPU and dtype is not built (one starts)."""
        from . import build

        if build.ready(call.device, call.dtype):
            return None
        build.start(call.device, call.dtype)
        return (f"its library for {str(call.dtype).replace('torch.', '')} on this GPU is "
                f"{build.status(call.device, call.dtype)} (nvcc, off the call's path; 'convt3d build' builds it ahead)")

    def precision_reasons(self, call: Call) -> list[str]:
        if call.dtype == torch.float32 and call.requested in ("tf32x3", "ieee"):
            return [f"precision {call.requested!r} (the head kernel computes float32 at TF32 only)"]
        return []

    def forward(self, call: Call) -> torch.Tensor:
        return ops.run_engine("cuda", call.x, call.weight, call.bias, call.params, self.precision(call))
