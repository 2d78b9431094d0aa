"""The Triton engine as the dispatcher sees it (``TritonEngine``), and PyTorch's forward recorded
with its backward for training steps (``HybridEngine``)."""
from __future__ import annotations

from typing import Callable

import torch

from ...core.call import Call
from ...dispatch import distributed
from ...dispatch.registry import HYBRID
from ..base import Engine, LaunchedRepeats
from ..torch.calls import torch_forward
from ..torch.peer import TorchEngine
from . import background
from . import engine as triton_engine
from .configs import CandidateFailure, device_name, tuned_config
from .persist import flush_triton, has_pending, prime_triton
from .warm_up import start_warm_up


class TritonEngine(LaunchedRepeats):
    """The phase-decomposed implicit GEMM in Triton (``convt3d.engines.triton.engine``)."""

    name = "triton"

    def __init__(self):
        self._primed: set = set()

    tuner = triton_engine  # holds the tuning records the ranks agree on (dispatch.distributed)

    def call_reasons(self, call: Call) -> list[str]:
        why = triton_engine.unsupported_reason(call.x, call.params)
        return [] if why is None else [why]

    def epilogue_reasons(self, call: Call, epi=None) -> list[str]:
        """Why the engine cannot run ``call`` with the epilogue ``epi`` fused into its GEMM (``engine.forward``)."""
        why = self.not_supported_reasons(call)
        fused = None if why else triton_engine.epilogue_reason(call.params, call.x, call.weight, call.precision, epi)
        return why + ([fused] if fused else [])

    # Why auto does not time it on a call yet (its candidates not compiled), and what compiles them.
    not_ready = staticmethod(background.not_ready)
    make_ready = staticmethod(background.start)

    @staticmethod
    def input_reason(x: torch.Tensor) -> str | None:
        """Why the engine cannot run calls on this input at all, for callers without the geometry."""
        return triton_engine.unsupported_reason(x, None)

    def forward(self, call: Call) -> torch.Tensor:
        self._prime(call)
        return triton_engine.forward(call.x, call.weight, call.bias, call.params, call.precision)

    def run(self, call: Call) -> torch.Tensor:
        if call.training:
            self._prime(call)
        return super().run(call)

    def steady_launcher(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        params, precision: str):
        """``triton_engine.steady_launcher``; on CUDA its ``run`` persists pending tuning results first."""
        launcher = triton_engine.steady_launcher(x, weight, bias is not None, params, precision)
        if launcher is None or x.device.type != "cuda":
            return launcher
        launch, alive = launcher

        def run(x, weight, bias):
            if has_pending():
                flush_triton()
            return launch(x, weight, bias)

        return run, alive

    def _prime(self, call: Call) -> None:
        """A signature's first CUDA call seeds its tile from the disk cache or tunes it; later calls persist results."""
        if call.device.type != "cuda":
            return
        key = None if call.repeat else (call.key, call.bias is not None)
        if key is not None and key not in self._primed:
            self._primed.add(key)
            start_warm_up()
            plan = triton_engine.plan(call.params, call.x, call.weight, call.precision)
            tk = plan.tune_key
            prime_triton(device_name(call.device), tk, plan.configs)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return  # nothing is timed inside graph capture: triton_engine.forward runs the default
            if distributed.active() or tuned_config(tk) is None:
                launch = triton_engine.prepare(call.x, call.weight, call.bias, call.params, call.precision)

                def choose():
                    shortlist = triton_engine.first_candidates(launch, call.params, call.x, call.precision)
                    return tuned_config(tk) or triton_engine._choose(tk, shortlist, guarded(launch.run))

                if distributed.active():
                    # Every rank takes rank 0's tile at its first sight of the signature, whatever its own cache held.
                    distributed.agree_config(tk, choose, launch.configs, tuner=triton_engine)
                elif launch.y.numel():
                    choose()
        elif has_pending():
            flush_triton()

    def forget(self) -> None:
        self._primed.clear()
        background.forget()


def guarded(run: Callable[[triton_engine.Config], object]) -> Callable[[triton_engine.Config], object]:
    """``run`` for the tuner: a candidate that raises (one this GPU cannot compile) returns a ``CandidateFailure``,
    so that it is left out rather than failing the call."""

    def attempt(cfg):
        try:
            return run(cfg)
        except Exception as exc:  # noqa: BLE001 -- any failure of one candidate leaves it out
            return CandidateFailure(f"{type(exc).__name__}: {exc}"[:300])

    return attempt


class HybridEngine(Engine):
    """Training steps only: PyTorch's forward with convt3d's backward, where cuDNN's dX is many times slower."""

    name = HYBRID
    _autograd_engine = "torch"

    devices = dtypes = None

    def call_reasons(self, call: Call) -> list[str]:
        return [] if call.training else ["not a training call (PyTorch's forward with convt3d's backward)"]

    @staticmethod
    def not_ready(call: Call) -> str | None:
        """Timed once the Triton engine's candidates are compiled (its backward's compile at that measurement)."""
        if triton_engine.unsupported_reason(call.x, call.params) is not None:
            return None
        why = background.not_ready(call)
        return None if why is None else "waits for the Triton engine: " + why

    @staticmethod
    def make_ready(call: Call) -> None:
        background.start(call)

    # Its precision is the call's (``Engine.precision``), also that of convt3d's backward kernels.
    precision_reasons = TorchEngine.precision_reasons

    def forward(self, call: Call) -> torch.Tensor:
        return torch_forward(call.x, call.weight, call.bias, call.params, call.requested)
