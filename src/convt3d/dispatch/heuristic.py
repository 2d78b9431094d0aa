"""The heuristic: the engine for a CUDA call where nothing can be timed (graph capture, tracing
with fake tensors, ``measure=False``, measuring switched off), as a pure function of the geometry
and its roofline floors on nominal Hopper ceilings."""
from __future__ import annotations

import torch

from ..core import roofline
from .registry import HYBRID

__all__ = ["NOMINAL_CEILINGS", "TINY_FLOOR_S", "HOST_BOUND_S", "COMPUTE_BOUND_RATIO", "CUDNN_CHANNEL_ALIGN",
           "TRAIN_SMALL_FLOOR_S", "floors", "heuristic"]


# Nominal ceilings (copy bytes/s counting read + write; bf16, TF32 and exact fp32 matmul FLOP/s)
# of an H200 as ``convt3d bench`` measures them. Only their ratios matter to the heuristic, and
# Hopper-class GPUs share those ratios within ~20%.
NOMINAL_CEILINGS = roofline.Ceilings(4.24e12, 683e12, 374e12, 51e12)


# Rule 1 -- tiny layers go to cuDNN: below this roofline floor a call is host-bound, and the
# Triton engine's 2-4 launches per call cost several times the host time of cuDNN's one. The
# threshold sits below the smallest bench layer Triton still wins (nnunet_128_64 bf16).
TINY_FLOOR_S = 10e-6


# ... but where timing can run, a tiny layer's PyTorch call is timed first, and only if it takes
# HOST_BOUND_S or more are our engines timed too: a PyTorch call shorter than the host time of a
# Triton call through the public API cannot be beaten, while one far above its floor can
# (auto measures that host time with each candidate).
HOST_BOUND_S = 50e-6


# Rule 3 -- compute-bound = compute floor at least this multiple of the memory floor; the bench's
# layers fall in two clusters of this ratio, one at most ~1 and one at 2.4 or more, and 2
# separates them.
COMPUTE_BOUND_RATIO = 2.0


# ... and cuDNN is fast on compute-bound layers only when both channel counts per group are
# multiples of its tensor-core tile (64 in fp32/TF32, 16 in 16-bit); otherwise it has no
# tensor-core kernel for them and runs far below the roofline.
CUDNN_CHANNEL_ALIGN = {torch.float32: 64, torch.float16: 16, torch.bfloat16: 16}


def floors(params, dtype: torch.dtype, precision: str, has_bias: bool = False,
           ceilings: roofline.Ceilings = NOMINAL_CEILINGS) -> tuple[float, float, str]:
    """(memory floor s, compute floor s, peak class) of a call (``core.roofline`` arithmetic)."""
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype)
    if name is None:
        raise ValueError(f"no roofline for dtype {dtype}")
    peak = roofline.peak_class(name, "default" if precision == "tf32" else "exact")
    mem, comp = roofline.floors(params.useful_flops, params.min_bytes(dtype.itemsize, has_bias), ceilings, peak)
    return mem, comp, peak


# Training steps (autograd records the call): below this roofline floor of the forward, a step is
# host-bound and PyTorch's own forward + backward has the least host time. The threshold separates
# the bench's training layers that lost to cuDNN's step from those that won (docs/design.md).
TRAIN_SMALL_FLOOR_S = 60e-6


def heuristic(params, dtype: torch.dtype, precision: str, has_bias: bool = False,
              candidates: tuple[str, ...] = ("triton", "torch"), training: bool = False) -> tuple[str, str]:
    """(candidate, why) for a CUDA call without timing: a pure function of the geometry.

    Training steps (``training``): a layer whose forward roofline floor is below
    ``TRAIN_SMALL_FLOOR_S`` takes PyTorch's forward and backward ("torch"); otherwise the forward
    rules below decide, and where they pick "torch" and HYBRID is a candidate, the step takes
    PyTorch's forward with convt3d's backward (HYBRID: per gradient the faster of cuDNN and our
    Triton kernels, timed once per signature), because cuDNN's dX can be many times slower than
    ours on layers where its forward is as fast.
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

    Rules, in order (the constants above give their reasons):

    0. only one candidate can run the call: that one;
    1. tiny (roofline floor < ``TINY_FLOOR_S``): torch -- host time decides;
    2. exact-grade float32 ("tf32x3"/"ieee"): triton -- cuDNN's exact fp32 runs on FFMA only,
       without tensor cores; the cuda engine is chosen only by measurement;
    3. compute-bound (compute floor >= ``COMPUTE_BOUND_RATIO`` x memory floor) with channels per
       group aligned to cuDNN's tiles (``CUDNN_CHANNEL_ALIGN``): torch;
    4. otherwise triton: memory-bound or balanced layers (the phase decomposition skips empty
       phases and writes whole rows once) and compute-bound ones cuDNN has no tensor-core
       kernel for.
    """
    if "triton" not in candidates or "torch" not in candidates:
        # The rules below are about these two; the cuda and conv3d engines are chosen by
        # measurement only.
        only = [c for c in candidates if c in ("triton", "torch")] or list(candidates)
        return only[0], f"only {only[0]} of triton/torch can run this call"
    mem, comp, peak = floors(params, dtype, precision, has_bias)
    floor = max(mem, comp)
    if floor < TINY_FLOOR_S:
        return "torch", (f"tiny layer: roofline floor {floor * 1e6:.3g} us < {TINY_FLOOR_S * 1e6:.0f} us, host-bound "
                         "(Triton's launches cost several times cuDNN's host time)")
    if dtype == torch.float32 and precision != "tf32":
        return "triton", (f"exact-grade fp32 ({precision}): cuDNN's exact fp32 runs on FFMA only, "
                          "under half the rate of Triton's 3xTF32 on tensor cores")
    ratio = comp / mem if mem > 0 else float("inf")
    align = CUDNN_CHANNEL_ALIGN[dtype]
    cin_g, cout_g = params.in_channels_per_group, params.out_channels_per_group
    aligned = cin_g % align == 0 and cout_g % align == 0
    shape = (f"compute floor {comp * 1e6:.1f} us = {ratio:.2f}x memory floor {mem * 1e6:.1f} us ({peak} peak), "
             f"Cin/g={cin_g}, Cout/g={cout_g}")
    if ratio >= COMPUTE_BOUND_RATIO and aligned:
        return "torch", (f"compute-bound with channels aligned to cuDNN's tiles ({shape}, multiples of {align}): "
                         "cuDNN runs such layers near its tensor-core peak")
    if ratio >= COMPUTE_BOUND_RATIO:
        return "triton", (f"compute-bound but channels not multiples of {align} ({shape}): cuDNN has no fast "
                          "tensor-core kernel here")
    return "triton", (f"memory-bound or balanced ({shape}): the phase decomposition skips empty phases and "
                      "writes each output row once")
