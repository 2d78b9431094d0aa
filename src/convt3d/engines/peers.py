"""The engines, as peers with one face, so the dispatcher makes one ordered pass over them.

Each engine answers, for a validated :class:`convt3d.core.call.Call`:

* ``not_supported_reasons(call)`` -- why it cannot run the call; an empty list means it can;
* ``run(call)`` -- the forward (5-D output); when autograd records the call, the forward is
  recorded with the engine's backward;
* ``time(call)`` -- a :class:`Timing` of what "auto" would choose it for (the forward, or for a
  training call the whole step: forward, then the gradients the call needs): the median ms of
  back-to-back calls, and the host ms per call of calls enqueued without waiting for the GPU;
* ``backward`` -- whose backward its training steps take: "convt3d" (``convt3d.engines.triton.backward``:
  per gradient the faster of cuDNN and our Triton kernels, timed once per signature) or
  "pytorch".

``ENGINES`` holds them in the dispatcher's preference order for ties: our engines first, then
the conv3d form of a stride-1 call (PyTorch's conv3d), then PyTorch, then PyTorch's forward with
convt3d's backward (training calls only).
"""
from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import torch

from ..dispatch import cache, distributed
from . import op as ops
from .triton import engine as triton_engine
from ..core.call import Call, autocast_inputs
from ..dispatch.steady import Direct, Repeat, steady_key
from .torch import at_flags_as_they_are, conv3d_form_reasons, torch_forward
from .triton.configs import HOST_CALLS, HOST_REP_MS  # noqa: F401 (re-exported)
from .triton.configs import CandidateFailure
from .triton.configs import _host_ms as triton_host_ms

__all__ = ["Engine", "TritonEngine", "CudaEngine", "TorchEngine", "Conv3dEngine", "HybridEngine", "ENGINES", "HYBRID",
           "MEASURE_WARMUP_MS", "MEASURE_REP_MS", "HOST_CALLS", "Timing"]

HYBRID = "torch+bwd"  # PyTorch's forward, convt3d's backward (training steps)

# do_bench budget of one timing (warm-up, then timed calls, of which the median is read): a short
# layer gets hundreds of timed calls, a long KernelBench row do_bench's minimum of one.
MEASURE_WARMUP_MS = 5.0
MEASURE_REP_MS = 25.0


class Timing(NamedTuple):
    """One timing round of a candidate.

    ``ms``: do_bench's median of back-to-back calls. It hides part of a call's host time:
    do_bench flushes the L2 (a 256 MB fill) before each timed call, and the call's host work
    before its first launch runs while the flush does. ``host_ms``: the host time per call of up
    to ``HOST_CALLS`` calls enqueued without synchronising. In a network that waits on the GPU
    now and then (a ``.item()``, a copy to the host), host time and GPU time add up, so "auto"
    charges a candidate the host time it costs beyond PyTorch's (``dispatch.pick``): a layer
    faster on the GPU alone can otherwise make such a network slower."""

    ms: float
    host_ms: float


def _host_ms(fn: Callable[[], object], ms: float) -> float:
    # One round, from one call up (auto times each candidate in several rounds itself: dispatch.MEASURE_ROUNDS).
    return triton_host_ms(fn, ms, rounds=1, least=1)


def _bench(fn: Callable[[], object], first: Callable[[], object] | None = None) -> Timing:
    import triton.testing

    # The first call (``first``, else ``fn``): Triton compiles and tunes, the cuda engine builds,
    # cuDNN picks its algorithm.
    (first or fn)()
    ms = float(triton.testing.do_bench(fn, warmup=MEASURE_WARMUP_MS, rep=MEASURE_REP_MS, return_mode="median"))
    return Timing(ms, _host_ms(fn, ms))


