"""The one ordered dispatcher: which engine runs a call, at which precision.

Order of decisions, for every call:

1. invalid arguments raise (``convt3d.validate.check_call``) -- before any engine is chosen;
2. the backend name is resolved: the ``backend=`` argument, else ``$CONVT3D_BACKEND``, else
   "auto"; an unknown name raises ValueError;
3. the precision is resolved (float32 only): None follows ``torch.backends.cudnn.allow_tf32``
   like PyTorch's convolutions ("tf32" when True, exact grade when False);
4. "auto" picks an engine (unsupported input falls back to "torch" here, and only here);
   an explicitly named engine that cannot run the call raises BackendUnavailableError.

How "auto" picks (issue 7: never slower than PyTorch), per call signature -- device, dtype,
input and weight strides, bias or not, every convolution parameter and shape, precision:

* CPU tensors and dtypes other than float32/float16/bfloat16: PyTorch.
* Candidates: "triton" (where it can run), "cuda" (exact-grade float32 only: it computes exact
  fp32, never TF32) and "torch" (cuDNN).
* A decision measured earlier -- in this process, or by any process on the same GPU model and
  versions (``convt3d.cache``) -- is reused, whatever the flags below.
* Benchmark mode (``torch.backends.cudnn.benchmark`` True, or ``convt3d.set_benchmark(True)``):
  the first call of a signature times every candidate on the call's own tensors
  (``triton.testing.do_bench``, median, L2 flushed; ~30 ms per candidate after its first call,
  which compiles/tunes the Triton engine or builds the CUDA one) and keeps the fastest, in
  memory and on disk. Never during CUDA graph capture or torch.compile tracing: there the
  heuristic decides.
* Otherwise the heuristic (:func:`heuristic`, no timing): a pure function of the geometry, dtype
  and precision, from roofline floors, calibrated on the H200 bench (README tables).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from . import cache, triton_engine
from .bench import roofline
from .errors import BackendUnavailableError

__all__ = ["BACKENDS", "PRECISIONS", "EXACT_GRADE", "Decision", "resolve_backend_name", "resolve_precision",
           "decide", "heuristic", "set_benchmark", "benchmark_enabled", "clear_decisions", "cudnn_conv_tf32",
           "cuda_unsupported_reason", "signature_text", "NOMINAL_CEILINGS"]

BACKENDS = ("auto", "triton", "torch", "cuda")
PRECISIONS = ("tf32", "tf32x3", "ieee")

# Exact grade = what precision=None means when TF32 is off. tf32x3 (three TF32 MMAs per
# product, split hi/lo operands) is ~2.4x faster than FMA "ieee" at peak (3 x 1/374 vs 1/51
# TFLOP/s) and stays within 2x of cuDNN's own exact-fp32 error (tests/test_gpu.py checks both).
EXACT_GRADE = "tf32x3"

_ENV = "CONVT3D_BACKEND"


@dataclass(frozen=True)
class Decision:
    engine: str  # "triton", "cuda" or "torch"
    precision: str  # "tf32" | "tf32x3" | "ieee" (meaningful for float32 only; "ieee" for "cuda")
    reason: str
    # engine "torch" under autograd: PyTorch's forward with convt3d's backward (its per-gradient
    # timed choice of cuDNN or our Triton dX/dW kernels) instead of PyTorch's own backward. Our
    # engines always use convt3d's backward.
    ours_backward: bool = False


# Training ("auto" when autograd records the call): candidate names beyond the engines.
HYBRID = "torch+bwd"  # PyTorch forward, convt3d backward


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
        # Set only on a change: the flag's setter validates and re-derives torch's precision
        # state, host time that every backward of a training step would pay twice.
        if self._old != self._value:
            setattr(self._obj, self._attr, self._value)
        return self

    def __exit__(self, *exc):
        if self._old != self._value:
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


# ---- benchmark mode -----------------------------------------------------------------------------
_benchmark: bool | None = None  # None: follow torch.backends.cudnn.benchmark


def set_benchmark(enabled: bool | None) -> None:
    """Measure "auto" decisions (True), use the heuristic (False), or follow
    ``torch.backends.cudnn.benchmark`` (None, the default). Decisions already measured are
    reused in every mode."""
    global _benchmark
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_benchmark(): argument 'enabled' must be bool or None, not {type(enabled).__name__}")
    _benchmark = enabled


def benchmark_enabled() -> bool:
    return bool(torch.backends.cudnn.benchmark) if _benchmark is None else _benchmark


@contextlib.contextmanager
def benchmark(enabled: bool | None) -> Iterator[None]:
    """``set_benchmark(enabled)`` for the duration of a block (``convt3d.tune`` uses it)."""
    global _benchmark
    old = _benchmark
    set_benchmark(enabled)
    try:
        yield
    finally:
        _benchmark = old


# ---- the cuda engine (being built; imported on first use, tolerated absent) ---------------------
_cuda_mod: tuple | None = None


def _cuda_engine():
    """(module, None) or (None, why the CUDA C++ engine is not available in this build)."""
    global _cuda_mod
    if _cuda_mod is None:
        import importlib

        try:
            _cuda_mod = (importlib.import_module(f"{__package__}.cuda_engine"), None)
        except ModuleNotFoundError as exc:  # the module is optional
            what = "is not in this build" if exc.name == f"{__package__}.cuda_engine" else f"cannot be imported ({exc})"
            _cuda_mod = (None, f"the CUDA C++ engine (convt3d.cuda_engine) {what}")
        except ImportError as exc:
            _cuda_mod = (None, f"the CUDA C++ engine (convt3d.cuda_engine) cannot be imported ({exc})")
    return _cuda_mod


def cuda_unsupported_reason(x, weight, params) -> str | None:
    """Why the CUDA C++ engine cannot run this call, or None (never builds it)."""
    mod, why = _cuda_engine()
    if mod is None:
        return why
    if weight is None or params is None:
        return "its check needs the weight and the geometry (decide(..., params, weight=...))"
    return mod.unsupported_reason(x, weight, params)


def _cuda_slow_path(params) -> str | None:
    """Why "auto" does not measure the cuda engine on a call it can run: only its register-blocked
    gemm_kernel is a contender (KB 77 on the H200: 1010 us; its older phase_kernel tiles 1596 us
    and slower, the direct kernel slower still). A measuring run stalled for over 6 minutes on
    KernelBench 58 at exact grade (105 taps, 16 output channels: a phase_kernel tile), so the
    fallbacks are never timed by auto; backend='cuda' still runs them."""
    mod = _cuda_engine()[0]
    choose, gemm = getattr(mod, "choose_variant", None), getattr(mod, "GEMM_VARIANTS", None)
    if choose is None or gemm is None:
        return None
    variant = choose(params)
    if variant in gemm:
        return None
    return f"its tile for this geometry is {variant!r}, not gemm_kernel (slow fallback, not measured by auto)"


# ---- the heuristic ------------------------------------------------------------------------------
# H200 ceilings as bench/roofline.py measures them (NOTES.md): 4.24 TB/s copy (read + write bytes),
# 683 / 374 / 51 TFLOP/s bf16 / TF32 / exact fp32 matmul. Only their ratios matter to the
# heuristic; Hopper-class GPUs share them within ~20%.
NOMINAL_CEILINGS = roofline.Ceilings(4.24e12, 683e12, 374e12, 51e12)

# Rule 1 -- tiny layers go to cuDNN. Below ~10 us of roofline floor a call is host-bound: the
# Triton engine spends 100-170 us of host time per call (2-4 launches at 25-30 us each, NOTES.md
# "Host overhead"), a cuDNN call ~20-30 us. The smallest bench layer (nnunet_128_64 bf16, 19.8 us
# floor) is still won by Triton (1.46-1.71x), so the threshold sits below it; scripts/gpu_auto.py
# times two tiny probes to check this rule.
TINY_FLOOR_S = 10e-6
# Rule 3 -- compute-bound = compute floor at least this multiple of the memory floor. The bench's
# layers fall in two clusters: <= 1.06 (nnunet, monai, aniso, KB 72/73/77) and >= 2.4 (gan 8.0,
# videogpt 8.8, refine 4.6, KB 58/61/68/70); 2 separates them.
COMPUTE_BOUND_RATIO = 2.0
# ... and cuDNN is fast on compute-bound layers only when both channel counts per group are
# multiples of its tile: measured on the H200, compute-bound layers with 64-aligned channels run
# in cuDNN at 33-68% of the roofline in fp32/TF32 (gan 256->128: 68%, refine 64->64: 34-42%) against
# 15-48% for Triton, while 16-/32-/48-aligned fp32 layers run at 4-10% (KB 58, 61, 68, 70; videogpt
# 240->240 falls back to exact fp32, 10.6 ms vs Triton's 1.8 ms). In 16-bit, 16-aligned is enough
# (videogpt bf16 240->240: cuDNN 46-55% vs Triton 35-55%).
CUDNN_CHANNEL_ALIGN = {torch.float32: 64, torch.float16: 16, torch.bfloat16: 16}


def floors(params, dtype: torch.dtype, precision: str, has_bias: bool = False,
           ceilings: roofline.Ceilings = NOMINAL_CEILINGS) -> tuple[float, float, str]:
    """(memory floor s, compute floor s, peak class) of a call (bench/roofline.py arithmetic)."""
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype)
    if name is None:
        raise ValueError(f"no roofline for dtype {dtype}")
    peak = roofline.peak_class(name, "default" if precision == "tf32" else "exact")
    mem, comp = roofline.floors(params.useful_flops, params.min_bytes(dtype.itemsize, has_bias), ceilings, peak)
    return mem, comp, peak


# Training steps (autograd records the call): below this roofline floor of the forward, a step is
# host-bound and PyTorch's own forward + backward has the least host time. Measured on the H200
# (session 3, scripts/gpu_training.py, Triton forward + convt3d backward vs cuDNN's step): the
# layers that lost are all below it -- nnunet_128_64 (floor 20-40 us: 0.34-0.51x), monai_unet_k3
# (20-40 us: 0.40-0.88x), aniso_122 (24-48 us: 0.39-0.70x) -- and those that won are all above it:
# nnunet_64_32 (79-158 us: 1.45-1.55x), videogpt fp32 (677 us: 2.2x).
TRAIN_SMALL_FLOOR_S = 60e-6


def heuristic(params, dtype: torch.dtype, precision: str, has_bias: bool = False,
              candidates: tuple[str, ...] = ("triton", "torch"), training: bool = False) -> tuple[str, str]:
    """(candidate, why) for a CUDA call without timing: a pure function of the geometry.

    Training steps (``training``): a layer whose forward roofline floor is below
    ``TRAIN_SMALL_FLOOR_S`` takes PyTorch's forward and backward ("torch"); otherwise the forward
    rules below decide, and where they pick "torch" and HYBRID is a candidate, the step takes
    PyTorch's forward with convt3d's backward (HYBRID: per gradient the faster of cuDNN and our
    Triton kernels, timed once per signature -- cuDNN's dX runs 25x slower than our Triton dX
    on gan_k4s2p1 and videogpt_k4s2p3 in bf16 channels-last, 6.4 ms vs 0.26 ms and 16 ms vs
    0.62 ms, while cuDNN's forward there is as fast as ours).
    """
    fwd = tuple(c for c in candidates if c != HYBRID)
    if training and "torch" in fwd and len(fwd) > 1:
        mem, comp, _ = floors(params, dtype, precision, has_bias)
        if max(mem, comp) < TRAIN_SMALL_FLOOR_S:
            return "torch", (f"training step of a small layer (roofline floor {max(mem, comp) * 1e6:.3g} us < "
                             f"{TRAIN_SMALL_FLOOR_S * 1e6:.0f} us): host-bound, PyTorch's forward and backward "
                             "have the least host time")
    engine, why = _forward_heuristic(params, dtype, precision, has_bias, fwd)
    if training and engine == "torch" and HYBRID in candidates:
        return HYBRID, (why + "; backward by convt3d (per gradient the faster of cuDNN and our Triton kernels, "
                        "timed once per signature)")
    return engine, why


def _forward_heuristic(params, dtype: torch.dtype, precision: str, has_bias: bool,
                       candidates: tuple[str, ...]) -> tuple[str, str]:
    """(engine, why) of the forward: a pure function of the geometry.

    On the H200 bench (README: 42 rows) it picks the faster engine on 40; the two misses are
    refine_k3s1 fp32 NCDHW (torch chosen, Triton 1.03x) and aniso_122 fp32 channels_last
    (Triton chosen, 0.58x). Rules, in order (constants above, with their data):

    0. only one candidate can run the call: that one;
    1. tiny (roofline floor < 10 us): torch -- host time decides;
    2. exact-grade float32 ("tf32x3"/"ieee"): triton -- cuDNN's exact fp32 is FFMA-only (51
       TFLOP/s) and lost every KernelBench exact row (1.7-6.6x); the cuda engine is chosen only
       by measurement until its H200 numbers calibrate a rule;
    3. compute-bound (compute floor >= 2x memory floor) with channels per group aligned to
       cuDNN's tiles (64 in fp32/TF32, 16 in 16-bit): torch -- gan_k4s2p1, refine_k3s1,
       videogpt bf16;
    4. otherwise triton: memory-bound or balanced layers (the phase decomposition skips empty
       phases and writes whole rows once; KernelBench 72/73/77 at TF32: 2.6-10.8x) and compute-bound ones
       cuDNN has no tensor-core kernel for (KernelBench 58-70, videogpt fp32: 2-5.8x).
    """
    if "triton" not in candidates or "torch" not in candidates:
        only = [c for c in candidates if c != "cuda"] or list(candidates)
        return only[0], f"only {only[0]} of triton/torch can run this call"
    mem, comp, peak = floors(params, dtype, precision, has_bias)
    floor = max(mem, comp)
    if floor < TINY_FLOOR_S:
        return "torch", (f"tiny layer: roofline floor {floor * 1e6:.3g} us < {TINY_FLOOR_S * 1e6:.0f} us, host-bound "
                         "(Triton's 2-4 launches cost 100-170 us of host time, cuDNN's ~20-30 us)")
    if dtype == torch.float32 and precision != "tf32":
        return "triton", (f"exact-grade fp32 ({precision}): cuDNN's exact fp32 runs on FFMA only (51 TFLOP/s); "
                          "Triton's 3xTF32 won every KernelBench exact row 1.7-6.6x on the H200")
    ratio = comp / mem if mem > 0 else float("inf")
    align = CUDNN_CHANNEL_ALIGN[dtype]
    cin_g, cout_g = params.in_channels_per_group, params.out_channels_per_group
    aligned = cin_g % align == 0 and cout_g % align == 0
    shape = (f"compute floor {comp * 1e6:.1f} us = {ratio:.2f}x memory floor {mem * 1e6:.1f} us ({peak} peak), "
             f"Cin/g={cin_g}, Cout/g={cout_g}")
    if ratio >= COMPUTE_BOUND_RATIO and aligned:
        return "torch", (f"compute-bound with channels aligned to cuDNN's tiles ({shape}, multiples of {align}): "
                         "cuDNN runs such layers at 34-68% of roofline on the H200 (gan_k4s2p1, refine_k3s1, "
                         "videogpt bf16)")
    if ratio >= COMPUTE_BOUND_RATIO:
        return "triton", (f"compute-bound but channels not multiples of {align} ({shape}): cuDNN has no fast "
                          "tensor-core kernel here (KernelBench 58-70, videogpt fp32: Triton 2-5.8x)")
    return "triton", (f"memory-bound or balanced ({shape}): the phase decomposition skips empty phases and "
                      "writes each output row once (nnunet, monai; KernelBench 72/73/77: Triton 2.6-10.8x at TF32)")


# ---- call signatures and the in-process memory ----------------------------------------------------
def _layout(t) -> str:
    if t.is_contiguous():
        return "ncdhw"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "cl"
    return "strided" + "x".join(map(str, t.stride()))


def signature_text(x, weight, bias, params, precision: str, training: bool = False) -> str:
    """The persistent form of a call signature (the GPU model is the cache file's)."""
    p = params

    def t3(v):
        return "x".join(map(str, v))

    return (f"{str(x.dtype).replace('torch.', '')}|x={_layout(x)}|w={_layout(weight) if weight is not None else '?'}|"
            f"{'bias' if bias is not None else 'nobias'}|N{p.batch} {p.in_channels}->{p.out_channels} g{p.groups} "
            f"in{t3(p.in_size)} k{t3(p.kernel_size)} s{t3(p.stride)} p{t3(p.padding)} op{t3(p.output_padding)} "
            f"d{t3(p.dilation)}|{precision}" + ("|train" if training else ""))


_settled: dict[tuple, Decision] = {}  # measured, read from the disk cache, or only one candidate
_guessed: dict[tuple, Decision] = {}  # heuristic decisions (benchmark off, or not measurable now)
_timings: dict[tuple, dict[str, float]] = {}  # measured ms per engine (explain)
_primed: set = set()  # signatures whose Triton tune key was looked up in the disk cache
_listeners: list[Callable[[str, dict], None]] = []


def clear_decisions() -> None:
    """Forget this process's auto decisions (not the disk cache)."""
    _settled.clear()
    _guessed.clear()
    _timings.clear()
    _primed.clear()


@contextlib.contextmanager
def listening(callback: Callable[[str, dict], None]) -> Iterator[None]:
    """Call ``callback(event, info)`` on "decision" (every auto decision) and "measure" (a
    candidate about to be timed) events for the duration of a block (``convt3d.tune``)."""
    _listeners.append(callback)
    try:
        yield
    finally:
        _listeners.remove(callback)


def _notify(event: str, **info) -> None:
    for cb in list(_listeners):
        cb(event, info)


def _signature(x, weight, bias, params, prec, training: bool = False) -> tuple:
    return (x.device, x.dtype, x.stride(), None if weight is None else weight.stride(), bias is not None, params,
            prec, training)


def cached_timings(x, weight, bias, params, precision: str) -> dict[str, float] | None:
    """Measured ms per engine for this call signature (this process or the disk cache), or None."""
    sig = _signature(x, weight, bias, params, precision)
    if sig in _timings:
        return dict(_timings[sig])
    if x.device.type != "cuda":
        return None
    entry = cache.load_decision(triton_engine.device_name(x.device),
                                signature_text(x, weight, bias, params, precision))
    return None if entry is None else dict(entry.get("timings_ms", {}))


# ---- decide -------------------------------------------------------------------------------------
def decide(input: torch.Tensor, backend: str | None, precision: str | None, params=None, *, weight=None, bias=None,
           measure: bool = True, training: bool = False) -> Decision:
    """Steps 2-4 of the module docstring (arguments are already validated).

    ``params`` (the call's ConvT3dParams), ``weight`` and ``bias`` let "auto" use the cuda engine,
    the heuristic and benchmark mode; without them "auto" keeps its geometry-blind rule (Triton
    for CUDA float32/float16/bfloat16). ``measure=False`` never times anything (explain).
    ``training``: autograd records the call, so "auto" decides (and measures) the training step,
    forward and backward (see :func:`heuristic`).
    """
    name = resolve_backend_name(backend)
    prec = resolve_precision(precision)
    if name == "auto":
        return _auto(input, weight, bias, params, precision, prec, measure, training)
    if name == "triton":
        why = triton_engine.unsupported_reason(input, params)
        if why is not None:
            raise BackendUnavailableError(f"backend='triton' cannot run this call: {why}")
        d = Decision("triton", prec, "backend='triton' requested")
        if input.device.type == "cuda" and params is not None and weight is not None:
            _after_triton(_signature(input, weight, bias, params, prec), input, weight, params, prec)
        return d
    if name == "torch":
        if precision == "tf32x3":
            raise BackendUnavailableError("backend='torch' cannot run precision='tf32x3' (cuDNN offers 'tf32' or "
                                          "exact fp32 'ieee'); use backend='triton' or 'auto'")
        return Decision("torch", prec, "backend='torch' requested")
    # "cuda"
    if precision in ("tf32", "tf32x3"):
        raise BackendUnavailableError(f"backend='cuda' cannot run precision={precision!r}: the CUDA C++ engine "
                                      "computes exact fp32 only (use precision=None or 'ieee', or another backend)")
    why = cuda_unsupported_reason(input, weight, params)
    if why is not None:
        raise BackendUnavailableError(f"backend='cuda' cannot run this call: {why}")
    return Decision("cuda", "ieee", "backend='cuda' requested (exact fp32)")


def _auto(x, weight, bias, params, precision, prec, measure, training=False) -> Decision:
    d, sig = _auto_choose(x, weight, bias, params, precision, prec, measure, training)
    if _listeners and params is not None:
        _notify("decision", signature=signature_text(x, weight, bias, params, prec, training), decision=d,
                timings=_timings.get(sig) if sig is not None else None)
    return d


def _auto_choose(x, weight, bias, params, precision, prec, measure, training=False) -> tuple[Decision, tuple | None]:
    if x.device.type != "cuda":
        return Decision("torch", prec, "auto: CPU tensors use PyTorch"), None
    if x.dtype not in triton_engine.SUPPORTED_DTYPES:
        return Decision("torch", prec, f"auto: dtype {x.dtype} is not run by the Triton engine"), None
    if params is None:  # a caller without the geometry: the rule before issue 7
        why = triton_engine.unsupported_reason(x, params)
        if why is not None:
            return Decision("torch", prec, f"auto: Triton engine unsupported here ({why})"), None
        return Decision("triton", prec, "auto: CUDA float32/float16/bfloat16 use the Triton engine"), None
    if torch.compiler.is_compiling():
        # Traced code: no memo, no files, no timing -- the heuristic alone (a pure function).
        why = triton_engine.unsupported_reason(x, params)
        cands = ("torch",) if why is not None else ("triton", "torch")
        engine, reason = heuristic(params, x.dtype, prec, bias is not None, cands)
        return Decision(engine, prec, f"auto (heuristic, traced): {reason}"), None

    sig = _signature(x, weight, bias, params, prec, training)
    d = _settled.get(sig)
    if d is None:
        measurable = measure and weight is not None and benchmark_enabled() and not _capturing()
        if not measurable:
            d = _guessed.get(sig)
        if d is None:
            d = _decide_new(x, weight, bias, params, precision, prec, sig, measurable, training)
    if d.engine == "triton" and weight is not None:
        _after_triton(sig, x, weight, params, prec)
    return d, sig


def _capturing() -> bool:
    """A CUDA graph is being captured on the current stream (then nothing may be timed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _candidates(x, weight, params, prec, training: bool = False) -> tuple[list[str], dict[str, str]]:
    """Engines that can run the call (in preference order for ties) and why the others cannot."""
    cands, excluded = [], {}
    why = triton_engine.unsupported_reason(x, params)
    if why is None:
        cands.append("triton")
    else:
        excluded["triton"] = why
    if x.dtype != torch.float32:
        excluded["cuda"] = f"dtype {x.dtype} (the cuda engine is exact fp32 only)"
    elif prec == "tf32":
        excluded["cuda"] = "precision tf32 (the cuda engine computes exact fp32, slower than TF32 by design)"
    else:
        why = cuda_unsupported_reason(x, weight, params) or _cuda_slow_path(params)
        if why is None:
            cands.append("cuda")
        else:
            excluded["cuda"] = why
    cands.append("torch")
    if training:
        cands.append(HYBRID)
    return cands, excluded


def _engine_precision(engine: str, prec: str) -> str:
    return "ieee" if engine == "cuda" else prec


def _decision(name: str, prec: str, reason: str) -> Decision:
    """The Decision of a candidate name (HYBRID: the torch engine with convt3d's backward)."""
    if name == HYBRID:
        return Decision("torch", prec, reason, ours_backward=True)
    return Decision(name, _engine_precision(name, prec), reason)


def _decide_new(x, weight, bias, params, precision, prec, sig, measurable, training=False) -> Decision:
    cands, excluded = _candidates(x, weight, params, prec, training)
    if len(cands) == 1:
        d = Decision(cands[0], prec, f"auto: only {cands[0]} can run this call ("
                     + "; ".join(f"{k}: {v}" for k, v in excluded.items()) + ")")
        _settled[sig] = d
        return d
    gpu = triton_engine.device_name(x.device)
    text = signature_text(x, weight, bias, params, prec, training)
    entry = cache.load_decision(gpu, text)
    if entry is not None and entry["engine"] in cands:
        timings = {k: float(v) for k, v in entry.get("timings_ms", {}).items()}
        d = _decision(entry["engine"], prec,
                      "auto (measured earlier, from the cache file): " + _timings_text(timings, entry["engine"]))
        _settled[sig], _timings[sig] = d, timings
        return d
    if measurable:
        timings, failed = _measure(x, weight, bias, params, precision, prec, cands, text, training)
        best = min(timings, key=timings.get)
        reason = ("auto (measured training steps, benchmark mode): " if training
                  else "auto (measured, benchmark mode): ") + _timings_text(timings, best)
        if failed:
            reason += "; failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
        d = _decision(best, prec, reason)
        _settled[sig], _timings[sig] = d, timings
        cache.save_decision(gpu, text, {"engine": best, "timings_ms": timings, "failed": failed,
                                        "candidates": cands})
        return d
    engine, why = heuristic(params, x.dtype, prec, bias is not None, tuple(cands), training)
    d = _decision(engine, prec, f"auto (heuristic): {why}")
    _guessed[sig] = d
    return d


def _timings_text(timings: dict[str, float], best: str) -> str:
    parts = ", ".join(f"{k} {v:.4g} ms" for k, v in sorted(timings.items(), key=lambda kv: kv[1]))
    return f"{parts} -> {best}"


def _after_triton(sig, x, weight, params, prec) -> None:
    """Before a signature's first Triton call, seed its tuning from the disk cache; on later
    calls, persist tuning results that earlier calls produced (one dict check when none)."""
    if sig not in _primed:
        _primed.add(sig)
        x5 = x if x.dim() == 5 else x.unsqueeze(0)
        plan = triton_engine.plan(params, x5, weight, prec)
        cache.prime_triton(triton_engine.device_name(x.device), plan.tune_key, plan.configs)
    elif cache.has_pending():
        cache.flush_triton()


# ---- measuring (benchmark mode, CUDA only) ------------------------------------------------------
# do_bench budget per candidate: 5 ms of warm-up and 25 ms of timed calls (a 100 us layer gets
# ~250 timed calls; the slowest bench row, 185 ms, gets do_bench's minimum of one), median.
MEASURE_WARMUP_MS = 5.0
MEASURE_REP_MS = 25.0


def torch_forward(x, weight, bias, params, precision):
    """PyTorch's forward for the torch engine (``convt3d.functional``, the ``torch+bwd`` step,
    measuring). A precision for CUDA float32 sets cuDNN's TF32 flag for this call only; None
    follows the flag as it is."""
    args = (x, weight, bias, params.stride, params.padding, params.output_padding, params.groups, params.dilation)
    if precision is None or x.device.type != "cuda" or x.dtype != torch.float32:
        return torch.nn.functional.conv_transpose3d(*args)
    with cudnn_conv_tf32(precision == "tf32"):
        return torch.nn.functional.conv_transpose3d(*args)


def _train_runner(engine, x, weight, bias, params, precision, prec) -> Callable[[], object]:
    """One training step of a candidate on the call's own tensors (forward, then the gradients of
    the tensors that require them, for a fixed random output gradient)."""
    from . import ops

    x5 = x if x.dim() == 5 else x.unsqueeze(0)
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (x5, weight, bias)]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    with torch.no_grad():
        dy = torch.randn_like(torch_forward(x5, weight, bias, params, precision))

    def forward():
        if engine == "torch":
            return torch_forward(leaves[0], leaves[1], leaves[2], params, precision)
        name = "torch" if engine == HYBRID else engine
        return ops.conv_transpose3d_autograd(leaves[0], leaves[1], leaves[2], params,
                                             _engine_precision(name, prec), name)

    def step():
        with torch.enable_grad():
            return torch.autograd.grad(forward(), wanted, dy)

    return step


def _runner(engine, x, weight, bias, params, precision, prec) -> Callable[[], torch.Tensor]:
    x5 = x if x.dim() == 5 else x.unsqueeze(0)
    if engine == "triton":
        return lambda: triton_engine.forward(x5, weight, bias, params, prec)
    if engine == "cuda":
        mod = _cuda_engine()[0]
        return lambda: mod.forward(x5, weight, bias, params)
    return lambda: torch_forward(x, weight, bias, params, precision)


def _measure(x, weight, bias, params, precision, prec, cands, label,
             training: bool = False) -> tuple[dict[str, float], dict[str, str]]:
    """Median ms of each candidate on the call's own tensors; (timings, failures). A candidate
    that raises (a failed CUDA build, out of memory) is left out; if all do, the last error is
    raised."""
    import triton.testing

    timings, failed, last = {}, {}, None
    with torch.no_grad():
        for engine in cands:
            _notify("measure", signature=label, engine=engine)
            fn = (_train_runner if training else _runner)(engine, x, weight, bias, params, precision, prec)
            try:
                fn()  # first call: Triton compiles and tunes, the cuda engine builds, cuDNN picks
                timings[engine] = float(triton.testing.do_bench(fn, warmup=MEASURE_WARMUP_MS, rep=MEASURE_REP_MS,
                                                                return_mode="median"))
            except Exception as exc:  # noqa: BLE001 -- any engine failure just removes the candidate
                failed[engine] = f"{type(exc).__name__}: {exc}"[:300]
                last = exc
    if not timings:
        raise last
    return timings, failed
