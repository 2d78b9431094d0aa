"""The engine for a CUDA call where nothing can be timed (graph capture, fake tensors, measuring off), a pure
function of the geometry and its roofline floors."""
from __future__ import annotations

import torch

from ..core import roofline
from .registry import HYBRID


# Nominal H200 ceilings (copy bytes/s; bf16, TF32 and exact fp32 FLOP/s): only their ratios matter.
NOMINAL_CEILINGS = roofline.Ceilings(4.24e12, 683e12, 374e12, 51e12)
# Rule 1: below this roofline floor a call is host-bound, and Triton's launches cost more than cuDNN's.
TINY_FLOOR_S = 10e-6
# A PyTorch call shorter than this is not beaten by our engines, whose host time alone is more.
HOST_BOUND_S = 50e-6
# Rule 3: compute-bound means a compute floor at least this multiple of the memory floor.
COMPUTE_BOUND_RATIO = 2.0
# cuDNN's tensor-core tile: channel counts per group that are not multiples run far below roofline.
CUDNN_CHANNEL_ALIGN = {torch.float32: 64, torch.float16: 16, torch.bfloat16: 16}
# Below this forward roofline floor a training step is host-bound, and PyTorch's has the least host time.
TRAIN_SMALL_FLOOR_S = 60e-6


def floors(params, dtype: torch.dtype, precision: str, has_bias: bool = False) -> tuple[float, float, str]:
    """(memory floor s, compute floor s, peak class) of a call on ``NOMINAL_CEILINGS``."""
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    peak = roofline.peak_class(name, "default" if precision == "tf32" else "exact")
    mem, comp = roofline.floors(params.useful_flops, params.min_bytes(dtype.itemsize, has_bias), NOMINAL_CEILINGS, peak)
    return mem, comp, peak


def heuristic(params, dtype: torch.dtype, precision: str, has_bias: bool = False,
              candidates: tuple[str, ...] = ("triton", "torch"), training: bool = False) -> tuple[str, str]:
    """(candidate, why) for a CUDA call without timing: PyTorch's for a training step below ``TRAIN_SMALL_FLOOR_S``,
    else the forward rules, where they pick "torch" with convt3d's backward if HYBRID is a candidate (cuDNN's dX
    can be far slower)."""
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
    """(engine, why) of the forward, rules in order: 0. only one of triton/torch can run: that one;
    1. tiny: torch; 2. exact-grade float32: triton; 3. compute-bound with channels aligned to cuDNN's
    tiles: torch; 4. otherwise triton. The conv3d engine is chosen by measurement only."""
    if "triton" not in candidates or "torch" not in candidates:
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
