"""The Triton engine's launcher: support checks, the plan of a call signature, its launches (tuned on
the first call, then replayed) and ``forward``; CPU tensors run the kernels in Triton's interpreter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...core.call import PRECISIONS, output_memory_format
from ...core.epilogue import CHANNEL, SCALAR, Epilogue
from ...core.errors import BackendUnavailableError
from ...core.memo import memo
from ...core.params import ConvT3dParams
from . import head as head_engine
from . import predict
# The tuner's names are read here by dispatch.distributed and the persisted results.
from .configs import (Config, TuneRecord, _choose, _tune_key, _tuned, candidate_configs, flat_geometry,
    tuned_config, tuning_log, uses_tensor_cores)
from .sites import (Site, _fill_planes_site, _fill_rows_site, _flat_descriptors, _flat_site, _head_site,
    _operands_site, _gemm_operands, _pack_site, _pack_weight, _phase_site, _prepare_input, _sites, _tables,
    _tma_capable, _w_descriptor, _x_descriptor, companion_masks, empty_planes, empty_rows, phase_table,
    slice_offsets_fit, gluon_capable, _box_site, _box_descriptors)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_unsupported: dict[tuple, str | None] = memo("engines.triton.engine.unsupported")


def unsupported_reason(x: torch.Tensor, params: ConvT3dParams | None = None) -> str | None:
    """Why the Triton engine cannot run this call, or None; memoised, as small layers are host-bound."""
    key = (params, x.dtype, x.device, x.stride())
    if key not in _unsupported:
        if len(_unsupported) >= 4096:
            _unsupported.clear()
        _unsupported[key] = _unsupported_reason(x, params)
    return _unsupported[key]


def _unsupported_reason(x: torch.Tensor, params: ConvT3dParams | None) -> str | None:
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} (the Triton engine runs float32, float16 and bfloat16)"
    if x.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(x.device)
        if major < 8:
            return f"GPU {torch.cuda.get_device_name(x.device)} (compute capability {major}.x; needs 8.0+)"
    elif x.device.type != "cpu":  # CPU runs Triton's interpreter
        return f"device type {x.device.type!r}"
    if params is not None:
        c, w, co, ow = params.in_channels, params.in_size[2], params.out_channels, params.out_size[2]
        pad = 256 + max(params.kernel_size) * max(params.dilation)
        xs = x.stride() if x.dim() == 5 else (0,) + x.stride()
        # The kernel reads x or its NDHWC copy: check the larger.
        x_strides = (0, max(xs[1], 1), 0, max(xs[3], w * c), max(xs[4], c))
        y_strides = (0, 0, 0, ow * co, co) if co > 1 else (0, 0, 0, ow, 1)
        if not slice_offsets_fit(params, x_strides, y_strides, pad):
            return "a depth slice of the input or output spans more than 2^31 elements"
    return None


def epilogue_configs(configs: tuple, epi: Epilogue | None = None, params: ConvT3dParams | None = None
                     ) -> tuple[Config, ...]:
    """The candidates that take ``epi``: phase and flat GEMM tiles (not Gluon boxes, not head tiles), for a channel
    softmax those whose N tile holds every output channel (groups 1)."""
    whole = epi is not None and epi.over_channels
    return tuple(c for c in configs if isinstance(c, Config) and not c.gluon
                 and (not whole or (params.groups == 1 and c.BLOCK_N >= params.out_channels)))


def epilogue_reason(params: ConvT3dParams, x: torch.Tensor, weight: torch.Tensor, precision: str,
                    epi: Epilogue | None = None) -> str | None:
    """Why the engine cannot fuse ``epi`` into this call, or None (``unsupported_reason`` comes first)."""
    if any(ph.num_taps == 0 for a in params.axes[:2] for ph in a.phases):
        # fill_rows/fill_planes and companion rows write those bias-only rows without the program.
        return ("output rows that no tap reaches (along depth or height, a kernel below the stride or a dilation "
                "sharing a factor with it) take no epilogue")
    if epilogue_configs(plan(params, x, weight, precision).configs, epi, params):
        return None
    if epi is not None and epi.over_channels:
        return "the channel softmax needs groups=1 and one GEMM tile as wide as the channels"
    return "no phase or flat GEMM tile for this layer (output-head tiles take no epilogue)"


def clear_caches() -> None:
    """Forget tuning results, plans and phase tables of this process."""
    for d in (_unsupported, _tuned, _steps, _tables, _sites, _plans, _scalars):
        d.clear()
    _forget_settled()


def seed_tuning(key, config: Config, timings_ms: dict | None = None, replace: bool = False) -> None:
    """Use ``config`` for ``key`` untimed (persisted, or rank 0's); one this process has wins unless ``replace``."""
    if replace or key not in _tuned:
        _tuned[key] = TuneRecord(config, 0.0, dict(timings_ms or {}))
        _forget_settled()  # a signature settled on another config must see this one


@dataclass(frozen=True)
class Plan:
    """Everything about a call that depends only on its signature (cached per process)."""

    out_format: torch.memory_format
    configs: tuple[Config, ...]
    tune_key: tuple
    round_tf32: bool
    copy_input: bool
    dot_precision: str


@dataclass
class Launch:
    """A prepared call: the output, ``run(config)``, which launches and returns the main kernel's handle, and the
    candidates and tune key (an epilogue call tunes among its own candidates, under a key of its own)."""

    y: torch.Tensor
    run: Callable[[Config], object]
    plan: Plan
    configs: tuple[Config, ...]
    tune_key: tuple


def first_candidates(launch: Launch, params: ConvT3dParams, x: torch.Tensor, precision: str) -> tuple[Config, ...]:
    """What a signature's first call compiles and times: every candidate, or the predicted shortlist."""
    return predict.shortlist(launch.configs, params, x.dtype, precision,
                             launch.plan.out_format == torch.channels_last_3d, x.device)


_plans: dict[tuple, Plan] = memo("engines.triton.engine.plans")


def plan(params: ConvT3dParams, x: torch.Tensor, weight: torch.Tensor, precision: str) -> Plan:
    """The launcher's decisions for this call signature."""
    key = (params, x.dtype, x.device, x.stride(), weight.stride(), precision)
    p = _plans.get(key)
    if p is None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, but got precision={precision!r}")
        fmt = output_memory_format(x, weight)
        cl_out = fmt == torch.channels_last_3d
        use_dot = uses_tensor_cores(params)
        is_fp32 = x.dtype == torch.float32
        round_tf32 = is_fp32 and precision == "tf32" and use_dot
        # The MMA's K is the input channel, so tensor-core calls read an NDHWC copy of an NCDHW
        # input (tf32 wgmma takes no MN-major operand); the copy also rounds fp32 to TF32.
        copy_input = use_dot and (x.stride(1) != 1 or round_tf32)
        # 16-bit operands take "tf32": the chained-accumulate path of the kernel.
        p = Plan(fmt, candidate_configs(params, x.dtype, precision, cl_out, flat=_tma_capable(x.device),
                                        gluon=gluon_capable(x.device)),
                 _tune_key(params, x, precision, cl_out), round_tf32, copy_input,
                 precision if is_fp32 else "tf32")
        _plans[key] = p
    return p


class _Steps:
    """The launches of one (call signature, config), their sites resolved once: small layers are host-bound."""

    def __init__(self, params: ConvT3dParams, pl: Plan, cfg: Config, has_bias: bool, device: torch.device,
                 epi: int = 0):
        self.pl, self.cfg, self.has_bias = pl, cfg, has_bias
        self.epi = epi  # the fused epilogue program's code (0: none)
        if isinstance(cfg, head_engine.HeadConfig):
            self.params = params
            self.head = head_engine.HeadSteps(params, cfg, pl.dot_precision, has_bias, _head_site, _prepare_input)
            return
        self.params = params = params.fold_groups(cfg.fold) if cfg.fold > 1 else params
        self.head = None
        companions = cfg.companions and companion_masks(params) is not None
        self.tab = phase_table(params, device, cfg.W_GROUP, cfg.fill_separate or companions, companions)
        self.n_groups = self.tab.shape[0] // cfg.W_GROUP
        # Empty rows/planes are filled first on the same stream: KernelBench's copies hold no other.
        self.fill_site, self.fill_table = None, None
        if companions:
            self.fill_site, self.fill_table = _fill_planes_site, empty_planes(params, device)
        elif cfg.fill_separate:
            self.fill_site, self.fill_table = _fill_rows_site, empty_rows(params, device)
        if self.fill_table is not None and self.fill_table.shape[0] == 0:
            self.fill_site = None
        self.geo = flat_geometry(params) if cfg.flat else None
        # The grid of the input copy the GEMM reads (zero-haloed for flat configs); None: x in place.
        self.copy_geo = self.geo if cfg.flat else ((0, 0, 0), params.in_size) if pl.copy_input else None
        self.use_tma = cfg.tma and cfg.use_dot and _tma_capable(device)
        # Sites made at their first launch; ops: the input copy and the pack in one launch (copy_geo).
        self.fill = self.pack = self.ops = None
        self.gemm: dict[tuple[bool, bool], Site] = {}

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                epi: Epilogue | None = None) -> torch.Tensor:
        """A settled call: allocate the output and launch (``bias`` contiguous)."""
        y = _output(self.params, self.pl, x)
        self.call(x, weight, bias, y, epi)
        return y

    def call(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
             epi: Epilogue | None = None):
        """Every launch of a call onto ``y``: the input copy and weight pack (one launch), then ``run``."""
        ops = _epilogue_operands(epi, y)
        xp = None
        if self.head is not None:
            wp = weight.contiguous()  # head kernels read the weight as stored
        elif self.copy_geo is not None and self.n_groups > 0:
            if self.ops is None:
                self.ops = _operands_site(x, self.copy_geo, self.params, weight.contiguous(), self.pl.round_tf32,
                                          self.cfg.fold)
            wp, xp = _gemm_operands(x, weight, self.copy_geo, self.params, self.pl.round_tf32, self.ops)
        else:
            if self.pack is None:
                self.pack = _pack_site(self.params, weight.contiguous(), self.pl.round_tf32, self.cfg.fold)
            wp = _pack_weight(weight, self.params, self.pack)
        return self.run(x, wp, bias if bias is not None else wp, y, xp, ops)  # wp: dummy pointer without bias

    def run(self, x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
            xp: torch.Tensor | None = None, ops: tuple = ()):
        """Launch onto ``y`` from ``x`` (or its copy ``xp``), the packed weight ``wp``, the bias (or any tensor)
        ``b`` and the epilogue's ``ops``; returns the main kernel's handle (None when no phase has taps)."""
        if self.head is not None:
            return self.head.run(x, wp, b, y)
        params, cfg, dev = self.params, self.cfg, x.device
        if self.fill_site is not None:
            if self.fill is None:
                self.fill = self.fill_site(params, y, self.has_bias, self.fill_table)
            self.fill.launch(dev, y, b, self.fill_table)
        if self.n_groups == 0:
            return None
        if cfg.flat:
            # flat_gemm_kernel, or box_gemm_kernel (Gluon) on the same padded copy.
            gemm = self.gemm.get((True, True))
            if gemm is None:
                gemm = self.gemm[(True, True)] = (
                    _box_site(cfg, xp, y, self.n_groups, params, self.geo, self.has_bias) if cfg.gluon else
                    _flat_site(cfg, xp, y, self.n_groups, params, self.geo, self.has_bias, self.pl.dot_precision,
                               self.epi))
            descriptors = _box_descriptors if cfg.gluon else _flat_descriptors
            x_desc, w_desc = descriptors(cfg, xp, wp, params.in_channels_per_group)
            return gemm.launch(dev, x_desc, w_desc, b, y, self.tab, *(() if cfg.gluon else ops))
        xin = x if xp is None else xp.permute(0, 4, 1, 2, 3)
        x_arg = _x_descriptor(xin, params, cfg) if self.use_tma else None
        w_arg = _w_descriptor(wp, cfg) if self.use_tma else None
        which = (x_arg is not None, w_arg is not None)
        gemm = self.gemm.get(which)
        if gemm is None:
            gemm = self.gemm[which] = _phase_site(cfg, params, self.pl, xin, wp, y, self.n_groups, self.has_bias,
                                                  *which, self.epi)
        return gemm.launch(dev, xin if x_arg is None else x_arg, wp if w_arg is None else w_arg, b, y, self.tab, *ops)


