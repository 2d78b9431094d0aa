"""The Triton engine's tile configurations and its tuner: ``candidate_configs`` lists what the
first call of a signature times (the first is the untuned default), ``_choose`` times them."""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ...core.flags import device_name
from ...core.params import ConvT3dParams, cdiv, pow2_at_least
from . import precompile
from ...dispatch.timing import gpu_ms, host_ms
from . import head as head_engine
from ...core.memo import memo


@dataclass(frozen=True)
class Config:
    """Tile shape and launch parameters of the phase, flat and box GEMMs (heads: ``head.HeadConfig``)."""

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
    tma: bool = False  # operands through tensor descriptors (TMA) where the layout allows
    flat: bool = False  # flat_gemm_kernel: 2-D TMA boxes over a zero-haloed input copy (Hopper)
    gluon: bool = False  # with flat: box_gemm_kernel (Gluon, sm_90) on the same padded copy
    fold: int = 1  # groups merged per GEMM (group_folds): block-diagonal weight, wider tiles

    def short(self) -> str:
        kind = "dot" if self.use_dot else "fma"
        tile = "" if self.flat and not self.gluon else f"({self.BLOCK_M // self.BLOCK_W}x{self.BLOCK_W})"
        flags = [("wg2", self.W_GROUP == 2), ("nofill", not self.fill_separate), ("nocomp", not self.companions),
                 ("tma", self.tma), ("flat", self.flat), ("gluon", self.gluon), (f"fold{self.fold}", self.fold > 1)]
        return (f"{kind} M{self.BLOCK_M}{tile} N{self.BLOCK_N} K{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"
                + "".join(f" {name}" for name, on in flags if on))


def uses_tensor_cores(params: ConvT3dParams) -> bool:
    """At least 8 channels per group on both sides: below, padding to tl.dot's 16 wastes over 4x."""
    return params.in_channels_per_group >= 8 and params.out_channels_per_group >= 8


def block_w(compact_hw: tuple[int, int], block_m: int) -> int:
    """Width of the position tile: the power of two padding the compact (h, w) plane least, wider on ties."""
    qh, qw = compact_hw

    def padded(bw: int) -> int:
        bh = block_m // bw
        return cdiv(qw, bw) * bw * cdiv(qh, bh) * bh

    return min((1 << i for i in range(block_m.bit_length())), key=lambda bw: (padded(bw), -bw))


