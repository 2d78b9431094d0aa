"""Issue 17's spike, Gluon candidate: the tap GEMM of a dense phase with TMA loads into a
multi-stage shared-memory ring and asynchronous wgmma, against the Triton engine on the same
problem.

The problem is the GEMM inside KB 77's one dense phase (and of any stride-1 layer): on a padded
channels-last input viewed as rows ``Xp[R, Cin]`` (R = N x Dp x Hp x Wp), every output row ``m``
(a padded position) is

    Y[m, co] = sum over taps t and ci of Xp[m + shift(t), ci] * W[co, t, ci],
    shift(t) = (td * Hp * Wp + th * Wp + tw) * dilation,

so a K step (tap t, a BLOCK_K slice of Cin) is one TMA box of Xp at row ``off_m + shift(t)``
(rows past the end come back as zeros) and one box of W. Rows whose taps leave the padded box
compute junk that the caller discards (the engine's flat path does the same).

Five rungs of issue 17's ladder, ``--kernel``:
- ``ring``: one partition with STAGES loads in flight and one wgmma outstanding while the next box
  lands, then a TMA store of the tile;
- ``ws``: the same with the loads in a producer warp (``gl.warp_specialize``);
- ``persistent``: ``ring`` over a program's share of the tiles, prefetching across tile boundaries
  and storing a tile while the next one computes;
- ``box``: tiles of output positions as 5-D TMA boxes, so no padded row is computed (the engine's
  ``box_gemm_kernel`` is this rung);
- ``hbox``: ``box`` with one box of the tile's rows and the H halo below them per (td, tw, Cin
  chunk), read by the KH taps of that column as 64-row slices.

What each measured on the H200, and what ncu says limits it, is in NOTES.md ("The Gluon spike").
It uses only the Gluon API that triton 3.6 (the GPU machine) and 3.9 (CI) share:
- ``allocate_shared_memory`` with ``MBarrierLayout``, not 3.9's ``allocate_mbarrier``;
- ``mbarrier.expect`` with a positional byte count;
- the TMA copies under the name each version has (``tma_load``, ``tma_store`` below).

    # offline, any machine: compile for sm_90 and print ptxas's registers, spills, shared memory
    python3 scripts/gluon_tap_gemm_spike.py --compile-only [--kernel ring|ws|persistent|box|hbox] [--dtype fp32|bf16]
    # on the GPU machine: check against conv3d in float64 and time against cuDNN's conv3d of the same
    python3 scripts/gluon_tap_gemm_spike.py [--kernel ring|ws|persistent|box|hbox] [--dtype fp32|bf16] [--stages 3]
    /usr/local/cuda/bin/ncu --set full -k regex:tap_gemm -c 1 python3 scripts/gluon_tap_gemm_spike.py --ncu
"""
from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# The TMA copies' names differ: triton 3.6 has only async_copy_global_to_shared and
# async_copy_shared_to_global; 3.9 has only async_load and async_store (the old names raise).
# Same arguments: (descriptor, coordinates, barrier, destination) and (descriptor, coordinates,
# source).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# KB 77: N16, 32 -> 64, 16 x 32 x 32 input, k3 s2 p1 d2. Its one dense phase is a dilated 3x3x3
# correlation over the input padded by 2 on every side (the engine's flat path).
KB77 = dict(n=16, cin=32, cout=64, size=(16, 32, 32), k=3, dil=2, pad=2)


@gluon.jit
def _tap_of(k, KH: gl.constexpr, KW: gl.constexpr, K_CHUNKS: gl.constexpr):
    """K step ``k`` as (tap, td, th, tw, Cin chunk): taps in (td, th, tw) order, chunk fastest."""
    tap = k // K_CHUNKS
    return tap, tap // (KH * KW), (tap // KW) % KH, tap % KW, k % K_CHUNKS