def _memo_check(call: Call, make: Callable[..., Direct]) -> Callable[[], bool]:
    """The check a weight's memo (``make``: ``steady.Direct`` or a ``steady.Repeat`` maker) does on
    a repeat of ``call``, for ``Engine.time`` to pay per timed call; the memo is made at the
    first check, under the grad mode of the timed calls."""
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
    backward: str = "convt3d"

    def not_supported_reasons(self, call: Call) -> list[str]:
        raise NotImplementedError

    def precision(self, call: Call) -> str:
        """The precision this engine computes the call at (float32 semantics)."""
        return call.precision

    def precision_reasons(self, call: Call) -> list[str]:
        """Why it cannot compute an explicitly requested precision as such. A named backend
        raises on these; "auto" still runs the engine where it computes at least as exactly
        (an exact-grade request is met by exact fp32)."""
        return []

    def forward(self, call: Call) -> torch.Tensor:
        """The plain forward (no autograd recording)."""
        raise NotImplementedError

    def run(self, call: Call) -> torch.Tensor:
        if call.training:
            return ops.conv_transpose3d_autograd(call.x, call.weight, call.bias, call.params, self.precision(call),
                                                 self._autograd_engine)
        return self.forward(call)

    _autograd_engine = ""  # the engine name ops.conv_transpose3d_autograd runs the forward with

    def time(self, call: Call) -> Timing:
        # Each timed call does what a repeated call of the steady path does with this engine's
        # decision -- its memo check (``steady_cost``), the autocast casts of the caller's
        # tensors, then a Call of its own through ``run`` (``_timed``) -- so that on a host-bound
        # layer the host cost of that path is in the measurement: the public call costs more
        # host time than the engine's forward alone, and a measurement without it can choose an
        # engine whose public call is slower than PyTorch's.
        cost = self.steady_cost(call)
        if not call.training:
            def forward(repeat: bool):
                cost()
                return self._timed(call, call.given, False, repeat)

            # The first call is a first sight (the engine primes its caches, agrees across
            # ranks); the timed ones are repeats.
            with torch.no_grad():
                return _bench(lambda: forward(True), first=lambda: forward(False))
        step = self._step(call, cost)
        return _bench(step, first=lambda: step(False))

    def _timed(self, call: Call, given: tuple, training: bool, repeat: bool) -> torch.Tensor:
        """One call as ``convt3d.conv_transpose3d`` makes it once this engine is decided: from
        ``given`` (tensors in the form the caller passes them, ``Call.given``), cast as every call
        casts them under autocast, then a Call of its own through ``run``. 5-D output."""
        x, w, b = autocast_inputs(*given)
        if call.unbatched:
            x = x.unsqueeze(0)
        return self.run(Call(x, w, b, call.params, call.precision, call.requested, training, call.unbatched,
                             repeat=repeat))

    def steady_cost(self, call: Call) -> Callable[[], object]:
        """The host work a repeated call decided for this engine does before ``run``: the steady
        key of its arguments (the caller's, before autocast)."""
        x, w, b = call.given
        p, requested = call.params, call.requested
        return lambda: steady_key(x, w, b, p.stride, p.padding, p.output_padding, p.groups, p.dilation, None,
                                  requested)

    def _step(self, call: Call, cost: Callable[[], object]) -> Callable[[], object]:
        """One training step on the call's own tensors (the caller's, where autocast cast them,
        with their casts in the step and in its backward): the steady path's memo check
        (``cost``), the forward, then the gradients of the tensors that require them, for a
        fixed random output gradient. ``step(repeat)``: a steady-path repeat unless ``repeat`` is
        False (the first step, a first sight as the forward's first timed call is)."""
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
    """An engine whose repeated inference calls go from the weight's ``steady.Repeat`` memo to
    its ``steady_launcher``, without the key and the Call; its timings take the same path, so
    that auto charges it the host time those repeats cost."""

    def steady_launcher(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params,
                        precision: str):
        """(run(x, weight, bias), alive()) of a settled inference signature, or None."""
        raise NotImplementedError

    @staticmethod
    def _repeats_launch(call: Call) -> bool:
        """Whether a repeat of this call goes through its weight's ``steady.Repeat`` memo straight
        to the launcher (dispatch.steady): inference on plain tensors outside autocast."""
        return (not call.training and call.sources is None and type(call.x) is torch.Tensor
                and not torch.is_autocast_enabled(call.device.type))

    def steady_cost(self, call: Call) -> Callable[[], object]:
        """A repeat that its weight's Repeat memo answers costs that memo's check, not the key."""
        if not self._repeats_launch(call):
            return super().steady_cost(call)
        return _memo_check(call, lambda *a: Repeat(*a, lambda: True))

    def _timed(self, call: Call, given: tuple, training: bool, repeat: bool) -> torch.Tensor:
        # A repeat of an inference call runs as the steady path runs it: the launcher alone, once
        # the first timed call has settled the signature (looked up per timed call, a key more
        # than the weight's memo, which holds it; held here it would keep the call's tensors).
        if repeat and not training and self._repeats_launch(call):
            launcher = self.steady_launcher(call.x, call.weight, call.bias, call.params, call.precision)
            if launcher is not None:
                return launcher[0](call.x, call.weight, call.bias)
        return super()._timed(call, given, training, repeat)


