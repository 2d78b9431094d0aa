"""The face every engine shows the dispatcher: what it supports (devices and dtypes as data,
``call_reasons`` for the rest), its precision, forward and run, and its timing as "auto" measures it."""
from __future__ import annotations

from typing import Callable

import torch

from ..core.call import Call, autocast_inputs
from ..dispatch.steady import Direct, Repeat, steady_key
from ..dispatch.timing import Timing, time_call
from . import op as ops
from .torch.calls import torch_forward


def memo_check(call: Call, make: Callable[..., Direct]) -> Callable[[], bool]:
    """The check a weight's memo (``make``: ``steady.Direct`` or a Repeat maker) does on a repeat, for ``time``."""
    p = call.params
    args = (p.stride, p.padding, p.output_padding, p.groups, p.dilation)
    x, w, b = call.given
    memo: list[Direct] = []

    def check() -> bool:
        if not memo:
            memo.append(make(x, w, b, args, None, call.requested))
        return memo[0].fits(x, w, b, args, None, call.requested)

    return check


class Engine:
    """The face every engine shows the dispatcher."""

    name: str = ""
    devices: tuple[str, ...] | None = ("cuda", "cpu")  # None: any
    dtypes: tuple[torch.dtype, ...] | None = (torch.float32, torch.float16, torch.bfloat16)  # None: any

    def not_supported_reasons(self, call: Call) -> list[str]:
        """Why it cannot run the call: the declared support first, then ``call_reasons``."""
        reasons = []
        if self.devices is not None and call.device.type not in self.devices:
            reasons.append(f"device {call.device.type!r} (runs on {', '.join(self.devices)})")
        if self.dtypes is not None and call.dtype not in self.dtypes:
            reasons.append(f"dtype {call.dtype} (runs {', '.join(str(d).replace('torch.', '') for d in self.dtypes)})")
        return reasons or self.call_reasons(call)

    def call_reasons(self, call: Call) -> list[str]:
        """Why it cannot run this call beyond the declared support (shapes, layouts, limits)."""
        return []

    def precision(self, call: Call) -> str:
        """The precision this engine computes the call at (float32 semantics)."""
        return call.precision

    def precision_reasons(self, call: Call) -> list[str]:
        """Why it cannot compute an explicitly requested precision: a named backend raises; "auto" still runs it."""
        return []

    def forward(self, call: Call) -> torch.Tensor:
        """The plain forward (no autograd recording)."""
        raise NotImplementedError

    def run(self, call: Call) -> torch.Tensor:
        if call.training:
            return ops.conv_transpose3d_autograd(call.x, call.weight, call.bias, call.params, self.precision(call),
                                                 self._autograd_engine or self.name)
        return self.forward(call)

    _autograd_engine = ""  # the engine ops.conv_transpose3d_autograd runs the forward with, where not this one

    def time(self, call: Call) -> Timing:
        # Each timed call does what a steady-path repeat does (memo check, autocast, a Call through ``run``): a
        # host-bound layer's public call costs more than its forward, and leaving that out can pick a slower engine.
        cost = self.steady_cost(call)
        if not call.training:
            def forward(repeat: bool):
                cost()
                return self._timed(call, call.given, False, repeat)

            # The first call is a first sight (caches primed, ranks agreed); the timed ones are repeats.
            with torch.no_grad():
                return time_call(lambda: forward(True), first=lambda: forward(False))
        step = self._step(call, cost)
        return time_call(step, first=lambda: step(False))

    def _timed(self, call: Call, given: tuple, training: bool, repeat: bool) -> torch.Tensor:
        """One call as ``convt3d.conv_transpose3d`` makes it once this engine is decided; 5-D output."""
        x, w, b = autocast_inputs(*given)
        if call.unbatched:
            x = x.unsqueeze(0)
        return self.run(Call(x, w, b, call.params, call.precision, call.requested, training, call.unbatched,
                             repeat=repeat))

    def steady_cost(self, call: Call) -> Callable[[], object]:
        """The host work a repeat of this engine's call does before ``run``: the steady key of its arguments."""
        x, w, b = call.given
        p, requested = call.params, call.requested
        return lambda: steady_key(x, w, b, p.stride, p.padding, p.output_padding, p.groups, p.dilation, None, requested)

    def _step(self, call: Call, cost: Callable[[], object]) -> Callable[[], object]:
        """A training step on the caller's tensors (``cost``, forward, grads of a fixed dY); ``step(False)``: first."""
        leaves = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad) for t in call.given)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        with torch.no_grad():
            dy = torch.randn_like(torch_forward(call.x, call.weight, call.bias, call.params, call.requested))

        def step(repeat: bool = True):
            with torch.enable_grad():
                cost()
                return torch.autograd.grad(self._timed(call, leaves, True, repeat), wanted, dy)

        return step


class LaunchedRepeats(Engine):
    """An engine whose inference repeats (and timings) go from the weight's ``steady.Repeat`` to its
    ``steady_launcher(x, weight, bias, params, precision)``: (run(x, weight, bias), alive()) of a settled
    inference signature, or None."""

    @staticmethod
    def _repeats_launch(call: Call) -> bool:
        """Whether a repeat goes from the weight's Repeat memo to the launcher: plain-tensor inference, no autocast."""
        return (not call.training and call.sources is None and type(call.x) is torch.Tensor
                and not torch.is_autocast_enabled(call.device.type))

    def steady_cost(self, call: Call) -> Callable[[], object]:
        """A repeat that its weight's Repeat memo answers costs that memo's check, not the key."""
        if not self._repeats_launch(call):
            return super().steady_cost(call)
        return memo_check(call, lambda *a: Repeat(*a, lambda: True))

    def _timed(self, call: Call, given: tuple, training: bool, repeat: bool) -> torch.Tensor:
        # A repeat runs the launcher alone, as the steady path does (looked up per call: held, it keeps tensors).
        if repeat and not training and self._repeats_launch(call):
            launcher = self.steady_launcher(call.x, call.weight, call.bias, call.params, call.precision)
            if launcher is not None:
                return launcher[0](call.x, call.weight, call.bias)
        return super()._timed(call, given, training, repeat)