_steps: dict[tuple, _Steps] = memo("engines.triton.engine.steps")
# Signature -> the steps of its tuned config: the steady state of ``forward``.
_steady: dict[tuple, _Steps] = memo("engines.triton.engine.steady")
# Bumped whenever settled signatures are forgotten; a ``steady_launcher`` is valid while it is unchanged.
_settled_epoch = [0]


def _forget_settled() -> None:
    _steady.clear()
    _settled_epoch[0] += 1


# (scalar values, device) -> their float32 vector there: a host-to-device copy waits for the stream.
_scalars: dict[tuple, torch.Tensor] = memo("engines.triton.engine.scalars")


def _epilogue_operands(epi: Epilogue | None, y: torch.Tensor) -> tuple:
    """The GEMM kernels' (scalars, per-channel table, residual) of a program, the residual at the output's
    strides (the kernels read it at the store's offsets); without one, ``y`` thrice as unread pointers."""
    if epi is None:
        return y, y, y
    key = (tuple(s.operand if s.form == SCALAR else 0.0 for s in epi.steps), y.device)
    scalars = _scalars.get(key)
    if scalars is None:
        if len(_scalars) >= 256:
            _scalars.clear()
        scalars = _scalars[key] = epi.scalars(y.device)
    # Without per-channel steps the kernels never read the table: the scalars stand in as its pointer.
    table = epi.channels(y.shape[1], y.device) if any(s.form == CHANNEL for s in epi.steps) else scalars
    res = epi.residual
    if res is None:
        res = y
    elif res.stride() != y.stride() or res.device != y.device:
        res = torch.empty_like(y, dtype=res.dtype).copy_(res)
    return scalars, table, res