@gluon.jit
def _issue(a_desc, b_desc, a_smem, b_smem, bars, s, k, off_m, off_n, plane, row,
           KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr, K_CHUNKS: gl.constexpr):
    """Start the loads of K step ``k`` (tap k // K_CHUNKS, Cin chunk k % K_CHUNKS) into stage ``s``."""
    tap, td, th, tw, chunk = _tap_of(k, KH, KW, K_CHUNKS)
    shift = (td * plane + th * row + tw) * DIL
    block_k: gl.constexpr = a_desc.block_type.shape[1]
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [off_m + shift, chunk * block_k], bar, a_smem.index(s))
    tma_load(b_desc, [off_n, tap * K_CHUNKS * block_k + chunk * block_k], bar, b_smem.index(s))


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr):
    """The shared-memory ring: STAGES boxes of A and of B."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    return a_smem, b_smem


@gluon.jit
def _barriers(STAGES: gl.constexpr):
    """One initialised mbarrier (count 1) per stage."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def _zero_acc(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, INSTR_N: gl.constexpr, OPERAND_BITS: gl.constexpr,
              num_warps: gl.constexpr):
    """A zero fp32 accumulator in wgmma's layout: one warpgroup along M per 4 warps, instruction
    [16, INSTR_N, 256 / operand bits]."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, INSTR_N, 256 // OPERAND_BITS])
    return gl.full([BLOCK_M, BLOCK_N], 0.0, gl.float32, mma_layout)


@gluon.jit
def _store_tile(c_desc, acc, off_m, off_n):
    """The tile through shared memory and one TMA store (rows past R are clipped)."""
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem.store(acc)
    fence_async_shared()
    tma_store(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


@gluon.jit
def _issue_step(a_desc, b_desc, a_smem, b_smem, bars, g, pid, programs, n_tiles_m, plane, row,
                STEPS: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
                K_CHUNKS: gl.constexpr, STAGES: gl.constexpr):
    """The loads of a program's K step ``g``, numbered across its tiles (pid, pid + programs,
    ...; M-major over ``n_tiles_m`` along M): step g % STEPS of its tile g // STEPS."""
    tile = pid + (g // STEPS) * programs
    off_m = (tile % n_tiles_m) * a_desc.block_type.shape[0]
    off_n = (tile // n_tiles_m) * b_desc.block_type.shape[0]
    _issue(a_desc, b_desc, a_smem, b_smem, bars, g % STAGES, g % STEPS, off_m, off_n, plane, row, KH, KW, DIL,
           K_CHUNKS)


@gluon.jit
def _prefetch(a_desc, b_desc, a_smem, b_smem, bars, total, pid, programs, n_tiles_m, plane, row,
              STEPS: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
              K_CHUNKS: gl.constexpr, STAGES: gl.constexpr):
    """The first STAGES - 1 of a program's ``total`` K steps in flight."""
    for i in gl.static_range(STAGES - 1):
        if i < total:
            _issue_step(a_desc, b_desc, a_smem, b_smem, bars, i, pid, programs, n_tiles_m, plane, row, STEPS, KH,
                        KW, DIL, K_CHUNKS, STAGES)


@gluon.jit
def _tile_mainloop(a_desc, b_desc, a_smem, b_smem, bars, t, total, pid, programs, n_tiles_m, plane, row,
                   STEPS: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
                   K_CHUNKS: gl.constexpr, STAGES: gl.constexpr, INSTR_N: gl.constexpr, num_warps: gl.constexpr):
    """The accumulator of a program's tile ``t``: for each of its K steps, wait for the stage to
    land, issue its wgmma, and once at most that wgmma is in flight (so the stage of the step
    before is free) refill the ring STAGES - 1 steps ahead, into the next tile where the steps
    run past this one."""
    acc = _zero_acc(a_desc.block_type.shape[0], b_desc.block_type.shape[0], INSTR_N,
                    a_desc.dtype.primitive_bitwidth, num_warps)
    for k in range(STEPS):
        g = t * STEPS + k
        s = g % STAGES
        mbarrier.wait(bars.index(s), (g // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_smem.index(s), b_smem.index(s)))
        nxt = g + STAGES - 1
        if nxt < total:
            _issue_step(a_desc, b_desc, a_smem, b_smem, bars, nxt, pid, programs, n_tiles_m, plane, row, STEPS, KH,
                        KW, DIL, K_CHUNKS, STAGES)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def tap_gemm_kernel(a_desc, b_desc, c_desc, plane, row, n_tiles_m,
                    KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
                    K_CHUNKS: gl.constexpr, STAGES: gl.constexpr, INSTR_N: gl.constexpr, num_warps: gl.constexpr):
    """Tile ``program_id`` (M-major, ``n_tiles_m`` along M) of Y = sum_t Xp[m + shift(t)] @ W[t]^T
    (see the module docstring). ``a_desc``: Xp rows [R, Cin] in boxes [BLOCK_M, BLOCK_K];
    ``b_desc``: W as [Cout, taps x Cin] (K contiguous, as wgmma wants for tf32) in boxes
    [BLOCK_N, BLOCK_K]; ``c_desc``: Y [R, Cout] fp32 in boxes [BLOCK_M, BLOCK_N]."""
    STEPS: gl.constexpr = KD * KH * KW * K_CHUNKS
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    a_smem, b_smem = _ring(a_desc, b_desc, STAGES)
    bars = _barriers(STAGES)
    _prefetch(a_desc, b_desc, a_smem, b_smem, bars, STEPS, pid, programs, n_tiles_m, plane, row, STEPS, KH, KW, DIL,
              K_CHUNKS, STAGES)
    acc = _tile_mainloop(a_desc, b_desc, a_smem, b_smem, bars, 0, STEPS, pid, programs, n_tiles_m, plane, row, STEPS,
                         KH, KW, DIL, K_CHUNKS, STAGES, INSTR_N, num_warps)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _store_tile(c_desc, acc, (pid % n_tiles_m) * c_desc.block_type.shape[0],
                (pid // n_tiles_m) * c_desc.block_type.shape[1])


# ---- the second rung: a producer warp ---------------------------------------------------------
# Registers of the producer warp (it holds a few indices; the consumers get the rest).
PRODUCER_REGS = gl.constexpr(40)

# The same GEMM with the loads in a worker partition of one warp (``gl.warp_specialize``): the
# producer waits for a stage to be released, arms its barrier and starts its two boxes; the four
# consumer warps wait for a stage to land, issue its wgmma and release the stage of the step
# before once at most one wgmma is outstanding. Two barriers per stage, ``ready`` (TMA bytes
# landed) and ``empty`` (the wgmma that read it is done); a fresh barrier counts as having
# finished the phase before its first, so the producer's first pass through the ring waits on
# nothing.
@gluon.jit
def _ws_producer(a_desc, b_desc, a_smem, b_smem, ready, empty, off_m, off_n, plane, row,
                 KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr, K_CHUNKS: gl.constexpr,
                 STAGES: gl.constexpr, STEPS: gl.constexpr):
    for k in range(STEPS):
        s = k % STAGES
        mbarrier.wait(empty.index(s), ((k // STAGES) & 1) ^ 1)
        _issue(a_desc, b_desc, a_smem, b_smem, ready, s, k, off_m, off_n, plane, row, KH, KW, DIL, K_CHUNKS)


@gluon.jit
def _ws_consumer(c_desc, a_smem, b_smem, ready, empty, off_m, off_n,
                 STAGES: gl.constexpr, STEPS: gl.constexpr, INSTR_N: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    acc = _zero_acc(BLOCK_M, BLOCK_N, INSTR_N, a_smem.dtype.primitive_bitwidth, num_warps)
    for k in range(STEPS):
        s = k % STAGES
        mbarrier.wait(ready.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_smem.index(s), b_smem.index(s)))
        if k > 0:
            mbarrier.arrive(empty.index((k - 1) % STAGES), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _store_tile(c_desc, acc, off_m, off_n)


@gluon.jit
def tap_gemm_ws_kernel(a_desc, b_desc, c_desc, plane, row,
                       KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
                       K_CHUNKS: gl.constexpr, STAGES: gl.constexpr, INSTR_N: gl.constexpr,
                       num_warps: gl.constexpr):
    """``tap_gemm_kernel``'s tile with its loads in a producer warp, on a 2-D grid of (M tiles, N
    tiles) instead of ``n_tiles_m``; other arguments as there."""
    STEPS: gl.constexpr = KD * KH * KW * K_CHUNKS
    off_m = gl.program_id(0) * c_desc.block_type.shape[0]
    off_n = gl.program_id(1) * c_desc.block_type.shape[1]
    a_smem, b_smem = _ring(a_desc, b_desc, STAGES)
    ready = _barriers(STAGES)
    empty = _barriers(STAGES)
    gl.warp_specialize([
        (_ws_consumer, (c_desc, a_smem, b_smem, ready, empty, off_m, off_n, STAGES, STEPS, INSTR_N, num_warps)),
        (_ws_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, off_m, off_n, plane, row, KH, KW, DIL,
                        K_CHUNKS, STAGES, STEPS)),
    ], [1], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# ---- the third rung: persistent programs ------------------------------------------------------
# ``ring``'s tile loop over a program's share of the tiles (tile = pid + t * programs), its K steps
# numbered across tiles so that the ring keeps prefetching over a tile boundary, and the store
# of a tile left in flight while the next tile's wgmmas run (one C buffer: a tile waits for the
# previous store only when it writes its own). With one tile per program it is ``ring``, except
# that its C buffer is not reused from the ring.
@gluon.jit
def tap_gemm_persistent_kernel(a_desc, b_desc, c_desc, plane, row, n_tiles_m, n_tiles,
                               KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
                               K_CHUNKS: gl.constexpr, STAGES: gl.constexpr, INSTR_N: gl.constexpr,
                               num_warps: gl.constexpr):
    """``tap_gemm_kernel`` over tiles ``pid, pid + programs, ...`` of the ``n_tiles``; other
    arguments as there."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    STEPS: gl.constexpr = KD * KH * KW * K_CHUNKS
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    my_tiles = (n_tiles - pid + programs - 1) // programs
    total = my_tiles * STEPS
    a_smem, b_smem = _ring(a_desc, b_desc, STAGES)
    bars = _barriers(STAGES)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    _prefetch(a_desc, b_desc, a_smem, b_smem, bars, total, pid, programs, n_tiles_m, plane, row, STEPS, KH, KW, DIL,
              K_CHUNKS, STAGES)
    for t in range(my_tiles):
        tile = pid + t * programs
        acc = _tile_mainloop(a_desc, b_desc, a_smem, b_smem, bars, t, total, pid, programs, n_tiles_m, plane, row,
                             STEPS, KH, KW, DIL, K_CHUNKS, STAGES, INSTR_N, num_warps)
        tma.store_wait(0)  # the previous tile's store has read c_smem
        c_smem.store(acc)
        fence_async_shared()
        tma_store(c_desc, [(tile % n_tiles_m) * BLOCK_M, (tile // n_tiles_m) * BLOCK_N], c_smem)
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


# ---- the fourth rung: position boxes --------------------------------------------------------
# ``ring`` over the rows of a padded volume computes every padded position, and 37% of KB 77's
# rows (414720, of which 262144 are outputs) feed only discarded outputs. Here a tile is a box of
# output positions [BH, BW] of one (n, d) plane, and a K step's A operand is the 5-D TMA box
# [1, 1, BH, BW, BLOCK_K] of the padded NDHWC input at that box shifted by the tap: it lands in
# shared memory as BH x BW consecutive rows of BLOCK_K channels, the [BLOCK_M, BLOCK_K] tile
# wgmma reads, so the stage is allocated 2-D and reshaped to the box's five dimensions only for
# the copy. No padded row is computed (where BW divides the output width), and the tile is
# stored as a 5-D box of the NDHWC output.
@gluon.jit
def _box_origin(pid, D, tiles_h, tiles_w, BH: gl.constexpr, BW: gl.constexpr):
    """(n, d, h0, w0) of box ``pid``: w fastest, then h, d, n."""
    w0 = (pid % tiles_w) * BW
    t = pid // tiles_w
    h0 = (t % tiles_h) * BH
    t = t // tiles_h
    return t // D, t % D, h0, w0


@gluon.jit
def _issue_box(a_desc, b_desc, a_smem, b_smem, bars, s, k, n, d, h0, w0,
               KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr, K_CHUNKS: gl.constexpr):
    """Start the loads of K step ``k`` of the box at (n, d, h0, w0) into stage ``s``."""
    tap, td, th, tw, chunk = _tap_of(k, KH, KW, K_CHUNKS)
    block_k: gl.constexpr = a_desc.block_type.shape[4]
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [n, d + td * DIL, h0 + th * DIL, w0 + tw * DIL, chunk * block_k], bar,
             a_smem.index(s).reshape(a_desc.block_type.shape))
    tma_load(b_desc, [0, tap * K_CHUNKS * block_k + chunk * block_k], bar, b_smem.index(s))


@gluon.jit
def tap_gemm_box_kernel(a_desc, b_desc, c_desc, D, tiles_h, tiles_w,
                        KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
                        K_CHUNKS: gl.constexpr, STAGES: gl.constexpr, INSTR_N: gl.constexpr,
                        num_warps: gl.constexpr):
    """Box ``program_id`` (w fastest, then h, d, n) of Y[n, d, h, w] = sum over taps of
    Xp[n, d + td*DIL, h + th*DIL, w + tw*DIL] @ W[t]^T. ``a_desc``: Xp [N, DP, HP, WP, Cin] in
    boxes [1, 1, BH, BW, BLOCK_K]; ``b_desc``: W as [Cout, taps x Cin] in boxes [Cout, BLOCK_K];
    ``c_desc``: Y [N, D, H, W, Cout] fp32 in boxes [1, 1, BH, BW, Cout]."""
    BH: gl.constexpr = a_desc.block_type.shape[2]
    BW: gl.constexpr = a_desc.block_type.shape[3]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[4]
    BLOCK_M: gl.constexpr = BH * BW
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STEPS: gl.constexpr = KD * KH * KW * K_CHUNKS
    n, d, h0, w0 = _box_origin(gl.program_id(0), D, tiles_h, tiles_w, BH, BW)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], a_desc.dtype)
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = _barriers(STAGES)
    for i in gl.static_range(STAGES - 1):
        _issue_box(a_desc, b_desc, a_smem, b_smem, bars, i, i, n, d, h0, w0, KH, KW, DIL, K_CHUNKS)
    acc = _zero_acc(BLOCK_M, BLOCK_N, INSTR_N, a_desc.dtype.primitive_bitwidth, num_warps)
    for k in range(STEPS):
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_smem.index(s), b_smem.index(s)))
        nxt = k + STAGES - 1
        if nxt < STEPS:
            _issue_box(a_desc, b_desc, a_smem, b_smem, bars, nxt % STAGES, nxt, n, d, h0, w0, KH, KW, DIL,
                       K_CHUNKS)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], c_desc.dtype)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_layout)
    c_smem.store(acc)
    fence_async_shared()
    tma_store(c_desc, [n, d, h0, w0, 0], c_smem.reshape(c_desc.block_type.shape))
    tma.store_wait(0)


# ---- the fifth rung: a halo along H reused by the taps of a column ---------------------------
# ``box`` still loads each input row once per tap: 27 boxes of [BH, BW] positions per Cin chunk.
# The KH taps that differ only in th read the same W columns, BH rows apart by DIL each: one box
# of BH + (KH - 1) * DIL rows of the input holds all of them, and tap th's A tile is its rows
# [th * DIL * BW, th * DIL * BW + BLOCK_M), a slice of the shared-memory stage that wgmma reads
# in place when DIL * BW is a multiple of the 8-row swizzle atom (KB 77: BW 32). A K step is
# then (td, tw, Cin chunk) with KH wgmmas on one A box and KH boxes of W: KB 77's A traffic
# falls from 27 x 128 rows to 9 x 256 per chunk, 1.5x less (L2 throughput was 70% of peak).
@gluon.jit
def _issue_hbox(a_desc, b_desc, a_smem, b_smem, bars, s, k, n, d, h0, w0,
                KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr, K_CHUNKS: gl.constexpr):
    """Start the loads of K step ``k`` = (td, tw, chunk) of the box at (n, d, h0, w0) into stage
    ``s``: the halo box of A and the KH boxes of W of taps (td, 0..KH-1, tw)."""
    chunk = k % K_CHUNKS
    r = k // K_CHUNKS
    tw = r % KW
    td = r // KW
    block_k: gl.constexpr = a_desc.block_type.shape[4]
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + KH * b_desc.block_type.nbytes)
    tma_load(a_desc, [n, d + td * DIL, h0, w0 + tw * DIL, chunk * block_k], bar,
             a_smem.index(s).reshape(a_desc.block_type.shape))
    for th in gl.static_range(KH):
        tap = (td * KH + th) * KW + tw
        tma_load(b_desc, [0, tap * K_CHUNKS * block_k + chunk * block_k], bar, b_smem.index(s * KH + th))


@gluon.jit
def tap_gemm_hbox_kernel(a_desc, b_desc, c_desc, D, tiles_h, tiles_w,
                         KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, DIL: gl.constexpr,
                         K_CHUNKS: gl.constexpr, STAGES: gl.constexpr, INSTR_N: gl.constexpr,
                         num_warps: gl.constexpr):
    """``tap_gemm_box_kernel`` with ``a_desc``'s boxes [1, 1, BH + (KH - 1) * DIL, BW, BLOCK_K]
    (the tile's rows and the halo below them); other arguments as there."""
    BW: gl.constexpr = a_desc.block_type.shape[3]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[4]
    HALO_M: gl.constexpr = a_desc.block_type.shape[2] * BW
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[2] * BW
    BH: gl.constexpr = c_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STEPS: gl.constexpr = KD * KW * K_CHUNKS
    n, d, h0, w0 = _box_origin(gl.program_id(0), D, tiles_h, tiles_w, BH, BW)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALO_M, BLOCK_K], a_desc.dtype)
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALO_M, BLOCK_K], a_layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES * KH] + b_desc.block_type.shape, b_desc.layout)
    bars = _barriers(STAGES)
    for i in gl.static_range(STAGES - 1):
        _issue_hbox(a_desc, b_desc, a_smem, b_smem, bars, i, i, n, d, h0, w0, KH, KW, DIL, K_CHUNKS)
    # Two accumulators of 64 rows (wgmma's M per warpgroup): Triton's shared-memory slices must
    # start at a multiple of their own size, so tap th's A tile is two 64-row slices at
    # th * DIL * BW and th * DIL * BW + 64, aligned when DIL * BW is a multiple of 64.
    gl.static_assert(BLOCK_M == 128, "two 64-row halves")
    gl.static_assert((DIL * BW) % 64 == 0, "tap slices on 64-row boundaries")
    acc0 = _zero_acc(64, BLOCK_N, INSTR_N, a_desc.dtype.primitive_bitwidth, num_warps)
    acc1 = _zero_acc(64, BLOCK_N, INSTR_N, a_desc.dtype.primitive_bitwidth, num_warps)
    for k in range(STEPS):
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        a = a_smem.index(s)
        for th in gl.static_range(KH):
            b = b_smem.index(s * KH + th).permute((1, 0))
            acc0 = warpgroup_mma(a.slice(th * DIL * BW, 64), b, acc0, is_async=True)
            acc1 = warpgroup_mma(a.slice(th * DIL * BW + 64, 64), b, acc1, is_async=True)
        # the step before is done (its stage is free) once at most this step's 2 KH are in flight
        acc0, acc1, _ = warpgroup_mma_wait(num_outstanding=2 * KH, deps=(acc0, acc1, a))
        nxt = k + STAGES - 1
        if nxt < STEPS:
            _issue_hbox(a_desc, b_desc, a_smem, b_smem, bars, nxt % STAGES, nxt, n, d, h0, w0, KH, KW, DIL,
                        K_CHUNKS)
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], c_desc.dtype)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_layout)
    c_smem.slice(0, 64).store(acc0)
    c_smem.slice(64, 64).store(acc1)
    fence_async_shared()
    tma_store(c_desc, [n, d, h0, w0, 0], c_smem.reshape(c_desc.block_type.shape))
    tma.store_wait(0)


KERNELS = {"ring": tap_gemm_kernel, "ws": tap_gemm_ws_kernel, "persistent": tap_gemm_persistent_kernel,
           "box": tap_gemm_box_kernel, "hbox": tap_gemm_hbox_kernel}


def _gl_dtype(name: str):
    return {"fp32": gl.float32, "bf16": gl.bfloat16}[name]


def _tiles(dtype: str, cin: int, cout: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 128 rows (one warpgroup's wgmma M of 64 twice), all of Cout up
    to 128 (one tile of N: every output channel of a row from one load of its taps), 128 bytes of
    Cin per box (the widest TMA swizzle)."""
    block_k = min(cin, 32 if dtype == "fp32" else 64)
    return 128, min(cout, 128), block_k


def _boxes(p: dict, bm: int, bn: int, bk: int, halo: bool = False) -> tuple[list[int], list[int]]:
    """The ``box`` kernels' TMA boxes of A and C: BLOCK_M positions as [1, 1, BH, BW] with BW the
    output width's power of two up to BLOCK_M (KB 77: 4 x 32, a whole row per box line); with
    ``halo`` (``hbox``), A's box has the (k - 1) x dilation rows of H below the tile too."""
    bw = min(bm, triton.next_power_of_2(p["size"][2]))
    bh = bm // bw
    return [1, 1, bh + (p["k"] - 1) * p["dil"] * halo, bw, bk], [1, 1, bh, bw, bn]


def compile_only(args) -> int:
    """Compile for sm_90 without a GPU and print ptxas's verdict."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource  # in 3.6 and 3.9

    p = KB77
    bm, bn, bk = _tiles(args.dtype, p["cin"], p["cout"])
    dt = _gl_dtype(args.dtype)
    name = {"fp32": "fp32", "bf16": "bf16"}[args.dtype]
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], dt)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], dt)
    c_layout = gl.NVMMASharedLayout.get_default_for([bm, bn], gl.float32)
    descs = {"a_desc": f"tensordesc<{name}[{bm},{bk}],{a_layout!r}>",
             "b_desc": f"tensordesc<{name}[{bn},{bk}],{b_layout!r}>",
             "c_desc": f"tensordesc<fp32[{bm},{bn}],{c_layout!r}>"}
    if args.kernel in ("box", "hbox"):
        a_box, c_box = _boxes(p, bm, bn, bk, halo=args.kernel == "hbox")
        a5 = gl.NVMMASharedLayout.get_default_for(a_box, dt)
        c5 = gl.NVMMASharedLayout.get_default_for(c_box, gl.float32)
        descs["a_desc"] = f"tensordesc<{name}[{','.join(map(str, a_box))}],{a5!r}>"
        descs["c_desc"] = f"tensordesc<fp32[{','.join(map(str, c_box))}],{c5!r}>"
    consts = {"KD": p["k"], "KH": p["k"], "KW": p["k"], "DIL": p["dil"], "K_CHUNKS": p["cin"] // bk,
              "STAGES": args.stages, "INSTR_N": bn, "num_warps": 4}
    fn = KERNELS[args.kernel]
    sig = {a: descs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    ptxas = args.ptxas or shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    print(f"tap_gemm {args.kernel} {args.dtype}: tiles {bm}x{bn}x{bk}, {args.stages} stages, "
          f"{compiled.metadata.shared} B shared memory (Triton)")
    if ptxas == "none" or not Path(ptxas).exists():
        print("PTX compiled; ptxas not run, registers not read")
        return 0
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.ptx"
        version = re.search(r"release (\d+)\.(\d+)", subprocess.run([ptxas, "--version"], capture_output=True,
                                                                    text=True).stdout)
        if version:  # the PTX ISA this ptxas reads (CUDA 12.x reads 8.x)
            ptx = re.sub(r"\.version \d+\.\d+", f".version {8 if int(version.group(1)) == 12 else 9}.0", ptx)
        f.write_text(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(f), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True)
    lines = [ln for ln in (out.stderr + out.stdout).splitlines() if "registers" in ln or "spill" in ln]
    print("\n".join(lines) or f"ptxas: {out.stderr.strip() or out.stdout.strip()}")
    return out.returncode


def make_problem(p: dict, dtype, device):
    """(x [N, Cin, D, H, W], weight [Cout, Cin, k, k, k], rows [R, Cin] of the padded channels-last
    input, the weight as [Cout, taps x Cin]) of problem ``p`` (seed 0)."""
    import torch
    import torch.nn.functional as F

    n, cin, cout, k, pad = p["n"], p["cin"], p["cout"], p["k"], p["pad"]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, cin, *p["size"], device=device, generator=gen).to(dtype)
    wt = (torch.randn(cout, cin, k, k, k, device=device, generator=gen) / math.sqrt(cin * k ** 3)).to(dtype)
    rows = F.pad(x, [pad] * 6).permute(0, 2, 3, 4, 1).contiguous().view(-1, cin)
    wk = wt.permute(0, 2, 3, 4, 1).reshape(cout, k ** 3 * cin).contiguous()
    return x, wt, rows, wk


def padded_dims(p: dict) -> tuple[int, int, int]:
    return tuple(v + 2 * p["pad"] for v in p["size"])


def tap_gemm_torch(rows, wk, p: dict):
    """The kernels' arithmetic in PyTorch (float64): Y[m] = sum_t rows[m + shift(t)] @ W[t]^T,
    rows past the end read as zeros (TMA's out-of-bounds fill)."""
    import torch

    k, dil, cin = p["k"], p["dil"], p["cin"]
    _, hp, wp = padded_dims(p)
    r = rows.shape[0]
    src = torch.cat([rows.double(), rows.new_zeros(2 * r, cin).double()])
    y = torch.zeros(r, wk.shape[0], dtype=torch.float64, device=rows.device)
    for t in range(k ** 3):
        td, th, tw = t // (k * k), (t // k) % k, t % k
        shift = (td * hp * wp + th * wp + tw) * dil
        y += src[shift:shift + r] @ wk[:, t * cin:(t + 1) * cin].double().T
    return y


def valid_outputs(y, p: dict):
    """The rows of Y that are outputs (their taps inside the padded box), as [N, Cout, D', H', W']."""
    dp, hp, wp = padded_dims(p)
    reach = (p["k"] - 1) * p["dil"]
    return y.view(p["n"], dp, hp, wp, -1)[:, :dp - reach, :hp - reach, :wp - reach].permute(0, 4, 1, 2, 3)


def reference(x, wt, p: dict):
    """The dilated correlation of the padded input in float64 (what the valid rows must equal)."""
    import torch.nn.functional as F

    return F.conv3d(F.pad(x, [p["pad"]] * 6).double(), wt.double(), dilation=p["dil"])


def run_on_gpu(args) -> int:
    import torch
    import torch.nn.functional as F
    import triton.testing
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    p = KB77
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    n, cin, cout, k, dil, pad = p["n"], p["cin"], p["cout"], p["k"], p["dil"], p["pad"]
    d, h, w = p["size"]
    _, hp, wp = padded_dims(p)
    x, wt, rows, wk = make_problem(p, dt, "cuda")
    y = torch.empty(rows.shape[0], cout, device="cuda", dtype=torch.float32)
    bm, bn, bk = _tiles(args.dtype, cin, cout)
    g = _gl_dtype(args.dtype)
    a_desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [bm, bk],
                              gl.NVMMASharedLayout.get_default_for([bm, bk], g))
    b_desc = TensorDescriptor(wk, list(wk.shape), list(wk.stride()), [bn, bk],
                              gl.NVMMASharedLayout.get_default_for([bn, bk], g))
    c_desc = TensorDescriptor(y, list(y.shape), list(y.stride()), [bm, bn],
                              gl.NVMMASharedLayout.get_default_for([bm, bn], gl.float32))
    n_tiles_m, n_tiles_n = triton.cdiv(rows.shape[0], bm), triton.cdiv(cout, bn)
    consts = (k, k, k, dil, cin // bk, args.stages, bn)
    n_tiles = n_tiles_m * n_tiles_n
    out_rows = y  # what the float64 check reads: padded rows [R, Cout], or the NDHWC outputs
    if args.kernel in ("box", "hbox"):
        a_box, c_box = _boxes(p, bm, bn, bk, halo=args.kernel == "hbox")
        xp5 = rows.view(n, *padded_dims(p), cin)
        out_rows = torch.empty(n, d, h, w, cout, device="cuda", dtype=torch.float32)
        a_desc = TensorDescriptor(xp5, list(xp5.shape), list(xp5.stride()), a_box,
                                  gl.NVMMASharedLayout.get_default_for(a_box, g))
        c_desc = TensorDescriptor(out_rows, list(out_rows.shape), list(out_rows.stride()), c_box,
                                  gl.NVMMASharedLayout.get_default_for(c_box, gl.float32))
        tiles_h, tiles_w = triton.cdiv(h, c_box[2]), triton.cdiv(w, c_box[3])
        kern = tap_gemm_box_kernel if args.kernel == "box" else tap_gemm_hbox_kernel
        launch = lambda: kern[(n * d * tiles_h * tiles_w,)](  # noqa: E731
            a_desc, b_desc, c_desc, d, tiles_h, tiles_w, *consts, num_warps=4)
    elif args.kernel == "persistent":
        programs = min(n_tiles, torch.cuda.get_device_properties(0).multi_processor_count * args.ctas_per_sm)
        launch = lambda: tap_gemm_persistent_kernel[(programs,)](  # noqa: E731
            a_desc, b_desc, c_desc, hp * wp, wp, n_tiles_m, n_tiles, *consts, num_warps=4)
    elif args.kernel == "ring":
        launch = lambda: tap_gemm_kernel[(n_tiles,)](  # noqa: E731
            a_desc, b_desc, c_desc, hp * wp, wp, n_tiles_m, *consts, num_warps=4)
    else:
        launch = lambda: tap_gemm_ws_kernel[(n_tiles_m, n_tiles_n)](  # noqa: E731
            a_desc, b_desc, c_desc, hp * wp, wp, *consts, num_warps=4)

    def gluon_gemm():
        launch()
        return out_rows

    gluon_gemm()
    torch.cuda.synchronize()
    if args.ncu:
        return 0
    # Valid rows: padded positions whose taps stay inside the padded box; there Y is the dilated
    # correlation of the padded input.
    ref = reference(x, wt, p)
    got = out_rows.permute(0, 4, 1, 2, 3) if out_rows.dim() == 5 else valid_outputs(y, p)
    err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
    useful = 2 * n * d * h * w * cout * cin * k ** 3  # the 16 x 16 x 32 x 32 positions that matter
    ms = triton.testing.do_bench(gluon_gemm, warmup=25, rep=200)
    # The same arithmetic in cuDNN: the dilated correlation of the padded channels-last input.
    xp_cl = F.pad(x, [pad] * 6).contiguous(memory_format=torch.channels_last_3d)
    ms_cudnn = triton.testing.do_bench(lambda: F.conv3d(xp_cl, wt, dilation=dil), warmup=25, rep=200)
    peak = {"fp32": 494.7e12, "bf16": 989.4e12}[args.dtype]  # H200 SXM dense TF32 / BF16
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, TF32 for cuDNN {torch.backends.cudnn.allow_tf32}")
    print(f"tap_gemm {args.kernel} {args.dtype}, {bm}x{bn}x{bk}, {args.stages} stages: {ms * 1e3:.1f} us, "
          f"{useful / ms / 1e9:.1f} TFLOP/s useful ({100 * useful / ms / 1e-3 / peak:.1f}% of peak), "
          f"max rel err vs float64 {err:.2e} (rows {out_rows.numel() // cout}, of which {n * d * h * w} useful); "
          f"cuDNN's conv3d of the same: {ms_cudnn * 1e3:.1f} us")
    return 0 if err < (5e-3 if args.dtype == "fp32" else 2e-2) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--kernel", default="ring", choices=tuple(KERNELS),
                    help="ring: one partition; ws: loads in a producer warp; persistent: ring over tiles; "
                         "box: tiles of output positions (5-D boxes); hbox: box with one H halo per KH taps")
    ap.add_argument("--ctas-per-sm", type=int, default=2, help="with --kernel persistent: programs per SM")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 offline, no GPU")
    ap.add_argument("--ncu", action="store_true", help="one launch, for ncu")
    ap.add_argument("--ptxas", default=None, help="with --compile-only: the ptxas to run ('none': PTX only)")
    args = ap.parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    return run_on_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
