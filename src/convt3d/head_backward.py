"""Backward of an output head: dX and dW of a transposed convolution with few output channels
per group, by ``kernels/head_grad.py`` (plan, tile configurations, launchers).

A head reads a wide input and writes a thin output: a 3-D GAN's 64 -> 1 voxel layer, a video
decoder's 64 -> 3 RGB layer, a U-Net's last up-convolution to a few classes. Its backward is
memory-bound: dX writes a tensor as wide as X from a thin dY, dW reads X once. cuDNN runs both far
above their floors on the H200 (2026-12-01, bf16, 16 x 64 -> 1, 32^3 -> 64^3, k4 s2 p1: dX 358 us,
dW 521 us, against ~18 us each for reading and writing their operands once at 4.8 TB/s). The
general Triton kernels (``backward``) need >= 8 output channels per group: they walk one tap per
step with Cout/g padded to 16.

These kernels flatten (tap, output channel) into one GEMM dimension and positions into another
(``kernels/head_grad.py``), so a head's whole kernel is one or two MMA steps and X is read once
per dW program range. They are candidates of the timed choice in ``backward`` (dX and dW each
against cuDNN, per call signature); nothing here decides by a threshold beyond which layers they
can run.

Which layers: at least 8 input channels per group (the wide side is the MMA's N for dX and M for
dW; fewer would be mostly padding, as for depthwise layers) and at most ``MAX_OUT_PER_GROUP``
output channels per group -- the narrow-output range of the forward's head path
(``head_engine``); from 8 to 15 output channels the general kernels compete too.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton

from .errors import BackendUnavailableError
from .kernels import head_grad
from .params import ConvT3dParams
from .triton_configs import _cdiv, _pow2_at_least
from .triton_sites import Site, interpreter_active, site

__all__ = ["MAX_OUT_PER_GROUP", "MIN_IN_PER_GROUP", "HeadDgradConfig", "HeadWgradConfig", "supports",
           "unsupported_reason", "device_programs", "dgrad_candidates", "wgrad_candidates", "padded_dy", "head_dgrad",
           "head_wgrad"]

MAX_OUT_PER_GROUP = 15
MIN_IN_PER_GROUP = 8
# Positions are flattened into one 32-bit index (with a tile of headroom).
_MAX_POSITIONS = 2**31 - 2**16
# The dW partial sums: at most 2^22 fp32 values (16 MB) over all splits, so adding them costs a
# few microseconds next to reading X.
_MAX_PARTIAL = 2**22


@dataclass(frozen=True)
class HeadDgradConfig:
    BLOCK_M: int  # input positions (flattened over n, id, ih, iw)
    BLOCK_N: int  # input channels of a group
    BLOCK_K: int  # (tap, output channel) pairs per step
    num_warps: int
    num_stages: int

    def short(self) -> str:
        return f"head M{self.BLOCK_M} N{self.BLOCK_N} K{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class HeadWgradConfig:
    BLOCK_CI: int  # input channels of a group
    BLOCK_K: int  # (tap, output channel) pairs
    BLOCK_P: int  # reduction positions per step
    num_warps: int
    num_stages: int
    splits: int  # programs along the reduction; partial sums added in a fixed order
    # The dY gather's lanes along positions instead of (tap, channel) pairs (head_wgrad_kernel).
    lanes_on_m: bool = False

    def short(self) -> str:
        return (f"head CI{self.BLOCK_CI} K{self.BLOCK_K} P{self.BLOCK_P} w{self.num_warps} s{self.num_stages} "
                f"split{self.splits}" + (" lanes-m" if self.lanes_on_m else ""))


def _clamp_pow2(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, _pow2_at_least(v)))


def _ktot(params: ConvT3dParams) -> int:
    return math.prod(params.kernel_size) * params.out_channels_per_group


def _positions(params: ConvT3dParams) -> int:
    return params.batch * math.prod(params.in_size)


@functools.lru_cache(maxsize=1024)
def unsupported_reason(params: ConvT3dParams) -> str | None:
    """Why the head kernels cannot run this call (None: they can). Memoised per geometry: every
    head dX and dW launch asks (two per training step)."""
    if params.out_channels_per_group > MAX_OUT_PER_GROUP:
        return (f"{params.out_channels_per_group} output channels per group: the head kernels take at most "
                f"{MAX_OUT_PER_GROUP}")
    if params.in_channels_per_group < MIN_IN_PER_GROUP:
        return (f"{params.in_channels_per_group} input channels per group: the head kernels need at least "
                f"{MIN_IN_PER_GROUP} (the wide side fills the MMA)")
    if _positions(params) > _MAX_POSITIONS:
        return f"{_positions(params)} input positions do not fit the kernels' 32-bit position index"
    return None


def supports(params: ConvT3dParams) -> bool:
    return unsupported_reason(params) is None


def dgrad_candidates(params: ConvT3dParams, dtype: torch.dtype, device: torch.device) -> tuple[HeadDgradConfig, ...]:
    """Tile configurations of ``head_dgrad_kernel``; the first is the untuned default.

    N = Cin/g and K = taps x Cout/g are capped by their sizes (padded to >= 16 for ``tl.dot``); M
    is the free dimension. The A tile is a gather (a 64-bit address per element, no vector loads),
    so K steps of 32; one stage, since gathered 16-bit loads are not pipelined and a second fp32
    stage made ptxas spill. Register use, ptxas for sm_90a offline (triton 3.9 code generation,
    2026-12-01; no spills in any of them, bf16 / fp32 tf32 / fp32 two-level): 128 x 64 on 4 warps
    168 / 188 / 255 registers, 128 x 128 on 8 warps 176 / 174 / 255, 256 x 64 on 8 warps 224 /
    188 / 255. Which is fastest on a GPU is the timed choice's to say.
    """
    bn = _clamp_pow2(params.in_channels_per_group, 16, 128)
    bk = _clamp_pow2(_ktot(params), 16, 32)
    if device.type != "cuda":
        # Triton's interpreter: ~0.1 s per program step whatever the tile; small tiles.
        return (HeadDgradConfig(min(32, _clamp_pow2(_positions(params), 16, 32)), min(bn, 32), bk, 4, 1),)
    out = []
    for bm, bn_cap, warps in ((128, 64, 4), (128, 128, 8), (256, 64, 8)):
        cfg = HeadDgradConfig(bm, min(bn, bn_cap), bk, warps, 1)
        if cfg not in out:
            out.append(cfg)
    return tuple(out)


def device_programs(device: torch.device, per_sm: int = 4) -> int:
    """Programs that fill a device: ``per_sm`` per SM on CUDA (the split-reduction kernels of the
    backward use 4: enough to hide the latency of the L2 reads that feed each step); 1 on the
    CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def _splits(params: ConvT3dParams, tiles: int, block_p: int, device: torch.device) -> int:
    steps = triton.cdiv(_positions(params), block_p)
    per_split = params.groups * params.in_channels_per_group * _ktot(params)
    cap = max(1, min(_MAX_PARTIAL // per_split, steps // 4, 1024))
    # ~4 programs per SM: each streams its X range once; several per SM hide the L2 latency of
    # the dY gather.
    return max(1, min(triton.cdiv(device_programs(device), tiles), cap))


def wgrad_candidates(params: ConvT3dParams, dtype: torch.dtype, device: torch.device) -> tuple[HeadWgradConfig, ...]:
    """Tile configurations of ``head_wgrad_kernel``; the first is the untuned default.

    M = Cin/g (<= 64 per tile) and N = taps x Cout/g (<= 64 or <= 128 per tile: 64 for a 4x4x4
    kernel with one output channel, so each program reads its X range once for every tap); the
    reduction step is 32 positions, one stage (ptxas for sm_90a offline, 2026-12-01: 64-position
    steps or more stages spilled 100-1000 bytes in fp32; these two tiles use 161-193 registers
    and never spill). The reduction is split so that ~4 programs run per SM.

    Each tile comes twice: its dY gather with the lanes along (tap, channel) pairs, and along
    positions (``lanes_on_m``). Neither wins everywhere (H200, 2026-12-01, kernel time by graph
    replay, ``scripts/gpu_head_probe.py --grads``, first tile, each with the same dY copy): 3-D
    GAN head fp32 263 us along positions against 240, k2 s2 8 -> 2 head bf16 119 against 129,
    128 -> 8 head bf16 438 against 501; so the timed choice takes one of them.
    """
    bci = _clamp_pow2(params.in_channels_per_group, 16, 64)
    ktot = _ktot(params)
    if device.type != "cuda":
        # Interpreter: one split (tests force more), small tiles.
        return (HeadWgradConfig(min(bci, 16), _clamp_pow2(ktot, 16, 32), 16, 4, 1, 1),)
    out = []
    for bk_cap, warps in ((64, 4), (128, 8)):
        bk = _clamp_pow2(ktot, 16, bk_cap)
        tiles = params.groups * triton.cdiv(params.in_channels_per_group, bci) * triton.cdiv(ktot, bk)
        cfg = HeadWgradConfig(bci, bk, 32, warps, 1, _splits(params, tiles, 32, device))
        if cfg not in out:
            out.append(cfg)
    return tuple(out) + tuple(dataclasses.replace(c, lanes_on_m=True) for c in out)


def padded_dy(dy: torch.Tensor, params: ConvT3dParams) -> torch.Tensor:
    """dY with zeros around it, so that the dY position ``i*s - p + t*d`` of every (input, tap)
    pair is ``i*s + t*d`` inside the copy (the kernels then gather without bounds tests): ``p``
    zeros before the data along each dimension, and after it up to ``(in-1)*s + (k-1)*d + 1``.
    Where no dimension needs a zero (padding 0 and every position reached, as in k2 s2 p0), dY
    itself: the kernels read it through its strides, and ``F.pad`` would copy it whole (66 MB
    of traffic for the bf16 k2s2 8 -> 2 head's dY at 128^3)."""
    pads = []
    for a in reversed(params.axes):  # F.pad lists the last dimension first
        reach = (a.in_size - 1) * a.stride + (a.kernel - 1) * a.dilation + 1
        pads += [a.padding, max(0, reach - a.padding - a.out_size)]
    if not any(pads):
        return dy
    return torch.nn.functional.pad(dy, pads)


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last of ``t`` (its strides' reach)."""
    return 1 + sum(abs(st) * (n - 1) for n, st in zip(t.shape, t.stride()) if n > 0)


def _big(*tensors: torch.Tensor) -> bool:
    """Whether the kernels need 64-bit offsets for these tensors."""
    return any(_span(t) >= 2**31 for t in tensors)


def _precision_args(dtype: torch.dtype, precision: str) -> dict:
    is_fp32 = dtype == torch.float32
    return {"PRECISION": precision if is_fp32 else "tf32", "ROUND_TF32": is_fp32 and precision == "tf32",
            "TWO_LEVEL": is_fp32 and precision != "tf32"}


def _check_runnable(t: torch.Tensor, params: ConvT3dParams, what: str) -> None:
    if t.device.type == "cpu" and not interpreter_active():
        raise BackendUnavailableError(
            f"the Triton head {what}-gradient kernel on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported")
    reason = unsupported_reason(params)
    if reason is not None:
        raise BackendUnavailableError(f"the Triton head {what}-gradient kernel cannot run this call: {reason}")


def _dgrad_site(params: ConvT3dParams, cfg: HeadDgradConfig, dyp: torch.Tensor, wp: torch.Tensor, dx: torch.Tensor,
                precision: str) -> Site:
    """The launch site of head_dgrad_kernel: its integer arguments, grid and constexprs are fixed by
    the call signature (geometry, config, strides, dtypes), so later steps replay the compiled
    kernel. Through ``kernel[grid]`` each of a step's two head launches cost ~20-33 us of
    argument binding (NOTES.md, section 4), on a k2s2 head step whose kernels take ~175 us."""
    def build():
        g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
        m = _positions(params)
        tiles_n = _cdiv(cin_g, cfg.BLOCK_N)
        return Site("head_dgrad_kernel", (_cdiv(m, cfg.BLOCK_M) * tiles_n, g), (
            m, cin_g, cout_g, _ktot(params),
            *params.in_size,
            params.kernel_size[1], params.kernel_size[2],
            *dyp.stride(), *dx.stride(),
            *params.stride, *params.dilation,
            tiles_n,
        ), dict(**_precision_args(wp.dtype, precision), BIG=_big(dyp, wp, dx),
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages), head_grad)

    return site(("head_dgrad", params, cfg, dyp.shape, dyp.stride(), dx.stride(), wp.dtype, precision), build)


def head_dgrad(dy: torch.Tensor, w: torch.Tensor, params: ConvT3dParams, precision: str, x_dtype: torch.dtype,
               config: HeadDgradConfig | None = None,
               x_format: torch.memory_format = torch.contiguous_format,
               dyp: torch.Tensor | None = None) -> torch.Tensor:
    """dX [N, Cin, D, H, W] in ``x_format``, from a zero-padded copy of dY (:func:`padded_dy`; or
    ``dyp``, that copy made already for the same call in the weight's dtype) and the weight packed
    as the GEMM's B operand."""
    _check_runnable(dy, params, "input")
    cfg = config or dgrad_candidates(params, w.dtype, dy.device)[0]
    if dyp is None:
        dyp = padded_dy(dy.to(w.dtype), params)
    dx = torch.empty(params.in_shape, dtype=x_dtype, device=dy.device, memory_format=x_format)
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    kd, kh, kw = params.kernel_size
    # [G, taps, Cout/g, Cin/g]: row k = tap * Cout/g + co of the GEMM's B operand, Cin contiguous.
    wp = w.reshape(g, cin_g, cout_g, kd * kh * kw).permute(0, 3, 2, 1).contiguous()
    _dgrad_site(params, cfg, dyp, wp, dx, precision).launch(dy.device, dyp, wp, dx)
    return dx


def _wgrad_site(params: ConvT3dParams, cfg: HeadWgradConfig, x: torch.Tensor, dyp: torch.Tensor,
                precision: str) -> Site:
    """The launch site of head_wgrad_kernel (see ``_dgrad_site``)."""
    def build():
        g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
        ktot = _ktot(params)
        tiles_ci, tiles_k = _cdiv(cin_g, cfg.BLOCK_CI), _cdiv(ktot, cfg.BLOCK_K)
        return Site("head_wgrad_kernel", (cfg.splits * tiles_ci * tiles_k, g), (
            _positions(params), cin_g, cout_g, ktot,
            *params.in_size,
            params.kernel_size[1], params.kernel_size[2], g, cfg.splits,
            *x.stride(), *dyp.stride(),
            *params.stride, *params.dilation,
            tiles_ci, tiles_k,
        ), dict(**_precision_args(x.dtype, precision), BIG=_big(x, dyp),
                LANES_ON_M=cfg.lanes_on_m, BLOCK_CI=cfg.BLOCK_CI, BLOCK_K=cfg.BLOCK_K, BLOCK_P=cfg.BLOCK_P,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages), head_grad)

    return site(("head_wgrad", params, cfg, x.stride(), dyp.shape, dyp.stride(), x.dtype, precision), build)


def head_wgrad(dy: torch.Tensor, x: torch.Tensor, params: ConvT3dParams, precision: str, out_dtype: torch.dtype,
               config: HeadWgradConfig | None = None, dyp: torch.Tensor | None = None) -> torch.Tensor:
    """dW [Cin, Cout/g, kD, kH, kW] (contiguous), from X in place (any strides) and a zero-padded
    copy of dY (:func:`padded_dy`; or ``dyp``, that copy made already for the same call in X's
    dtype)."""
    _check_runnable(x, params, "weight")
    cfg = config or wgrad_candidates(params, x.dtype, x.device)[0]
    if dyp is None:
        dyp = padded_dy(dy.to(x.dtype), params)
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    kernel = params.kernel_size
    taps, ktot = math.prod(kernel), _ktot(params)
    part = torch.empty((cfg.splits, g, cin_g, ktot), dtype=torch.float32, device=x.device)
    _wgrad_site(params, cfg, x, dyp, precision).launch(x.device, x, dyp, part)
    total = part.sum(0) if cfg.splits > 1 else part[0]  # fixed-order reduction: deterministic
    dw = torch.empty((params.in_channels, cout_g) + tuple(kernel), dtype=out_dtype, device=x.device)
    # k = tap * Cout/g + co  ->  dW[g*Cin/g + ci, co, tap]
    dw.view(g, cin_g, cout_g, taps).copy_(total.view(g, cin_g, taps, cout_g).permute(0, 1, 3, 2))
    return dw
