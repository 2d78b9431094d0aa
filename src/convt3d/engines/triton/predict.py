"""Predicted, then confirmed: the tuner times a shortlist (``pick`` of ``rank``), ranked by the GPU architecture's
tuning table (``tables/sm<major><minor>.json``, from ``tools/tuning_table.py --merge``). Opt-in
(``CONVT3D_TUNE=predicted``): its choice is slower than the exhaustive tuner's on the suites' layers."""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import warnings
from pathlib import Path

import torch

from ...core.params import ConvT3dParams
from .head import MAX_HEAD_CHANNELS

TABLES = Path(__file__).with_name("tables")
ENV_MODE = "CONVT3D_TUNE"
MODES = ("exhaustive", "predicted")  # the first is the default
SHORTLIST = 3  # candidates compiled and timed at a first call (one per family, at least)
NEIGHBOURS = 8  # recorded layers whose costs rank a candidate kind
WEIGHTS = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5)  # per feature: M, N, K, taps, phases, groups, width
OTHER_REGIME = 4.0  # distance added for another dtype class, precision, layout or head/GEMM side
OTHER_DTYPE = 0.5  # distance added for another 16-bit type


def _field(cfg, name: str, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def label(cfg, k_range: tuple[int, int] = (0, 0)) -> str:
    """A candidate's kind, the same across layers: family, tile rows, stages and flags, with marks of a
    narrower N or an unusual K step (``k_range``: the family's least and widest BLOCK_K)."""
    head = _field(cfg, "head", "")
    if head:
        s = f"{head} M{_field(cfg, 'BLOCK_M')} s{_field(cfg, 'num_stages')} w{_field(cfg, 'num_warps')}"
        flags = [("persist", "p"), ("w_packed", "wpk"), ("n_joint", "nj"), ("x_cl", "xcl"), ("BOX_H", "box")]
        s += "".join(f" {tag}" for name, tag in flags if _field(cfg, name))
        s += f" sn{_field(cfg, 'shifts_n')}" + ("" if _field(cfg, "use_dot") else " fma")
        s += " n64" if _field(cfg, "BLOCK_N") == 64 else ""
        return s + (" halfK" if _field(cfg, "BLOCK_K") < k_range[1] else "")
    s = f"{'dot' if _field(cfg, 'use_dot') else 'fma'} M{_field(cfg, 'BLOCK_M')} s{_field(cfg, 'num_stages')}"
    s += "".join(f" {name}" for name in ("tma", "flat", "gluon") if _field(cfg, name))
    s += " fold" if _field(cfg, "fold", 1) > 1 else ""
    return s + (" wideK" if _field(cfg, "BLOCK_K") > k_range[0] else "")


def labels(configs) -> list[str]:
    """``label`` of each candidate, its K step marked against the others of its family."""
    ks: dict[str, list[int]] = {}
    for c in configs:
        ks.setdefault(_field(c, "head", ""), []).append(_field(c, "BLOCK_K"))
    return [label(c, (min(ks[_field(c, "head", "")]), max(ks[_field(c, "head", "")]))) for c in configs]


def features(params: ConvT3dParams) -> list[float]:
    """log2 of the GEMM's M (compact positions), N and K per group, mean taps, phases, groups, width."""
    m = params.batch * math.prod(params.compact_size)
    taps = sum(ph.num_taps for ph in params.phases) / max(1, params.num_phases)
    return [math.log2(max(1, m)), math.log2(params.out_channels_per_group), math.log2(params.in_channels_per_group),
            math.log2(1 + taps), math.log2(params.num_phases), math.log2(params.groups),
            math.log2(params.out_size[2])]


def regime(dtype: str, precision: str, channels_last: bool, params: ConvT3dParams) -> list:
    """What a recorded layer must share with a call to count as near: dtype class, precision, layout, head side."""
    head = params.out_channels_per_group <= MAX_HEAD_CHANNELS
    return [dtype == "float32", precision if dtype == "float32" else "tf32", bool(channels_last), head]


def params_of(row: dict) -> ConvT3dParams:
    """The layer of a ``tools/tuning_table.py`` row."""
    geometry = (tuple(row[k]) for k in ("in_size", "kernel_size", "stride", "padding", "output_padding", "dilation"))
    return ConvT3dParams.create(row["batch"], row["in_channels"], row["out_channels"], row["groups"], *geometry)


def charged_ms(candidate: dict) -> float:
    """A recorded candidate's cost as the tuner charges it (configs.host_charged): max of GPU median and host time."""
    return max(candidate["ms"], candidate.get("host_ms") or 0.0)


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


@functools.lru_cache(maxsize=8)
def table_for(arch: str) -> list[dict] | None:
    """The tuning table of an architecture, or None if none ships."""
    path = TABLES / f"{arch}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["layers"]


def rank(configs, params: ConvT3dParams, dtype: torch.dtype, precision: str, channels_last: bool,
         table: list[dict]) -> list[int]:
    """Candidate indices, best predicted first: each kind's mean log cost ratio over the nearest recorded
    layers that had it (nearer ones weigh more); unseen kinds follow in their listed order."""
    names = labels(configs)
    dname = str(dtype).replace("torch.", "")
    me = regime(dname, precision, channels_last, params)
    f = features(params)
    near = sorted((math.sqrt(sum(w * (a - b) ** 2 for w, a, b in zip(WEIGHTS, f, row["features"])))
                   + (0.0 if row["regime"] == me else OTHER_REGIME)
                   + (0.0 if row["dtype"] == dname else OTHER_DTYPE), i) for i, row in enumerate(table))
    score = {}
    for name in dict.fromkeys(names):
        costs = ((1.0 / (0.3 + d), table[i]["costs"].get(name)) for d, i in near)
        seen = list(itertools.islice(((w, c) for w, c in costs if c is not None), NEIGHBOURS))
        den = sum(w for w, _ in seen)
        score[name] = sum(w * c for w, c in seen) / den if den else math.inf
    return sorted(range(len(configs)), key=lambda i: (score[names[i]], i))


def tune_mode() -> str:
    """``$CONVT3D_TUNE``; an unknown value warns once and times every candidate."""
    mode = os.environ.get(ENV_MODE, MODES[0])
    if mode not in MODES:
        _warn_unknown_mode(mode)
        return MODES[0]
    return mode


@functools.cache
def _warn_unknown_mode(mode: str) -> None:
    warnings.warn(f"{ENV_MODE}={mode!r} is not one of {MODES}; every tile candidate is timed", stacklevel=3)


def shortlist(configs: tuple, params: ConvT3dParams, dtype: torch.dtype, precision: str, channels_last: bool,
              device: torch.device) -> tuple:
    """The candidates a first call times: ``pick`` of ``rank`` with CONVT3D_TUNE=predicted and a table, else all."""
    if len(configs) <= SHORTLIST or tune_mode() != "predicted":
        return configs
    table = table_for(arch_of(device)) if device.type == "cuda" else None
    if table is None:
        return configs
    order = rank(configs, params, dtype, precision, channels_last, table)
    return tuple(configs[i] for i in pick(configs, order))


def pick(configs, order: list[int]) -> list[int]:
    """From a ranking, the best of each family, then the next best up to SHORTLIST, in ranked order."""
    picked = []
    for i in order:
        if _field(configs[i], "head", "gemm") not in {_field(configs[j], "head", "gemm") for j in picked}:
            picked.append(i)
    picked += [i for i in order if i not in picked][:max(0, SHORTLIST - len(picked))]
    return sorted(picked, key=order.index)


def write_tables(paths: list[str]) -> str:
    """Write ``tables/<arch>.json`` from ``tools/tuning_table.py`` runs: per timed layer, its features,
    regime and each candidate kind's log cost ratio to the best (costs charged as the tuner does)."""
    by_arch: dict[str, list[dict]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            cands = [c for c in r.get("candidates", []) if c.get("ms")]
            if not cands:
                continue
            params = params_of(r)
            cost = [charged_ms(c) for c in cands]
            best = min(cost)
            costs = {}
            for name, c in zip(labels([c["config"] for c in cands]), cost):
                costs[name] = min(costs.get(name, math.inf), round(math.log(c / best), 4))
            by_arch.setdefault(r.get("arch", "sm90"), []).append(dict(
                features=[round(v, 4) for v in features(params)], dtype=r["dtype"],
                regime=regime(r["dtype"], r["precision"], r["channels_last"], params),
                costs=costs, gpu=r.get("gpu", "")))
    TABLES.mkdir(exist_ok=True)
    for arch, rows in by_arch.items():
        (TABLES / f"{arch}.json").write_text(json.dumps({"arch": arch, "layers": rows}, separators=(",", ":")) + "\n")
    table_for.cache_clear()
    return ", ".join(f"{arch}: {len(rows)} layers" for arch, rows in by_arch.items())
