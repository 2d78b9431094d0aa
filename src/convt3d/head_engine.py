"""Launcher of the output-head path (kernels in ``kernels/head_gemm.py``): layers with
1-15 output channels per group -- the last layer of 3-D generators and decoders (voxels, RGB
video, segmentation classes).

The Triton engine (``triton_engine``) offers these configurations as tuning candidates next to
its phase-GEMM ones (``head_tiles``), and runs a chosen one through ``HeadSteps``; this module
holds the plan (which kernels, tiles, grids, integer arguments), not the launch machinery: the
engine passes its launch-site factory in, so the kernels are replayed as cheaply as its own.

Traffic per call (why the design, see the kernel module): the input is read once, the fp32
tap-product buffer Z (bf16 in bf16 calls) written once and read once, the output
written once. For the 16 x 64 -> 1
head (32^3 -> 64^3, k4 s2 p1, fp32) the gather kind's Z (input positions x Cout/g x taps) makes
134 + 2 x 134 + 17 MB against the 151 MB floor of the layer; the rows kind's Z (output rows) is
half of it. Where no two taps meet on an output (``collision_free``) Z is skipped altogether, and
at dilation 1 (``shuffle_layer``) one kernel writes the whole output, summing the taps past the
stride as shifts of its K loop. The
fused kind keeps Z in an L2-resident slot per program instead (no Z traffic to HBM), but its
serial per-tile chain makes it latency-bound on the H200 (2-3x slower than the Z kinds, NOTES
section 10); it is offered where no Z kind fits.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .head_box_engine import BoxSteps, box_tiles
from .params import ConvT3dParams

__all__ = ["MAX_HEAD_CHANNELS", "HEAD_KINDS", "head_tiles", "fused_tiles", "fused_box", "collision_free",
           "shuffle_layer", "shuffle_shifts", "shuffle_n_shifts", "shuffle_halo", "shuffle_blocks", "shuffle_tiles", "shuffle_shape",
           "head_z_elements", "head_z_bytes", "width_shifts", "HeadSteps"]

# Output channels per group up to which head configurations are candidates. Above ~16 the phase
# GEMM's N is a full MMA width and reads its input tile once per tap for >= 16 useful columns;
# between 8 and 15 the two are timed against each other by the tuner (issue: "whether it beats
# the tensor-core path at 8-15 channels is a measurement").
MAX_HEAD_CHANNELS = 15
# "gather": GEMM into Z (every tap in N), then head_gather_kernel; "rows": the width taps summed
# in the GEMM (head_rows_kernel), so Z holds output rows and head_gather_tile_kernel sums the
# depth and height taps only; "direct": GEMM stored into the output (collision-free layers
# only) plus a fill (head_gather_tile_kernel) of the positions no tap reaches.
# "fused": head_fused_kernel, the GEMM and the gather of one box of outputs in one persistent
# kernel, Z in a per-program scratch slot that stays in L2 (no Z traffic to HBM).
# "box": head_box_kernel (Gluon, sm_90 only; head_box_engine), the GEMM and the tap sum of a box
# of positions in one program, the tap products in registers and shared memory.
# "shuffle": head_shuffle_kernel, for layers at dilation 1 (shuffle_layer): the outputs of each
# block q (o = q * s - p + r) sum the taps j * s + r of the inputs q - j, all in registers, and
# are written in one sweep (a pixel shuffle of a stride-1 convolution; no Z, no fill).
HEAD_KINDS = ("gather", "rows", "direct", "shuffle", "fused", "box")
# Elements of one batch element up to which a kernel's offsets inside it are 32-bit.
OFFSET_LIMIT = 2**31
# Z is a temporary of the call; beyond this it is not offered (the phase path needs no buffer).
MAX_Z_BYTES = 4 << 30
# The fused kind's scratch slots (all programs together) stay within this share of L2, so that
# the input streaming through L2 does not evict them before they are rewritten: the H100/H200
# L2 holds 50 MB, and the 3-D GAN head streams 134 MB of input through it per call.
FUSED_SCRATCH_BYTES = 20 << 20
# Programs per SM of the fused kind: two 4-warp programs keep a tile's Z (<= 128 KB each)
# within FUSED_SCRATCH_BYTES on 132 SMs; the launcher lowers the grid further where slots are
# larger.
FUSED_PER_SM = 2


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def _columns(params: ConvT3dParams) -> int:
    """N of the head GEMM: Cout/g x taps, every (output channel, tap) pair."""
    return params.out_channels_per_group * math.prod(params.kernel_size)


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
      thread, else 8; BLOCK_K as the GEMMs'. On the H200 (2026-12-03, k2 s2 8 -> 2 head, graph
      replay) the one-row tile of 64 positions ran 30.1-47.3 us against 110-192 for the direct
      kind; programs of 1 row are small (4 KB of output each), so wider ones are timed too.
      Layers with shifts (k > s) loop over (channel block, shift) steps, one stage: 3 stages
      ran 5-14% slower on 4 of 5 head rows, best tile against best (H200, 2026-12-03, graph
      replay; faster, 625 against 682 us, on the fp32 VQ-VAE head, where the rows kind ran 382).
    * MMA with shifts in N (``shifts_n`` 1: the width shifts, 2: the height ones too, where the
      layer has them): fewer input tiles per channel block, N NS_P times as wide and a halo of
      blocks read, not written (``shuffle_halo``). On the H200 (2026-12-03, graph replay) 1.08-
      1.40x faster in fp32 and 1.17-1.32x in NCDHW bf16 than the tiles without, 7-16% slower in
      channels-last bf16 and 1.21x slower on the VQ-VAE head (NOTES.md section 10, "Shifts in N").
      One stage here too. Of 24 shifted-in-N tiles timed at one and at 3 stages (H200, 2026-12-04,
      graph replay; GAN fp32 NCDHW, video 64 -> 3 in four layouts and dtypes, 128 -> 8 fp32 cl),
      3 stages were slower on 19, by 1.35-3.9x in fp32 (video fp32 NCDHW nw M256: 218.3 against
      460.8 us), within 0.2% on the four bf16 NCDHW ones, and faster on one (video bf16 cl nw M256
      on 8 warps, 114.7 against 140.4 us), which the row's best tile (97.2 us) beats anyway.
    * FMA, for layers without shifts: about 2048 accumulators per program (16 per thread at 4
      warps) and BLOCK_K 8, so that the product of a K step (BLOCK_K x the accumulators) stays
      in 128 registers a thread; BLOCK_W down to 1 for wide boxes. It ran 7-15 us behind the
      MMA tile on the k2 s2 head, and 4-19x behind it on the shifted heads (834 against 97 us
      on the bf16 64 -> 3 video head, 3943 against 625 on the fp32 VQ-VAE head).
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
            # tiles take 121-255 registers (ncu, GAN head bf16 cl, M256 N32: 255, 12.5%
            # occupancy; H200, 2026-12-03), and 8 were faster on 2 of 5 head rows, slower on 3.
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


def _all_reached(params: ConvT3dParams) -> bool:
    """Every output position is reached by some tap (then a collision-free layer needs no fill).
    Reach is separable: a position is reached iff each of its coordinates is."""
    for a in params.axes:
        reached = set()
        for t in range(a.kernel):
            for i in range(a.in_size):
                o = i * a.stride - a.padding + t * a.dilation
                if 0 <= o < a.out_size:
                    reached.add(o)
        if len(reached) < a.out_size:
            return False
    return True


def head_z_elements(params: ConvT3dParams, kind: str = "gather") -> int:
    """Elements of the buffer Z of the gather kind (input positions x Cout x taps) or of the
    rows kind (input depth x height x output width x Cout x depth and height taps)."""
    (d, h, w), (kd, kh, kw), ow = params.in_size, params.kernel_size, params.out_size[2]
    if kind == "rows":
        return params.batch * params.out_channels * kd * kh * d * h * ow
    return params.batch * params.out_channels * kd * kh * kw * d * h * w


def head_z_bytes(params: ConvT3dParams, kind: str = "gather") -> int:
    """Bytes of Z in fp32 (the size bound MAX_Z_BYTES is checked on)."""
    return 4 * head_z_elements(params, kind)


def width_shifts(params: ConvT3dParams) -> tuple[int, int]:
    """(first, count) of the width shifts delta = iw - q of the rows kind: input column
    iw = q + delta feeds output column ow = q * SW + rw through tap tw where
    rw + PW - delta * SW = tw * DW; the shifts of every (rw, tw) pair, as one range."""
    a = params.axes[2]
    deltas = [(rw + a.padding - tw * a.dilation) // a.stride for rw in range(a.stride) for tw in range(a.kernel)
              if (rw + a.padding - tw * a.dilation) % a.stride == 0]
    return min(deltas), max(deltas) - min(deltas) + 1


def head_tiles(params: ConvT3dParams, dtype: torch.dtype, precision: str, gluon: bool = False,
               channels_last: bool = True) -> list[dict]:
    """The head configurations for this call, as Config fields (``triton_engine.Config``):
    BLOCK_M input positions x BLOCK_N of the Cout/g x taps columns x BLOCK_K input channels per
    GEMM program; BLOCK_W output columns and about BLOCK_R elements per gather program (its rows
    follow, ``_gather_tile``); ``head`` the kind. Empty when the layer is not a head or Z would
    be too large.

    * BLOCK_N covers all columns up to 128 (one input tile per program, fp32 accumulators of
      128 x 128 at 8 warps = 64 per thread); wider layers loop over N tiles in the program.
    * BLOCK_K: Cin/g rounded up to a power of two, at most 64 (16-bit) or 32 (fp32): one
      128-byte line per position and step, as the phase GEMM.
    * Kinds: "direct" where no taps meet (collision_free), else "gather" and "rows" (Z ~SW/KW
      of gather's: half for k4 s2, at the price of re-reading the input tile per width shift
      from cache). Measured on the H200 (2026-12-01, scripts/gpu_head_probe.py): rows won the
      bf16 heads (3-D GAN head 108-134 vs 178 us), gather the fp32 ones (228 vs 463-487 us), so
      both are candidates. Tiles: BLOCK_M 128; the direct kind also BLOCK_M 64 (it won the
      fp32 k2 s2 head, 132 vs 143 us). Each candidate costs ~1 s of compile when tuning.
    * "shuffle" at dilation 1 (shuffle_layer), last: no Z. Where the kernel fits in the stride
      it won the k2 s2 head by 2.6-4.6x; with shifts (k > s) its input tiles are re-read per
      shift through L1 (ncu, 3-D GAN head bf16 cl, 8 shifts: L1/TEX 87%, DRAM 11%), and on the
      H200 (2026-12-03) its best tile by graph replay took 104.3 us on the bf16 channels-last
      GAN head against 57.1 us for the public call on the rows kind, 96.9 us on the 64 -> 3
      video head (where the tuner chose it), and lost on the 128 -> 8 and VQ-VAE heads.
    * tl.dot needs 16 along every operand dimension, so K and N are padded to 16 (masked).
    * bfloat16 calls: the gather and rows tiles keep Z in bf16 (``z_bf16``).
    * ``gluon`` (a Hopper GPU): the box kind's candidates too (``head_box_engine.box_tiles``), last.
    * Where no persistent rows tile holds its weight: single-sweep rows tiles on a weight packed
      once per call (``_packed``).
    * ``channels_last`` False (an NCDHW call): rows tiles on a channels-last copy of the input
      too (``_x_copies``).
    """
    cout_g = params.out_channels_per_group
    # In-element offsets are 32-bit (HeadSteps.run): one batch element must hold < 2^31.
    if cout_g > MAX_HEAD_CHANNELS or params.in_channels * math.prod(params.in_size) >= 2**31:
        return []
    bk = _block_k(params, dtype)
    bw = max(16, min(128, _pow2_ceil(params.out_size[2])))
    sw = params.stride[2]

    def tile(kind, ncol, bm, elements):
        bn = max(16, min(128, _pow2_ceil(ncol)))
        warps = 4 if bm * bn <= 128 * 64 else 8
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_W=bw, num_warps=warps, num_stages=2,
                    use_dot=True, head=kind, BLOCK_R=elements)

    if collision_free(params):
        tiles = [tile("direct", _columns(params), bm, el) for bm, el in ((128, 2048), (64, 1024))]
    else:
        tiles = []
        if head_z_bytes(params, "gather") <= MAX_Z_BYTES:
            tiles.append(tile("gather", _columns(params), 128, 0))  # per-row gather: no BLOCK_R
            tiles += _persistent(params, dtype, tiles[-1])
        # The rows kind interleaves the W residues in registers (a reshape): SW a power of two.
        if sw & (sw - 1) == 0 and sw <= 16 and head_z_bytes(params, "rows") <= MAX_Z_BYTES:
            rows = tile("rows", _rows_columns(params), 128, 2048)
            persistent = _persistent(params, dtype, rows)
            tiles += [rows] + persistent
            tiles += _packed(params, dtype, rows, any(head_smem(params, dtype, t)[1] for t in persistent))
        # The fused kind needs no Z buffer, but it loses to the Z kinds where they run: H200,
        # 2026-12-01, 3-D GAN head 16 x 64 -> 1 (Nsight Compute at its locked 1.36 GHz clocks)
        # 350 us bf16 / 574 us fp32 against 109-131 / 226 us for rows / gather in the bench, the
        # tuner picking rows or gather over it on every head row timed. ncu: 2 CTAs of 4 warps
        # per SM (12% occupancy, 0.5 waves at two programs per SM), 6.3 cycles per issued
        # instruction, DRAM 4.5% of peak, L2 hit 94%: latency-bound on the serial
        # GEMM -> slot -> barrier -> gather chain of each tile. So it is offered only where no Z
        # kind is (Z beyond MAX_Z_BYTES): there it competes with the phase path alone.
        if not tiles:
            tiles = fused_tiles(params, dtype)
    if shuffle_layer(params):
        tiles += shuffle_tiles(params, dtype)
    # Half-K variants, after the measured tiles (which stay the untuned defaults). ptxas for
    # sm_90a (offline, Triton 3.9 code generation, 2026-12-01; scripts/ptxas_regs.py): the 16-bit
    # K-64 GEMM tiles run at 255 registers and spill (gather 100 B, rows 512 B); at K 32 they
    # take 214 / 254 registers and do not. fp32 K 32 with two stages spills 320 B (gather); K 16
    # does not. Whether the spill-free tiles beat the measured ones is the tuner's measurement.
    if bk > 16:
        tiles += [dict(t, BLOCK_K=bk // 2) for t in tiles
                  if t["head"] not in ("fused", "shuffle") and not t.get("persist")]

    # Z in bfloat16 for bfloat16 calls: each tap product (or, for rows, each sum over the width
    # taps) is rounded to bf16 once before the gather adds them in fp32. The output is rounded
    # to bf16 anyway, so the partials add errors of the same size: float64 emulation of both
    # (CPU, 2026-12-02, the GPU tests' head geometries, randn data) put the largest error at
    # 1.16-1.54x cuDNN's for rows and 1.13-1.61x for gather, inside the 2x budget, and on the
    # H200 every such tile passed test_gpu_head's bar. bf16 keeps fp32's range, so no partial
    # can overflow where the output does not; fp16's narrow range could, and fp16 and fp32
    # calls keep an fp32 Z. Half of Z's bytes (the 3-D GAN head's rows kind moves 67 + 2 x 34 +
    # 8 MB instead of 67 + 2 x 67 + 8), and faster on every bf16 head row timed (H200,
    # 2026-12-02, CUDA-graph replay, best tile of a kind with / without: GAN head cl rows
    # 80.0 / 99.0 us, ncdhw 110.4 / 122.5; video 64->3 cl rows 151.0 / 183.4; video k4s2p1 cl
    # rows 120.0 / 128.0; 128->8 cl gather 295.1 / 350.6; the fp32-Z tile won none of the 20
    # pairs of those runs), so bf16 calls get these tiles in place of the fp32-Z ones (each
    # would be one more compile at a layer's first call).
    if dtype == torch.bfloat16:
        tiles = [dict(t, z_bf16=True) if t["head"] in ("gather", "rows") else t for t in tiles]
    if not channels_last or (dtype == torch.float32 and precision == "tf32"):
        tiles += _x_copies(tiles)
    if gluon:
        tiles += box_tiles(params, dtype, precision)
    return tiles


def _x_copies(tiles: list[dict]) -> list[dict]:
    """The persistent and packed rows tiles again, on a channels-last copy of the input
    (``Config.x_cl``), for NCDHW calls and for fp32 calls at TF32 (where the copy also rounds
    the input to TF32). In NCDHW the GEMM's input tile [positions, channels] is read element by
    element (a position's width shift has no alignment the compiler can see); in channels-last
    each position's channels are one contiguous vector. The rows tiles ran 1.5-1.9x faster on
    channels-last input in the bench (H200, 2026-12-02, bf16: 3-D GAN head 56.7 against 87.3 us,
    video 64 -> 3 103.1 / 155.5, 128 -> 8 109.1 / 206.6, video k4s2p1 73.1 / 108.8), and the copy
    moves the input's bytes twice. With the copy the NCDHW bf16 rows read (same bench, source
    digest 5b818bc2fa8a) 143.1 against 208.5 us on the 128 -> 8 head, 90.6 / 117.2 on video
    k4s2p1, 278.8 / 343.6 on the VQ-VAE decoder's 240 -> 3 head; the GAN and 64 -> 3 video heads,
    whose inputs are large against their GEMMs, kept the native tile. Where the sum wins is the
    tuner's measurement. At TF32 the copy rounds the input (cuDNN's numerics), so the GEMM's input
    tiles go from shared memory to the tensor cores untouched: rounded in registers, the A
    operand takes a shared-memory load per step beside the asynchronous copy (Triton 3.6's
    TTGIR for sm_90a, offline, 2026-12-02; head_rows_kernel's ROUND_W says more). Only the full-K
    tiles, to keep the first call's compiles few (each candidate costs ~1 s)."""
    bk = max(t["BLOCK_K"] for t in tiles) if tiles else 0
    return [dict(t, x_cl=True) for t in tiles
            if t["head"] == "rows" and (t.get("persist") or t.get("w_packed")) and t["BLOCK_K"] == bk]


def fused_box(params: ConvT3dParams, box: tuple[int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(input box IB per dimension, cells per dimension, rows IBD x IBH x IBW) of the fused kind
    for a box of ``box`` output cells: IB = box + (kernel - 1) * dilation // stride, and
    ceil((out + padding mod stride) / (box * stride)) cells cover the output."""
    ib = tuple(b + (a.kernel - 1) * a.dilation // a.stride for b, a in zip(box, params.axes))
    cells = tuple(-(-(a.out_size + a.padding % a.stride) // (b * a.stride)) for b, a in zip(box, params.axes))
    return ib, cells, math.prod(ib)


def fused_tiles(params: ConvT3dParams, dtype: torch.dtype) -> list[dict]:
    """Fused-kind candidates (head_fused_kernel), for layers where taps meet (the direct kind
    covers the others). A box of output cells is a power of two per dimension (the gather's
    tile is BOX_D x BOX_H x BOX_W cells); a dimension whose output has a single cell row gets a
    box of 1 there. Box (4, 4, 8) for the 3-D GAN head (k4 s2 p1): 128 cells, an input box of
    5 x 5 x 9 = 225 rows (1.76x the MMA work), a slot of 64 columns x 256 rows x 4 B = 64 KB;
    (2, 8, 8) trades depth halo for height and width; wider layers (more columns) take smaller
    boxes, down to (1, 4, 4). BLOCK_M 64 keeps a chunk's accumulators at 32 registers per thread
    on 4 warps. Only slots of <= 128 KB are offered (a smaller grid would leave the device's
    memory pipes idle). Which tile wins is the tuner's measurement."""
    if collision_free(params):
        return []
    ncol = _columns(params)
    bn = max(16, min(128, _pow2_ceil(ncol)))
    n_pad = -(-ncol // bn) * bn

    def slot_fits(box, bm):
        rows = fused_box(params, box)[2]
        return n_pad * (-(-rows // bm) * bm) * 4 <= 128 << 10

    # No wider than the output needs: a box of cells beyond a short dimension is padding.
    boxes = [tuple(min(b, _pow2_ceil(-(-a.out_size // a.stride))) for b, a in zip(box, params.axes))
             for box in ((4, 4, 8), (2, 8, 8), (2, 4, 8), (2, 4, 4), (1, 4, 4))]
    fitting = list(dict.fromkeys(b for b in boxes if slot_fits(b, 64)))
    # Tiles: the two largest boxes whose slot fits, on 4 warps with BLOCK_M 64, and the largest
    # on 8 warps with BLOCK_M 128. ptxas for sm_90a (offline, Triton 3.9 code generation,
    # 2026-12-01; scripts/ptxas_regs.py), 3-D GAN head, box (4, 4, 8), K 32: M64 on 4 warps 214
    # (fp32 TF32) / 227 (bf16) / 238 (tf32x3) registers, M128 on 8 warps 250 (bf16), no spill;
    # bf16 K 64 on 4 warps spills 204 B, so K stays at most 32.
    tiles = [(b, 64, 4) for b in fitting[:2]]
    if fitting and slot_fits(fitting[0], 128):
        tiles.append((fitting[0], 128, 8))
    bk = min(_block_k(params, dtype), 32)
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_W=box[2], num_warps=warps, num_stages=1, use_dot=True,
                 head="fused", BLOCK_R=0, BOX_D=box[0], BOX_H=box[1]) for box, bm, warps in tiles]


# Shared memory of one H100/H200 SM (228 KB), 1 KB of which the driver keeps per resident block.
SM_SHARED_BYTES = 228 << 10
MAX_BLOCK_SMEM = 227 << 10  # the most one block may take


def head_smem(params: ConvT3dParams, dtype: torch.dtype, t: dict) -> tuple[int, bool]:
    """(shared memory estimate in bytes, weight held for all tiles) of a persistent gather or
    rows tile ``t`` (head_gemm_kernel / head_rows_kernel with UNROLL: their loops unrolled in
    the tile loop, which Triton pipelines): per stage one tile's input, K steps x NSHIFT (rows,
    once for all N tiles) or K steps x N tiles (gather) of BLOCK_M x BLOCK_K; the weight tiles, K steps x NSHIFT x N tiles of BLOCK_K x
    BLOCK_N, once where they are held (rows, wherever they fit beside the stages in one block's
    shared memory) or per stage; ~4 KB for the epilogue. Triton 3.6 for sm_90a (offline,
    2026-12-02, scripts/ptxas_regs.py, the 3-D GAN head's bf16 rows tiles, weight held): 161.8 KB at BLOCK_M 128 / 3 stages (this estimate 160.0 KB), 88.1 KB at
    64 / 3 (88.0); 79 and 48 registers, no spills. The gather kind rounds a TF32 call's
    operands in its MMA step, through registers, which takes less than this (fewer programs per
    SM than could fit, never more); the rows kind rounds them where they are made (the held
    weight once, the input on the copy or as it is loaded: head_rows_kernel's ROUND_X)."""
    elt = dtype.itemsize
    rows = t["head"] == "rows"
    nshift = width_shifts(params)[1] if rows else 1
    k_steps = -(-params.in_channels_per_group // t["BLOCK_K"])
    ncol = _rows_columns(params) if rows else _columns(params)
    n_tiles = -(-ncol // t["BLOCK_N"])
    # The rows kernel loads each input tile once for all its N tiles; the gather kernel once
    # per N tile.
    x_stage = nshift * k_steps * t["BLOCK_M"] * t["BLOCK_K"] * elt * (1 if rows else n_tiles)
    w_bytes = nshift * k_steps * n_tiles * t["BLOCK_K"] * t["BLOCK_N"] * elt
    stages = t["num_stages"] * x_stage + (4 << 10)
    held = rows and stages + w_bytes <= MAX_BLOCK_SMEM
    return stages + (w_bytes if held else t["num_stages"] * w_bytes), held


def _persistent(params: ConvT3dParams, dtype: torch.dtype, base: dict) -> list[dict]:
    """Persistent variants of the gather or rows tile ``base`` (``Config.persist``), with as many
    programs per SM (at most 3) as their shared memory (``head_smem``) fits: for rows BLOCK_M 64
    at 3 and 2 stages and 128 at 3, for gather 128 at 2. Those won each kind on the H200
    (2026-12-02, CUDA-graph replay, out of BLOCK_M 64 / 128 at 2 / 3 stages each): rows 64 / 3
    on the 3-D GAN head in fp32 and bf16 channels-last (115.7 and 51.8 us against 158.3-176.5
    and 56.5-83.8 for the others), on the video head bf16 channels-last (99.7 against
    109.1-158.6) and on fp32 NCDHW rows (160.0, 302.1), 64 / 2 on the bf16 NCDHW GAN head
    (81.0, 128 / 2 81.2); gather 128 / 2 on every fp32 row (205.7-342.8). The loads are
    asynchronous copies only where the channel mask is constant over 8 channels: Cin/g a
    multiple of 16, which Triton's launch specialisation sees; otherwise they stay synchronous
    and the persistent loop only saves the launch of each tile."""
    rows = base["head"] == "rows"
    shapes = [(bm, stages, base["BLOCK_N"]) for bm, stages in (((64, 3), (128, 3), (64, 2)) if rows else ((128, 2),))]
    ncol = _rows_columns(params)
    if rows and ncol > base["BLOCK_N"]:
        # Wider than one N tile (Cout/g x kd x kh x SW > 128: the 128 -> 8 k3 head's 144
        # columns): the rows kernel keeps one accumulator per N tile, all fed by each input
        # tile, so narrower N tiles cost no input traffic and pad fewer columns: BLOCK_N 64
        # (192 columns for 144, against 256), at BLOCK_M 64, 2 and 3 stages. Narrower still
        # spills: ptxas for sm_90a (Triton 3.6 offline, 2026-12-02, that head in bf16, 2 stages)
        # gives 254 registers and no spill at BLOCK_N 64 (3 accumulators), 356 B of spill at
        # 16 (9 accumulators, 144 columns exactly), 88 B at 128 (2).
        shapes += [(64, stages, 64) for stages in (2, 3)]
    out = []
    for bm, stages, bn in shapes:
        t = dict(base, BLOCK_M=bm, BLOCK_N=bn, num_stages=stages, num_warps=4 if bm * bn <= 128 * 64 else 8)
        smem = head_smem(params, dtype, t)[0]
        # 1 KB per block kept by the driver, and 8 KB of slack: the estimate is within 2 KB of
        # ptxas' figure offline, yet on the H200 a 112.6 KB tile (BLOCK_M 128, 2 stages) ran
        # one block per SM where two were launched (ncu, 2026-12-02), so that the second
        # program of each SM waited for the first.
        per_sm = min(3, SM_SHARED_BYTES // (smem + (9 << 10)))
        if per_sm >= 1 and smem <= MAX_BLOCK_SMEM:
            out.append(dict(t, persist=per_sm))
    return out


# Accumulator registers per thread a joint tile may take (fp32, all its N tiles together):
# three 64 x 64 tiles on 4 warps (the 128 -> 8 head's), 96; ptxas for sm_90a put that tile at
# 144-161 registers without spilling (Triton 3.6, offline, 2026-12-03).
JOINT_ACC_REGS = 96


def _joint_fits(params: ConvT3dParams, dtype: torch.dtype, bm: int, warps: int, stages: int, bk: int) -> bool:
    """A joint tile (N tiles of 64 columns stepped together) keeps its accumulators within
    JOINT_ACC_REGS per thread and its stages (an input tile and every N tile's weight tile
    each, plus ~4 KB of epilogue) within one block's shared memory. A 256 -> 7 k6 s2 head (504
    columns: 8 tiles) would need 256 registers and, in bf16 at 3 stages, 240 KB (on the H200
    its compile failed: 245760 bytes of shared memory against 232448)."""
    n_tiles = -(-_rows_columns(params) // 64)
    smem = stages * (bm * bk + n_tiles * bk * 64) * dtype.itemsize + (4 << 10)
    return n_tiles * bm * 64 <= JOINT_ACC_REGS * 32 * warps and smem <= MAX_BLOCK_SMEM


def _packed(params: ConvT3dParams, dtype: torch.dtype, base: dict, held: bool) -> list[dict]:
    """Single-sweep rows tiles on the packed weight (``Config.w_packed``). Where no persistent
    tile holds the weight (``held`` False) every M tile gathers each of its NSHIFT x K_STEPS
    weight tiles tap by tap (``_rows_weight_tile``) -- 12 per tile for the VQ-VAE decoder's
    240 -> 3 head, whose held weight would take 196 KB in bf16 -- where the packed copy makes
    each a contiguous block. H200, 2026-12-02, video k4s2p1 head in fp32 (tuner medians): 0.25-0.26
    ms at BLOCK_M 128 / 3 stages against 0.46-0.70 for the gathered weight, 0.28-0.32 at 2 stages.
    ncu there and on the VQ-VAE head (bf16 NCDHW): 182-203 registers on 8 warps, so one program
    per SM (12.5% occupancy), and a third of the issue stalls on L1TEX (the input's loads, which
    in NCDHW are element-wise). So BLOCK_M 64 on 4 warps is offered too (half the accumulator per
    thread: more programs per SM), at 3 and 4 stages. And BLOCK_M 256 on 8 warps: each weight
    tile read from L2 then feeds twice the MMAs, the other way to the same L2 traffic per FLOP
    (ptxas offline for the fp32 K-16 tile: 192-208 registers, no spill; on the H200 the VQ-VAE
    head's fp32 call fell from 990 to 660 us with it and the pre-rounded operands, bench
    2026-12-02). Which wins is the tuner's measurement.

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
    planes. The head kernels (forward and ``head_grad.head_wgrad_kernel``) then offset a position
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
    contiguous); ``b`` is the bias or any tensor when there is none. ``prepare_input`` and
    ``descriptor``: the engine's NDHWC copy and Gluon descriptors, which the box kind needs
    (``head_box_engine.BoxSteps``)."""

    def __init__(self, params: ConvT3dParams, cfg, precision: str, has_bias: bool, make_site: MakeSite,
                 prepare_input=None, descriptor=None):
        self.params, self.cfg, self.has_bias, self.make_site = params, cfg, has_bias, make_site
        self.prepare_input = prepare_input
        self.box = (BoxSteps(params, cfg, precision, has_bias, make_site, prepare_input, descriptor)
                    if cfg.head == "box" else None)
        self.precision = precision  # the dot's input precision ("tf32" for 16-bit: ignored there)
        self.direct = cfg.head == "direct"
        if self.direct and not collision_free(params):
            raise ValueError("head config 'direct' needs a collision-free layer (at most one tap per output residue)")
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
        self.fused = cfg.head == "fused"
        # The fused kind writes every output itself; the direct kind needs a fill where no tap reaches.
        self.fill_needed = not self.fused and not self.shuffle and not (self.direct and _all_reached(params))
        self.gemm = None
        self.gather = None
        self.pack = None  # (head_rows_pack_kernel's site, packed elements) of a w_packed tile
        self.slots = 0  # the fused kind's scratch (fp32 elements, all programs), set with its site
        # The input copy the GEMMs read, decided at the first run (the signature fixes x's
        # strides): "cl" for an x_cl tile on input not channels-last already or to be rounded to
        # TF32, "dense" where x spans >= 2^31 elements per batch element, "" for none.
        self.copy_x = None

    def _rounds(self, dtype: torch.dtype) -> bool:
        """Whether the call's operands are rounded to TF32 (fp32 at TF32, cuDNN's numerics)."""
        return dtype == torch.float32 and self.precision == "tf32"

    def _fused_site(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        """head_fused_kernel's launch: a persistent grid of at most FUSED_PER_SM programs per SM
        and at most FUSED_SCRATCH_BYTES of slots; returns (site, slot elements)."""
        p, cfg = self.params, self.cfg
        box = (cfg.BOX_D, cfg.BOX_H, cfg.BLOCK_W)
        _, cells, rows = fused_box(p, box)
        ncol = _columns(p)
        m_pad = -(-rows // cfg.BLOCK_M) * cfg.BLOCK_M
        n_pad = -(-ncol // cfg.BLOCK_N) * cfg.BLOCK_N
        slot = m_pad * n_pad
        tiles = p.groups * p.batch * math.prod(cells)
        if x.device.type == "cuda":
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            programs = min(tiles, FUSED_PER_SM * sms, max(sms, FUSED_SCRATCH_BYTES // (4 * slot)))
        else:
            programs = min(tiles, 3)  # the interpreter: a few programs, each looping over tiles
        round_tf32 = self._rounds(x.dtype)
        ints = (p.batch, p.in_channels_per_group, p.out_channels_per_group, ncol, *p.in_size, *p.out_size,
                *p.padding, *x.stride(), w.stride(0), *y.stride(), *cells, tiles, programs)
        consts = dict(KD=p.kernel_size[0], KH=p.kernel_size[1], KW=p.kernel_size[2], SD=p.stride[0], SH=p.stride[1],
                      SW=p.stride[2], DD=p.dilation[0], DH=p.dilation[1], DW=p.dilation[2], HAS_BIAS=self.has_bias,
                      ROUND_TF32=round_tf32, PRECISION=self.precision, BOX_D=box[0], BOX_H=box[1], BOX_W=box[2],
                      BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                      BLOCK_CO=_pow2_ceil(p.out_channels_per_group), M_PAD=m_pad, N_PAD=n_pad,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        key = ("head_fused", p, cfg, x.stride(), y.stride(), self.has_bias, self.precision, x.dtype, programs)
        return self.make_site(key, "head_fused_kernel", (programs,), ints, consts), programs * slot

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

    def _gemm_site(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        p, cfg = self.params, self.cfg
        _, _, d, h, wd = x.shape
        s = d * h * wd
        ncol = _columns(p)
        tiles_m = -(-s // cfg.BLOCK_M)
        round_tf32 = self._rounds(x.dtype)
        flat = flat_spatial(x)
        consts = dict(FLAT_X=flat, ROUND_TF32=round_tf32, PRECISION=self.precision,
                      BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        grid = (p.groups * p.batch * tiles_m,)
        key = ("head_gemm", cfg.head, p, cfg, x.stride(), y.stride(), self.has_bias,
               self.precision, x.dtype)
        if cfg.head == "gather":
            num_tiles = p.groups * p.batch * tiles_m
            programs = persistent_programs(x.device, num_tiles, cfg.persist)
            ints = (p.batch, p.in_channels_per_group, ncol, s, h, wd, *x.stride(), w.stride(0), tiles_m, num_tiles)
            return self.make_site(key + (programs,), "head_gemm_kernel", (programs,), ints,
                                  dict(consts, UNROLL=cfg.persist > 0, N_TILES=-(-ncol // cfg.BLOCK_N),
                                       K_STEPS=-(-p.in_channels_per_group // cfg.BLOCK_K)))
        if cfg.head == "rows":
            (kd, kh, kw), sw, ow = p.kernel_size, p.stride[2], p.out_size[2]
            qw = -(-ow // sw)
            tiles_m = -(-(d * h * qw) // cfg.BLOCK_M)
            shift0, nshift = width_shifts(p)
            ncol_rows = _rows_columns(p)
            num_tiles = p.batch * tiles_m  # per group: the grid's second axis
            programs = -(-persistent_programs(x.device, p.groups * num_tiles, cfg.persist) // p.groups)
            ints = (p.batch, p.in_channels_per_group, ncol_rows, d, h, wd, ow, qw,
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
            return self.make_site(key + (programs,), "head_rows_kernel", (programs, p.groups), ints, consts)
        ints = (p.batch, p.in_channels_per_group, p.out_channels_per_group, ncol, s, h, wd, *p.out_size,
                p.kernel_size[1], p.kernel_size[2], *p.stride, *p.padding, *p.dilation,
                *x.stride(), w.stride(0), *y.stride(), tiles_m)
        kw = p.kernel_size[2]
        # W taps interleaved in the store: NCDHW output, k = s along W, dilation 1 (the taps of
        # consecutive inputs tile the row), KW a power of two dividing the N tile.
        interleave = (y.stride(4) == 1 and p.out_size[2] > 1 and kw == p.stride[2] and p.dilation[2] == 1
                      and kw & (kw - 1) == 0 and cfg.BLOCK_N % kw == 0 and kw > 1)
        return self.make_site(key, "head_direct_kernel", grid, ints,
                              dict(HAS_BIAS=self.has_bias, INTERLEAVE_W=interleave, KW_C=kw if interleave else 1,
                                   **consts))

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
        p, cfg = self.params, self.cfg
        od, oh, ow = p.out_size
        (d, h, wd), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = p.in_size, p.stride, p.padding, p.dilation
        (kd, kh, kw), cout_g = p.kernel_size, p.out_channels_per_group
        if cfg.head == "gather":
            # head_gather_kernel: per program BLOCK_H rows of BLOCK_W columns, about 2048 elements
            # and at most 8 rows (a runtime loop); one warp per 128 elements of a row, at most 4
            # (a 1-channel row of 64 columns on 4 warps would leave half the threads holding
            # copies).
            bc = _pow2_ceil(cout_g)
            bh = max(1, min(8, 2048 // (bc * cfg.BLOCK_W)))
            tiles_h, tiles_w = -(-oh // bh), -(-ow // cfg.BLOCK_W)
            ints = (p.batch, cout_g, d, h, wd, od, oh, ow, kd, kh, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                    *y.stride(), tiles_h, tiles_w)
            consts = dict(HAS_BIAS=self.has_bias, KW=kw, BLOCK_C=bc, BLOCK_H=bh, BLOCK_W=cfg.BLOCK_W,
                          num_warps=max(1, min(4, bc * cfg.BLOCK_W // 128)))
            key = ("head_gather", p, cfg.BLOCK_W, y.stride(), self.has_bias)
            return self.make_site(key, "head_gather_kernel", (p.groups * p.batch * od * tiles_h * tiles_w,),
                                  ints, consts)
        if cfg.head == "rows":
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
        consts = dict(HAS_BIAS=self.has_bias, FILL_ONLY=self.direct, KD=kd, KH=kh, KW=kw, BLOCK_C=bc, BLOCK_R=br,
                      BLOCK_W=cfg.BLOCK_W, num_warps=warps)
        key = ("head_gather_tile", cfg.head, p, cfg.BLOCK_W, cfg.BLOCK_R, y.stride(), self.has_bias)
        return self.make_site(key, "head_gather_tile_kernel", grid, ints, consts)

    def run(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
        """Launch onto ``y``; returns Triton's handle of the GEMM kernel."""
        if self.box is not None:
            return self.box.run(x, w, b, y)
        dev = x.device
        if self.copy_x is None:
            # The GEMM kernels add 64-bit bases per (batch element, group) to 32-bit in-element
            # offsets; a view whose strides reach further is read from a contiguous copy.
            cl = x.is_contiguous(memory_format=torch.channels_last_3d)
            self.copy_x = ("cl" if self.cfg.x_cl and (self._rounds(x.dtype) or not cl)
                           else "dense" if _batch_span(x) >= 2**31 else "")
        if self.copy_x == "cl":
            # The engine's NDHWC copy kernel (to_channels_last_kernel): PyTorch's own
            # .contiguous(memory_format=channels_last_3d) measured 4-8x slower as part of these
            # tiles (H200, 2026-12-02, tuner medians: VQ-VAE head 0.66 ms against 0.18 for the
            # channels-last call, 3-D GAN head 0.20 against 0.06).
            x = self.prepare_input(x, self._rounds(x.dtype), True)
        elif self.copy_x == "dense":
            x = x.contiguous()
        if self.fused:
            if self.gemm is None:
                self.gemm, self.slots = self._fused_site(x, w, y)
            z = torch.empty(self.slots, dtype=torch.float32, device=dev)
            return self.gemm.launch(dev, x, w, b, y, z)
        if self.shuffle:
            if self.gemm is None:
                self.gemm = self._shuffle_site(x, w, y)
            return self.gemm.launch(dev, x, w, b, y)
        if self.gemm is None:
            self.gemm = self._gemm_site(x, w, y)
        if self.fill_needed and self.gather is None:
            self.gather = self._gather_site(y)
        if self.direct:
            # Disjoint element sets: the fill writes only positions the GEMM does not.
            if self.fill_needed:
                self.gather.launch(dev, y, b, y)
            return self.gemm.launch(dev, x, w, b, y)
        p = self.params
        if self.cfg.w_packed:
            if self.pack is None:
                self.pack = self._pack_site(w)
            site, elements = self.pack
            packed = torch.empty(elements, device=dev, dtype=w.dtype)
            site.launch(dev, w, packed)
            w = packed
        z = torch.empty(head_z_elements(p, self.cfg.head), device=dev,
                        dtype=torch.bfloat16 if self.cfg.z_bf16 else torch.float32)
        handle = self.gemm.launch(dev, x, w, z)
        self.gather.launch(dev, z, b, y)
        return handle
