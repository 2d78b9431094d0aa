"""Backward of ``convt3d.conv_transpose3d`` (dX, dW, db), deterministic at the forward's precision. On CUDA a
signature's first backward times cuDNN against each gradient's Triton tiles (dX: ``kernels/dgrad_bwd.py``; heads:
``head_backward``), keeping a tile only if it wins by more than ``_MARGIN`` (saved in the cache file).
``$CONVT3D_BWD_INPUT`` and ``$CONVT3D_BWD_WEIGHT`` force "cudnn" or "triton" (dW's Triton kernels: heads only)."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from ...dispatch import cache as disk_cache
from . import head_backward as HB
from . import precompile
from ...core.flags import set_backend_flag
from ..torch.calls import torch_grads
from ...core.errors import BackendUnavailableError
from ...core.params import ConvT3dParams, cdiv, pow2_at_least
from ...dispatch.timing import gpu_ms
from .kernels import dgrad_bwd
from .configs import _tuning_enabled, device_name, uses_tensor_cores
from ...core.call import suggests_channels_last
from .sites import _INT32_MAX, Site, _prepare_padded_input, require_interpreter, site
from ...core.memo import memo

WGRAD_IMPLS = ("cudnn", "triton")
_FORCE_ENV = "CONVT3D_BWD_WEIGHT"
_FORCE_ENV_X = "CONVT3D_BWD_INPUT"


@dataclass(frozen=True)
class DgradConfig:
    BLOCK_M: int  # input positions of one (n, id) plane, flattened (ih, iw)
    BLOCK_N: int  # input channels of a group
    BLOCK_K: int  # output channels of a group per step (one tap per step)
    num_warps: int
    num_stages: int

    def short(self) -> str:
        return f"M{self.BLOCK_M} N{self.BLOCK_N} K{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"


@dataclass
class Choice:
    impl: str  # "cudnn" | "triton"
    config: DgradConfig | HB.HeadDgradConfig | HB.HeadWgradConfig | None
    seconds: float  # tuning time (0 for a static choice)
    timings_ms: dict[str, float]
    reason: str


_choices: dict[tuple, Choice] = memo("engines.triton.backward.choices")  # dW
_dgrad_choices: dict[tuple, Choice] = memo("engines.triton.backward.dgrad_choices")  # dX


def choices() -> dict[tuple, Choice]:
    """dW implementation chosen per call signature in this process (for the bench and tests)."""
    return dict(_choices)


def dgrad_choices() -> dict[tuple, Choice]:
    """dX implementation chosen per call signature in this process (same keys as :func:`choices`)."""
    return dict(_dgrad_choices)


def clear_caches() -> None:
    _choices.clear()
    _dgrad_choices.clear()
    _plans.clear()


def differentiable_grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, params: ConvT3dParams, precision: str,
                         mask: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """(dX, dW, db) by ``convolution_backward``, which autograd can differentiate (``create_graph``)."""
    return _torch_grads(dy, x, w, params, precision, *mask)


def grad_formats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.memory_format, torch.memory_format]:
    """Memory formats of (dX, dW): each follows its own tensor, so autograd never re-lays one out."""
    return tuple(torch.channels_last_3d if suggests_channels_last(t) else torch.contiguous_format for t in (x, w))


def _torch_grads(dy, x, w, params, precision, need_x, need_w, need_b=False):
    """dX and/or dW (and db) by PyTorch's kernels in one call, as autograd does for ConvTranspose3d, with
    cuDNN's deterministic algorithms (the TF32 flag is the precision's: ``torch_grads``)."""
    old = torch.backends.cudnn.deterministic
    if not old:
        set_backend_flag(torch.backends.cudnn, "deterministic", True)
    try:
        return torch_grads(dy, x, w, params, precision, (need_x, need_w, need_b))
    finally:
        if torch.backends.cudnn.deterministic != old:
            set_backend_flag(torch.backends.cudnn, "deterministic", old)


def dgrad_candidates(params: ConvT3dParams, dtype: torch.dtype, device: torch.device,
                     precision: str = "tf32") -> tuple[DgradConfig, ...]:
    """Tile configurations of ``dgrad_kernel`` (the first is the default), capped by the channels.
    128 x 128 tiles use 8 warps (4 spill at two-level fp32), 4 at "tf32" (8 serialise its wgmma)."""
    bn_max = max(16, min(128, pow2_at_least(params.in_channels_per_group)))
    bk_max = max(16, min(64, pow2_at_least(params.out_channels_per_group)))
    hw = params.in_size[1] * params.in_size[2]
    if device.type != "cuda":
        # The interpreter is slow per program step whatever the tile: small tiles.
        shapes = ((min(32, max(16, pow2_at_least(hw))), 16, 16, 4, 1),)
    else:
        # One tile per regime: every tile timed costs a compilation at a signature's first backward.
        shapes = (
            (128, 64, 32, 4, 4),   # default
            (128, 128, 64, 8, 3),  # large 16-bit layers: one 128-byte row per channel block
            (128, 128, 32, 8, 4),  # large fp32 layers (tf32 runs it on 4 warps, below)
        )
    tf32_mma = dtype == torch.float32 and precision == "tf32"
    out = []
    for bm, bn, bk, warps, stages in shapes:
        bn, bk = min(bn, bn_max), min(bk, bk_max)
        if bm * bn < 128 * 128 or tf32_mma:
            warps = min(warps, 4)
        while stages > 1 and stages * (bm * bk + bk * bn) * dtype.itemsize > 160 * 1024:
            stages -= 1
        out.append(DgradConfig(bm, bn, bk, warps, stages))
    return tuple(dict.fromkeys(out))


def _dy_in_place_ok(dy: torch.Tensor, params: ConvT3dParams) -> bool:
    """dY can be read as it is: channels innermost (K-major) and in-slice offsets in 32 bits."""
    st = dy.stride()
    if (st[1] != 1 and dy.shape[1] != 1) or any(v < 0 for v in st):
        return False
    (oh, ow), (ph, pw) = params.out_size[1:], params.padding[1:]
    span = (oh + 2 * ph + 1) * st[3] + (ow + 2 * pw + 1) * st[4] + (params.out_channels - 1) * st[1]
    return span <= _INT32_MAX


def _pack_dgrad(w: torch.Tensor, params: ConvT3dParams, round_tf32: bool) -> torch.Tensor:
    """The dgrad kernel's packed weight [G, taps, Cin/g, Cout/g]."""
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    taps = math.prod(params.kernel_size)
    if w.stride()[2:] != (w.shape[3] * w.shape[4], w.shape[4], 1):
        w = w.contiguous()  # the kernel reads each (ci, co) row's taps as one contiguous run

    def build():
        # Blocks of 32 output channels by up to 64 taps (k3: 27 of 32, k4: 64): 4 warps.
        block_co, block_t = min(32, pow2_at_least(cout_g)), min(64, pow2_at_least(taps))
        return Site("pack_dgrad_weight_kernel", (cin_g * cdiv(cout_g, block_co) * cdiv(taps, block_t), g),
                    (cin_g, cout_g, taps, w.stride(0), w.stride(1)),
                    dict(ROUND_TF32=round_tf32, BLOCK_CO=block_co, BLOCK_T=block_t, num_warps=4), dgrad_bwd)

    packed = torch.empty((g, taps, cin_g, cout_g), dtype=w.dtype, device=w.device)
    site(("pack_dgrad_weight", params, w.stride(), round_tf32), build).launch(w.device, w, packed)
    return packed


