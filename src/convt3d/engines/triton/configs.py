"""The Triton engine's tile configurations and its tuner.

``Config`` is one launch configuration; ``candidate_configs`` lists, per GEMM shape and dtype, the
configurations the first call of a signature times (the first is the untuned default), with the
measurements that chose them; ``_choose`` times them and ``tuning_log`` holds the results. Pure
host logic: no tensor is touched here (``triton_engine`` launches, ``triton_sites`` builds the
launches).
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import triton

from ...core.flags import device_name
from ...core.params import ConvT3dParams
from ...dispatch.timing import gpu_ms, host_ms
from . import head as head_engine
from ...core.memo import memo


@dataclass(frozen=True)
class Config:
    """Tile shape and launch parameters of ``phase_gemm_kernel``."""

    BLOCK_M: int  # compact output positions per program (the GEMM's M)
    BLOCK_N: int  # output channels per program (the GEMM's N)
    BLOCK_K: int  # input channels per K step
    BLOCK_W: int  # the position tile is (BLOCK_M // BLOCK_W) compact rows x BLOCK_W compact columns
    num_warps: int
    num_stages: int
    use_dot: bool = True
    W_GROUP: int = 1  # W-residues interleaved per store (2 for stride 2 along W, NCDHW output)
    fill_separate: bool = True  # rows no tap reaches are written by fill_rows_kernel
    companions: bool = True  # empty row classes written by the GEMM programs (see companion_masks)
    x_cache: str = ""  # cache modifier of the input loads ("" or ".ca")
    maxnreg: int | None = None  # register cap per thread (occupancy)
    tma: bool = False  # operands through tensor descriptors (TMA) where the layout allows
    flat: bool = False  # flat_gemm_kernel: 2-D TMA boxes over a zero-haloed input copy (Hopper)
    # With flat: box_gemm_kernel (kernels/gluon_gemm.py, Gluon, sm_90 only) on the same padded
    # copy, tiles of BLOCK_M // BLOCK_W x BLOCK_W compact positions.
    gluon: bool = False
    fold: int = 1  # groups merged per GEMM (group_folds): block-diagonal weight, wider tiles
    # Output-head path (head_engine, kernels/head_gemm.py): "rows" or "shuffle", "" otherwise.
    # Its GEMM tile is BLOCK_M positions x BLOCK_N columns x BLOCK_K; for the rows kind BLOCK_W
    # is the tap sum's row span and BLOCK_R its elements per program.
    head: str = ""
    BLOCK_R: int = 0
    # The shuffle kind's tile of blocks: BOX_H x BLOCK_W (= BLOCK_M); with BOX_H 0 it takes
    # BLOCK_M consecutive blocks of a plane instead.
    BOX_H: int = 0
    # The rows kind's tap-product buffer Z in bfloat16 instead of fp32 (bf16 calls only;
    # head_engine.head_tiles says why): half of Z's traffic.
    z_bf16: bool = False
    # Programs per SM of a persistent head GEMM, each looping over its share of the tiles so
    # that the next tile's loads are in flight during this one's MMAs (head_rows_kernel);
    # 0: one program per tile.
    persist: int = 0
    # The rows kind's weight tiles packed densely once per call (head_rows_pack_kernel) and
    # read as contiguous blocks, instead of gathered tap by tap from the weight at every step.
    w_packed: bool = False
    # With w_packed: each input tile steps every N tile's accumulator (N tiles live together)
    # instead of one N tile at a time re-reading the input (head_rows_kernel's N_JOINT).
    n_joint: bool = False
    # The head GEMM reads a channels-last copy of an NCDHW input (one copy kernel per call):
    # each position's channels contiguous, so its loads are vectors (head_engine._x_copies).
    x_cl: bool = False
    # The shuffle kind's shifts as MMA columns instead of K steps: 0 none, 1 the width shifts,
    # 2 the height and width shifts (head_shuffle_kernel's NJH, NJW).
    shifts_n: int = 0

    def short(self) -> str:
        if self.head == "shuffle":
            box = f"{self.BOX_H}x{self.BLOCK_W}" if self.BOX_H else "flat"
            return (f"head-shuffle M{self.BLOCK_M}({box}) N{self.BLOCK_N} K{self.BLOCK_K} "
                    f"{'mma' if self.use_dot else 'fma'} w{self.num_warps} s{self.num_stages}"
                    + ("" if not self.shifts_n else " nw" if self.shifts_n == 1 else " nhw"))
        if self.head:
            return (f"head-{self.head} M{self.BLOCK_M} N{self.BLOCK_N} K{self.BLOCK_K} W{self.BLOCK_W} "
                    f"R{self.BLOCK_R} w{self.num_warps} s{self.num_stages}" + (" zbf16" if self.z_bf16 else "")
                    + (f" p{self.persist}" if self.persist else "") + (" wpk" if self.w_packed else "") + (" nj" if self.n_joint else "")
                    + (" xcl" if self.x_cl else ""))
        kind = "dot" if self.use_dot else "fma"
        tile = "" if self.flat and not self.gluon else f"({self.BLOCK_M // self.BLOCK_W}x{self.BLOCK_W})"
        return (f"{kind} M{self.BLOCK_M}{tile} N{self.BLOCK_N} "
                f"K{self.BLOCK_K} w{self.num_warps} s{self.num_stages}" + (" wg2" if self.W_GROUP == 2 else "")
                + ("" if self.fill_separate else " nofill") + ("" if self.companions else " nocomp") + (f" {self.x_cache}" if self.x_cache else "")
                + (f" r{self.maxnreg}" if self.maxnreg else "") + (" tma" if self.tma else "")
                + (" flat" if self.flat else "") + (" gluon" if self.gluon else "")
                + (f" fold{self.fold}" if self.fold > 1 else ""))


def _cdiv(a: int, b: int) -> int:
    # Host-side ceil division. triton.cdiv is a ConstexprFunction in newer Triton (~5-15 us per
    # call from Python); the launcher calls it a few times per forward.
    return -(-a // b)


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def uses_tensor_cores(params: ConvT3dParams) -> bool:
    """tl.dot needs 16 rows/cols per operand. Below 8 channels per group on either side the
    padding to 16 would waste more than 2x of each MMA and 4x overall, so the exact FMA path
    is used instead (depthwise and small-group layers)."""
    return params.in_channels_per_group >= 8 and params.out_channels_per_group >= 8


def block_w(compact_hw: tuple[int, int], block_m: int) -> int:
    """Width of the position tile: the power of two that wastes the fewest padded positions on
    the compact (h, w) plane, the wider on ties (longer contiguous rows). KB 77 (32 x 32
    compact) gets 4 x 32 at BLOCK_M=128; KB 58 (36 x 70) gets 8 x 16 (27% padding, vs 45% for
    a plain 64-wide tile) and 4 x 16 at BLOCK_M=64 (12.5%)."""
    qh, qw = compact_hw
    best, best_pad = 1, None
    bw = 1
    while bw <= block_m:
        bh = block_m // bw
        pad = _cdiv(qw, bw) * bw * _cdiv(qh, bh) * bh
        if best_pad is None or pad <= best_pad:
            best, best_pad = bw, pad
        bw *= 2
    return best


@functools.lru_cache(maxsize=1024)
def candidate_configs(params: ConvT3dParams, dtype: torch.dtype, precision: str,
                      channels_last_out: bool = False, flat: bool = False,
                      gluon: bool = False) -> tuple[Config, ...]:
    """All configurations tried for one GEMM shape and dtype; the first is the untuned default.

    Why these tiles:
    * BLOCK_N (output channels) covers Cout/g in one tile up to 128, so each input tile is read
      once per program. The spatial side is the MMA's M, so wgmma runs for any Cout/g >= 16.
    * BLOCK_K (input channels per step): 32 for fp32 (one 128-byte line per position), 64 for
      16-bit (bf16 at K 32 spills registers and runs several times slower).
    * BLOCK_M (positions): 128 is the default; 256 on 8 warps (large-N bf16 layers) and 64 at 4
      stages are candidates. Accumulators are kept <= 128 registers per thread.
    * num_stages 3: more stages never won by more than noise and lost on some layers; cache
      hints and register caps changed nothing.
    * tma: operands through tensor descriptors, faster on most layers but slower where Cout is
      narrow (and the fp32 FMA ("ieee") dot spills with it), so both kinds are candidates and
      the tuner picks.
    * W_GROUP=2 for stride 2 along W into NCDHW output: both W-residues of a row are computed
      and stored as whole rows (strided per-phase stores use a fraction of each transaction).
    * companions (default) / fill_separate: rows no tap reaches are written by the GEMM
      programs next to their own rows (companion_masks), else by a store-only kernel.
    """
    cin_g, cout_g = params.in_channels_per_group, params.out_channels_per_group
    esize = dtype.itemsize
    # Tile shapes follow the compact grids of the phases that do GEMM work; the extra row or
    # column of empty phases (KB 77) is covered by store-only edge tiles.
    hw = tuple(max(p.axes[i].size for p in params.phases if not p.empty) for i in (1, 2))
    wg = 2 if params.stride[2] == 2 and not channels_last_out else 1
    if not uses_tensor_cores(params):
        # Outer-product FMA path: one input channel per step; the accumulators hold
        # BLOCK_M x BLOCK_N = 2048 fp32 (16 per thread at 4 warps).
        bn = min(_pow2_at_least(cout_g), 16)
        plane = _pow2_at_least(hw[0] * hw[1])
        sizes = dict.fromkeys(min(b, plane) for b in (2048 // bn // wg, 1024 // bn // wg))
        fma = tuple(Config(bm, bn, 1, block_w(hw, bm), 4, 2, use_dot=False, W_GROUP=wg) for bm in sizes)
        # The output-head tiles come first, as the untuned default (graph capture, the CPU
        # interpreter, CONVT3D_AUTOTUNE=0): they beat these FMA tiles on nearly every head layer,
        # by large factors; the FMA tiles stay candidates for the few k2 s2 heads they win.
        return _head_configs(params, dtype, precision, channels_last_out) + fma

    # Tiles larger than the compact plane only add padding (and interpreter time on CPU).
    plane = max(16, _pow2_at_least(hw[0] * hw[1]))
    bn = max(16, min(128, _pow2_at_least(cout_g)))
    bk = max(16, min(32 if esize == 4 else 64, _pow2_at_least(cin_g)))
    # Accumulators per program: a W residue with no taps (W_SKIP) holds none through the loop.
    acc_wg = wg if _w_skip(params, wg) < 0 else 1

    def tile(bm: int, stages: int, bound: int, block_k: int = bk, **kind) -> Config | None:
        bm = min(bm, bound)
        warps = 4 if acc_wg * bm * bn <= 128 * 64 else 8
        if acc_wg * bm * bn // (32 * warps) > 128:
            return None  # accumulators would spill
        if stages * (bn * block_k + block_k * bm) * esize > 200 * 1024:
            return None  # operand ring beyond shared memory
        bw = bm if kind.get("flat") and not kind.get("gluon") else block_w(hw, bm)
        return Config(bm, bn, block_k, bw, warps, stages, W_GROUP=wg, **kind)

    if flat and flat_unsupported(params, dtype, bk) is None:
        # Hopper (and the interpreter): flat_gemm_kernel first, then the 5-D TMA path of
        # phase_gemm_kernel: each tiling here is the fastest on some layer; further tilings came
        # within a few percent of these and are left out, since every candidate costs about a
        # second of compile when tuning.
        # Flat tiles run along whole padded rows: the plane bound uses the padded width.
        _, (_, _, wp) = flat_geometry(params)
        fplane = max(16, _pow2_at_least(hw[0] * wp))
        plans = [(128, 3, fplane, {"flat": True}), (64, 4, fplane, {"flat": True}),
                 (128, 3, plane, {"tma": True}), (256, 3, plane, {"tma": True})]
        if esize == 4 and precision != "ieee" and 32 < cin_g <= 64 and (params.groups == 1 or cin_g == 64):
            # One 64-channel K step per tap instead of two of 32 (the second partly padding when
            # Cin/g = 48): faster on some such layers and slower on others, so a candidate for
            # the tuner, not a rule.
            plans.append((128, 3, fplane, {"flat": True, "block_k": 64}))
        if gluon and (esize == 2 or precision == "tf32") and plane >= 64:  # wgmma: 64 rows per warpgroup
            # box_gemm_kernel (wgmma reads fp32 as TF32 only, so not for tf32x3 / ieee). Last:
            # the first candidate is the untuned default, and this one runs on sm_90 alone. At 4
            # stages, which made the whole call faster than 3.
            plans.append((128, 4, plane, {"flat": True, "gluon": True}))
    else:
        # No TMA (before Hopper, or a call flat_unsupported rejects): pointer loads, with the
        # tilings that won the pointer-load sweep.
        plans = [(128, 3, plane, {}), (256, 3, plane, {}), (64, 4, plane, {}), (128, 4, plane, {})]
    configs = []
    for bm, stages, bound, kind in plans:
        cfg = tile(bm, stages, bound, **kind)
        if cfg is not None and cfg not in configs:
            configs.append(cfg)
    # Merged groups: the first two tilings of each fold (each candidate costs ~1 s of compile
    # when tuning; the later tilings never won on the grouped KernelBench problems).
    for f in group_folds(params):
        merged = candidate_configs(params.fold_groups(f), dtype, precision, channels_last_out, flat)
        configs += [replace(c, fold=f) for c in merged[:2]]
    return tuple(configs) + _head_configs(params, dtype, precision, channels_last_out)


def _head_configs(params: ConvT3dParams, dtype: torch.dtype, precision: str,
                  channels_last: bool) -> tuple[Config, ...]:
    """Output-head candidates (head_engine.head_tiles) for layers of <= 15 channels per group,
    timed by the tuner against the phase-GEMM configs above (``channels_last``: the call is laid
    out channels-last, so no tile reads a copy)."""
    return tuple(Config(**t) for t in head_engine.head_tiles(params, dtype, precision, channels_last))


def group_folds(params: ConvT3dParams) -> tuple[int, ...]:
    """Group merges (ConvT3dParams.fold_groups) worth a tuning candidate, smallest first.

    A group of fewer than 16 input or output channels fills at most half of each 16-wide MMA
    operand, and its programs do one small MMA per tap, far below the roofline (KernelBench 72:
    4 groups of 8 -> 8, 105 taps). Merging f groups multiplies the work by f but fills the tiles. Candidates: the
    smallest f reaching 16 channels on both sides, and the full merge (one dense GEMM) while it
    keeps <= 128 channels, i.e. one output-channel tile. Only for calls already on tensor cores
    (>= 8 channels per group): the FMA path's smaller groups would multiply the work by >= 16x.
    """
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    if g == 1 or not uses_tensor_cores(params) or (cin_g >= 16 and cout_g >= 16):
        return ()
    folds = []
    smallest = next((f for f in range(2, g + 1) if g % f == 0 and f * cin_g >= 16 and f * cout_g >= 16), None)
    if smallest is not None:
        folds.append(smallest)
    if g not in folds and params.in_channels <= 128 and params.out_channels <= 128:
        folds.append(g)
    return tuple(folds)


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------
@dataclass
class TuneRecord:
    config: Config
    seconds: float
    timings_ms: dict[str, float]
    # Host ms per call of each config's launches (``_host_ms``), where the tuner read them.
    host_ms: dict[str, float] = field(default_factory=dict)
    # Configs that raised on their first run (a compile that needs more shared memory or
    # registers than this GPU has), with the error: left out of the choice.
    failed: dict[str, str] = field(default_factory=dict)


_tuned: dict[tuple, TuneRecord] = memo("engines.triton.configs.tuned")


@dataclass(frozen=True)
class CandidateFailure:
    """What a guarded tuning run returns instead of raising: the error of a candidate that could
    not run (``engines.TritonEngine`` guards its runs; a run that raises is not guarded, and
    ``_choose`` lets the error through)."""

    error: str


def tuning_log() -> dict[tuple, TuneRecord]:
    """Tuning results of this process (key -> chosen config, tuning seconds, per-config ms)."""
    return dict(_tuned)


def tuned_config(key) -> Config | None:
    """The configuration this process uses for a tune key (timed or seeded), or None if none yet."""
    rec = _tuned.get(key)
    return None if rec is None else rec.config


def _tuning_enabled() -> bool:
    return os.environ.get("CONVT3D_AUTOTUNE", "1") not in ("0", "false", "False", "")


@functools.lru_cache(maxsize=None)
def _tune_key(params: ConvT3dParams, x: torch.Tensor, precision: str, out_cl: bool) -> tuple:
    return (device_name(x.device), x.dtype, precision, out_cl, params)


def host_charged(timings: dict[str, float], host_ms: dict[str, float]) -> dict[str, float]:
    """Each config's cost per call in a stream of calls: the larger of its GPU median and its
    host time per call (the host enqueues ahead while the GPU is the slower; the GPU waits
    while the host is). do_bench's median alone hides up to ~80 us of a call's host time (its
    L2 flush runs while the host prepares the next call), so on a host-bound layer it picks
    the config that is slower in use; adding only the host time beyond the cheapest config's
    (the rule "auto" applies between engines, for networks that wait on the GPU) picks the
    wrong tile where the GPU is the slower."""
    if not host_ms:
        return dict(timings)
    return {k: max(v, host_ms.get(k, 0.0)) for k, v in timings.items()}


def _choose(key, configs: list[Config], run: Callable[[Config], None]) -> Config:
    rec = _tuned.get(key)
    if rec is not None:
        return rec.config
    if len(configs) == 1 or not _tuning_enabled():
        _tuned[key] = TuneRecord(configs[0], 0.0, {})
        return configs[0]
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    hosts: dict[str, float] = {}
    failed: dict[str, str] = {}
    for cfg in configs:
        outcome = run(cfg)  # compile + warm
        if isinstance(outcome, CandidateFailure):
            # A run that reports its failure (engines.TritonEngine's guarded run): the offer rules
            # hold the H100/H200's limits (shared memory per block, registers), and on a GPU with
            # less a candidate fails to compile. The others still decide; every run writes the
            # whole output, so a partial run leaves nothing behind.
            failed[cfg.short()] = outcome.error
            continue
        timings[cfg.short()] = gpu_ms(lambda: run(cfg), warmup=5, rep=30)
        hosts[cfg.short()] = host_ms(lambda: run(cfg), timings[cfg.short()])
    if not timings:
        raise RuntimeError("every tile configuration failed: " + "; ".join(f"[{k}] {v}" for k, v in failed.items()))
    configs = [c for c in configs if c.short() in timings]
    # The candidates within 25% of the best, timed again in reverse order (at most 3): one pass
    # lets clock ramp or a neighbour's work decide between near-equal tiles; each keeps its
    # lower median, as the auto backend's two opposite-order rounds do.
    cost = host_charged(timings, hosts)
    close = sorted((c for c in configs if cost[c.short()] <= 1.25 * min(cost.values())),
                   key=lambda c: cost[c.short()])[:3]
    if len(close) > 1:
        for cfg in reversed(close):
            again = gpu_ms(lambda: run(cfg), warmup=5, rep=30)
            timings[cfg.short()] = min(timings[cfg.short()], again)
            hosts[cfg.short()] = min(hosts[cfg.short()], host_ms(lambda: run(cfg), timings[cfg.short()]))
        cost = host_charged(timings, hosts)
    best = min(configs, key=lambda c: cost[c.short()])
    _tuned[key] = TuneRecord(best, time.perf_counter() - t0, timings, hosts, failed)
    return best


@functools.lru_cache(maxsize=256)
def flat_geometry(params: ConvT3dParams) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(low padding, padded size) per dimension of the zero-haloed input of flat_gemm_kernel.

    A compact position q of a phase reads input q + off0 - j * ostep for its taps j; over all
    phases with taps these shifts span [lo, hi]. The padded buffer puts input index i at
    i + P with P = max(0, -lo) and is long enough for every valid q (q < compact size) plus hi,
    so every tap of every valid output position reads inside the buffer (zeros in the halo)."""
    pads, sizes = [], []
    for a, q in zip(params.axes, params.compact_size):
        shifts = [ph.first_offset - j * a.offset_step for ph in a.phases for j in range(ph.num_taps)]
        lo, hi = (min(shifts), max(shifts)) if shifts else (0, 0)
        pad = max(0, -lo)
        pads.append(pad)
        sizes.append(pad + max(a.in_size, q + hi))
    return tuple(pads), tuple(sizes)


