"""Launcher of the output-head path (kernels in ``kernels/head_gemm.py``): layers with
1-15 output channels per group -- the last layer of 3-D generators and decoders (voxels, RGB
video, segmentation classes).

The Triton engine (``triton_engine``) offers these configurations as tuning candidates next to
its phase-GEMM ones (``head_tiles``), and runs a chosen one through ``HeadSteps``; this module
holds the plan (which kernels, tiles, grids, integer arguments), not the launch machinery: the
engine passes its launch-site factory in, so the kernels are replayed as cheaply as its own.

Two kinds, each reading the input once and writing the output once. The rows kind sums the
width taps inside its GEMM, so its tap-product buffer Z (fp32, bf16 in bf16 calls) holds output
rows, written once and read once by the kernel that sums the depth and height taps. The shuffle
kind (dilation 1, ``shuffle_layer``) writes the whole output from one kernel, summing the taps
past the stride as shifts of its K loop, with no Z at all.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ...core.params import ConvT3dParams

__all__ = ["MAX_HEAD_CHANNELS", "HEAD_KINDS", "head_tiles", "collision_free",
           "shuffle_layer", "shuffle_shifts", "shuffle_n_shifts", "shuffle_halo", "shuffle_blocks", "shuffle_tiles",
           "shuffle_shape", "head_z_elements", "head_z_bytes", "width_shifts", "HeadSteps"]

# Output channels per group up to which head configurations are candidates. Above ~16 the phase
# GEMM's N is a full MMA width and reads its input tile once per tap for >= 16 useful columns;
# between 8 and 15 the tuner times the two paths against each other.
MAX_HEAD_CHANNELS = 15
# "rows": head_rows_kernel, a GEMM whose N holds (Cout/g, depth tap, height tap, W residue) and
# whose K steps over the width shifts, so Z holds output rows; head_gather_tile_kernel then sums
# the depth and height taps of every output. "shuffle": head_shuffle_kernel, for layers at
# dilation 1 (shuffle_layer): the outputs of each block q (o = q * s - p + r) sum the taps
# j * s + r of the inputs q - j, all in registers, and are written in one sweep (a pixel shuffle
# of a stride-1 convolution; no Z, no fill).
HEAD_KINDS = ("rows", "shuffle")
# Elements of one batch element up to which a kernel's offsets inside it are 32-bit.
OFFSET_LIMIT = 2**31
# Z is a temporary of the call; beyond this it is not offered (the phase path needs no buffer).
MAX_Z_BYTES = 4 << 30


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def _rows_columns(params: ConvT3dParams) -> int:
    """N of the rows kind's GEMM: Cout/g x depth taps x height taps x W residues."""
    (kd, kh, _), sw = params.kernel_size, params.stride[2]
    return params.out_channels_per_group * kd * kh * sw


def _block_k(params: ConvT3dParams, dtype: torch.dtype) -> int:
    """The GEMM's K step: Cin/g rounded up to a power of two, 16 to 32 (fp32) or 64 (16-bit)."""
    return max(16, min(32 if dtype.itemsize == 4 else 64, _pow2_ceil(params.in_channels_per_group)))


def collision_free(params: ConvT3dParams) -> bool:
    """No output position receives two (input, tap) contributions: along every dimension each
    output residue has at most one tap. Two taps t < t' of one dimension meet on an output only
    if (t' - t) * dilation is a multiple of the stride, the nearest being t' - t = the tap step
    s / gcd(s, d) (params.Axis.tap_step); so the rule is tap_step >= kernel, which holds when
    dilation * (kernel - 1) < stride (k2 s2) but also for k2 s2 d3 (odd and even positions)."""
    return all(a.tap_step >= a.kernel for a in params.axes)


def shuffle_layer(params: ConvT3dParams) -> bool:
    """Dilation 1 along every dimension (or a kernel of 1): tap t = j * s + r of a dimension
    (shift j, residue r < s) sends input i to output (i + j) * s - p + r, so the outputs
    q * s - p + r of block q are a box of their own, summed from the inputs q - j
    (``shuffle_shifts``), which head_shuffle_kernel writes in a single sweep. Boxes of at most
    16 depth x height rows and 16 columns (the kernel unrolls them)."""
    return (all(a.dilation == 1 or a.kernel == 1 for a in params.axes)
            and params.stride[0] * params.stride[1] <= 16 and params.stride[2] <= 16)


