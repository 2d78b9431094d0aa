"""Backward of an output head (<= ``MAX_OUT_PER_GROUP`` output, >= ``MIN_IN_PER_GROUP`` input channels per group):
tiles and launchers of ``kernels/head_grad.py`` and ``kernels/head_phase_grad.py``, whose GEMMs flatten (tap, output
channel) into one dimension and read dY zero-padded (:func:`padded_dy`) or split by phase (:class:`DyPhases`)."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from ...core.errors import BackendUnavailableError
from .head import device_programs, flat_spatial, rounds_tf32
from .kernels import head_grad, head_phase_grad
from ...core.params import ConvT3dParams, cdiv, pow2_at_least
from .sites import Site, require_interpreter, site

MAX_OUT_PER_GROUP = 15
MIN_IN_PER_GROUP = 8
_MAX_POSITIONS = 2**31 - 2**16  # program and step indices over all positions are 32-bit (a tile of headroom)
_MAX_PARTIAL = 2**22  # fp32 dW partial sums over all splits at most: cheap to add next to reading X


@dataclass(frozen=True)
class HeadDgradConfig:
    BLOCK_M: int  # input positions (a run of one batch element's (id, ih, iw); or BLOCK_M // BLOCK_W rows x BLOCK_W)
    BLOCK_N: int  # input channels of a group
    BLOCK_K: int  # (tap, output channel) pairs per step
    num_warps: int
    num_stages: int
    BLOCK_W: int = 0  # 0: dY's zero-padded copy (head_dgrad_kernel); > 0: dY split by phase, rows of BLOCK_W

    def short(self) -> str:
        return (f"head M{self.BLOCK_M} N{self.BLOCK_N} K{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"
                + (f" phases W{self.BLOCK_W}" if self.BLOCK_W else ""))


@dataclass(frozen=True)
class HeadWgradConfig:
    BLOCK_CI: int  # input channels of a group
    BLOCK_K: int  # (tap, output channel) pairs
    BLOCK_P: int  # reduction positions per step
    num_warps: int
    num_stages: int
    splits: int  # programs along the reduction; partial sums added in a fixed order
    lanes_on_m: bool = False  # the dY gather's lanes on positions, not (tap, channel) pairs (head_wgrad_kernel)
    BLOCK_W: int = 0  # as HeadDgradConfig.BLOCK_W (head_wgrad_phase_kernel)

    def short(self) -> str:
        return (f"head CI{self.BLOCK_CI} K{self.BLOCK_K} P{self.BLOCK_P} w{self.num_warps} s{self.num_stages} "
                f"split{self.splits}" + (" lanes-m" if self.lanes_on_m else "")
                + (f" phases W{self.BLOCK_W}" if self.BLOCK_W else ""))


def _clamp_pow2(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, pow2_at_least(v)))


def _ktot(params: ConvT3dParams) -> int:
    return math.prod(params.kernel_size) * params.out_channels_per_group


def _positions(params: ConvT3dParams) -> int:
    return params.batch * math.prod(params.in_size)


@functools.lru_cache(maxsize=1024)
def unsupported_reason(params: ConvT3dParams) -> str | None:
    """Why the head kernels cannot run this call (None: they can); memoised, since every launch asks."""
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


def _phase_block_w(params: ConvT3dParams, block: int) -> int:
    """Positions along W of a phase tile: W up to a power of two, at most ``block``."""
    return _clamp_pow2(params.in_size[2], 1, block)


def dgrad_candidates(params: ConvT3dParams, dtype: torch.dtype, device: torch.device) -> tuple[HeadDgradConfig, ...]:
    """Tiles of ``head_dgrad_kernel`` and ``head_dgrad_phase_kernel`` (``BLOCK_W`` > 0), the first the
    default; the flat kernel's A tile is a gather, so K steps of 32 at one stage (no spills)."""
    bn = _clamp_pow2(params.in_channels_per_group, 16, 128)
    bk = _clamp_pow2(_ktot(params), 16, 32)
    if device.type != "cuda":
        # The interpreter is slow per program step whatever the tile: small tiles.
        bm = _clamp_pow2(_positions(params), 16, 32)
        return (HeadDgradConfig(bm, min(bn, 32), bk, 4, 1),
                HeadDgradConfig(32, min(bn, 32), bk, 4, 1, _phase_block_w(params, 32)))
    # 64 x 128 on 4 warps: the fastest for wide 16-bit heads, slower in fp32 (timed).
    flat = [HeadDgradConfig(bm, min(bn, bn_cap), bk, warps, 1)
            for bm, bn_cap, warps in ((128, 64, 4), (128, 128, 8), (256, 64, 8), (64, 128, 4))]
    # The phase kernel's tiles keep K at 32: a K step of 64 is slower on heads.
    phase = [HeadDgradConfig(bm, min(bn, bn_cap), bk, warps, 1, _phase_block_w(params, bm))
             for bm, bn_cap, warps in ((64, 128, 4), (128, 128, 8))]
    return tuple(dict.fromkeys(flat + phase))