class TritonEngine(LaunchedRepeats):
    """The phase-decomposed implicit GEMM in Triton (``convt3d.engines.triton.engine``)."""

    name = "triton"
    _autograd_engine = "triton"

    def __init__(self):
        self._primed: set = set()

    def not_supported_reasons(self, call: Call) -> list[str]:
        why = triton_engine.unsupported_reason(call.x, call.params)
        return [] if why is None else [why]

    def forward(self, call: Call) -> torch.Tensor:
        self._prime(call)
        return triton_engine.forward(call.x, call.weight, call.bias, call.params, call.precision)

    def run(self, call: Call) -> torch.Tensor:
        if call.training:
            self._prime(call)
        return super().run(call)

    def steady_launcher(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        params, precision: str):
        """(run, alive) of a settled inference signature for ``steady.Repeat``
        (``triton_engine.steady_launcher``), or None; on CUDA ``run`` also persists pending
        tuning results first, as ``_prime`` does for a repeat."""
        launcher = triton_engine.steady_launcher(x, weight, bias is not None, params, precision)
        if launcher is None or x.device.type != "cuda":
            return launcher
        launch, alive = launcher

        def run(x, weight, bias):
            if cache.has_pending():
                cache.flush_triton()
            return launch(x, weight, bias)

        return run, alive

    def _prime(self, call: Call) -> None:
        """Before a signature's first call on CUDA, seed its tile choice from the disk cache, or
        tune it with every candidate's run guarded (``_guarded``); on later calls, persist tuning
        results that earlier calls produced (one set lookup and one flag check when there are
        none; the flag check alone for a steady-path repeat)."""
        if call.device.type != "cuda":
            return
        key = None if call.repeat else (call.key, call.bias is not None)
        if key is not None and key not in self._primed:
            self._primed.add(key)
            plan = triton_engine.plan(call.params, call.x, call.weight, call.precision)
            tk = plan.tune_key
            cache.prime_triton(triton_engine.device_name(call.device), tk, plan.configs)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return  # nothing is timed inside graph capture: triton_engine.forward runs the default
            if distributed.active():
                # Every rank agrees on the tile at its first sight of the signature, whatever it
                # seeded from its own cache file: rank 0 tunes (or keeps its seed), the others
                # take its config (convt3d.dispatch.distributed).
                launch = triton_engine.prepare(call.x, call.weight, call.bias, call.params, call.precision)
                distributed.agree_config(
                    tk, lambda: triton_engine.tuned_config(tk) or triton_engine._choose(tk, launch.configs,
                                                                                         _guarded(launch.run)),
                    launch.configs, tuner=triton_engine)
            elif triton_engine.tuned_config(tk) is None:
                launch = triton_engine.prepare(call.x, call.weight, call.bias, call.params, call.precision)
                if launch.y.numel():
                    triton_engine._choose(tk, launch.configs, _guarded(launch.run))
        elif cache.has_pending():
            cache.flush_triton()

    def forget(self) -> None:
        self._primed.clear()


def _guarded(run: Callable[[triton_engine.Config], object]) -> Callable[[triton_engine.Config], object]:
    """``run`` for the tuner, returning a candidate's failure (``CandidateFailure``) instead of
    raising it, so that a tile this GPU cannot compile (less shared memory per block than the
    H100/H200 the offer rules assume) is left out rather than failing the call. Here and not in
    ``triton_configs``: the KernelBench files carry that module verbatim, and KernelBench's static
    rules reject any try/except there (on the H200 it runs on, every candidate compiles)."""

    def attempt(cfg):
        try:
            return run(cfg)
        except Exception as exc:  # noqa: BLE001 -- any failure of one candidate leaves it out
            return CandidateFailure(f"{type(exc).__name__}: {exc}"[:300])

    return attempt