def dgrad_triton(dy: torch.Tensor, w: torch.Tensor, params: ConvT3dParams, precision: str, x_dtype: torch.dtype,
                 config: DgradConfig | HB.HeadDgradConfig | None = None,
                 x_format: torch.memory_format = torch.contiguous_format,
                 dyp: torch.Tensor | None = None) -> torch.Tensor:
    """dX in ``x_format`` by ``dgrad_kernel``, or by the head kernels for a ``HeadDgradConfig``."""
    if isinstance(config, HB.HeadDgradConfig):
        return HB.head_dgrad(dy, w, params, precision, x_dtype, config, x_format, dyp=dyp)
    require_interpreter(dy.device, "the Triton input-gradient kernel")
    cfg = config or dgrad_candidates(params, w.dtype, dy.device, precision)[0]
    round_tf32 = w.dtype == torch.float32 and precision == "tf32"
    if dy.dtype != w.dtype:
        dy = dy.to(w.dtype)
    round_a = False
    if _dy_in_place_ok(dy, params):
        round_a = round_tf32  # rounded by the GEMM kernel as it reads dY
    elif round_tf32:
        # One pass: NDHWC copy and TF32 rounding (the forward's padded copy, without a halo).
        dy = _prepare_padded_input(dy, ((0, 0, 0), tuple(dy.shape[2:])), True).permute(0, 4, 1, 2, 3)
    else:
        dy = dy.contiguous(memory_format=torch.channels_last_3d)

    packed = _pack_dgrad(w, params, round_tf32)
    dx = torch.empty(params.in_shape, dtype=x_dtype, device=dy.device, memory_format=x_format)

    def build():
        g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
        is_fp32 = dy.dtype == torch.float32
        tiles_m = cdiv(params.in_size[1] * params.in_size[2], cfg.BLOCK_M)
        tiles_n = cdiv(cin_g, cfg.BLOCK_N)
        return Site("dgrad_kernel", (g * params.batch * params.in_size[0] * tiles_m * tiles_n,), (
            params.batch, cin_g, cout_g, *params.in_size, *params.out_size, *params.kernel_size, g,
            *dy.stride(), *dx.stride(), *params.stride, *params.padding, *params.dilation, tiles_m, tiles_n,
        ), dict(
            PRECISION=precision if is_fp32 else "tf32", ROUND_A=round_a, TWO_LEVEL=is_fp32 and precision != "tf32",
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ), dgrad_bwd)

    key = ("dgrad", params, cfg, dy.stride(), dx.stride(), dy.dtype, precision, round_a)
    site(key, build).launch(dy.device, dy, packed, dx)
    return dx


