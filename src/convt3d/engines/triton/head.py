"""The output-head path (``kernels/head_gemm.py``) for 1-15 output channels per group: tuning candidates
(``head_tiles``) and their launches (``HeadSteps``). "rows" sums the width taps in its GEMM into a buffer Z
of output rows that a second kernel sums over the depth and height taps; "shuffle" (dilation 1) writes the
output from one kernel."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...core.params import ConvT3dParams, cdiv, pow2_at_least

MAX_HEAD_CHANNELS = 15  # Cout/g up to which head configs are candidates (above, the GEMM's N fills an MMA)
HEAD_KINDS = ("rows", "shuffle")  # head_rows_kernel then head_gather_tile_kernel over Z; head_shuffle_kernel


@dataclass(frozen=True)
class HeadConfig:
    """Tile shape and launch parameters of an output-head kind: "rows" (BLOCK_W the tap sum's row span,
    BLOCK_R its elements per program) or "shuffle" (BOX_H x BLOCK_W blocks, or BLOCK_M where BOX_H is 0)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    BLOCK_W: int
    num_warps: int
    num_stages: int
    use_dot: bool = True
    head: str = ""  # the kind, one of HEAD_KINDS
    BLOCK_R: int = 0
    BOX_H: int = 0
    z_bf16: bool = False  # rows: tap-product buffer in bf16 (bf16 calls), half its traffic
    persist: int = 0  # programs per SM of a persistent head GEMM; 0: one program per tile
    w_packed: bool = False  # rows: weight tiles packed densely once per call
    n_joint: bool = False  # with w_packed: every N tile's accumulator live per input tile
    x_cl: bool = False  # the head GEMM reads a channels-last copy of an NCDHW input (vector loads)
    shifts_n: int = 0  # shuffle: shifts as MMA columns (0 none, 1 width, 2 height and width)

    def short(self) -> str:
        if self.head == "shuffle":
            box = f"{self.BOX_H}x{self.BLOCK_W}" if self.BOX_H else "flat"
            return (f"head-shuffle M{self.BLOCK_M}({box}) N{self.BLOCK_N} K{self.BLOCK_K} "
                    f"{'mma' if self.use_dot else 'fma'} w{self.num_warps} s{self.num_stages}"
                    + ("" if not self.shifts_n else " nw" if self.shifts_n == 1 else " nhw"))
        return (f"head-{self.head} M{self.BLOCK_M} N{self.BLOCK_N} K{self.BLOCK_K} W{self.BLOCK_W} "
                f"R{self.BLOCK_R} w{self.num_warps} s{self.num_stages}" + (" zbf16" if self.z_bf16 else "")
                + (f" p{self.persist}" if self.persist else "") + (" wpk" if self.w_packed else "")
                + (" nj" if self.n_joint else "") + (" xcl" if self.x_cl else ""))


OFFSET_LIMIT = 2**31  # elements of one batch element up to which a kernel's offsets inside it are 32-bit
MAX_Z_BYTES = 4 << 30  # Z is a temporary of the call: no rows tile needing more is offered (the phase path needs none)


def rounds_tf32(dtype: torch.dtype, precision: str) -> bool:
    """Whether a call's operands are rounded to TF32: fp32 at "tf32" (cuDNN's numerics)."""
    return dtype == torch.float32 and precision == "tf32"


def _rows_columns(params: ConvT3dParams) -> int:
    """N of the rows kind's GEMM: Cout/g x depth taps x height taps x W residues."""
    (kd, kh, _), sw = params.kernel_size, params.stride[2]
    return params.out_channels_per_group * kd * kh * sw


def _block_k(params: ConvT3dParams, dtype: torch.dtype) -> int:
    """The GEMM's K step: Cin/g rounded up to a power of two, 16 to 32 (fp32) or 64 (16-bit)."""
    return max(16, min(32 if dtype.itemsize == 4 else 64, pow2_at_least(params.in_channels_per_group)))


def collision_free(params: ConvT3dParams) -> bool:
    """No output position receives two (input, tap) contributions: every ``tap_step`` >= the kernel."""
    return all(a.tap_step >= a.kernel for a in params.axes)


def shuffle_layer(params: ConvT3dParams) -> bool:
    """Dilation (or kernel) 1 everywhere, so each block's outputs form their own box, of at most 16 x 16 (unrolled)."""
    return (all(a.dilation == 1 or a.kernel == 1 for a in params.axes)
            and params.stride[0] * params.stride[1] <= 16 and params.stride[2] <= 16)


