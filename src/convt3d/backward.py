"""Backward of ``convt3d.conv_transpose3d``: dX, dW and db, and the choice of implementation.

For ``y = conv_transpose3d(x, w, b)`` with output gradient dY:

* dX is an ordinary strided conv3d of dY with the same weight (stride, padding, dilation and
  groups of the transposed convolution). This is cuDNN's *forward* convolution, the operation
  cuDNN is best at (implicit GEMM with M = N*D*H*W input positions, K = Cout/g * taps); we use
  it through ``aten.convolution_backward`` (which calls exactly that kernel for a transposed
  convolution and handles output_padding >= stride, where F.conv3d's output would be one row
  too long).
* dW is the correlation of dY with X: per group and tap, a GEMM [Cin/g x P] @ [P x Cout/g]
  whose reduction runs over all P = N*D*H*W input positions. cuDNN's weight-gradient kernels
  for 3-D (``convolution_backward`` with only the weight mask) are the part of a
  transposed-convolution backward it does worst; its deterministic algorithms (which we need)
  are slower still. Two implementations compete per call signature: "cudnn" and "triton"
  (``kernels/wgrad_bwd.py``: one program per (tap, Cin tile, Cout tile, split of the
  reduction), fp32 partial sums per split added in a fixed order -- deterministic).
* db is the sum of dY over batch and positions (fp32 accumulation, as PyTorch).

Choice per call signature (device, dtype, precision, geometry, layouts): on CUDA the first
backward of a signature times each dW candidate (``triton.testing.do_bench`` medians, ~0.2-1 s
once) and keeps the fastest; under CUDA graph capture, with ``CONVT3D_AUTOTUNE=0`` or on CPU,
the static rule ``_static_wgrad`` decides. ``$CONVT3D_BWD_WEIGHT`` ("cudnn" or "triton") forces
one. TODO(lead, H200 numbers from scripts/gpu_training.py): replace the static rule with the
measured winners and record the per-case times here.

Precision follows the forward's resolved precision: float32 "tf32" runs cuDNN with its TF32 flag
on and the Triton kernel with TF32 MMAs on operands rounded to nearest TF32 (cuDNN's rounding);
"tf32x3" and "ieee" run cuDNN in exact fp32 (``cudnn_conv_tf32(False)``) and the Triton kernel
at the same precision with two-level summation. 16-bit inputs multiply in their own type and
accumulate in fp32 everywhere.

Determinism: every path is deterministic by default (cuDNN runs with
``torch.backends.cudnn.deterministic = True`` for these calls, which excludes its atomic-add
weight-gradient algorithms). ``CONVT3D_DETERMINISTIC=0`` lifts that for cuDNN.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import triton

from .dispatch import cudnn_conv_tf32
from .errors import BackendUnavailableError
from .params import ConvT3dParams
from .triton_engine import interpreter_active, suggests_channels_last

__all__ = ["WGRAD_IMPLS", "WgradConfig", "grads", "wgrad_triton", "wgrad_candidates", "choices", "clear_caches",
           "grad_formats"]

WGRAD_IMPLS = ("cudnn", "triton")
_FORCE_ENV = "CONVT3D_BWD_WEIGHT"


@dataclass(frozen=True)
class WgradConfig:
    BLOCK_CI: int
    BLOCK_CO: int
    BLOCK_P: int  # reduction positions per step: (BLOCK_P // BLOCK_W) rows x BLOCK_W columns of (ih, iw)
    BLOCK_W: int
    num_warps: int
    num_stages: int
    splits: int  # programs along the reduction; partial sums are added in a fixed order

    def short(self) -> str:
        return (f"CI{self.BLOCK_CI} CO{self.BLOCK_CO} P{self.BLOCK_P}({self.BLOCK_P // self.BLOCK_W}x{self.BLOCK_W}) "
                f"w{self.num_warps} s{self.num_stages} split{self.splits}")


@dataclass
class WgradChoice:
    impl: str  # "cudnn" | "triton"
    config: WgradConfig | None
    seconds: float  # tuning time (0 for a static choice)
    timings_ms: dict[str, float]
    reason: str


_choices: dict[tuple, WgradChoice] = {}


def choices() -> dict[tuple, WgradChoice]:
    """dW implementation chosen per call signature in this process (for the bench and tests)."""
    return dict(_choices)


def clear_caches() -> None:
    _choices.clear()


# ---- helpers ------------------------------------------------------------------------------------
def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


class _cudnn_flags:
    """cuDNN for our backward calls: TF32 per the resolved precision (fp32 only) and
    deterministic algorithms unless CONVT3D_DETERMINISTIC=0; restored on exit."""

    def __init__(self, dtype: torch.dtype, precision: str):
        self.tf32 = cudnn_conv_tf32(precision == "tf32") if dtype == torch.float32 else None
        self.deterministic = os.environ.get("CONVT3D_DETERMINISTIC", "1") not in ("0", "false", "False")

    def __enter__(self):
        if self.tf32 is not None:
            self.tf32.__enter__()
        self._old = torch.backends.cudnn.deterministic
        if self.deterministic:
            torch.backends.cudnn.deterministic = True
        return self

    def __exit__(self, *exc):
        torch.backends.cudnn.deterministic = self._old
        if self.tf32 is not None:
            self.tf32.__exit__(*exc)
        return False


def grad_formats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.memory_format, torch.memory_format]:
    """Memory formats of (dX, dW): each follows its own tensor (channels_last_3d in, channels_last_3d
    gradient), so autograd never re-lays a gradient out. The fake implementation uses the same rule."""
    fx = torch.channels_last_3d if suggests_channels_last(x) else torch.contiguous_format
    fw = torch.channels_last_3d if suggests_channels_last(w) else torch.contiguous_format
    return fx, fw


def _conv_args(params: ConvT3dParams):
    return (list(params.stride), list(params.padding), list(params.dilation), True, list(params.output_padding),
            params.groups)


def _torch_grads(dy, x, w, params, precision, need_x, need_w):
    """PyTorch's own kernels (cuDNN on CUDA): dX and/or dW in one call."""
    with _cudnn_flags(x.dtype, precision):
        gx, gw, _ = torch.ops.aten.convolution_backward(dy, x, w, None, *_conv_args(params), [need_x, need_w, False])
    return gx, gw