def _triton_dgrad_ok(params: ConvT3dParams) -> bool:
    """dgrad_kernel takes the layer: channels at the tensor-core threshold (below it cuDNN only) and 32-bit
    in-slice offsets (dY with padding overhang, dX, a group's weight)."""
    (oh, ow), (ph, pw), (h, w) = params.out_size[1:], params.padding[1:], params.in_size[1:]
    y_span = ((oh + 2 * ph + 1) * (ow + 2 * pw + 1) + 1) * params.out_channels
    w_span = math.prod(params.kernel_size) * params.in_channels_per_group * params.out_channels_per_group
    return uses_tensor_cores(params) and max(y_span, h * w * params.in_channels, w_span) <= _INT32_MAX


def recorded_choices(x, w, params, precision) -> list[tuple[str, Choice]]:
    """("dX" | "dW", choice) made in this process for a forward signature (``convt3d.explain``)."""
    want = (str(x.device), x.dtype, precision, params, x.stride())
    return [(what, rec) for what, made in (("dX", _dgrad_choices), ("dW", _choices))
            for key, rec in made.items() if key[:5] == want and key[6] == w.stride()]


_MARGIN = 0.03  # a Triton tile replaces cuDNN only when faster by more: medians move by 1-2% between runs


def _time_choice(cands: tuple, run_cudnn, run_triton) -> Choice:
    """Time cuDNN and each Triton candidate; a candidate that raises is left out, named in the reason."""
    t0 = time.perf_counter()
    precompile.compile_candidates(cands, run_triton)
    runs = {"cudnn": (None, run_cudnn), **{f"triton {c.short()}": (c, lambda c=c: run_triton(c)) for c in cands}}
    timings, failed = {}, {}
    for label, (cfg, fn) in runs.items():
        try:
            fn()  # compile + warm
            timings[label] = gpu_ms(fn, warmup=5, rep=25)
        except Exception as exc:  # noqa: BLE001 -- one candidate's failure only removes it
            if cfg is None:
                raise  # cuDNN itself failed: PyTorch's own backward would fail the same way
            failed[label] = f"{type(exc).__name__}: {exc}"[:200]
    best = min(timings, key=timings.get)
    if best != "cudnn" and not timings[best] * (1.0 + _MARGIN) < timings["cudnn"]:
        best = "cudnn"
    reason = f"timed: {best} fastest" + (f" (beyond a {_MARGIN:.0%} margin)" if best != "cudnn" else "")
    if failed:
        reason += "; failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
    return Choice("cudnn" if best == "cudnn" else "triton", runs[best][0], time.perf_counter() - t0, timings, reason)


def _entry_from_choice(rec: Choice, cands: tuple) -> dict:
    """The disk-cache entry of a timed choice (``convt3d.dispatch.cache``, section "backward")."""
    config = None if rec.config is None else {"type": type(rec.config).__name__,
                                              "fields": disk_cache.config_to_dict(rec.config)}
    return {"impl": rec.impl, "config": config, "timings_ms": dict(rec.timings_ms), "tuning_s": rec.seconds,
            "candidates": [c.short() for c in cands]}