def shuffle_shifts(params: ConvT3dParams) -> tuple[int, int, int]:
    """(J_d, J_h, J_w): the shuffle kind's shifts per dimension, ceil(k / s)."""
    return tuple(cdiv(a.kernel, a.stride) for a in params.axes)


def shuffle_blocks(params: ConvT3dParams) -> tuple[int, int, int]:
    """The shuffle kind's blocks q = (o + p) // s covering the output, per dimension."""
    return tuple(cdiv(a.out_size + a.padding, a.stride) for a in params.axes)


def shuffle_n_shifts(params: ConvT3dParams, shifts_n: int) -> tuple[int, int]:
    """(NJH, NJW): the height and width shifts a shuffle tile puts in the MMA's N (1: K steps)."""
    _, jh, jw = shuffle_shifts(params)
    return (jh if shifts_n >= 2 else 1), (jw if shifts_n >= 1 else 1)


def shuffle_halo(params: ConvT3dParams, shifts_n: int, box_h: int, block_w: int) -> tuple[int, int]:
    """The blocks a shuffle tile reads but does not write, as shifts in N read rows q - (nh, nw) of the tile:
    (height rows, width columns) of a box tile, (0, blocks) of a flat one."""
    njh, njw = shuffle_n_shifts(params, shifts_n)
    if box_h == 0:
        return 0, (njh - 1) * shuffle_blocks(params)[2] + njw - 1
    return njh - 1, njw - 1


def shuffle_shape(params: ConvT3dParams, use_dot: bool, shifts_n: int = 0) -> tuple[int, int, int]:
    """(R_P, SW_P, BLOCK_C) of head_shuffle_kernel: the box's depth x height rows and its width,
    each a power of two, and the channels per row block (for the MMA, enough that N reaches 16)."""
    r_p, sw_p = pow2_at_least(params.stride[0] * params.stride[1]), pow2_at_least(params.stride[2])
    bc = pow2_at_least(params.out_channels_per_group)
    if use_dot:
        ns_p = pow2_at_least(math.prod(shuffle_n_shifts(params, shifts_n)))
        bc = max(bc, pow2_at_least(cdiv(16, ns_p * r_p * sw_p)))
    return r_p, sw_p, bc