class CudaEngine(Engine):
    """The CUDA C++ engine: ``convt3d.engines.cuda.gemm`` (built with ``load_inline`` on first use;
    float32, its exact grade FFMA "ieee") and, for output heads at dilation 1, the head kernel
    ``convt3d.engines.cuda.head`` (float32 at TF32, bfloat16, float16; built with nvcc on first use)."""

    name = "cuda"
    _autograd_engine = "cuda"

    def __init__(self):
        self._mod: tuple | None = None

    def module(self):
        """(module, None) or (None, why the CUDA C++ engine is not available in this build)."""
        if self._mod is None:
            name = "convt3d.engines.cuda.gemm"
            try:
                self._mod = (importlib.import_module(name), None)
            except ModuleNotFoundError as exc:  # the module is optional
                what = "is not in this build" if exc.name == name else f"cannot be imported ({exc})"
                self._mod = (None, f"the CUDA C++ engine (convt3d.engines.cuda.gemm) {what}")
            except ImportError as exc:
                self._mod = (None, f"the CUDA C++ engine (convt3d.engines.cuda.gemm) cannot be imported ({exc})")
        return self._mod

    def precisions(self) -> tuple[str, ...]:
        mod = self.module()[0]
        return tuple(getattr(mod, "PRECISIONS", ("ieee",))) if mod is not None else ("ieee",)

    def precision(self, call: Call) -> str:
        # Exact grade is its FFMA "ieee"; TF32 where the build has that mode (the head kernel's
        # only fp32 mode).
        return "tf32" if call.precision == "tf32" and "tf32" in self.precisions() else "ieee"

    @staticmethod
    def head_reason(call: Call) -> str | None:
        """Why the call does not run on the head kernel (``cuda_head.call_reason``), or None."""
        from .cuda import head as cuda_head

        return cuda_head.call_reason(call.x, call.params, call.precision)

    def not_supported_reasons(self, call: Call) -> list[str]:
        mod, why = self.module()
        if mod is None:  # the head kernel's launcher builds with cuda_engine's compiler lookup
            return [why]
        head = self.head_reason(call)
        if head is None:
            return []
        reasons = []
        if call.dtype != torch.float32:
            reasons.append(f"dtype {call.dtype} (the cuda engine computes float32, and 16-bit output heads on its "
                           f"head kernel, which does not take this call: {head})")
        if call.requested == "tf32" and "tf32" not in self.precisions():
            reasons.append("precision 'tf32' (this build of the cuda engine computes ieee only)")
        if not reasons:
            why = mod.unsupported_reason(call.x, call.weight, call.params)
            if why is not None:
                reasons.append(why)
        return reasons

    def precision_reasons(self, call: Call) -> list[str]:
        if call.requested == "tf32x3":
            return ["precision 'tf32x3' (the cuda engine's exact grade is FFMA 'ieee')"]
        return []

    def slow_path(self, call: Call) -> str | None:
        """Why "auto" does not time the cuda engine on a call it can run: only its
        register-blocked gemm_kernel is a contender; its older phase_kernel tiles and the direct
        kernel are slower, and timing them can stall a measuring run for minutes (many taps, few
        output channels), so the fallbacks are never timed by auto; backend='cuda' still runs
        them."""
        mod = self.module()[0]
        if mod is not None and self.head_reason(call) is None:
            return None
        choose, gemm = getattr(mod, "choose_variant", None), getattr(mod, "GEMM_VARIANTS", None)
        if choose is None or gemm is None:
            return None
        variant = choose(call.params)
        if variant in gemm:
            return None
        return f"its tile for this geometry is {variant!r}, not gemm_kernel (slow fallback, not measured by auto)"

    def forward(self, call: Call) -> torch.Tensor:
        return ops.run_engine("cuda", call.x, call.weight, call.bias, call.params, self.precision(call))