def _choice_from_entry(entry: dict | None, cands: tuple) -> Choice | None:
    """A cached choice, if it was made among exactly the current candidates and names one of them
    (nothing in the file is trusted: a foreign tile could compute wrong values); else None."""
    if not isinstance(entry, dict) or entry.get("candidates") != [c.short() for c in cands]:
        return None
    timings = entry.get("timings_ms")
    timings = dict(timings) if isinstance(timings, dict) else {}
    if entry.get("impl") == "cudnn" and entry.get("config") is None:
        return Choice("cudnn", None, 0.0, timings, "cached: cudnn fastest (timed by an earlier process)")
    cfg = entry.get("config")
    if entry.get("impl") != "triton" or not isinstance(cfg, dict):
        return None
    # The same fields can name tiles of two kernels (DgradConfig, HeadDgradConfig): match the type too.
    c = disk_cache.config_from_dict(cfg.get("fields"), [c for c in cands if type(c).__name__ == cfg.get("type")])
    if c is None:
        return None
    return Choice("triton", c, 0.0, timings, f"cached: triton {c.short()} fastest (timed by an earlier process)")


def _can_time(x: torch.Tensor, supported: bool) -> bool:
    """Whether this call may time its candidates (CUDA, a capable kernel, tuning on, no capture)."""
    return x.device.type == "cuda" and supported and _tuning_enabled() and not torch.cuda.is_current_stream_capturing()


def _choose(cache: dict, env: str, what: str, supported: bool, candidates, run_cudnn, run_triton,
            dy, x, w, params, precision) -> Choice:
    """The per-signature choice of one gradient; without timing cuDNN (no Triton tile wins widely)."""
    forced = os.environ.get(env) or None
    if forced == "torch":
        forced = "cudnn"
    if forced is not None:
        if forced not in WGRAD_IMPLS:
            raise ValueError(f"environment variable {env}={forced!r} is not {'an' if what == 'input' else 'a'} "
                             f"{what}-gradient implementation; expected one of {WGRAD_IMPLS}")
        if forced == "triton" and not supported:
            raise BackendUnavailableError(
                f"{env}=triton cannot run this call: the Triton {what}-gradient kernels need at least 8 input "
                f"and output channels per group, or at least {HB.MIN_IN_PER_GROUP} input and at most "
                f"{HB.MAX_OUT_PER_GROUP} output channels per group (the head kernels)")
        cfg = candidates()[0] if forced == "triton" else None
        return Choice(forced, cfg, 0.0, {}, f"${env}={forced}")
    # The signature; ``recorded_choices`` reads this layout.
    key = (str(x.device), x.dtype, precision, params, x.stride(), dy.stride(), w.stride())
    rec = cache.get(key)
    if rec is not None:
        return rec
    if not _can_time(x, supported):
        why = ("static rule (no timing: CPU, graph capture or CONVT3D_AUTOTUNE=0)" if supported
               else f"static rule (no Triton {what}-gradient kernel takes this layer)")
        rec = Choice("cudnn", None, 0.0, {}, why)
        if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
            cache[key] = rec
        return rec
    gpu = device_name(x.device)
    # The cache file's key; "deterministic=True" stays in it so that earlier entries stay valid.
    name = (f"bwd-{what}|{x.dtype}|{precision}|{params}|{tuple(x.stride())}|{tuple(dy.stride())}|"
            f"{tuple(w.stride())}|deterministic=True")

    def decide() -> Choice:
        # The disk cache first (only rank 0's file counts under torch.distributed), then timing.
        cands = tuple(candidates())
        rec = _choice_from_entry(disk_cache.store_for(gpu).get("backward", name), cands)
        if rec is None:
            rec = _time_choice(cands, run_cudnn, run_triton)
            disk_cache.store_for(gpu).put("backward", name, _entry_from_choice(rec, cands))
        return rec

    # Under torch.distributed every rank takes rank 0's choice; a tile this rank does not offer
    # (another GPU model) is never run: it times for itself.
    from ...dispatch import distributed

    rec = distributed.agree(decide, name)
    if rec.config is not None and rec.config not in candidates():
        with distributed.local():
            rec = _time_choice(tuple(candidates()), run_cudnn, run_triton)
    cache[key] = rec
    return rec


def wgrad_choice_candidates(params, dtype, device) -> tuple:
    """The Triton dW tiles the choice times (the first runs when forced): the head kernels', heads only."""
    return HB.wgrad_candidates(params, dtype, device) if HB.supports(params) else ()


def wgrad_unavailable(params: ConvT3dParams) -> str | None:
    """Why ``$CONVT3D_BWD_WEIGHT=triton`` cannot run this layer's dW (it is no output head), or None: a
    forced implementation never silently runs another."""
    why = HB.unsupported_reason(params)
    if os.environ.get(_FORCE_ENV) != "triton" or why is None:
        return None
    return f"{_FORCE_ENV}=triton cannot run this call: the Triton weight-gradient kernels take output heads only ({why})"