def shuffle_shifts(params: ConvT3dParams) -> tuple[int, int, int]:
    """(J_d, J_h, J_w): the shifts per dimension of the shuffle kind, ceil(k / s) -- 1 where the
    kernel fits in its stride (k2 s2), 2 for k4 s2, 3 for k3 s1."""
    return tuple(-(-a.kernel // a.stride) for a in params.axes)


def shuffle_blocks(params: ConvT3dParams) -> tuple[int, int, int]:
    """The shuffle kind's blocks q = (o + p) // s covering the output, per dimension: past the
    input where output padding or the shifts reach further."""
    return tuple(-(-(a.out_size + a.padding) // a.stride) for a in params.axes)


def shuffle_n_shifts(params: ConvT3dParams, shifts_n: int) -> tuple[int, int]:
    """(NJH, NJW): the height and width shifts a shuffle tile with ``Config.shifts_n`` puts in
    the MMA's N (1 where they stay K steps): shifts_n 1 the width's, 2 the height's and the
    width's."""
    _, jh, jw = shuffle_shifts(params)
    return (jh if shifts_n >= 2 else 1), (jw if shifts_n >= 1 else 1)


def shuffle_halo(params: ConvT3dParams, shifts_n: int, box_h: int, block_w: int) -> tuple[int, int]:
    """The blocks a shuffle tile reads but does not write (shifts in N read the products of
    the rows q - (nh, nw) of the same tile): (height rows, width columns) of a box tile, or
    (0, blocks) of a flat one (BOX_H 0: the first (NJH - 1) x blocks_w + NJW - 1 of its row
    order)."""
    njh, njw = shuffle_n_shifts(params, shifts_n)
    if box_h == 0:
        return 0, (njh - 1) * shuffle_blocks(params)[2] + njw - 1
    return njh - 1, njw - 1


def shuffle_shape(params: ConvT3dParams, use_dot: bool, shifts_n: int = 0) -> tuple[int, int, int]:
    """(R_P, SW_P, BLOCK_C) of head_shuffle_kernel: the box's depth x height rows and its width,
    each rounded up to a power of two, and the channels per row block -- every output channel
    of the group, and for the MMA enough that its N (NS_P x R_P x BLOCK_C x SW_P, NS_P the
    power of two of the shifts in N) reaches 16."""
    r_p, sw_p = _pow2_ceil(params.stride[0] * params.stride[1]), _pow2_ceil(params.stride[2])
    bc = _pow2_ceil(params.out_channels_per_group)
    if use_dot:
        ns_p = _pow2_ceil(math.prod(shuffle_n_shifts(params, shifts_n)))
        bc = max(bc, _pow2_ceil(-(-16 // (ns_p * r_p * sw_p))))
    return r_p, sw_p, bc


def shuffle_tiles(params: ConvT3dParams, dtype: torch.dtype) -> list[dict]:
    """The shuffle kind's candidates (``shuffle_layer`` layers): programs of BOX_H rows x
    BLOCK_W columns of blocks (BLOCK_W covering the row up to 128), MMA tiles of M = 1 row, 128
    and 256 blocks, or flat MMA tiles of 128 and 256 blocks in row order (64 at N 256; BOX_H 0,
    BLOCK_W 0) where the row of blocks is not a multiple of its W tile; and one FMA tile.

    * MMA: N = R_P x BLOCK_C x SW_P columns (16 for the k2 s2 8 -> 2 head: 4 rows x 2 channels
      x 2 taps), at most 256; M at least 16 (tl.dot); 4 warps up to 64 fp32 accumulators per
      thread, else 8; BLOCK_K as the GEMMs'. Programs of one row of blocks are small (4 KB of
      output each on that head), so wider ones are timed too. Layers with shifts (k > s) loop
      over (channel block, shift) steps at one stage, which beat three on most head rows.
    * MMA with shifts in N (``shifts_n`` 1: the width shifts, 2: the height ones too, where the
      layer has them): fewer input tiles per channel block, N NS_P times as wide and a halo of
      blocks read, not written (``shuffle_halo``); faster than the tiles without in fp32 and
      NCDHW bf16, slower in channels-last bf16, so both are offered. One stage here too: three
      were slower on most such tiles.
    * FMA, for layers without shifts: about 2048 accumulators per program (16 per thread at 4
      warps) and BLOCK_K 8, so that the product of a K step (BLOCK_K x the accumulators) stays
      in 128 registers a thread; BLOCK_W down to 1 for wide boxes. Several times behind the MMA
      tiles on heads with shifts, so not offered there.
    The layer's Cout/g x taps multiply-adds per input element decide between them (compute
    against bandwidth): the tuner's measurement."""
    _, blocks_h, blocks_w = shuffle_blocks(params)
    jd, jh, jw = shuffle_shifts(params)
    shifted = jd * jh * jw > 1
    tiles = []
    bw = max(16, min(128, _pow2_ceil(blocks_w)))
    plane = blocks_h * blocks_w
    # Shifts in N (shifts_n 1: the width's, 2: the height's too) where the layer has them.
    for shifts_n in [0] + [1] * (jw > 1) + [2] * (jh > 1):
        njh, njw = shuffle_n_shifts(params, shifts_n)
        r_p, sw_p, bc = shuffle_shape(params, True, shifts_n)
        ncol = _pow2_ceil(njh * njw) * r_p * bc * sw_p
        if ncol > 256:
            continue
        # Box tiles (BLOCK_M, BOX_H, BLOCK_W) where the row of blocks fills its W tiles; flat
        # tiles (BOX_H 0) of 128 and 256 consecutive blocks where a box would mask lanes (33
        # blocks in a W tile of 64) or would lose a column and a row to the halo of shifts in
        # N (a full W tile of 32 blocks writing 31); at N 256 one flat tile of 64.
        # Accumulators at most 128 x 128, and tiles that write at least half their blocks
        # (the halo is read, not written).
        if plane >= 128 and (shifts_n or blocks_w % bw != 0):
            halo = shuffle_halo(params, shifts_n, 0, 0)[1]
            shapes = [(m, 0, 0) for m in (128, 256) if m * ncol <= 128 * 128] or [(128 * 128 // ncol, 0, 0)]
            shapes = [t for t in shapes if t[0] >= 2 * halo]
        else:
            hh, hw = shuffle_halo(params, shifts_n, 1, bw)
            heights = dict.fromkeys(max(1, min(m // bw, _pow2_ceil(blocks_h))) for m in (bw, 128, 256))
            shapes = [(box_h * bw, box_h, bw) for box_h in heights
                      if box_h * bw * ncol <= 128 * 128 and 2 * (box_h - hh) * (bw - hw) >= box_h * bw]
        for tm, box_h, tw in shapes:
            # With shifts in N, 8 warps offered beside 4 from 32 accumulators a thread: at 4 the
            # largest of these tiles take up to 255 registers a thread (low occupancy), and
            # neither warp count wins every head row.
            warps = [4 if tm * ncol <= 128 * 64 else 8] + [8] * (shifts_n > 0 and 128 * 32 < tm * ncol <= 128 * 64)
            for n_warps in warps:
                tiles.append(dict(BLOCK_M=tm, BLOCK_N=ncol, BLOCK_K=_block_k(params, dtype), BLOCK_W=tw,
                                  BOX_H=box_h, num_warps=n_warps, num_stages=1, use_dot=True, head="shuffle",
                                  BLOCK_R=0, shifts_n=shifts_n))
    r_p, sw_p, bc = shuffle_shape(params, False)
    rows = r_p * bc * sw_p
    if rows <= 2048 and not shifted:
        bw = max(1, min(128, _pow2_ceil(blocks_w), 2048 // rows))
        box_h = max(1, min(2048 // (rows * bw), _pow2_ceil(blocks_h)))
        tiles.append(dict(BLOCK_M=box_h * bw, BLOCK_N=rows, BLOCK_K=min(8, _pow2_ceil(params.in_channels_per_group)),
                          BLOCK_W=bw, BOX_H=box_h, num_warps=4, num_stages=1, use_dot=False, head="shuffle",
                          BLOCK_R=0))
    return tiles


def head_z_elements(params: ConvT3dParams) -> int:
    """Elements of the rows kind's buffer Z: input depth x height x output width x Cout x depth
    and height taps."""
    (d, h, _), (kd, kh, _), ow = params.in_size, params.kernel_size, params.out_size[2]
    return params.batch * params.out_channels * kd * kh * d * h * ow


def head_z_bytes(params: ConvT3dParams) -> int:
    """Bytes of Z in fp32 (the size bound MAX_Z_BYTES is checked on)."""
    return 4 * head_z_elements(params)


def width_shifts(params: ConvT3dParams) -> tuple[int, int]:
    """(first, count) of the width shifts delta = iw - q of the rows kind: input column
    iw = q + delta feeds output column ow = q * SW + rw through tap tw where
    rw + PW - delta * SW = tw * DW; the shifts of every (rw, tw) pair, as one range."""
    a = params.axes[2]
    deltas = [(rw + a.padding - tw * a.dilation) // a.stride for rw in range(a.stride) for tw in range(a.kernel)
              if (rw + a.padding - tw * a.dilation) % a.stride == 0]
    return min(deltas), max(deltas) - min(deltas) + 1


def head_tiles(params: ConvT3dParams, dtype: torch.dtype, precision: str, channels_last: bool = True) -> list[dict]:
    """The head configurations for this call, as Config fields (``triton_engine.Config``):
    BLOCK_M GEMM rows x BLOCK_N columns x BLOCK_K input channels per GEMM program; BLOCK_W output
    columns and about BLOCK_R elements per program of the tap sum (its rows follow,
    ``_gather_tile``); ``head`` the kind. Empty when the layer is not a head or neither kind
    takes it.

    * "rows" where taps meet (not ``collision_free``), the width stride is a power of two up to
      16 (the kernel interleaves the W residues by a register reshape) and Z fits MAX_Z_BYTES:
      the single-sweep tile first (the untuned default), then its persistent variants
      (``_persistent``) and the tiles on a packed weight (``_packed``). Its input tile is re-read
      per width shift from cache, which costs less than a Z of every tap.
    * BLOCK_N covers all columns up to 128 (one input tile per program, fp32 accumulators of
      128 x 128 at 8 warps = 64 per thread); wider layers loop over N tiles in the program.
    * BLOCK_K: Cin/g rounded up to a power of two, at most 64 (16-bit) or 32 (fp32): one
      128-byte line per position and step, as the phase GEMM.
    * "shuffle" at dilation 1 (``shuffle_layer``), after the rows tiles: no Z (``shuffle_tiles``).
    * tl.dot needs 16 along every operand dimension, so K and N are padded to 16 (masked).
    * Half-K copies of the non-persistent rows tiles, after the others: the full-K tiles spill
      registers where the half-K ones do not (ptxas for sm_90a), so the tuner times both.
    * bfloat16 calls: the rows tiles keep Z in bf16 (``z_bf16``).
    * ``channels_last`` False (an NCDHW call) or an fp32 call at TF32: rows tiles on a
      channels-last copy of the input too (``_x_copies``).
    Each candidate costs about a second of compile at a layer's first tuned call.
    """
    cout_g = params.out_channels_per_group
    # In-element offsets are 32-bit (HeadSteps.run): one batch element must hold < 2^31.
    if cout_g > MAX_HEAD_CHANNELS or params.in_channels * math.prod(params.in_size) >= 2**31:
        return []
    bk = _block_k(params, dtype)
    bw = max(16, min(128, _pow2_ceil(params.out_size[2])))
    sw = params.stride[2]
    tiles = []
    # The rows kind interleaves the W residues in registers (a reshape): SW a power of two.
    if (not collision_free(params) and sw & (sw - 1) == 0 and sw <= 16
            and head_z_bytes(params) <= MAX_Z_BYTES):
        bn = max(16, min(128, _pow2_ceil(_rows_columns(params))))
        rows = dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, BLOCK_W=bw, num_warps=4 if 128 * bn <= 128 * 64 else 8,
                    num_stages=2, use_dot=True, head="rows", BLOCK_R=2048)
        persistent = _persistent(params, dtype, rows)
        tiles += [rows] + persistent
        tiles += _packed(params, dtype, rows, any(head_smem(params, dtype, t)[1] for t in persistent))
    if shuffle_layer(params):
        tiles += shuffle_tiles(params, dtype)
    # Half-K variants, after the full-K tiles (which stay the untuned defaults): the 16-bit K-64
    # and the fp32 two-stage K-32 rows tiles spill registers, their half-K copies do not.
    if bk > 16:
        tiles += [dict(t, BLOCK_K=bk // 2) for t in tiles if t["head"] == "rows" and not t.get("persist")]
    # Z in bfloat16 for bfloat16 calls: each sum over the width taps is rounded to bf16 once
    # before the tap sum adds them in fp32, errors of the size the output's own rounding makes
    # (within the accuracy budget of twice cuDNN's error); bf16 keeps fp32's range, so no
    # partial overflows where the output does not (fp16's could: fp16 and fp32 calls keep an
    # fp32 Z); and it halves Z's traffic, so bf16 calls get these tiles in place of fp32-Z ones.
    if dtype == torch.bfloat16:
        tiles = [dict(t, z_bf16=True) if t["head"] == "rows" else t for t in tiles]
    if not channels_last or (dtype == torch.float32 and precision == "tf32"):
        tiles += _x_copies(tiles)
    return tiles


def _x_copies(tiles: list[dict]) -> list[dict]:
    """The persistent and packed rows tiles again, on a channels-last copy of the input
    (``Config.x_cl``), for NCDHW calls and for fp32 calls at TF32 (where the copy also rounds
    the input to TF32). In NCDHW the GEMM's input tile [positions, channels] is read element by
    element (a position's width shift has no alignment the compiler can see); in channels-last
    each position's channels are one contiguous vector, at the price of moving the input's bytes
    twice, so whether the copy pays is the tuner's measurement per layer. At TF32 the copy
    rounds the input (cuDNN's numerics), so the GEMM's input tiles go from shared memory to the
    tensor cores untouched (head_rows_kernel's ROUND_W says why that matters). Only the full-K
    tiles, to keep the first call's compiles few."""
    bk = max(t["BLOCK_K"] for t in tiles) if tiles else 0
    return [dict(t, x_cl=True) for t in tiles
            if t["head"] == "rows" and (t.get("persist") or t.get("w_packed")) and t["BLOCK_K"] == bk]


# Shared memory of one H100/H200 SM (228 KB), 1 KB of which the driver keeps per resident block.
SM_SHARED_BYTES = 228 << 10
MAX_BLOCK_SMEM = 227 << 10  # the most one block may take


def head_smem(params: ConvT3dParams, dtype: torch.dtype, t: dict) -> tuple[int, bool]:
    """(shared memory estimate in bytes, weight held for all tiles) of a persistent rows tile
    ``t`` (head_rows_kernel with UNROLL: its loops unrolled in the tile loop, which Triton
    pipelines): per stage one tile's input, K steps x NSHIFT of BLOCK_M x BLOCK_K, loaded once
    for all N tiles; the weight tiles, K steps x NSHIFT x N tiles of BLOCK_K x BLOCK_N, once
    where they fit beside the stages in one block's shared memory (held), else per stage; ~4 KB
    for the epilogue. The estimate is within 2 KB of Triton's own figure for sm_90a; the kernel
    rounds a TF32 call's operands where they are made (the held weight once, the input on the
    copy or as it is loaded: head_rows_kernel's ROUND_X), which takes no shared memory."""
    elt = dtype.itemsize
    nshift = width_shifts(params)[1]
    k_steps = -(-params.in_channels_per_group // t["BLOCK_K"])
    n_tiles = -(-_rows_columns(params) // t["BLOCK_N"])
    x_stage = nshift * k_steps * t["BLOCK_M"] * t["BLOCK_K"] * elt
    w_bytes = nshift * k_steps * n_tiles * t["BLOCK_K"] * t["BLOCK_N"] * elt
    stages = t["num_stages"] * x_stage + (4 << 10)
    held = stages + w_bytes <= MAX_BLOCK_SMEM
    return stages + (w_bytes if held else t["num_stages"] * w_bytes), held


def _persistent(params: ConvT3dParams, dtype: torch.dtype, base: dict) -> list[dict]:
    """Persistent variants of the rows tile ``base`` (``Config.persist``), with as many
    programs per SM (at most 3) as their shared memory (``head_smem``) fits: BLOCK_M 64 at 3 and
    2 stages and 128 at 3, the shapes that won the bench's head rows between them. The loads are
    asynchronous copies only where the channel mask is constant over 8 channels: Cin/g a
    multiple of 16, which Triton's launch specialisation sees; otherwise they stay synchronous
    and the persistent loop only saves the launch of each tile."""
    shapes = [(bm, stages, base["BLOCK_N"]) for bm, stages in ((64, 3), (128, 3), (64, 2))]
    if _rows_columns(params) > base["BLOCK_N"]:
        # Wider than one N tile (Cout/g x kd x kh x SW > 128: the 128 -> 8 k3 head's 144
        # columns): the rows kernel keeps one accumulator per N tile, all fed by each input
        # tile, so narrower N tiles cost no input traffic and pad fewer columns: BLOCK_N 64
        # (192 columns for 144, against 256), at BLOCK_M 64, 2 and 3 stages. Narrower N tiles
        # (more accumulators) spill registers.
        shapes += [(64, stages, 64) for stages in (2, 3)]
    out = []
    for bm, stages, bn in shapes:
        t = dict(base, BLOCK_M=bm, BLOCK_N=bn, num_stages=stages, num_warps=4 if bm * bn <= 128 * 64 else 8)
        smem = head_smem(params, dtype, t)[0]
        # 1 KB per block kept by the driver, and 8 KB of slack: a tile just under half an SM's
        # shared memory by the estimate can still run one block per SM where two are launched,
        # so that the second program of each SM waits for the first.
        per_sm = min(3, SM_SHARED_BYTES // (smem + (9 << 10)))
        if per_sm >= 1 and smem <= MAX_BLOCK_SMEM:
            out.append(dict(t, persist=per_sm))
    return out


# Accumulator registers per thread a joint tile may take (fp32, all its N tiles together):
# three 64 x 64 tiles on 4 warps (the 128 -> 8 head's), 96, which ptxas for sm_90a compiles
# without spilling.
JOINT_ACC_REGS = 96


def _joint_fits(params: ConvT3dParams, dtype: torch.dtype, bm: int, warps: int, stages: int, bk: int) -> bool:
    """A joint tile (N tiles of 64 columns stepped together) keeps its accumulators within
    JOINT_ACC_REGS per thread and its stages (an input tile and every N tile's weight tile
    each, plus ~4 KB of epilogue) within one block's shared memory. A 256 -> 7 k6 s2 head (504
    columns: 8 tiles) would need 256 registers and, in bf16 at 3 stages, 240 KB of shared
    memory, more than a block may take."""
    n_tiles = -(-_rows_columns(params) // 64)
    smem = stages * (bm * bk + n_tiles * bk * 64) * dtype.itemsize + (4 << 10)
    return n_tiles * bm * 64 <= JOINT_ACC_REGS * 32 * warps and smem <= MAX_BLOCK_SMEM


def _packed(params: ConvT3dParams, dtype: torch.dtype, base: dict, held: bool) -> list[dict]:
    """Single-sweep rows tiles on the packed weight (``Config.w_packed``). Where no persistent
    tile holds the weight (``held`` False) every M tile gathers each of its NSHIFT x K_STEPS
    weight tiles tap by tap (``_rows_weight_tile``) -- 12 per tile for the VQ-VAE decoder's
    240 -> 3 head, whose held weight would take 196 KB in bf16 -- where the packed copy makes
    each a contiguous block. Tiles: BLOCK_M 128 on 8 warps; BLOCK_M 64 on 4 warps at 3 and 4
    stages (half the accumulator per thread, so that more programs share an SM where the
    8-warp tile's registers leave room for one); and BLOCK_M 256 on 8 warps (each weight tile
    read from L2 feeds twice the MMAs). Which wins is the tuner's measurement.

    Wider than one N tile (the 128 -> 8 k3 head's 144 columns): the single sweep otherwise runs
    its N tiles one after another, each re-reading every input tile (and padding 144 columns to
    256 at BLOCK_N 128). The joint tiles (``Config.n_joint``) step all N tiles' accumulators with
    each input tile, at BLOCK_N 64 (192 columns): per K step of that head one input tile and
    three 64-column weight tiles through shared memory, against two of each, and 25% fewer MMA
    columns. Three fp32 accumulators of 64 x 64 (or 128 x 64 on 8 warps) are 96 registers per
    thread, where two 128 x 128 on 8 warps spill (head_rows_kernel's N_JOINT); offered where
    they fit (``_joint_fits``).

    Where a persistent tile holds the weight, one packed tile (BLOCK_M 64, 4 warps, 3 stages)
    competes with it: a persistent stage holds the whole tile's input for every width shift and
    K step (the fp32 video 64 -> 3 head: 48 KB a stage, so one program of 4 warps per SM), a
    single-sweep stage one input and one weight tile (12 KB there), so several programs share an
    SM. Only one, to keep the first call's compiles few."""
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
    return -(-_rows_columns(params) // cfg.BLOCK_N), -(-params.in_channels_per_group // cfg.BLOCK_K)


def persistent_programs(device: torch.device, tiles: int, per_sm: int) -> int:
    """Programs of a head GEMM launch over ``tiles`` tiles: one per tile (``per_sm`` 0), or
    ``per_sm`` per SM, each looping over its share (``Config.persist``); a few on the CPU, so
    that the interpreter runs the loop."""
    if per_sm <= 0:
        return tiles
    if device.type != "cuda":
        return max(1, min(tiles, 3))
    return max(1, min(tiles, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))


def _gather_tile(cout_g: int, rows: int, block_w: int, elements: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_R) of the gather tile [BLOCK_C * BLOCK_R, BLOCK_W]: every channel of the
    group, and as many rows of one height residue as make about ``elements`` elements (the
    config's BLOCK_R), at most the ``rows`` of a residue."""
    bc = _pow2_ceil(cout_g)
    return bc, max(1, min(_pow2_ceil(rows), elements // (bc * block_w)))


def _batch_span(x: torch.Tensor) -> int:
    """Elements between the first and last of one batch element of x (its strides' reach)."""
    return 1 + sum(abs(st) * (n - 1) for n, st in zip(x.shape[1:], x.stride()[1:]))


def flat_spatial(x: torch.Tensor) -> bool:
    """D, H, W of x can be walked by one stride (its W stride): contiguous NCDHW or channels-last
    planes. The head backward's kernels (``head_grad.head_wgrad_kernel``) then offset a position
    s of a batch element by ``s * stride_w``: runs the compiler sees where that stride is 1."""
    _, _, d, h, w = x.shape
    sd, sh, sw = x.stride()[2:]
    return (h == 1 or sh == w * sw) and (d == 1 or sd == h * sh)


MakeSite = Callable[..., object]  # (key, kernel name, grid, integer args, constexprs[, kernel module])


class HeadSteps:
    """The launches of one (call signature, head config): built on the first run, replayed.

    ``make_site(key, kernel name, grid, integer args, constexprs)`` returns the engine's launch
    site for that key (``triton_engine.Site``); ``run(x, w, b, y)`` launches onto the
    allocated output ``y`` from the input and the weight as PyTorch stores it (``w``
    contiguous); ``b`` is the bias or any tensor when there is none. ``prepare_input``: the
    engine's NDHWC copy, which the x_cl tiles read."""

    def __init__(self, params: ConvT3dParams, cfg, precision: str, has_bias: bool, make_site: MakeSite,
                 prepare_input=None):
        self.params, self.cfg, self.has_bias, self.make_site = params, cfg, has_bias, make_site
        self.prepare_input = prepare_input
        self.precision = precision  # the dot's input precision ("tf32" for 16-bit: ignored there)
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
        self.gemm = None
        self.gather = None
        self.pack = None  # (head_rows_pack_kernel's site, packed elements) of a w_packed tile
        # The input copy the GEMMs read, decided at the first run (the signature fixes x's
        # strides): "cl" for an x_cl tile on input not channels-last already or to be rounded to
        # TF32, "dense" where x spans >= 2^31 elements per batch element, "" for none.
        self.copy_x = None

    def _rounds(self, dtype: torch.dtype) -> bool:
        """Whether the call's operands are rounded to TF32 (fp32 at TF32, cuDNN's numerics)."""
        return dtype == torch.float32 and self.precision == "tf32"

    def _shuffle_site(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        """head_shuffle_kernel's launch: one program per (n, g, depth block, BOX_H height blocks,
        W tile of width blocks), the blocks covering the output (o + p) // s along every
        dimension, output padding included."""
        p, cfg = self.params, self.cfg
        (sd, sh, sw), (pd, ph, pw), (od, oh, ow) = p.stride, p.padding, p.out_size
        blocks_d, blocks_h, blocks_w = shuffle_blocks(p)
        flat = cfg.BOX_H == 0
        box_h = max(1, cfg.BOX_H)
        # Tiles overlap by the halo that shifts in N read (shuffle_halo).
        hh, hw = shuffle_halo(p, cfg.shifts_n, cfg.BOX_H, cfg.BLOCK_W)
        if flat:  # BLOCK_M consecutive blocks of the plane (BOX_H 0)
            tiles_h, tiles_w = -(-(blocks_h * blocks_w) // (cfg.BLOCK_M - hw)), 1
        else:
            tiles_h, tiles_w = -(-blocks_h // (box_h - hh)), -(-blocks_w // (cfg.BLOCK_W - hw))
        r_p, sw_p, bc = shuffle_shape(p, cfg.use_dot, cfg.shifts_n)
        jd, jh, jw = shuffle_shifts(p)
        njh, njw = shuffle_n_shifts(p, cfg.shifts_n)
        jh, jw = (1 if njh > 1 else jh), (1 if njw > 1 else jw)  # shifts in N leave the K loop
        ints = (p.batch, p.in_channels_per_group, p.out_channels_per_group, *p.in_size, od, oh, ow, pd, ph, pw,
                *x.stride(), w.stride(0), *y.stride(), blocks_d, blocks_w, tiles_h, tiles_w)
        consts = dict(HAS_BIAS=self.has_bias, ROUND_TF32=self._rounds(x.dtype), PRECISION=self.precision,
                      USE_DOT=cfg.use_dot, KD=p.kernel_size[0], KH=p.kernel_size[1], KW=p.kernel_size[2],
                      SD=sd, SH=sh, SW=sw, JD=jd, JH=jh, JW=jw, NJH=njh, NJW=njw,
                      NS_P=_pow2_ceil(njh * njw), FLAT=flat, R_P=r_p, SW_P=sw_p, BLOCK_C=bc,
                      BLOCK_H=1 if flat else box_h, BLOCK_W=cfg.BLOCK_M if flat else cfg.BLOCK_W,
                      BLOCK_K=cfg.BLOCK_K, Y64=_batch_span(y) >= OFFSET_LIMIT, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        grid = (p.groups * p.batch * blocks_d * tiles_h * tiles_w,)
        key = ("head_shuffle", p, cfg, x.stride(), y.stride(), self.has_bias, self.precision, x.dtype)
        return self.make_site(key, "head_shuffle_kernel", grid, ints, consts)

    def _rows_site(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        """head_rows_kernel's launch: (programs, groups), each program walking its group's
        (n, M tile) tiles (one per tile in the single sweep, ``Config.persist`` per SM else)."""
        p, cfg = self.params, self.cfg
        _, _, d, h, wd = x.shape
        round_tf32 = self._rounds(x.dtype)
        (kd, kh, kw), sw, ow = p.kernel_size, p.stride[2], p.out_size[2]
        qw = -(-ow // sw)
        tiles_m = -(-(d * h * qw) // cfg.BLOCK_M)
        shift0, nshift = width_shifts(p)
        num_tiles = p.batch * tiles_m  # per group: the grid's second axis
        programs = -(-persistent_programs(x.device, p.groups * num_tiles, cfg.persist) // p.groups)
        ints = (p.batch, p.in_channels_per_group, _rows_columns(p), d, h, wd, ow, qw,
                kh, kw, kd * kh * kw, sw, p.padding[2], p.dilation[2], shift0,
                *x.stride(), w.stride(0), tiles_m, num_tiles)
        # FLAT_DH: depth and height walked by the height stride (contiguous NCDHW or
        # channels-last input); FULL_W: every compact column fills SW output columns.
        flat_dh = x.stride(2) == h * x.stride(3)
        n_tiles, k_steps = _rows_steps(p, cfg)
        # The input is rounded by the copy kernel where the tile reads a copy (x_cl), else in
        # registers; the weight as it is gathered, or by head_rows_pack_kernel (W_PACKED).
        consts = dict(ROUND_X=round_tf32 and self.copy_x != "cl", ROUND_W=round_tf32, PRECISION=self.precision,
                      SW_C=sw, NSHIFT=nshift,
                      FLAT_DH=flat_dh, FULL_W=ow == qw * sw, UNROLL=cfg.persist > 0,
                      W_ONCE=cfg.persist > 0 and head_smem(p, x.dtype, vars(cfg))[1], W_PACKED=cfg.w_packed,
                      N_JOINT=cfg.n_joint, N_TILES=n_tiles, K_STEPS=k_steps,
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
        round_tf32 = self._rounds(w.dtype)
        consts = dict(ROUND_TF32=round_tf32, SW_C=p.stride[2], NSHIFT=nshift, N_TILES=n_tiles, K_STEPS=k_steps,
                      BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=4)
        key = ("head_rows_pack", p, cfg.BLOCK_N, cfg.BLOCK_K, w.dtype, round_tf32)
        site = self.make_site(key, "head_rows_pack_kernel", (nshift * k_steps * n_tiles, p.groups), ints, consts)
        return site, p.groups * nshift * k_steps * cfg.BLOCK_K * n_tiles * cfg.BLOCK_N

    def _gather_site(self, y: torch.Tensor):
        """head_gather_tile_kernel's launch: the depth and height taps of Z's output rows summed
        into the output (a width of OW and one width tap: the GEMM summed the width taps)."""
        p, cfg = self.params, self.cfg
        od, oh, ow = p.out_size
        (d, h, _), (sd, sh, _), (pd, ph, _), (dd, dh, _) = p.in_size, p.stride, p.padding, p.dilation
        (kd, kh, _), cout_g = p.kernel_size, p.out_channels_per_group
        # Z holds output rows: one "width tap" over a width of OW (iw = ow).
        wd, sw, pw, dw, kw = ow, 1, 0, 1, 1
        bc, br = _gather_tile(cout_g, -(-oh // sh), cfg.BLOCK_W, cfg.BLOCK_R)
        # Programs per (n, g, od): height residues x tiles of BLOCK_R rows of a residue x W tiles.
        tiles_q, tiles_w = -(-(-(-oh // sh)) // br), -(-ow // cfg.BLOCK_W)
        grid = (p.groups * p.batch * od * sh * tiles_q * tiles_w,)
        ints = (p.batch, cout_g, d, h, wd, od, oh, ow, sd, sh, sw, pd, ph, pw, dd, dh, dw, *y.stride(),
                tiles_q, tiles_w)
        # 4 warps from 1024 elements down (8 per thread and W tap); fewer for smaller tiles,
        # whose threads would otherwise hold copies.
        warps = max(1, min(4, bc * br * cfg.BLOCK_W // 256))
        consts = dict(HAS_BIAS=self.has_bias, KD=kd, KH=kh, KW=kw, BLOCK_C=bc, BLOCK_R=br,
                      BLOCK_W=cfg.BLOCK_W, num_warps=warps)
        key = ("head_gather_tile", cfg.head, p, cfg.BLOCK_W, cfg.BLOCK_R, y.stride(), self.has_bias)
        return self.make_site(key, "head_gather_tile_kernel", grid, ints, consts)

    def run(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
        """Launch onto ``y``; returns Triton's handle of the GEMM kernel."""
        dev = x.device
        if self.copy_x is None:
            # The GEMM kernels add 64-bit bases per (batch element, group) to 32-bit in-element
            # offsets; a view whose strides reach further is read from a contiguous copy.
            cl = x.is_contiguous(memory_format=torch.channels_last_3d)
            self.copy_x = ("cl" if self.cfg.x_cl and (self._rounds(x.dtype) or not cl)
                           else "dense" if _batch_span(x) >= 2**31 else "")
        if self.copy_x == "cl":
            # The engine's NDHWC copy kernel (to_channels_last_kernel), which costs these tiles
            # several times less than PyTorch's .contiguous(memory_format=channels_last_3d).
            x = self.prepare_input(x, self._rounds(x.dtype), True)
        elif self.copy_x == "dense":
            x = x.contiguous()
        if self.shuffle:
            if self.gemm is None:
                self.gemm = self._shuffle_site(x, w, y)
            return self.gemm.launch(dev, x, w, b, y)
        if self.gemm is None:
            self.gemm = self._rows_site(x, w, y)
        if self.gather is None:
            self.gather = self._gather_site(y)
        if self.cfg.w_packed:
            if self.pack is None:
                self.pack = self._pack_site(w)
            site, elements = self.pack
            packed = torch.empty(elements, device=dev, dtype=w.dtype)
            site.launch(dev, w, packed)
            w = packed
        z = torch.empty(head_z_elements(self.params), device=dev,
                        dtype=torch.bfloat16 if self.cfg.z_bf16 else torch.float32)
        handle = self.gemm.launch(dev, x, w, z)
        self.gather.launch(dev, z, b, y)
        return handle