def _splits(params: ConvT3dParams, block_ci: int, block_k: int, steps: int, device: torch.device) -> int:
    """Splits of the dW reduction of ``steps`` position steps over output tiles of ``block_ci`` x ``block_k``."""
    tiles = params.groups * cdiv(params.in_channels_per_group, block_ci) * cdiv(_ktot(params), block_k)
    per_split = params.groups * params.in_channels_per_group * _ktot(params)
    cap = max(1, min(_MAX_PARTIAL // per_split, steps // 4, 1024))
    # ~4 programs per SM, each streaming its X range once, hide the L2 latency of the dY loads.
    return max(1, min(cdiv(device_programs(device), tiles), cap))


def _phase_tiles(params: ConvT3dParams, block: int, block_w: int) -> int:
    """Position tiles of the phase kernels: rows of ``block_w`` along W, ``block // block_w`` along H."""
    n, (d, h, w) = params.batch, params.in_size
    return n * d * cdiv(h, block // block_w) * cdiv(w, block_w)


def wgrad_candidates(params: ConvT3dParams, dtype: torch.dtype, device: torch.device) -> tuple[HeadWgradConfig, ...]:
    """Tiles of ``head_wgrad_kernel`` and ``head_wgrad_phase_kernel`` (``BLOCK_W`` > 0), the first the
    default; flat tiles take 32 positions per step, with the dY gather's lanes on pairs or positions."""
    bci = _clamp_pow2(params.in_channels_per_group, 16, 64)
    ktot = _ktot(params)
    if device.type != "cuda":
        # Interpreter: one split (tests force more), small tiles.
        bk = _clamp_pow2(ktot, 16, 32)
        return (HeadWgradConfig(min(bci, 16), bk, 16, 4, 1, 1),
                HeadWgradConfig(min(bci, 16), bk, 16, 4, 1, 1, BLOCK_W=_phase_block_w(params, 16)))
    out = []
    steps = params.batch * cdiv(math.prod(params.in_size), 32)
    for bk_cap, warps in ((64, 4), (128, 8)):
        bk = _clamp_pow2(ktot, 16, bk_cap)
        out.append(HeadWgradConfig(bci, bk, 32, warps, 1, _splits(params, bci, bk, steps, device)))
    out += [dataclasses.replace(c, lanes_on_m=True) for c in out]
    bci_wide = _clamp_pow2(params.in_channels_per_group, 16, 128)
    # 64 positions per step in 16-bit, 32 in fp32 (a 64 x 64 fp32 tile of 64 spills at "tf32").
    bp = 64 if dtype != torch.float32 else 32
    bw = _phase_block_w(params, bp)
    for bk_cap, ci, warps in ((64, bci, 4), (128, bci, 8), (64, bci_wide, 8)):
        bk = _clamp_pow2(ktot, 16, bk_cap)
        splits = _splits(params, ci, bk, _phase_tiles(params, bp, bw), device)
        out.append(HeadWgradConfig(ci, bk, bp, warps, 1, splits, BLOCK_W=bw))
    return tuple(dict.fromkeys(out))


def _dy_pads(params: ConvT3dParams) -> tuple[tuple[int, int], ...]:
    """Per dimension, the zeros dY's padded copy holds before (``p``) and after (to ``(in-1)*s + (k-1)*d + 1``)."""
    return tuple((a.padding, max(0, (a.in_size - 1) * a.stride + (a.kernel - 1) * a.dilation + 1
                                 - a.padding - a.out_size)) for a in params.axes)


def _dy_needs_zeros(params: ConvT3dParams) -> bool:
    """Whether the padded copy of dY holds any zero: else :func:`padded_dy` returns dY itself."""
    return any(any(p) for p in _dy_pads(params))


def dy_copied(params: ConvT3dParams, config: HeadDgradConfig | HeadWgradConfig) -> bool:
    """Whether ``config``'s kernel reads a copy of dY (``dy_operand``), on which it skips dY's rounding."""
    return bool(config.BLOCK_W) or _dy_needs_zeros(params)


def _pad_site(params: ConvT3dParams, dy: torch.Tensor, dyp: torch.Tensor, round_tf32: bool) -> Site:
    """The launch site of head_grad.dy_pad_kernel: up to 1024 elements of a plane per program."""
    def build():
        cl = dyp.stride(1) == 1 and params.out_channels > 1
        (pd, _), (ph, _), (pw, _) = _dy_pads(params)
        n, c, ld, lh, lw = dyp.shape
        plane = lh * lw * (c if cl else 1)
        block = _clamp_pow2(plane, 128, 1024)
        chunks = cdiv(plane, block)
        return Site("dy_pad_kernel", (dyp.numel() // plane * chunks,), (
            plane, chunks, c, *params.out_size, ld, lw, pd, ph, pw, *dy.stride(),
        ), dict(CL=cl, ROUND_TF32=round_tf32, BIG=_big(dy, dyp), BLOCK=block, num_warps=4), head_grad)

    return site(("dy_pad", params, dy.stride(), dy.dtype, dyp.dtype, dyp.stride(), round_tf32), build)


def padded_dy(dy: torch.Tensor, params: ConvT3dParams, dtype: torch.dtype | None = None,
              round_tf32: bool = False) -> torch.Tensor:
    """dY zero-padded so that dY position ``i*s - p + t*d`` is ``i*s + t*d`` in the copy, in ``dtype``
    and dY's layout, rounded to TF32 with ``round_tf32``; dY itself where no zero is needed."""
    dtype = dtype or dy.dtype
    round_tf32 = round_tf32 and dtype == torch.float32  # TF32 is a rounding of fp32 only
    if not _dy_needs_zeros(params):
        return dy.to(dtype)
    shape = params.out_shape[:2] + tuple(o + a + b for o, (a, b) in zip(params.out_size, _dy_pads(params)))
    cl = dy.dim() == 5 and dy.is_contiguous(memory_format=torch.channels_last_3d) and not dy.is_contiguous()
    dyp = torch.empty(shape, dtype=dtype, device=dy.device,
                      memory_format=torch.channels_last_3d if cl else torch.contiguous_format)
    _pad_site(params, dy, dyp, round_tf32).launch(dy.device, dy, dyp)
    return dyp


@dataclass(frozen=True)
class DyPhases:
    """dY split by phase, contiguous [sd, sh, sw, N, C, Ld, Lh, Lw] (``kernels/head_phase_grad.py``): per dimension,
    tap t reads residue ``(t*d - p) mod s`` at index ``i + (t*d + lift) // s``, ``lift = c*s - p``, ``c = ceil(p / s)``;
    index ``q'`` is dY's position ``(q' - c)*s + r`` (zero outside dY)."""

    lift: tuple[int, int, int]
    shift: tuple[int, int, int]  # c per dimension
    length: tuple[int, int, int]
    shape: tuple[int, ...]

    @property
    def strides(self) -> tuple[int, ...]:
        """(residue d, residue h, residue w, n, c, index d, index h); index w has stride 1."""
        return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape) - 1))