class TorchEngine(Engine):
    """PyTorch's own forward and backward (cuDNN on CUDA)."""

    name = "torch"
    backward = "pytorch"

    def not_supported_reasons(self, call: Call) -> list[str]:
        return []

    def precision_reasons(self, call: Call) -> list[str]:
        if call.requested == "tf32x3":
            return ["precision 'tf32x3' (cuDNN offers 'tf32' or exact fp32 'ieee')"]
        return []

    def precision(self, call: Call) -> str:
        return call.precision if call.dtype != torch.float32 or call.precision == "tf32" else "ieee"

    def forward(self, call: Call) -> torch.Tensor:
        return torch_forward(call.x, call.weight, call.bias, call.params, call.requested)

    def run(self, call: Call) -> torch.Tensor:
        return self.forward(call)  # differentiable as it is

    def run_arguments(self, input, weight, bias, stride, padding, output_padding, groups, dilation):
        """The steady path of a call decided for PyTorch at the flags as they are: its own op on
        the caller's arguments, as an untouched layer calls it (autocast, unbatched input and
        autograd handled by PyTorch)."""
        return torch.nn.functional.conv_transpose3d(input, weight, bias, stride, padding, output_padding, groups,
                                                    dilation)

    def _timed(self, call: Call, given: tuple, training: bool, repeat: bool) -> torch.Tensor:
        # At the flags as they are, a repeated call is PyTorch's own op on the caller's tensors:
        # under autocast PyTorch casts them itself (a model's fp32 weight once per autocast
        # region, from its cast cache), so a timed call of a call autocast cast starts from them.
        if call.sources is None or not at_flags_as_they_are(call.x, call.requested):
            return super()._timed(call, given, training, repeat)
        p = call.params
        y = self.run_arguments(*given, p.stride, p.padding, p.output_padding, p.groups, p.dilation)
        return y.unsqueeze(0) if call.unbatched else y

    def steady_cost(self, call: Call) -> Callable[[], object]:
        """At the flags as they are, a repeated call goes straight to PyTorch's op after the check
        of its direct memo (``steady.Direct``); with an explicit precision it takes the key."""
        if not at_flags_as_they_are(call.x, call.requested):
            return super().steady_cost(call)
        return _memo_check(call, Direct)


class Conv3dEngine(LaunchedRepeats):
    """A stride-1 call as PyTorch's conv3d of the flipped weight with its channel axes swapped
    (``torch_engine.conv3d_forward``): cuDNN's forward kernels, where PyTorch's own
    conv_transpose3d runs its dgrad kernels, several times slower on such calls (docs/design.md,
    "The conv3d form of stride-1 calls"). Training steps take convt3d's backward: autograd through the
    conv3d would compute dX on those dgrad kernels, where the transposed convolution's dX is a
    forward conv3d."""

    name = "conv3d"
    _autograd_engine = "conv3d"

    def not_supported_reasons(self, call: Call) -> list[str]:
        return conv3d_form_reasons(call.params, call.dtype, call.precision)

    # Its precision is the call's: not_supported_reasons leaves it TF32 or 16-bit.
    precision_reasons = TorchEngine.precision_reasons

    def forward(self, call: Call) -> torch.Tensor:
        return ops.run_engine("conv3d", call.x, call.weight, call.bias, call.params, call.precision)

    def steady_launcher(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params,
                        precision: str):
        """(run, alive) of a settled inference signature for ``steady.Repeat``: the conv3d form of
        the caller's tensors without the key and the Call: on a tiny layer, whose launches are
        all but free, those cost about as much host time as the weight's two copies the form
        itself needs."""

        def run(x, weight, bias):
            return ops.run_engine("conv3d", x, weight, bias, params, precision)

        return run, _always


def _always() -> bool:
    return True


class HybridEngine(Engine):
    """Training steps only: PyTorch's forward, recorded with convt3d's backward, for layers where
    cuDNN's forward is as fast as ours but its dX is many times slower than our Triton dX."""

    name = HYBRID
    _autograd_engine = "torch"

    def not_supported_reasons(self, call: Call) -> list[str]:
        return [] if call.training else ["not a training call (PyTorch's forward with convt3d's backward)"]

    precision_reasons = TorchEngine.precision_reasons

    def precision(self, call: Call) -> str:
        # Also the precision of convt3d's backward kernels: exact grade stays tf32x3 there.
        return call.precision

    def forward(self, call: Call) -> torch.Tensor:
        return torch_forward(call.x, call.weight, call.bias, call.params, call.requested)


ENGINES: dict[str, Engine] = {e.name: e for e in (TritonEngine(), CudaEngine(), Conv3dEngine(), TorchEngine(),
                                                   HybridEngine())}
