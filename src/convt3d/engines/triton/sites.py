"""The Triton engine's launch sites: the host side of every launch (grid, integer arguments, device
tables, input copies, weight packing, descriptors), built once per call signature."""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from .kernels import phase_gemm as K
from .kernels import head_gemm as HK
from .kernels import gluon_gemm as GK
from ...core.errors import BackendUnavailableError
from ...core.params import ConvT3dParams, cdiv, pow2_at_least
from .configs import Config, _w_skip
from ...core.memo import memo


_INT32_MAX = 2**31 - 1


def interpreter_active() -> bool:
    """True when Triton was imported with TRITON_INTERPRET=1 (its kernels then run on the CPU)."""
    return bool(triton.knobs.runtime.interpret)


def require_interpreter(device: torch.device, what: str) -> None:
    """CPU tensors run ``what`` through Triton's interpreter, which must be on before triton is imported."""
    if device.type == "cpu" and not interpreter_active():
        raise BackendUnavailableError(f"{what} on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                                      "before triton is imported")


def _kernel(name: str, device: torch.device, module=None):
    # Triton picks compiling or interpreting when a @triton.jit function is created, so CPU
    # tensors need TRITON_INTERPRET=1 before triton is imported.
    if device.type == "cpu" and not interpreter_active():
        raise BackendUnavailableError(
            "backend='triton' on CPU tensors runs Triton's interpreter, which must be enabled before "
            "triton is imported: set TRITON_INTERPRET=1 in the environment (or move the tensors to CUDA)")
    if module is not None:
        return getattr(module, name)
    return getattr(HK if name.startswith("head_") else GK if name.startswith("box_") else K, name)


class Site:
    """One kernel launch of a call signature: name, grid, integer arguments and constexprs, all
    fixed by the signature. After its first launch through Triton it replays the compiled kernel
    directly, since Triton's argument binding costs as much as a small layer's GPU work; Triton's
    own path stays under launch hooks and the interpreter. ``launch(device, *tensors)`` passes
    the tensor arguments, which come first in every kernel; ``module``: the kernel's module."""

    __slots__ = ("name", "grid", "ints", "consts", "compiled", "tail", "module")

    def __init__(self, name: str, grid: tuple, ints: tuple, consts: dict, module=None):
        self.name, self.grid, self.ints, self.consts = name, tuple(grid) + (1,) * (3 - len(grid)), tuple(ints), consts
        self.module = module
        self.compiled: dict[tuple, object] = {}  # pointer-alignment pattern -> compiled kernel
        self.tail: tuple | None = None  # constexpr values in declaration order (Triton passes them too)

    def launch(self, device: torch.device, *tensors):
        kern = _kernel(self.name, device, self.module)
        if device.type != "cuda":
            return kern[self.grid](*tensors, *self.ints, **self.consts)
        drv = triton.runtime.driver.active
        idx = drv.get_current_device()
        if idx != device.index:
            # Triton launches on the current device, not the tensors'.
            with torch.cuda.device(device.index):
                return self.launch(device, *tensors)
        hooks = triton.knobs.runtime
        if _hook_set(hooks.launch_enter_hook) or _hook_set(hooks.launch_exit_hook):
            return kern[self.grid](*tensors, *self.ints, **self.consts)
        # Triton specialises a pointer on its dtype and 16-byte alignment; descriptors are fixed.
        key = (idx,) + tuple((t.dtype, t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor) else None
                             for t in tensors)
        ck = self.compiled.get(key)
        if ck is None:
            ck = kern[self.grid](*tensors, *self.ints, **self.consts)
            self.compiled[key] = ck
            if self.tail is None:
                names = kern.arg_names[len(tensors) + len(self.ints):]
                defaults = {p.name: p.default for p in kern.params}
                self.tail = tuple(self.consts.get(n, defaults.get(n)) for n in names)
            return ck
        ck.run(self.grid[0], self.grid[1], self.grid[2], drv.get_current_stream(idx), ck.function,
               ck.packed_metadata, None, None, None, *tensors, *self.ints, *self.tail)
        return ck


def _hook_set(hook) -> bool:
    """A launch hook is installed: Triton 3.6+ keeps an empty HookChain (``.calls``) when none is."""
    return hook is not None and len(getattr(hook, "calls", (hook,))) > 0


_sites: dict[tuple, Site] = memo("engines.triton.sites.sites")


def site(key: tuple, build: Callable[[], Site]) -> Site:
    """The launch site of ``key`` (which must determine every integer argument), built once."""
    s = _sites.get(key)
    if s is None:
        if len(_sites) >= 4096:
            _sites.clear()
        s = _sites[key] = build()
    return s


def _head_site(key: tuple, name: str, grid: tuple, ints: tuple, consts: dict) -> Site:
    """head_engine's site factory: its launches replayed like the engine's own."""
    return site(key, lambda: Site(name, grid, ints, consts))


_tables: dict[tuple, torch.Tensor] = memo("engines.triton.sites.tables")


def _device_table(kind: tuple, params: ConvT3dParams, device: torch.device, build: Callable[[], list],
                  width: int | None = None) -> torch.Tensor:
    """An int32 table on ``device`` built once per (kind, spatial geometry, device), [rows, ``width``]."""
    key = (kind, params.stride, params.padding, params.dilation, params.kernel_size, params.out_size,
           params.in_size, str(device))
    tab = _tables.get(key)
    if tab is None:
        tab = torch.tensor(build(), dtype=torch.int32)
        if width is not None:
            tab = tab.reshape(-1, width)
        tab = _tables[key] = tab.to(device)
    return tab


def _row_class_empty(params: ConvT3dParams, rd: int, rh: int) -> bool:
    """No tap reaches output rows of depth residue rd / height residue rh (whatever the W residue)."""
    return params.axes[0].phases[rd].num_taps == 0 or params.axes[1].phases[rh].num_taps == 0


@functools.lru_cache(maxsize=256)
def companion_masks(params: ConvT3dParams) -> dict[tuple[int, int], int] | None:
    """Owner row class -> mask: each empty row class (dd with taps, hh without) is written by the GEMM
    programs of (dd, first height residue with taps), bit ``dd * SH + hh``; None if ownerless or over 31 bits."""
    sd, sh = params.stride[0], params.stride[1]
    d_ok = [params.axes[0].phases[r].num_taps > 0 for r in range(sd)]
    h_ok = [params.axes[1].phases[r].num_taps > 0 for r in range(sh)]
    if sd * sh > 31 or not any(h_ok):
        return None
    rh0 = h_ok.index(True)
    masks = {(dd, rh0): sum(1 << (dd * sh + hh) for hh in range(sh) if not h_ok[hh]) for dd in range(sd) if d_ok[dd]}
    return {owner: mask for owner, mask in masks.items() if mask}


def empty_planes(params: ConvT3dParams, device: torch.device) -> torch.Tensor:
    """int32 [planes]: the output depth indices whose residue no tap reaches."""
    def build():
        sd = params.stride[0]
        return [od for od in range(params.out_size[0]) if params.axes[0].phases[od % sd].num_taps == 0]

    return _device_table(("planes",), params, device, build)


def _fill_planes_site(params: ConvT3dParams, y: torch.Tensor, has_bias: bool, planes: torch.Tensor) -> Site:
    """The launch site of fill_planes_kernel writing the depth ``planes`` (``empty_planes``) of y."""
    def build():
        cl = y.dim() == 5 and y.stride(1) == 1 and params.out_channels > 1
        oh, ow = params.out_size[1:]
        outer = params.batch if cl else params.batch * params.out_channels
        seg = oh * ow * (params.out_channels if cl else 1)
        return Site("fill_planes_kernel", (planes.numel() * outer,),
                    (params.out_channels, seg, planes.numel(), y.stride(0), y.stride(1), y.stride(2)),
                    dict(CHANNELS_LAST=cl, HAS_BIAS=has_bias, BLOCK=1024, VEC=16 // y.element_size(), num_warps=4))

    return site(("fill_planes", params, y.stride(), has_bias), build)


def _fill_rows_site(params: ConvT3dParams, y: torch.Tensor, has_bias: bool, rows: torch.Tensor) -> Site:
    """The launch site of fill_rows_kernel writing the (od, oh) ``rows`` (``empty_rows``) of y."""
    def build():
        block_c = min(64, pow2_at_least(params.out_channels))
        block_w = min(128, pow2_at_least(params.out_size[2]))
        c_blocks = cdiv(params.out_channels, block_c)
        return Site("fill_rows_kernel", (rows.shape[0] * c_blocks * params.batch,),
                    (params.out_channels, params.out_size[2], rows.shape[0], c_blocks, *y.stride()),
                    dict(HAS_BIAS=has_bias, BLOCK_C=block_c, BLOCK_W=block_w, num_warps=4))

    return site(("fill_rows", params, y.stride(), has_bias), build)


def phase_table(params: ConvT3dParams, device: torch.device, w_group: int = 1,
                skip_empty_rows: bool = False, companions: bool = False) -> torch.Tensor:
    """int32 [groups * w_group, 16]: per phase its residues, tap counts, first taps, first offsets and
    compact sizes, column 15 the companion mask; ``skip_empty_rows`` leaves out unreached row classes."""
    def build():
        rows = []
        masks = (companion_masks(params) or {}) if companions else {}
        for ph in params.phases:
            a = ph.axes
            if skip_empty_rows and _row_class_empty(params, a[0].residue, a[1].residue):
                continue
            first = a[2].residue % w_group == 0  # the mask lives in a group's first row
            rows.append([getattr(ax, f) for f in ("residue", "num_taps", "first_tap", "first_offset", "size")
                         for ax in a] + [masks.get((a[0].residue, a[1].residue), 0) if first else 0])
        return rows

    return _device_table(("phases", w_group, skip_empty_rows, companions), params, device, build, width=16)


def empty_rows(params: ConvT3dParams, device: torch.device) -> torch.Tensor:
    """int32 [rows, 2]: the (od, oh) output rows that no tap reaches (bias/zero only)."""
    def build():
        (sd, sh, _), (od_n, oh_n, _) = params.stride, params.out_size
        return [(od, oh) for od in range(od_n) for oh in range(oh_n) if _row_class_empty(params, od % sd, oh % sh)]

    return _device_table(("rows",), params, device, build, width=2)


def _prepare_input(x: torch.Tensor, round_tf32: bool) -> torch.Tensor:
    """x's copy with channels innermost (NDHWC strides), TF32-rounded with ``round_tf32``."""
    sd, sh, sw = x.stride()[2:]
    if sh != x.shape[4] * sw or sd != x.shape[3] * sh:
        x = x.contiguous()  # the copy kernel walks D, H, W as one flat index
    n, c, d, h, w = x.shape

    def build():  # to_channels_last_kernel's blocks: 64 positions by up to 64 channels
        block_c = min(64, pow2_at_least(c))
        s_blocks, c_blocks = cdiv(d * h * w, 64), cdiv(c, block_c)
        return Site("to_channels_last_kernel", (s_blocks * c_blocks * n,),
                    (c, d * h * w, s_blocks, c_blocks, x.stride(0), x.stride(1), x.stride(4)),
                    dict(ROUND_TF32=round_tf32, BLOCK_C=block_c, BLOCK_S=64, num_warps=4))

    y = torch.empty((n, d, h, w, c), dtype=x.dtype, device=x.device)
    if y.numel() > 0:
        site(("to_channels_last", x.shape, x.stride(), round_tf32), build).launch(x.device, x, y)
    return y.permute(0, 4, 1, 2, 3)  # logical NCDHW view of NDHWC memory


def _packed_shape(params: ConvT3dParams) -> tuple[int, int, int, int]:
    """[G, taps, Cout/g, Cin/g]: the packed weight the GEMM kernels read (K-major per tap)."""
    return (params.groups, math.prod(params.kernel_size), params.out_channels_per_group,
            params.in_channels_per_group)


def _pack_blocks(params: ConvT3dParams) -> tuple[int, int, int]:
    """(BLOCK_CI, BLOCK_J, programs per group) of pack_weight_kernel: 32 x 64, narrower for fewer channels."""
    _, kvol, cout_g, cin_g = _packed_shape(params)
    block_ci, block_j = min(32, pow2_at_least(cin_g)), 64
    return block_ci, block_j, cdiv(cin_g, block_ci) * cdiv(cout_g * kvol, block_j)


def _pack_site(params: ConvT3dParams, w: torch.Tensor, round_tf32: bool, fold: int = 1) -> Site:
    """The launch site of pack_weight_kernel for a contiguous weight (``params`` merged when ``fold`` > 1)."""
    g, kvol, cout_g, cin_g = _packed_shape(params)

    def build():
        block_ci, block_j, programs = _pack_blocks(params)
        return Site("pack_weight_kernel", (programs, g), (cin_g, cout_g, kvol, fold, w.stride(0)),
                    dict(ROUND_TF32=round_tf32, BLOCK_CI=block_ci, BLOCK_J=block_j, num_warps=4))

    return site(("pack_weight", params, round_tf32, fold), build)


def _pack_weight(weight: torch.Tensor, params: ConvT3dParams, pack: Site) -> torch.Tensor:
    """The packed weight for the kernel's ``params`` by its launch site ``pack``."""
    packed = torch.empty(_packed_shape(params), dtype=weight.dtype, device=weight.device)
    pack.launch(weight.device, weight.contiguous(), packed)
    return packed


def slice_offsets_fit(params: ConvT3dParams, x_strides, y_strides, pad: int) -> bool:
    """The kernels' 32-bit in-slice offsets stay below 2^31 with ``pad`` positions of tile padding."""
    (h, w), (oh, ow) = params.in_size[1:], params.out_size[1:]
    x_span = (h + pad) * abs(x_strides[3]) + (w + pad) * abs(x_strides[4]) \
        + params.in_channels_per_group * abs(x_strides[1])
    y_span = (oh + pad) * abs(y_strides[3]) + (ow + pad) * abs(y_strides[4])
    return max(x_span, y_span) <= _INT32_MAX


def _check_slice_offsets(params, xin, y, pad):
    if not slice_offsets_fit(params, xin.stride(), y.stride(), pad + max(params.kernel_size) * max(params.dilation)):
        raise BackendUnavailableError(
            "backend='triton' cannot run this call: one depth slice of the input or output spans more "
            f"than 2^31 elements (input {tuple(xin.shape)}, output {tuple(y.shape)})")


def _tma_capable(device: torch.device) -> bool:
    # TMA exists from sm_90 on; the interpreter emulates it.
    return device.type == "cpu" or torch.cuda.get_device_capability(device)[0] >= 9


def _tma_strides_ok(t: torch.Tensor, order) -> bool:
    """A tensor descriptor needs a 16-byte aligned base and outer strides, unit stride innermost."""
    es = t.element_size()
    st = [t.stride(i) for i in order]
    return t.data_ptr() % 16 == 0 and st[-1] == 1 and all(s * es % 16 == 0 for s in st[:-1])


def _x_descriptor(xin: torch.Tensor, params: ConvT3dParams, cfg: Config):
    """5-D descriptor over the NDHWC input, or None where a channel block would read the next
    group (in bounds, so not zeroed) or the strides do not suit TMA."""
    cin_g = params.in_channels_per_group
    order = (0, 2, 3, 4, 1)  # N, D, H, W, C
    if not (params.groups == 1 or cin_g % cfg.BLOCK_K == 0) or not _tma_strides_ok(xin, order):
        return None
    return TensorDescriptor(xin, [xin.shape[i] for i in order], [xin.stride(i) for i in order],
                            [1, 1, cfg.BLOCK_M // cfg.BLOCK_W, cfg.BLOCK_W, cfg.BLOCK_K])


def _w_descriptor(wp: torch.Tensor, cfg: Config):
    """4-D descriptor over the packed weight [G, taps, Cout/g, Cin/g], or None."""
    if not _tma_strides_ok(wp, (0, 1, 2, 3)):
        return None
    return TensorDescriptor(wp, list(wp.shape), list(wp.stride()), [1, 1, cfg.BLOCK_N, cfg.BLOCK_K])


def _padded_args(x: torch.Tensor, geo, round_tf32: bool) -> tuple[int, int, tuple, dict]:
    """(row blocks, channel blocks, integer arguments, constexprs) of x's copy onto ``geo``'s grid
    (to_padded_kernel): blocks of up to 64 channels x 64 columns, fitted to C and W."""
    (pd, ph, pw), (dp, hp, wp) = geo
    c = x.shape[1]
    block_c, block_w = min(64, pow2_at_least(c)), min(64, pow2_at_least(wp))
    return (dp * hp * cdiv(wp, block_w), cdiv(c, block_c), (*x.shape[1:], dp, hp, wp, pd, ph, pw, *x.stride()),
            dict(ROUND_TF32=round_tf32, SRC_CL=x.stride(1) == 1 and c > 1, BLOCK_C=block_c, BLOCK_W=block_w))


def _padded_site(x: torch.Tensor, geo, round_tf32: bool) -> Site:
    def build():
        r_blocks, c_blocks, ints, consts = _padded_args(x, geo, round_tf32)
        return Site("to_padded_kernel", (r_blocks * c_blocks * x.shape[0],), (*ints, r_blocks, c_blocks),
                    dict(consts, num_warps=4))

    return site(("to_padded", x.shape, x.stride(), geo, round_tf32), build)


def _operands_site(x: torch.Tensor, geo, params: ConvT3dParams, w: torch.Tensor, round_tf32: bool,
                   fold: int = 1) -> Site:
    """The launch site of gemm_operands_kernel: ``_padded_site``'s copy and ``_pack_site``'s pack in one launch."""
    def build():
        r_blocks, c_blocks, ints, consts = _padded_args(x, geo, round_tf32)
        block_ci, block_j, pack_programs = _pack_blocks(params)
        g, kvol, cout_g, cin_g = _packed_shape(params)
        pad_programs = r_blocks * c_blocks * x.shape[0]
        return Site("gemm_operands_kernel", (pad_programs + pack_programs * g,),
                    (*ints, cin_g, cout_g, kvol, fold, w.stride(0), r_blocks, c_blocks, pad_programs, pack_programs),
                    dict(consts, BLOCK_CI=block_ci, BLOCK_J=block_j, num_warps=4))

    return site(("gemm_operands", x.shape, x.stride(), geo, params, round_tf32, fold), build)


def _gemm_operands(x: torch.Tensor, weight: torch.Tensor, geo, params: ConvT3dParams, round_tf32: bool,
                   ops: Site) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, NDHWC copy of x on ``geo``'s grid) by one launch of ``ops``."""
    packed = torch.empty(_packed_shape(params), dtype=weight.dtype, device=weight.device)
    xp = _padded_buffer(x, geo)
    ops.launch(x.device, x, xp, weight.contiguous(), packed)
    return packed, xp


def _padded_buffer(x: torch.Tensor, geo) -> torch.Tensor:
    """An uninitialised [N, DP, HP, WP, C] buffer for x's copy on ``geo``'s grid."""
    _, (dp, hp, wp) = geo
    return torch.empty((x.shape[0], dp, hp, wp, x.shape[1]), dtype=x.dtype, device=x.device)


def _prepare_padded_input(x: torch.Tensor, geo, round_tf32: bool) -> torch.Tensor:
    """x's contiguous [N, DP, HP, WP, C] copy on ``geo``'s grid by to_padded_kernel alone (the backward's)."""
    y = _padded_buffer(x, geo)
    _padded_site(x, geo, round_tf32).launch(x.device, x, y)
    return y


def _offsets_fit_int32(params: ConvT3dParams, y: torch.Tensor, pad: int) -> bool:
    """Channel plus in-slice offsets of the output stay below 2^31 (32-bit epilogue offsets)."""
    (oh, ow), st = params.out_size[1:], y.stride()
    span = (params.out_channels - 1) * abs(st[1]) + (oh + pad) * abs(st[3]) + (ow + pad) * abs(st[4])
    return span <= _INT32_MAX


def _epi_consts(epi: int) -> dict:
    """The GEMM kernels' EPI constexpr where a program is fused (its default 0 left implicit otherwise)."""
    return {"EPI": epi} if epi else {}


def _axis_steps(params: ConvT3dParams) -> tuple:
    """The GEMM kernels' per-dimension stride, tap step and offset step arguments."""
    return (*params.stride, *(a.tap_step for a in params.axes), *(a.offset_step for a in params.axes))


def _box_tiles(cfg: Config, params: ConvT3dParams, n_groups: int) -> tuple[int, int, int, int]:
    """(tiles_h, tiles_w, tiles_n, programs) of a GEMM over BLOCK_M // BLOCK_W x BLOCK_W boxes of the
    largest compact grid (those past a phase's own grid only store)."""
    q = params.compact_size
    tiles_h, tiles_w = cdiv(q[1], cfg.BLOCK_M // cfg.BLOCK_W), cdiv(q[2], cfg.BLOCK_W)
    tiles_n = cdiv(params.out_channels_per_group, cfg.BLOCK_N)
    return tiles_h, tiles_w, tiles_n, params.groups * params.batch * q[0] * tiles_h * tiles_w * n_groups * tiles_n


def _flat_site(cfg: Config, xp: torch.Tensor, y: torch.Tensor, n_groups: int, params: ConvT3dParams, geo,
               has_bias: bool, precision: str, epi: int = 0) -> Site:
    """The launch site of flat_gemm_kernel (descriptors from ``_flat_descriptors``; ``epi``: the program's code)."""
    cin_g = params.in_channels_per_group

    def build():
        (pd, ph, pw), (dp, hp, wpad) = geo
        _check_slice_offsets(params, xp.permute(0, 4, 1, 2, 3), y, cfg.BLOCK_M)
        q = params.compact_size
        tiles_m = cdiv(q[1] * wpad, cfg.BLOCK_M)
        tiles_n = cdiv(params.out_channels_per_group, cfg.BLOCK_N)
        return Site("flat_gemm_kernel", (params.groups * params.batch * q[0] * tiles_m * n_groups * tiles_n,), (
            params.batch, cin_g, params.out_channels_per_group, dp, hp, wpad, pd, ph, pw,
            *params.in_size[:2], q[0], params.out_size[2], params.out_size[0], params.out_size[1], n_groups, math.prod(params.kernel_size),
            params.kernel_size[1], params.kernel_size[2], *y.stride(), *_axis_steps(params), tiles_m, tiles_n,
            params.out_channels,
        ), dict(
            HAS_BIAS=has_bias, PRECISION=precision, W_GROUP=cfg.W_GROUP, W_SKIP=_w_skip(params, cfg.W_GROUP),
            OFF32=_offsets_fit_int32(params, y, cfg.BLOCK_M), BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
            BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_epi_consts(epi),
        ))

    return site(("flat_gemm", params, cfg, y.stride(), n_groups, has_bias, precision, epi), build)


def _flat_descriptors(cfg: Config, xp: torch.Tensor, wp: torch.Tensor, cin_g: int):
    """2-D descriptors of flat_gemm_kernel over the padded input and the packed weight (per call)."""
    c = xp.shape[-1]
    return (TensorDescriptor(xp, [xp.numel() // c, c], [c, 1], [cfg.BLOCK_M, cfg.BLOCK_K]),
            TensorDescriptor(wp, [wp.numel() // cin_g, cin_g], [cin_g, 1], [cfg.BLOCK_N, cfg.BLOCK_K]))


def gluon_capable(device: torch.device) -> bool:
    """box_gemm_kernel can run here: wgmma is sm_90's alone, and Gluon has no interpreter."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def w_pairs(cfg: Config, params: ConvT3dParams, y: torch.Tensor) -> bool:
    """box_gemm_kernel may store both W residues of a position as one vector (PAIRS): NCDHW output with
    W_GROUP=2, every pair aligned (``y`` is a fresh allocation, so this holds for every later call)."""
    return (cfg.W_GROUP == 2 and y.stride(4) == 1 and params.out_size[2] % 2 == 0
            and all(s % 2 == 0 for s in y.stride()[:4]) and y.data_ptr() % (2 * y.element_size()) == 0)


def _box_site(cfg: Config, xp: torch.Tensor, y: torch.Tensor, n_groups: int, params: ConvT3dParams, geo,
              has_bias: bool) -> Site:
    """The launch site of box_gemm_kernel (descriptors from ``_box_descriptors``)."""
    def build():
        (pd, ph, pw), _ = geo
        _check_slice_offsets(params, xp.permute(0, 4, 1, 2, 3), y, cfg.BLOCK_M)
        tiles_h, tiles_w, tiles_n, programs = _box_tiles(cfg, params, n_groups)
        cl_out = y.stride(1) == 1 and params.out_channels > 1
        return Site("box_gemm_kernel", (programs,), (
            params.batch, params.in_channels_per_group, params.out_channels_per_group, pd, ph, pw, *params.in_size,
            params.compact_size[0], *params.out_size, n_groups, math.prod(params.kernel_size),
            params.kernel_size[1], params.kernel_size[2], *y.stride(), *_axis_steps(params), tiles_h, tiles_w, tiles_n,
        ), dict(
            HAS_BIAS=has_bias, W_GROUP=cfg.W_GROUP, W_SKIP=_w_skip(params, cfg.W_GROUP),
            OFF32=_offsets_fit_int32(params, y, cfg.BLOCK_M), CL_OUT=cl_out, PAIRS=w_pairs(cfg, params, y),
            STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        ))

    return site(("box_gemm", params, cfg, y.stride(), n_groups, has_bias), build)


@functools.lru_cache(maxsize=64)
def _nvmma_layout(box: tuple, dtype: torch.dtype):
    """The shared-memory layout wgmma reads a TMA box in (the widest swizzle its rows allow)."""
    gdt = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gdt)


def gluon_descriptor(t: torch.Tensor, box: tuple):
    """A Gluon TMA descriptor over ``t`` in boxes ``box``, laid out for wgmma (per call)."""
    return GluonDescriptor(t, list(t.shape), list(t.stride()), list(box), _nvmma_layout(tuple(box), t.dtype))


def _box_descriptors(cfg: Config, xp: torch.Tensor, wp: torch.Tensor, cin_g: int):
    """Gluon descriptors of box_gemm_kernel over the padded input and the packed weight (per call)."""
    return (gluon_descriptor(xp, (1, 1, cfg.BLOCK_M // cfg.BLOCK_W, cfg.BLOCK_W, cfg.BLOCK_K)),
            gluon_descriptor(wp.view(-1, cin_g), (cfg.BLOCK_N, cfg.BLOCK_K)))


def _phase_site(cfg: Config, params: ConvT3dParams, pl, xin: torch.Tensor, wp: torch.Tensor, y: torch.Tensor,
                n_groups: int, has_bias: bool, x_tma: bool, w_tma: bool, epi: int = 0) -> Site:
    """The launch site of phase_gemm_kernel for the engine's Plan ``pl`` (``x_tma``, ``w_tma``: descriptors)."""
    def build():
        _check_slice_offsets(params, xin, y, max(c.BLOCK_M for c in pl.configs))
        tiles_h, tiles_w, tiles_n, programs = _box_tiles(cfg, params, n_groups)
        return Site("phase_gemm_kernel", (programs,), (
            params.batch, params.in_channels_per_group, params.out_channels_per_group,
            *params.in_size, params.compact_size[0], params.out_size[2], params.out_size[0], params.out_size[1],
            n_groups, params.kernel_size[1], params.kernel_size[2], *xin.stride(), *wp.stride(), *y.stride(),
            *_axis_steps(params), tiles_h, tiles_w, tiles_n, params.out_channels,
        ), dict(
            HAS_BIAS=has_bias, USE_DOT=cfg.use_dot, PRECISION=pl.dot_precision, W_GROUP=cfg.W_GROUP,
            W_SKIP=_w_skip(params, cfg.W_GROUP), X_CACHE="", X_TMA=x_tma, W_TMA=w_tma, BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, BLOCK_W=cfg.BLOCK_W, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **_epi_consts(epi),
        ))

    return site(("phase_gemm", params, cfg, xin.stride(), y.stride(), n_groups, has_bias, pl.dot_precision,
                 x_tma, w_tma, epi), build)