def shuffle_tiles(params: ConvT3dParams, dtype: torch.dtype) -> list[dict]:
    """The shuffle kind's candidates: MMA tiles of BOX_H x BLOCK_W blocks or of consecutive blocks,
    without and with shifts in N (each wins on some layouts); one FMA tile for layers without shifts."""
    _, blocks_h, blocks_w = shuffle_blocks(params)
    jd, jh, jw = shuffle_shifts(params)
    shifted = jd * jh * jw > 1
    tiles = []
    bw = max(16, min(128, pow2_at_least(blocks_w)))
    plane = blocks_h * blocks_w
    # Shifts in N (shifts_n 1: the width's, 2: the height's too) where the layer has them.
    for shifts_n in [0] + [1] * (jw > 1) + [2] * (jh > 1):
        njh, njw = shuffle_n_shifts(params, shifts_n)
        r_p, sw_p, bc = shuffle_shape(params, True, shifts_n)
        ncol = pow2_at_least(njh * njw) * r_p * bc * sw_p
        if ncol > 256:
            continue
        # Box tiles where the row of blocks fills its W tiles, else flat ones (at most 128 x 128).
        if plane >= 128 and (shifts_n or blocks_w % bw != 0):
            halo = shuffle_halo(params, shifts_n, 0, 0)[1]
            shapes = [(m, 0, 0) for m in (128, 256) if m * ncol <= 128 * 128] or [(128 * 128 // ncol, 0, 0)]
            shapes = [t for t in shapes if t[0] >= 2 * halo]
        else:
            hh, hw = shuffle_halo(params, shifts_n, 1, bw)
            heights = dict.fromkeys(max(1, min(m // bw, pow2_at_least(blocks_h))) for m in (bw, 128, 256))
            shapes = [(box_h * bw, box_h, bw) for box_h in heights
                      if box_h * bw * ncol <= 128 * 128 and 2 * (box_h - hh) * (bw - hw) >= box_h * bw]
        for tm, box_h, tw in shapes:
            # With shifts in N, 8 warps beside 4, where 4 may take up to 255 registers a thread.
            warps = [4 if tm * ncol <= 128 * 64 else 8] + [8] * (shifts_n > 0 and 128 * 32 < tm * ncol <= 128 * 64)
            for n_warps in warps:
                tiles.append(dict(BLOCK_M=tm, BLOCK_N=ncol, BLOCK_K=_block_k(params, dtype), BLOCK_W=tw,
                                  BOX_H=box_h, num_warps=n_warps, num_stages=1, use_dot=True, head="shuffle",
                                  BLOCK_R=0, shifts_n=shifts_n))
    r_p, sw_p, bc = shuffle_shape(params, False)
    rows = r_p * bc * sw_p
    if rows <= 2048 and not shifted:
        bw = max(1, min(128, pow2_at_least(blocks_w), 2048 // rows))
        box_h = max(1, min(2048 // (rows * bw), pow2_at_least(blocks_h)))
        tiles.append(dict(BLOCK_M=box_h * bw, BLOCK_N=rows, BLOCK_K=min(8, pow2_at_least(params.in_channels_per_group)),
                          BLOCK_W=bw, BOX_H=box_h, num_warps=4, num_stages=1, use_dot=False, head="shuffle",
                          BLOCK_R=0))
    return tiles


def head_z_elements(params: ConvT3dParams) -> int:
    """Elements of the rows kind's Z: N x Cout x kd x kh x input D x H x output W."""
    (d, h, _), (kd, kh, _), ow = params.in_size, params.kernel_size, params.out_size[2]
    return params.batch * params.out_channels * kd * kh * d * h * ow


def head_z_bytes(params: ConvT3dParams) -> int:
    """Bytes of Z in fp32 (the size bound MAX_Z_BYTES is checked on)."""
    return 4 * head_z_elements(params)


def width_shifts(params: ConvT3dParams) -> tuple[int, int]:
    """(first, count) of the rows kind's width shifts delta = iw - q: input column q + delta feeds
    output column q * SW + rw through tap tw where rw + PW - delta * SW = tw * DW."""
    a = params.axes[2]
    deltas = [(rw + a.padding - tw * a.dilation) // a.stride for rw in range(a.stride) for tw in range(a.kernel)
              if (rw + a.padding - tw * a.dilation) % a.stride == 0]
    return min(deltas), max(deltas) - min(deltas) + 1


def head_tiles(params: ConvT3dParams, dtype: torch.dtype, precision: str, channels_last: bool = True) -> list[dict]:
    """The ``HeadConfig`` fields of this call's head candidates (each a compile at a first tuned call), the first the
    default: "rows" where taps meet and Z fits MAX_Z_BYTES, "shuffle" at dilation 1; none for other layers."""
    cout_g = params.out_channels_per_group
    # In-element offsets are 32-bit (HeadSteps.run): one batch element must hold < 2^31.
    if cout_g > MAX_HEAD_CHANNELS or params.in_channels * math.prod(params.in_size) >= 2**31:
        return []
    bk = _block_k(params, dtype)
    bw = max(16, min(128, pow2_at_least(params.out_size[2])))
    sw = params.stride[2]
    tiles = []
    # The rows kind interleaves the W residues in registers (a reshape): SW a power of two up to 16.
    if not collision_free(params) and sw & (sw - 1) == 0 and sw <= 16 and head_z_bytes(params) <= MAX_Z_BYTES:
        bn = max(16, min(128, pow2_at_least(_rows_columns(params))))
        rows = dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, BLOCK_W=bw, num_warps=4 if 128 * bn <= 128 * 64 else 8,
                    num_stages=2, use_dot=True, head="rows", BLOCK_R=2048)
        persistent = _persistent(params, dtype, rows)
        tiles += [rows] + persistent
        tiles += _packed(params, dtype, rows, any(head_smem(params, dtype, t)[1] for t in persistent))
    if shuffle_layer(params):
        tiles += shuffle_tiles(params, dtype)
    # Half-K copies after the full-K defaults: the 16-bit K-64 and fp32 K-32 rows tiles spill, they do not.
    if bk > 16:
        tiles += [dict(t, BLOCK_K=bk // 2) for t in tiles if t["head"] == "rows" and not t.get("persist")]
    # bf16 calls keep Z in bf16, halving its traffic: each width-tap sum is rounded once, like the output.
    if dtype == torch.bfloat16:
        tiles = [dict(t, z_bf16=True) if t["head"] == "rows" else t for t in tiles]
    if not channels_last or rounds_tf32(dtype, precision):
        # The persistent and packed full-K rows tiles again on a channels-last copy of the input (``x_cl``).
        tiles += [dict(t, x_cl=True) for t in tiles
                  if t["head"] == "rows" and (t.get("persist") or t.get("w_packed")) and t["BLOCK_K"] == bk]
    return tiles


SM_SHARED_BYTES = 228 << 10  # of one H100/H200 SM, 1 KB of which the driver keeps per resident block
MAX_BLOCK_SMEM = 227 << 10  # the most one block may take


def head_smem(params: ConvT3dParams, dtype: torch.dtype, t: dict) -> tuple[int, bool]:
    """(shared memory, weight held) of a persistent rows tile, within 2 KB of Triton's figure for sm_90a: per stage
    each width shift and K step's input, the weight once if it fits beside them (held) else per stage, 4 KB epilogue."""
    elt = dtype.itemsize
    nshift = width_shifts(params)[1]
    k_steps = cdiv(params.in_channels_per_group, t["BLOCK_K"])
    n_tiles = cdiv(_rows_columns(params), t["BLOCK_N"])
    x_stage = nshift * k_steps * t["BLOCK_M"] * t["BLOCK_K"] * elt
    w_bytes = nshift * k_steps * n_tiles * t["BLOCK_K"] * t["BLOCK_N"] * elt
    stages = t["num_stages"] * x_stage + (4 << 10)
    held = stages + w_bytes <= MAX_BLOCK_SMEM
    return stages + (w_bytes if held else t["num_stages"] * w_bytes), held


def _persistent(params: ConvT3dParams, dtype: torch.dtype, base: dict) -> list[dict]:
    """Persistent variants of the rows tile ``base``, with as many programs per SM (at most 3) as fit."""
    shapes = [(bm, stages, base["BLOCK_N"]) for bm, stages in ((64, 3), (128, 3), (64, 2))]
    if _rows_columns(params) > base["BLOCK_N"]:
        # Wider than one N tile: BLOCK_N 64 pads fewer columns at no cost in input traffic.
        shapes += [(64, stages, 64) for stages in (2, 3)]
    out = []
    for bm, stages, bn in shapes:
        t = dict(base, BLOCK_M=bm, BLOCK_N=bn, num_stages=stages, num_warps=4 if bm * bn <= 128 * 64 else 8)
        smem = head_smem(params, dtype, t)[0]
        # 1 KB per block for the driver and 8 KB of slack: a tile just under half an SM may fit only one block.
        per_sm = min(3, SM_SHARED_BYTES // (smem + (9 << 10)))
        if per_sm >= 1 and smem <= MAX_BLOCK_SMEM:
            out.append(dict(t, persist=per_sm))
    return out


JOINT_ACC_REGS = 96  # fp32 accumulator registers per thread a joint tile may take: ptxas keeps so many unspilled


def _joint_fits(params: ConvT3dParams, dtype: torch.dtype, bm: int, warps: int, stages: int, bk: int) -> bool:
    """A joint tile's accumulators fit JOINT_ACC_REGS per thread and its stages one block's shared memory."""
    n_tiles = cdiv(_rows_columns(params), 64)
    smem = stages * (bm * bk + n_tiles * bk * 64) * dtype.itemsize + (4 << 10)
    return n_tiles * bm * 64 <= JOINT_ACC_REGS * 32 * warps and smem <= MAX_BLOCK_SMEM


def _packed(params: ConvT3dParams, dtype: torch.dtype, base: dict, held: bool) -> list[dict]:
    """Single-sweep rows tiles on the packed weight (``w_packed``): one where a persistent tile holds it (``held``), to
    keep first-call compiles few; else several, plus ``n_joint`` tiles wider than an N tile where ``_joint_fits``."""
    if held:
        return [dict(base, BLOCK_M=64, num_warps=4, num_stages=3, w_packed=True)]
    out = [dict(base, BLOCK_M=bm, num_warps=warps, num_stages=stages, w_packed=True)
           for bm, warps, stages in ((128, 8, 3), (64, 4, 3), (64, 4, 4), (256, 8, 3))]
    ncol = _rows_columns(params)
    if ncol > base["BLOCK_N"]:  # base: BLOCK_N 128, the widest tile
        out += [dict(base, BLOCK_M=bm, BLOCK_N=64, num_warps=warps, num_stages=3, w_packed=True, n_joint=True)
                for bm, warps in ((64, 4), (128, 8)) if _joint_fits(params, dtype, bm, warps, 3, base["BLOCK_K"])]
    return out


def _rows_steps(params: ConvT3dParams, cfg) -> tuple[int, int]:
    """(N tiles, K steps) of the rows GEMM under ``cfg``'s BLOCK_N and BLOCK_K."""
    return cdiv(_rows_columns(params), cfg.BLOCK_N), cdiv(params.in_channels_per_group, cfg.BLOCK_K)


def device_programs(device: torch.device, per_sm: int = 4) -> int:
    """Programs that fill a device: ``per_sm`` per SM on CUDA, 1 on the CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(device: torch.device, tiles: int, per_sm: int) -> int:
    """Programs of a head GEMM over ``tiles`` tiles: one per tile (``per_sm`` 0), else ``per_sm`` per SM (at most 3 on
    the CPU, so that the interpreter runs the loop)."""
    if per_sm <= 0:
        return tiles
    if device.type != "cuda":
        return max(1, min(tiles, 3))
    return max(1, min(tiles, device_programs(device, per_sm)))


def _batch_span(x: torch.Tensor) -> int:
    """Elements between the first and last of one batch element of x (its strides' reach)."""
    return 1 + sum(abs(st) * (n - 1) for n, st in zip(x.shape[1:], x.stride()[1:]))


def flat_spatial(x: torch.Tensor) -> bool:
    """D, H, W of x are walked by one stride (its W stride): contiguous NCDHW or channels-last planes."""
    _, _, d, h, w = x.shape
    sd, sh, sw = x.stride()[2:]
    return (h == 1 or sh == w * sw) and (d == 1 or sd == h * sh)


class HeadSteps:
    """The launches of one (call signature, head config), built on the first run: ``make_site`` gives
    the engine's launch sites, ``prepare_input`` its NDHWC copy (which x_cl tiles read)."""

    def __init__(self, params: ConvT3dParams, cfg, precision: str, has_bias: bool, make_site: Callable[..., object],
                 prepare_input=None):
        self.params, self.cfg, self.has_bias, self.make_site = params, cfg, has_bias, make_site
        self.prepare_input, self.precision = prepare_input, precision  # "tf32" for 16-bit: ignored there
        if cfg.head not in HEAD_KINDS:
            raise ValueError(f"head config {cfg.head!r} is not a head kind (one of {', '.join(HEAD_KINDS)})")
        self.shuffle = cfg.head == "shuffle"
        if self.shuffle and not shuffle_layer(params):
            raise ValueError("head config 'shuffle' needs dilation 1 (or a kernel of 1) along every dimension and "
                             "boxes of at most 16 x 16 (shuffle_layer)")
        if cfg.w_packed and (cfg.head != "rows" or cfg.persist):
            raise ValueError("head config 'w_packed' is a single-sweep rows option (persist 0)")
        if cfg.n_joint and not cfg.w_packed:
            raise ValueError("head config 'n_joint' is an option of the packed weight (w_packed)")
        if cfg.x_cl and prepare_input is None:
            raise ValueError("head config 'x_cl' needs the engine's input copy (prepare_input)")
        # The sites, built at the first run; ``pack``: (head_rows_pack_kernel's site, packed elements).
        self.gemm = self.gather = self.pack = None
        # The input copy the GEMMs read, decided at the first run: "cl" (an x_cl tile on input not
        # channels-last or to be rounded), "dense" (>= 2^31 elements per batch element), "" none.
        self.copy_x = None

    def _shuffle_site(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        """head_shuffle_kernel's launch: one program per (n, g, depth block, tile of blocks)."""
        p, cfg = self.params, self.cfg
        (sd, sh, sw), (pd, ph, pw), (od, oh, ow) = p.stride, p.padding, p.out_size
        blocks_d, blocks_h, blocks_w = shuffle_blocks(p)
        flat = cfg.BOX_H == 0  # tiles of BLOCK_M consecutive blocks of the plane
        box_h = max(1, cfg.BOX_H)
        # Tiles overlap by the halo that shifts in N read (shuffle_halo).
        hh, hw = shuffle_halo(p, cfg.shifts_n, cfg.BOX_H, cfg.BLOCK_W)
        tiles_h, tiles_w = ((cdiv(blocks_h * blocks_w, cfg.BLOCK_M - hw), 1) if flat
                            else (cdiv(blocks_h, box_h - hh), cdiv(blocks_w, cfg.BLOCK_W - hw)))
        r_p, sw_p, bc = shuffle_shape(p, cfg.use_dot, cfg.shifts_n)
        jd, jh, jw = shuffle_shifts(p)
        njh, njw = shuffle_n_shifts(p, cfg.shifts_n)
        jh, jw = (1 if njh > 1 else jh), (1 if njw > 1 else jw)  # shifts in N leave the K loop
        ints = (p.batch, p.in_channels_per_group, p.out_channels_per_group, *p.in_size, od, oh, ow, pd, ph, pw,
                *x.stride(), w.stride(0), *y.stride(), blocks_d, blocks_w, tiles_h, tiles_w)
        consts = dict(HAS_BIAS=self.has_bias, ROUND_TF32=rounds_tf32(x.dtype, self.precision), PRECISION=self.precision,
                      USE_DOT=cfg.use_dot, KD=p.kernel_size[0], KH=p.kernel_size[1], KW=p.kernel_size[2],
                      SD=sd, SH=sh, SW=sw, JD=jd, JH=jh, JW=jw, NJH=njh, NJW=njw,
                      NS_P=pow2_at_least(njh * njw), FLAT=flat, R_P=r_p, SW_P=sw_p, BLOCK_C=bc,
                      BLOCK_H=1 if flat else box_h, BLOCK_W=cfg.BLOCK_M if flat else cfg.BLOCK_W,
                      BLOCK_K=cfg.BLOCK_K, Y64=_batch_span(y) >= OFFSET_LIMIT, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        grid = (p.groups * p.batch * blocks_d * tiles_h * tiles_w,)
        key = ("head_shuffle", p, cfg, x.stride(), y.stride(), self.has_bias, self.precision, x.dtype)
        return self.make_site(key, "head_shuffle_kernel", grid, ints, consts)

    def _rows_site(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        """head_rows_kernel's launch: (programs, groups), each walking its group's (n, M tile) tiles."""
        p, cfg = self.params, self.cfg
        _, _, d, h, wd = x.shape
        round_tf32 = rounds_tf32(x.dtype, self.precision)
        (kd, kh, kw), sw, ow = p.kernel_size, p.stride[2], p.out_size[2]
        qw = cdiv(ow, sw)
        tiles_m = cdiv(d * h * qw, cfg.BLOCK_M)
        shift0, nshift = width_shifts(p)
        num_tiles = p.batch * tiles_m  # per group: the grid's second axis
        programs = cdiv(persistent_programs(x.device, p.groups * num_tiles, cfg.persist), p.groups)
        ints = (p.batch, p.in_channels_per_group, _rows_columns(p), d, h, wd, ow, qw, kh, kw, kd * kh * kw, sw,
                p.padding[2], p.dilation[2], shift0, *x.stride(), w.stride(0), tiles_m, num_tiles)
        n_tiles, k_steps = _rows_steps(p, cfg)
        # The input is rounded by the copy (x_cl) or in registers, the weight as gathered or packed. FLAT_DH: depth
        # and height walked by the height stride (NCDHW or channels-last input); FULL_W: each compact column fills SW.
        consts = dict(ROUND_X=round_tf32 and self.copy_x != "cl", ROUND_W=round_tf32, PRECISION=self.precision,
                      SW_C=sw, NSHIFT=nshift, FLAT_DH=x.stride(2) == h * x.stride(3), FULL_W=ow == qw * sw,
                      UNROLL=cfg.persist > 0, W_ONCE=cfg.persist > 0 and head_smem(p, x.dtype, vars(cfg))[1],
                      W_PACKED=cfg.w_packed, N_JOINT=cfg.n_joint, N_TILES=n_tiles, K_STEPS=k_steps,
                      BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        key = ("head_gemm", cfg.head, p, cfg, x.stride(), y.stride(), self.has_bias, self.precision, x.dtype, programs)
        return self.make_site(key, "head_rows_kernel", (programs, p.groups), ints, consts)

    def _pack_site(self, w: torch.Tensor):
        """head_rows_pack_kernel's launch and the packed copy's elements (``Config.w_packed``)."""
        p, cfg = self.params, self.cfg
        shift0, nshift = width_shifts(p)
        n_tiles, k_steps = _rows_steps(p, cfg)
        ints = (p.in_channels_per_group, _rows_columns(p), p.kernel_size[2], math.prod(p.kernel_size), p.stride[2],
                p.padding[2], p.dilation[2], shift0, w.stride(0))
        round_tf32 = rounds_tf32(w.dtype, self.precision)
        consts = dict(ROUND_TF32=round_tf32, SW_C=p.stride[2], NSHIFT=nshift, N_TILES=n_tiles, K_STEPS=k_steps,
                      BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=4)
        key = ("head_rows_pack", p, cfg.BLOCK_N, cfg.BLOCK_K, w.dtype, round_tf32)
        site = self.make_site(key, "head_rows_pack_kernel", (nshift * k_steps * n_tiles, p.groups), ints, consts)
        return site, p.groups * nshift * k_steps * cfg.BLOCK_K * n_tiles * cfg.BLOCK_N

    def _gather_site(self, y: torch.Tensor):
        """head_gather_tile_kernel's launch: the depth and height taps of Z's output rows summed into y."""
        p, cfg = self.params, self.cfg
        od, oh, ow = p.out_size
        (d, h, _), (sd, sh, _), (pd, ph, _), (dd, dh, _) = p.in_size, p.stride, p.padding, p.dilation
        (kd, kh, _), cout_g = p.kernel_size, p.out_channels_per_group
        # The gather tile: the group's channels by rows of one height residue (at most its rows), about BLOCK_R elements.
        bc = pow2_at_least(cout_g)
        br = max(1, min(pow2_at_least(cdiv(oh, sh)), cfg.BLOCK_R // (bc * cfg.BLOCK_W)))
        # Programs per (n, g, od): height residues x tiles of BLOCK_R rows of a residue x W tiles.
        tiles_q, tiles_w = cdiv(cdiv(oh, sh), br), cdiv(ow, cfg.BLOCK_W)
        grid = (p.groups * p.batch * od * sh * tiles_q * tiles_w,)
        # Z holds output rows: one "width tap" (stride and dilation 1, no padding) over a width of OW.
        ints = (p.batch, cout_g, d, h, ow, od, oh, ow, sd, sh, 1, pd, ph, 0, dd, dh, 1, *y.stride(), tiles_q, tiles_w)
        # 4 warps from 1024 elements down, fewer for smaller tiles (whose threads would hold copies).
        warps = max(1, min(4, bc * br * cfg.BLOCK_W // 256))
        consts = dict(HAS_BIAS=self.has_bias, KD=kd, KH=kh, KW=1, BLOCK_C=bc, BLOCK_R=br, BLOCK_W=cfg.BLOCK_W,
                      num_warps=warps)
        key = ("head_gather_tile", cfg.head, p, cfg.BLOCK_W, cfg.BLOCK_R, y.stride(), self.has_bias)
        return self.make_site(key, "head_gather_tile_kernel", grid, ints, consts)

    def run(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
        """Launch onto ``y``; returns Triton's handle of the GEMM kernel."""
        dev = x.device
        round_tf32 = rounds_tf32(x.dtype, self.precision)
        if self.copy_x is None:
            # The GEMMs' in-element offsets are 32-bit: a view whose strides reach further is copied.
            cl = x.is_contiguous(memory_format=torch.channels_last_3d)
            self.copy_x = ("cl" if self.cfg.x_cl and (round_tf32 or not cl)
                           else "dense" if _batch_span(x) >= 2**31 else "")
        if self.copy_x == "cl":
            # The engine's NDHWC copy kernel, cheaper than PyTorch's .contiguous(channels_last_3d).
            x = self.prepare_input(x, round_tf32)
        elif self.copy_x == "dense":
            x = x.contiguous()
        if self.gemm is None:
            self.gemm = self._shuffle_site(x, w, y) if self.shuffle else self._rows_site(x, w, y)
        if self.shuffle:
            return self.gemm.launch(dev, x, w, b, y)
        if self.gather is None:
            self.gather = self._gather_site(y)
        if self.cfg.w_packed:
            self.pack = self.pack or self._pack_site(w)
            site, elements = self.pack
            packed = torch.empty(elements, device=dev, dtype=w.dtype)
            site.launch(dev, w, packed)
            w = packed
        z = torch.empty(head_z_elements(self.params), device=dev,
                        dtype=torch.bfloat16 if self.cfg.z_bf16 else torch.float32)
        handle = self.gemm.launch(dev, x, w, z)
        self.gather.launch(dev, z, b, y)
        return handle