def _kernel_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias contiguous: the kernels index it by channel alone."""
    return bias if bias is None or bias.is_contiguous() else bias.contiguous()


def _settled_key(x: torch.Tensor, weight: torch.Tensor, has_bias: bool, params: ConvT3dParams, precision: str):
    return (params, x.dtype, x.device, x.stride(), weight.stride(), has_bias, precision)


def steady_launcher(x: torch.Tensor, weight: torch.Tensor, has_bias: bool, params: ConvT3dParams,
                    precision: str):
    """(run, alive) of a settled signature, else None: ``forward``'s steady path without its lookup, and
    whether the signature is still settled."""
    st = _steady.get(_settled_key(x, weight, has_bias, params, precision))
    if st is None:
        return None
    epoch = _settled_epoch[0]
    return (lambda x, weight, bias: st.forward(x, weight, _kernel_bias(bias)),
            lambda: _settled_epoch[0] == epoch)


def _steps_for(params: ConvT3dParams, pl: Plan, cfg: Config, has_bias: bool, x: torch.Tensor,
               epi: int = 0) -> _Steps:
    # x's strides are in the key: sites that read x bake them in.
    key = (pl, cfg, has_bias, x.device, x.stride()) + ((epi,) if epi else ())
    st = _steps.get(key)
    if st is None:
        if len(_steps) >= 4096:
            _steps.clear()
        st = _steps[key] = _Steps(params, pl, cfg, has_bias, x.device, epi)
    return st


def _output(params: ConvT3dParams, pl: Plan, x: torch.Tensor) -> torch.Tensor:
    return torch.empty(params.out_shape, dtype=x.dtype, device=x.device, memory_format=pl.out_format)


def prepare(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: ConvT3dParams,
            precision: str, epilogue: Epilogue | None = None) -> Launch:
    """Allocate the output; ``run(config)`` prepares the operands and launches, so tuning times both."""
    pl = plan(params, x, weight, precision)
    y = _output(params, pl, x)
    configs, key = (pl.configs, pl.tune_key) if epilogue is None else (
        epilogue_configs(pl.configs, epilogue, params), pl.tune_key + (epilogue.signature,))
    if y.numel() == 0:
        return Launch(y, lambda cfg: None, pl, configs, key)
    has_bias = bias is not None
    code = epilogue.code if epilogue is not None else 0

    def run(cfg: Config):
        return _steps_for(params, pl, cfg, has_bias, x, code).call(x, weight, bias, y, epilogue)

    return Launch(y, run, pl, configs, key)


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: ConvT3dParams,
            precision: str, config: Config | None = None, epilogue: Epilogue | None = None) -> torch.Tensor:
    """Transposed convolution of a validated 5-D input (``precision`` ignored for 16-bit); ``config`` forces a
    tile, else a signature's first CUDA call tunes; ``epilogue`` (validated) is applied before the store."""
    bias = _kernel_bias(bias)
    epi = epilogue if epilogue else None  # an empty program is none
    key = _settled_key(x, weight, bias is not None, params, precision) + ((epi.signature,) if epi else ())
    if config is None:
        st = _steady.get(key)
        if st is not None:
            return st.forward(x, weight, bias, epi)
    if epi is not None:
        why = unsupported_reason(x, params) or epilogue_reason(params, x, weight, precision, epi)
        if why is None and config is not None and not epilogue_configs((config,), epi, params):
            why = f"the tile {config.short()} takes no epilogue"
        if why is not None:
            raise BackendUnavailableError(f"backend='triton' cannot fuse this epilogue: {why}")
    launch = prepare(x, weight, bias, params, precision, epi)
    if launch.y.numel() == 0:
        return launch.y
    settled = config is None
    if config is None:
        rec = _tuned.get(launch.tune_key)
        if rec is None and epi is not None:
            # The plain call's tile where it takes an epilogue: a short elementwise epilogue does not move it.
            rec = _tuned.get(launch.plan.tune_key)
            rec = rec if rec is not None and rec.config in launch.configs else None
        if rec is not None:
            config = rec.config
        elif x.device.type != "cuda":
            config = launch.configs[0]  # no timing on CPU (the interpreter)
        elif torch.cuda.is_current_stream_capturing():
            config, settled = launch.configs[0], False  # no timing inside graph capture
        else:
            config = _choose(launch.tune_key, first_candidates(launch, params, x, precision), launch.run)
    launch.run(config)
    if settled:
        st = _steps_for(params, launch.plan, config, bias is not None, x, epi.code if epi else 0)
        if len(_steady) >= 4096:
            _forget_settled()
        _steady[key] = st
    return launch.y