@functools.lru_cache(maxsize=1024)
def candidate_configs(params: ConvT3dParams, dtype: torch.dtype, precision: str, channels_last_out: bool = False,
                      flat: bool = False, gluon: bool = False) -> tuple[Config, ...]:
    """All configurations tried for one GEMM shape and dtype, the first the untuned default: BLOCK_N
    covers Cout/g up to 128 (each input tile read once), BLOCK_K a 128-byte line (64 for 16-bit),
    accumulators within 128 registers a thread; W_GROUP=2 stores stride-2 NCDHW rows whole."""
    cin_g, cout_g = params.in_channels_per_group, params.out_channels_per_group
    esize = dtype.itemsize
    # Tiles follow the compact grids of phases with taps; empty phases' extra rows get store-only tiles.
    hw = tuple(max(p.axes[i].size for p in params.phases if not p.empty) for i in (1, 2))
    wg = 2 if params.stride[2] == 2 and not channels_last_out else 1
    # Tiles larger than the compact plane only add padding (and interpreter time on CPU).
    plane = max(16, pow2_at_least(hw[0] * hw[1]))
    bn = max(16, min(128, pow2_at_least(cout_g)))
    bk = max(16, min(32 if esize == 4 else 64, pow2_at_least(cin_g)))
    # Accumulators per program: a W residue with no taps (W_SKIP) holds none through the loop.
    acc_wg = wg if _w_skip(params, wg) < 0 else 1
    # Output-head candidates (layers of few output channels per group), last but on the FMA path.
    head_fields = head_engine.head_tiles(params, dtype, precision, channels_last_out)
    heads = tuple(head_engine.HeadConfig(**t) for t in head_fields)

    def tile(bm: int, stages: int, bound: int, block_k: int = bk, **kind) -> Config | None:
        bm = min(bm, bound)
        warps = 4 if acc_wg * bm * bn <= 128 * 64 else 8
        if acc_wg * bm * bn // (32 * warps) > 128:
            return None  # accumulators would spill
        if stages * (bn * block_k + block_k * bm) * esize > 200 * 1024:
            return None  # operand ring beyond shared memory
        bw = bm if kind.get("flat") and not kind.get("gluon") else block_w(hw, bm)
        return Config(bm, bn, block_k, bw, warps, stages, W_GROUP=wg, **kind)

    if not uses_tensor_cores(params):
        # FMA path: one input channel per step, 2048 fp32 accumulators (16 a thread at 4 warps).
        fma_bn = min(pow2_at_least(cout_g), 16)
        fma_plane = pow2_at_least(hw[0] * hw[1])
        sizes = dict.fromkeys(min(b, fma_plane) for b in (2048 // fma_bn // wg, 1024 // fma_bn // wg))
        fma = tuple(Config(bm, fma_bn, 1, block_w(hw, bm), 4, 2, use_dot=False, W_GROUP=wg) for bm in sizes)
        padded = ()
        if cout_g >= 8 and dtype == torch.float32 and precision == "tf32x3":
            # Under 8 input channels a layer is bound by its output, not the wasted products: tensor-core tiles
            # of one masked K step of 16; at exact grade only (at TF32 their error neared twice cuDNN's).
            padded = tuple(t for t in dict.fromkeys(tile(bm, 2, plane, block_k=16) for bm in (256, 128)) if t)
        # Head tiles first, as the untuned default: they beat the FMA tiles on nearly every head.
        return heads + fma + padded

    if flat and flat_unsupported(params, dtype, bk) is None:
        # Hopper, interpreter: flat tiles (whole padded rows: fplane), then 5-D TMA; only winners (each compiles).
        _, (_, _, wp) = flat_geometry(params)
        fplane = max(16, pow2_at_least(hw[0] * wp))
        plans = [(128, 3, fplane, {"flat": True}), (64, 4, fplane, {"flat": True}),
                 (128, 3, plane, {"tma": True}), (256, 3, plane, {"tma": True})]
        if esize == 4 and precision != "ieee" and 32 < cin_g <= 64 and (params.groups == 1 or cin_g == 64):
            # One 64-channel K step per tap instead of two of 32: wins on some such layers only.
            plans.append((128, 3, fplane, {"flat": True, "block_k": 64}))
        if gluon and (esize == 2 or precision == "tf32") and plane >= 64:  # wgmma: 64 rows per warpgroup
            # box_gemm_kernel (wgmma reads fp32 as TF32 only); last, as it runs on sm_90 alone.
            plans.append((128, 4, plane, {"flat": True, "gluon": True}))
    else:
        # No TMA (before Hopper, or flat_unsupported): pointer loads.
        plans = [(128, 3, plane, {}), (256, 3, plane, {}), (64, 4, plane, {}), (128, 4, plane, {})]
    configs = [c for c in dict.fromkeys(tile(bm, stages, bound, **kind) for bm, stages, bound, kind in plans) if c]
    # Merged groups: the first two tilings of each fold (the later ones never won).
    for f in group_folds(params):
        merged = candidate_configs(params.fold_groups(f), dtype, precision, channels_last_out, flat)
        configs += [replace(c, fold=f) for c in merged if isinstance(c, Config)][:2]
    return tuple(configs) + heads


def group_folds(params: ConvT3dParams) -> tuple[int, ...]:
    """Group merges (``fold_groups``) worth a candidate on tensor cores, as groups under 16 channels
    half-fill each MMA: the smallest reaching 16 on both sides, and the full one within a 128 tile."""
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    if g == 1 or not uses_tensor_cores(params) or (cin_g >= 16 and cout_g >= 16):
        return ()
    folds = [f for f in range(2, g + 1) if g % f == 0 and f * cin_g >= 16 and f * cout_g >= 16][:1]
    if g not in folds and params.in_channels <= 128 and params.out_channels <= 128:
        folds.append(g)
    return tuple(folds)


@dataclass
class TuneRecord:
    config: Config
    seconds: float
    timings_ms: dict[str, float]
    host_ms: dict[str, float] = field(default_factory=dict)  # host ms per call of each config
    failed: dict[str, str] = field(default_factory=dict)  # configs that raised on their first run


_tuned: dict[tuple, TuneRecord] = memo("engines.triton.configs.tuned")


@dataclass(frozen=True)
class CandidateFailure:
    """What a guarded tuning run returns instead of raising: the error of a candidate that could not run."""

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
    """Each config's cost per call in a stream of calls: the larger of its GPU median and host time."""
    return {k: max(v, host_ms.get(k, 0.0)) for k, v in timings.items()}


def _choose(key, configs: list[Config], run: Callable[[Config], None]) -> Config:
    rec = _tuned.get(key)
    if rec is not None:
        return rec.config
    if len(configs) == 1 or not _tuning_enabled():
        _tuned[key] = TuneRecord(configs[0], 0.0, {})
        return configs[0]
    t0 = time.perf_counter()
    timings, hosts, failed = {}, {}, {}
    if key not in precompile.compiled:
        precompile.compile_candidates(configs, run)
    for cfg in configs:
        outcome = run(cfg)  # compile (or load what the workers compiled) + warm
        if isinstance(outcome, CandidateFailure):
            # A candidate beyond this GPU's limits: the others decide (each run writes all of y).
            failed[cfg.short()] = outcome.error
            continue
        timings[cfg.short()] = gpu_ms(lambda: run(cfg), warmup=5, rep=30)
        hosts[cfg.short()] = host_ms(lambda: run(cfg), timings[cfg.short()])
    if not timings:
        raise RuntimeError("every tile configuration failed: " + "; ".join(f"[{k}] {v}" for k, v in failed.items()))
    configs = [c for c in configs if c.short() in timings]
    # Up to 3 candidates within 25% of the best are timed again in reverse order (lower median kept):
    # clock ramp must not decide between near-equal tiles.
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
    """(low padding, padded size) per dimension of flat_gemm_kernel's zero-haloed input: input i sits
    at i + max(0, -lo), where the taps' shifts q + off0 - j * ostep span [lo, hi]."""
    pads, sizes = [], []
    for a, q in zip(params.axes, params.compact_size):
        shifts = [ph.first_offset - j * a.offset_step for ph in a.phases for j in range(ph.num_taps)]
        lo, hi = (min(shifts), max(shifts)) if shifts else (0, 0)
        pad = max(0, -lo)
        pads.append(pad)
        sizes.append(pad + max(a.in_size, q + hi))
    return tuple(pads), tuple(sizes)


def flat_unsupported(params: ConvT3dParams, dtype: torch.dtype, block_k: int) -> str | None:
    """Why flat_gemm_kernel cannot run a call, or None: TMA needs 16-byte aligned rows and int32
    coordinates, and a channel block must not read the next group's (in-bounds) channels."""
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
    return next((r for r in (0, 1) if w_group == 2 and params.axes[2].phases[r].num_taps == 0), -1)