@functools.lru_cache(maxsize=1024)
def dy_phases_layout(params: ConvT3dParams) -> DyPhases:
    shift = tuple(cdiv(a.padding, a.stride) for a in params.axes)
    lift = tuple(c * a.stride - a.padding for c, a in zip(shift, params.axes))
    length = tuple(a.in_size + ((a.kernel - 1) * a.dilation + up) // a.stride for up, a in zip(lift, params.axes))
    return DyPhases(lift, shift, length, tuple(params.stride) + (params.batch, params.out_channels) + length)


def dy_phases(dy: torch.Tensor, params: ConvT3dParams, dtype: torch.dtype, round_tf32: bool = False) -> torch.Tensor:
    """dY split by phase (:class:`DyPhases`) in ``dtype`` by one launch, TF32-rounded with ``round_tf32``."""
    lay = dy_phases_layout(params)
    dyq = torch.empty(lay.shape, dtype=dtype, device=dy.device)
    round_tf32 = round_tf32 and dtype == torch.float32

    def build():  # dy_phases_kernel: BLOCK_R rows of the copy, ~2048 elements, per program
        rows = dyq.numel() // lay.length[2]
        block_q = _clamp_pow2(lay.length[2], 16, 128)
        block_r = max(1, 2048 // block_q)
        return Site("dy_phases_kernel", (cdiv(rows, block_r),), (
            rows, params.batch, params.out_channels, lay.length[0], lay.length[1], lay.length[2],
            *params.out_size, *params.stride, *lay.shift, *dy.stride(),
        ), dict(ROUND_TF32=round_tf32, BIG=_big(dy, dyq), BLOCK_R=block_r, BLOCK_Q=block_q, num_warps=4),
            head_phase_grad)

    site(("dy_phases", params, dy.stride(), dy.dtype, dyq.dtype, round_tf32), build).launch(dy.device, dy, dyq)
    return dyq


def dy_operand(dy: torch.Tensor, params: ConvT3dParams, dtype: torch.dtype,
               config: HeadDgradConfig | HeadWgradConfig, precision: str) -> torch.Tensor:
    """The copy of dY that ``config``'s kernel reads, in ``dtype``, TF32-rounded at TF32 precision."""
    return (dy_phases if config.BLOCK_W else padded_dy)(dy, params, dtype, rounds_tf32(dtype, precision))


def _big(*tensors: torch.Tensor) -> bool:
    """Whether the kernels need 64-bit offsets: a tensor's strides reach 2^31 elements or more."""
    spans = (1 + sum(abs(st) * (n - 1) for n, st in zip(t.shape, t.stride()) if n > 0) for t in tensors)
    return any(span >= 2**31 for span in spans)


def _precision_args(dtype: torch.dtype, precision: str, dy_rounded: bool) -> dict:
    """The kernels' precision constexprs; ``dy_rounded``: dY is a copy rounded when made (``dy_operand``)."""
    is_fp32 = dtype == torch.float32
    return {"PRECISION": precision if is_fp32 else "tf32", "ROUND_TF32": rounds_tf32(dtype, precision),
            "DY_ROUNDED": dy_rounded and rounds_tf32(dtype, precision), "TWO_LEVEL": is_fp32 and precision != "tf32"}


def _check_runnable(t: torch.Tensor, params: ConvT3dParams, what: str) -> None:
    require_interpreter(t.device, f"the Triton head {what}-gradient kernel")
    reason = unsupported_reason(params)
    if reason is not None:
        raise BackendUnavailableError(f"the Triton head {what}-gradient kernel cannot run this call: {reason}")


def _phase_geometry_args(params: ConvT3dParams) -> tuple:
    """The phase kernels' geometry arguments from D, H, W on (see their signatures)."""
    lay = dy_phases_layout(params)
    return (*params.in_size, params.kernel_size[1], params.kernel_size[2]), (
        *params.stride, *params.dilation, *lay.lift, *lay.strides)


def head_dgrad(dy: torch.Tensor, w: torch.Tensor, params: ConvT3dParams, precision: str, x_dtype: torch.dtype,
               config: HeadDgradConfig | None = None,
               x_format: torch.memory_format = torch.contiguous_format,
               dyp: torch.Tensor | None = None) -> torch.Tensor:
    """dX in ``x_format`` from the copy of dY the config's kernel reads (``dyp`` if made already)."""
    _check_runnable(dy, params, "input")
    if x_format not in (torch.contiguous_format, torch.channels_last_3d):
        raise ValueError(f"head_dgrad writes dX NCDHW or channels-last, not {x_format}")
    cfg = config or dgrad_candidates(params, w.dtype, dy.device)[0]
    if dyp is None:
        dyp = dy_operand(dy, params, w.dtype, cfg, precision)
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    dx = torch.empty(params.in_shape, dtype=x_dtype, device=dy.device, memory_format=x_format)
    # [G, taps, Cout/g, Cin/g]: row k = tap * Cout/g + co of the GEMM's B operand, Cin contiguous.
    wp = w.reshape(g, cin_g, cout_g, math.prod(params.kernel_size)).permute(0, 3, 2, 1).contiguous()

    def build():  # head_dgrad_phase_kernel for a BLOCK_W, else head_dgrad_kernel
        tiles_n = cdiv(cin_g, cfg.BLOCK_N)
        consts = dict(**_precision_args(wp.dtype, precision, dy_copied(params, cfg)), BIG=_big(dyp, wp, dx),
                      BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.BLOCK_W:
            spatial, phase = _phase_geometry_args(params)
            tiles = _phase_tiles(params, cfg.BLOCK_M, cfg.BLOCK_W)
            return Site("head_dgrad_phase_kernel", (tiles * tiles_n, g), (
                cin_g, cout_g, _ktot(params), *spatial, *phase, *dx.stride(), tiles_n,
            ), dict(consts, BLOCK_W=cfg.BLOCK_W), head_phase_grad)
        # Position tiles per batch element (the kernel's store sees runs of positions).
        s = math.prod(params.in_size)
        tiles_s = cdiv(s, cfg.BLOCK_M)
        return Site("head_dgrad_kernel", (params.batch * tiles_s * tiles_n, g), (
            s, cin_g, cout_g, _ktot(params), *params.in_size, params.kernel_size[1], params.kernel_size[2],
            *dyp.stride(), *dx.stride(), *params.stride, *params.dilation, tiles_s, tiles_n,
        ), consts, head_grad)

    key = ("head_dgrad", params, cfg, dyp.shape, dyp.stride(), dx.stride(), wp.dtype, precision)
    site(key, build).launch(dy.device, dyp, wp, dx)
    return dx


_FINISH_TILE = 8192  # fp32 values per step of the finish, whose BLOCK_E is small enough to spread over the SMs


def _finish_blocks(elements: int, splits: int, programs: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_E) of wgrad_finish_kernel, for about ``programs`` programs."""
    block_e = _clamp_pow2(cdiv(elements, programs), 32, 256)
    return _clamp_pow2(splits, 2, _FINISH_TILE // block_e), block_e


def _finish_site(params: ConvT3dParams, splits: int, dw: torch.Tensor) -> Site:
    def build():
        e = params.groups * params.in_channels_per_group * _ktot(params)
        block_s, block_e = _finish_blocks(e, splits, device_programs(dw.device, 1))
        return Site("wgrad_finish_kernel", (cdiv(e, block_e),), (
            e, splits, params.out_channels_per_group, _ktot(params), math.prod(params.kernel_size),
        ), dict(BLOCK_S=block_s, BLOCK_E=block_e, num_warps=4), head_phase_grad)

    return site(("head_wgrad_finish", params, splits, dw.dtype, dw.device), build)


def head_wgrad(dy: torch.Tensor, x: torch.Tensor, params: ConvT3dParams, precision: str, out_dtype: torch.dtype,
               config: HeadWgradConfig | None = None, dyp: torch.Tensor | None = None) -> torch.Tensor:
    """dW (contiguous) from X (any strides) and the copy of dY the config's kernel reads (``dyp`` if
    made already): fp32 partial sums per split, then one launch adding them in a fixed order."""
    _check_runnable(x, params, "weight")
    cfg = config or wgrad_candidates(params, x.dtype, x.device)[0]
    if dyp is None:
        dyp = dy_operand(dy, params, x.dtype, cfg, precision)
    g, cin_g, cout_g, ktot = params.groups, params.in_channels_per_group, params.out_channels_per_group, _ktot(params)

    def build():  # head_wgrad_phase_kernel for a BLOCK_W, else head_wgrad_kernel
        tiles_ci, tiles_k = cdiv(cin_g, cfg.BLOCK_CI), cdiv(ktot, cfg.BLOCK_K)
        grid = (cfg.splits * tiles_ci * tiles_k, g)
        consts = dict(**_precision_args(x.dtype, precision, dy_copied(params, cfg)), BIG=_big(x, dyp),
                      BLOCK_CI=cfg.BLOCK_CI, BLOCK_K=cfg.BLOCK_K, BLOCK_P=cfg.BLOCK_P,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.BLOCK_W:
            spatial, phase = _phase_geometry_args(params)
            return Site("head_wgrad_phase_kernel", grid, (
                cin_g, cout_g, ktot, *spatial, g, cfg.splits, _phase_tiles(params, cfg.BLOCK_P, cfg.BLOCK_W),
                *phase, *x.stride(), tiles_ci, tiles_k,
            ), dict(consts, BLOCK_W=cfg.BLOCK_W), head_phase_grad)
        return Site("head_wgrad_kernel", grid, (
            params.batch, math.prod(params.in_size), cin_g, cout_g, ktot, *params.in_size,
            params.kernel_size[1], params.kernel_size[2], g, cfg.splits, *x.stride(), *dyp.stride(),
            *params.stride, *params.dilation, tiles_ci, tiles_k,
        ), dict(consts, LANES_ON_M=cfg.lanes_on_m, FLAT_X=flat_spatial(x)), head_grad)

    part = torch.empty((cfg.splits, g, cin_g, ktot), dtype=torch.float32, device=x.device)
    key = ("head_wgrad", params, cfg, x.stride(), dyp.shape, dyp.stride(), x.dtype, precision)
    site(key, build).launch(x.device, x, dyp, part)
    dw = torch.empty((params.in_channels, params.out_channels_per_group) + tuple(params.kernel_size),
                     dtype=out_dtype, device=x.device)
    _finish_site(params, cfg.splits, dw).launch(x.device, part, dw)
    return dw