def flat_unsupported(params: ConvT3dParams, dtype: torch.dtype, block_k: int) -> str | None:
    """Why flat_gemm_kernel cannot run a call (None: it can). TMA needs 16-byte aligned row
    strides (channels x element size); a channel block must not run into the next group's
    channels, which are in bounds and would not read as zeros; TMA coordinates are int32."""
    es = dtype.itemsize
    if not uses_tensor_cores(params):
        return "fewer than 8 channels per group (FMA path)"
    if (params.in_channels * es) % 16 or (params.in_channels_per_group * es) % 16:
        return "channel rows not 16-byte aligned"
    if params.groups > 1 and params.in_channels_per_group % block_k:
        return "channel blocks would cross groups"
    _, (dp, hp, wp) = flat_geometry(params)
    kvol = math.prod(params.kernel_size)
    if params.batch * dp * hp * wp >= 2**31 or params.groups * kvol * params.out_channels_per_group >= 2**31:
        return "more than 2^31 rows"
    return None


def _w_skip(params: ConvT3dParams, w_group: int) -> int:
    """The W residue (0 or 1) of an interleaved pair that has no taps, else -1."""
    if w_group == 2:
        for r in (0, 1):
            if params.axes[2].phases[r].num_taps == 0:
                return r
    return -1