def dgrad_choice_candidates(params, dtype, device, precision) -> tuple:
    """The Triton dX tiles the choice times: the general kernel's (the first forced), then the head's."""
    general = dgrad_candidates(params, dtype, device, precision) if _triton_dgrad_ok(params) else ()
    head = HB.dgrad_candidates(params, dtype, device) if HB.supports(params) else ()
    return general + head


def choose_wgrad(dy, x, w, params, precision) -> Choice:
    why = wgrad_unavailable(params)
    if why is not None:
        raise BackendUnavailableError(why)
    return _choose(_choices, _FORCE_ENV, "weight", HB.supports(params),
                   lambda: wgrad_choice_candidates(params, x.dtype, x.device),
                   lambda: _torch_grads(dy, x, w, params, precision, False, True)[1],
                   lambda cfg: HB.head_wgrad(dy, x, params, precision, w.dtype, cfg),
                   dy, x, w, params, precision)


def choose_dgrad(dy, x, w, params, precision) -> Choice:
    fx = grad_formats(x, w)[0]
    return _choose(_dgrad_choices, _FORCE_ENV_X, "input", _triton_dgrad_ok(params) or HB.supports(params),
                   lambda: dgrad_choice_candidates(params, w.dtype, x.device, precision),
                   lambda: _torch_grads(dy, x, w, params, precision, True, False)[0],
                   lambda cfg: dgrad_triton(dy, w, params, precision, x.dtype, cfg, fx),
                   dy, x, w, params, precision)


# A backward signature's decisions per call key (with the env overrides): small layers are host-bound.
_ENV_KEYS = (_FORCE_ENV, _FORCE_ENV_X, "CONVT3D_AUTOTUNE")
_plans: dict[tuple, tuple] = memo("engines.triton.backward.plans")


def _plan(dy, x, w, params, precision, mask) -> tuple:
    """(dX format, dW format, dX choice or None, dW choice or None) for this call."""
    key = (x.device, x.dtype, precision, params, x.stride(), dy.stride(), w.stride(), mask,
           tuple(os.environ.get(k) for k in _ENV_KEYS))
    p = _plans.get(key)
    if p is None:
        fx, fw = grad_formats(x, w)
        ximpl = choose_dgrad(dy, x, w, params, precision) if mask[0] else None
        wimpl = choose_wgrad(dy, x, w, params, precision) if mask[1] else None
        p = (fx, fw, ximpl, wimpl)
        # Choices made without timing during graph capture are provisional: not cached.
        if x.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            if len(_plans) >= 4096:
                _plans.clear()
            _plans[key] = p
    return p


def grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, params: ConvT3dParams, precision: str,
          mask: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dX, dW, db) for the True entries of ``mask`` (else None), dX and dW in :func:`grad_formats`."""
    need_x, need_w, need_b = mask
    gx = gw = gb = None
    fx, fw, ximpl, wimpl = _plan(dy, x, w, params, precision, mask)
    use_torch_x = ximpl is not None and ximpl.impl == "cudnn"
    use_torch_w = wimpl is not None and wimpl.impl == "cudnn"
    if use_torch_x or use_torch_w:
        # Those on cuDNN: one convolution_backward call computes them and db, as PyTorch's autograd.
        gx, gw, gb = _torch_grads(dy, x, w, params, precision, use_torch_x, use_torch_w, need_b)
        need_b = False
    dyp = None
    if (need_x and need_w and not use_torch_x and not use_torch_w and isinstance(ximpl.config, HB.HeadDgradConfig)
            and w.dtype == x.dtype and bool(ximpl.config.BLOCK_W) == bool(wimpl.config.BLOCK_W)):
        # Both head kernels (every Triton dW tile is a head's) read the same copy of dY: one copy for the two.
        dyp = HB.dy_operand(dy, params, x.dtype, ximpl.config, precision)
    if need_x and not use_torch_x:
        gx = dgrad_triton(dy, w, params, precision, x.dtype, ximpl.config, fx, dyp=dyp)
    if need_w and not use_torch_w:
        gw = HB.head_wgrad(dy, x, params, precision, w.dtype, wimpl.config, dyp=dyp)
    if need_b:
        # fp32 accumulation for 16-bit dY, as PyTorch's bias gradient.
        gb = dy.sum(dim=(0, 2, 3, 4), dtype=torch.float32).to(dy.dtype)
    # The Triton kernels write dX in fx and dW contiguous; cuDNN's may come in either layout.
    if use_torch_x:
        gx = gx.contiguous(memory_format=fx)
    if gw is not None and (use_torch_w or fw != torch.contiguous_format):
        gw = gw.contiguous(memory_format=fw)
    return gx, gw, gb