# ---- Triton dW --------------------------------------------------------------------------------
def _device_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    # 4 programs per SM: enough to hide the latency of the L2 reads that feed each step.
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def wgrad_candidates(params: ConvT3dParams, dtype: torch.dtype, device: torch.device) -> tuple[WgradConfig, ...]:
    """Tile configurations of ``wgrad_kernel``; the first is the untuned default.

    Tiles: Cin/g and Cout/g are the GEMM's M and N (each padded to >= 16 for tl.dot); the
    reduction step covers BLOCK_P input positions of one (n, id) row. The accumulator stays at
    <= 64 fp32 registers per thread; operand stages at <= 150 KB of shared memory.
    """
    cin_g, cout_g = params.in_channels_per_group, params.out_channels_per_group
    esize = dtype.itemsize
    bci_max = max(16, min(128, _pow2_at_least(cin_g)))
    bco = max(16, min(128, _pow2_at_least(cout_g)))
    w = params.in_size[2]
    h = params.in_size[1]
    taps = math.prod(params.kernel_size)
    out = []
    interp = device.type != "cuda"
    shapes = ((64, 64), (128, 32), (64, 32)) if not interp else ((16, 16),)
    for bci, bp in shapes:
        bci = min(bci, bci_max)
        bp = min(bp, max(16, _pow2_at_least(h * w)))
        bw = min(bp, _pow2_at_least(w))
        warps = 8 if bci * bco >= 64 * 128 else 4
        stages = 3
        while stages > 1 and stages * (bci * bp + bp * bco) * esize > 150 * 1024:
            stages -= 1
        tiles = params.groups * taps * triton.cdiv(cin_g, bci) * triton.cdiv(cout_g, bco)
        rows = params.batch * params.in_size[0] * triton.cdiv(h, bp // bw) * triton.cdiv(w, bw)
        splits = max(1, min(triton.cdiv(_device_programs(device), tiles), max(1, rows // 4), 256))
        if interp:
            splits = 1  # Triton's interpreter: ~0.1 s per program step; tests force more splits
        cfg = WgradConfig(bci, bco, bp, bw, warps, stages, max(1, splits))
        if cfg not in out:
            out.append(cfg)
    return tuple(out)


def wgrad_triton(dy: torch.Tensor, x: torch.Tensor, params: ConvT3dParams, precision: str,
                 out_dtype: torch.dtype, config: WgradConfig | None = None) -> torch.Tensor:
    """dW [Cin, Cout/g, kD, kH, kW] (contiguous) by ``kernels.wgrad_bwd.wgrad_kernel``."""
    if x.device.type == "cpu" and not interpreter_active():
        raise BackendUnavailableError(
            "the Triton weight-gradient kernel on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported")
    from .kernels import wgrad_bwd

    cfg = config or wgrad_candidates(params, x.dtype, x.device)[0]
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    kernel = params.kernel_size
    taps = math.prod(kernel)
    part = torch.empty((cfg.splits, g, taps, cin_g, cout_g), dtype=torch.float32, device=x.device)
    tiles_ci, tiles_co = triton.cdiv(cin_g, cfg.BLOCK_CI), triton.cdiv(cout_g, cfg.BLOCK_CO)
    tiles_h = triton.cdiv(params.in_size[1], cfg.BLOCK_P // cfg.BLOCK_W)
    tiles_w = triton.cdiv(params.in_size[2], cfg.BLOCK_W)
    is_fp32 = x.dtype == torch.float32
    grid = (cfg.splits * g * taps * tiles_ci * tiles_co,)
    wgrad_bwd.wgrad_kernel[grid](
        x, dy, part,
        params.batch, cin_g, cout_g, *params.in_size, *params.out_size,
        kernel[1], kernel[2], taps, g, cfg.splits,
        *x.stride(), *dy.stride(),
        *params.stride, *params.padding, *params.dilation,
        tiles_ci, tiles_co, tiles_h, tiles_w,
        PRECISION=precision if is_fp32 else "tf32",
        ROUND_TF32=is_fp32 and precision == "tf32",
        TWO_LEVEL=is_fp32 and precision != "tf32",
        BLOCK_CI=cfg.BLOCK_CI, BLOCK_CO=cfg.BLOCK_CO, BLOCK_P=cfg.BLOCK_P, BLOCK_W=cfg.BLOCK_W,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    total = part.sum(0) if cfg.splits > 1 else part[0]  # fixed-order reduction: deterministic
    dw = torch.empty((params.in_channels, cout_g) + tuple(kernel), dtype=out_dtype, device=x.device)
    dw.view(g, cin_g, cout_g, taps).copy_(total.permute(0, 2, 3, 1))
    return dw


# ---- choice -------------------------------------------------------------------------------------
def _triton_wgrad_ok(params: ConvT3dParams) -> bool:
    # tl.dot pads Cin/g and Cout/g to 16; below 8 channels per group more than half of every
    # MMA would be padding (depthwise and small-group layers): cuDNN only there.
    return params.in_channels_per_group >= 8 and params.out_channels_per_group >= 8


def _static_wgrad(params: ConvT3dParams, x: torch.Tensor) -> str:
    """The dW implementation when nothing is timed (CPU, graph capture, CONVT3D_AUTOTUNE=0)."""
    if x.device.type != "cuda" or not _triton_wgrad_ok(params):
        return "cudnn"
    # Until the H200 numbers are in, cuDNN is the static choice (the timed choice decides when
    # tuning is on, which is the default).
    return "cudnn"


def _forced() -> str | None:
    v = os.environ.get(_FORCE_ENV)
    if not v:
        return None
    if v == "torch":
        v = "cudnn"
    if v not in WGRAD_IMPLS:
        raise ValueError(f"environment variable {_FORCE_ENV}={v!r} is not a weight-gradient implementation; "
                         f"expected one of {WGRAD_IMPLS}")
    return v


def _tuning_enabled() -> bool:
    return os.environ.get("CONVT3D_AUTOTUNE", "1") not in ("0", "false", "False", "")


def _key(dy, x, w, params, precision) -> tuple:
    return (str(x.device), x.dtype, precision, params, x.stride(), dy.stride(), w.stride())


def choose_wgrad(dy, x, w, params, precision) -> WgradChoice:
    forced = _forced()
    if forced is not None:
        if forced == "triton" and not _triton_wgrad_ok(params):
            raise BackendUnavailableError(f"{_FORCE_ENV}=triton cannot run this call: the Triton weight-gradient "
                                          "kernel needs at least 8 input and output channels per group")
        cfg = wgrad_candidates(params, x.dtype, x.device)[0] if forced == "triton" else None
        return WgradChoice(forced, cfg, 0.0, {}, f"${_FORCE_ENV}={forced}")
    key = _key(dy, x, w, params, precision)
    rec = _choices.get(key)
    if rec is not None:
        return rec
    timed = (x.device.type == "cuda" and _triton_wgrad_ok(params) and _tuning_enabled()
             and not torch.cuda.is_current_stream_capturing())
    if not timed:
        impl = _static_wgrad(params, x)
        cfg = wgrad_candidates(params, x.dtype, x.device)[0] if impl == "triton" else None
        rec = WgradChoice(impl, cfg, 0.0, {}, "static rule (no timing: CPU, graph capture or CONVT3D_AUTOTUNE=0)")
        if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
            _choices[key] = rec
        return rec
    import triton.testing

    t0 = time.perf_counter()
    runs = {"cudnn": (None, lambda: _torch_grads(dy, x, w, params, precision, False, True))}
    for cfg in wgrad_candidates(params, x.dtype, x.device):
        runs[f"triton {cfg.short()}"] = (cfg, lambda cfg=cfg: wgrad_triton(dy, x, params, precision, w.dtype, cfg))
    timings = {}
    for name, (_, fn) in runs.items():
        fn()  # compile + warm
        timings[name] = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
    best = min(timings, key=timings.get)
    rec = WgradChoice("cudnn" if best == "cudnn" else "triton", runs[best][0], time.perf_counter() - t0, timings,
                      f"timed: {best} fastest")
    _choices[key] = rec
    return rec


# ---- entry point --------------------------------------------------------------------------------
def grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, params: ConvT3dParams, precision: str,
          mask: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dX, dW, db) for the entries of ``mask`` that are True (None for the others).

    ``precision`` is the forward's resolved precision ("tf32" | "tf32x3" | "ieee"; only float32
    reads it). dX and dW come back in the memory formats of :func:`grad_formats`.
    """
    need_x, need_w, need_b = mask
    gx = gw = gb = None
    fx, fw = grad_formats(x, w)
    wimpl = choose_wgrad(dy, x, w, params, precision) if need_w else None
    use_torch_w = wimpl is not None and wimpl.impl == "cudnn"
    if need_x or use_torch_w:
        gx, gw_t = _torch_grads(dy, x, w, params, precision, need_x, use_torch_w)
        gw = gw_t if use_torch_w else None
    if need_w and not use_torch_w:
        gw = wgrad_triton(dy, x, params, precision, w.dtype, wimpl.config)
    if need_b:
        # fp32 accumulation for 16-bit dY, as PyTorch's bias gradient.
        gb = dy.sum(dim=(0, 2, 3, 4), dtype=torch.float32).to(dy.dtype)
    if gx is not None:
        gx = gx.contiguous(memory_format=fx)
    if gw is not None:
        gw = gw.contiguous(memory_format=fw)
    return gx, gw, gb
