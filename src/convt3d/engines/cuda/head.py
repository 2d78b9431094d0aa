"""Launcher of the CUDA head kernel (``head_shuffle.cu``'s header gives the design): geometry, tiles, the first
call's timed choice, weight packing, the nvcc build loaded by ctypes; fp32 runs at TF32 (rounded as cuDNN)."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import itertools
import math
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ...core.call import output_memory_format
from ...core.errors import BackendUnavailableError
from ...core.params import ConvT3dParams, cdiv, pow2_at_least
from ...core.memo import memo

__all__ = ["CONFIGS", "MAX_COLUMNS", "MAX_SHIFTS", "MAX_HEAD_CHANNELS", "HeadPlan", "geometry", "columns",
           "width_shifts", "unsupported_reason", "call_reason", "staging_mode", "configs_for", "tile_boxes", "plan",
           "shift_masks", "pack_weight", "library_path", "load_library", "forward", "variants",
           "candidate_plans", "choose_tile", "round_tf32", "pack_weight_cuda"]

# The .cu's CONVT3D_HEAD_CONFIGS: index -> (MT, NTW, WM, WN), a CTA covering BM = WM x MT x 16 output
# blocks and BN = WN x NTW x 8 columns; narrow heads take four m-tiles a warp (two are issue-bound).
CONFIGS = {
    0: (4, 1, 4, 1),   # BM 256, BN 8
    1: (4, 2, 4, 1),   # BM 256, BN 16
    2: (2, 4, 4, 1),   # BM 128, BN 32
    3: (2, 4, 4, 2),   # BM 128, BN 64 (256 threads)
    4: (2, 4, 2, 4),   # BM 64, BN 128 (256 threads)
    5: (2, 1, 4, 1),   # BM 128, BN 8
    6: (2, 2, 4, 1),   # BM 128, BN 16
}
MAX_COLUMNS = 128        # residues x Cout/g, padded to 8: the widest configuration's BN
MAX_SHIFTS = 64          # J_d x J_h x J_w (the kernel's mask table)
MAX_HEAD_CHANNELS = 15  # output channels per group of a head (as head_engine's)
SMEM_LIMIT = 232448  # the H100/H200 opt-in shared memory per block
# Boxes staging more rank after smaller ones: two CTAs an SM overlap one's staging with the other's MMAs.
SMEM_TWO_CTAS = 113 * 1024
SMEM_PER_SM = 228 * 1024  # H100/H200, 1 KB of it reserved per CTA
REGS_PER_SM = 65536
KERNEL_REGS = 128  # the most ptxas gives any of the kernels, for the occupancy estimate

_state: dict = {"lib": {}, "pack": {}}
_lock = threading.Lock()
_chosen: dict = memo("engines.cuda.head.chosen")
_shift_arrays: dict = memo("engines.cuda.head.shift_arrays")


def geometry(params: ConvT3dParams) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(shifts J = ceil(k/s), first block p // s, blocks) per dimension: tap t = j * s + r, output q * s - p + r."""
    js = tuple(cdiv(a.kernel, a.stride) for a in params.axes)
    first = tuple(a.padding // a.stride for a in params.axes)
    last = [(a.out_size - 1 + a.padding) // a.stride for a in params.axes]
    return js, first, tuple(max(0, hi - lo + 1) for lo, hi in zip(first, last))


def columns(params: ConvT3dParams, jn: int = 1) -> int:
    """N of the GEMM: jn x residues x Cout/g, padded to a multiple of 8 (one MMA n-tile)."""
    return cdiv(jn * math.prod(params.stride) * params.out_channels_per_group, 8) * 8


def width_shifts(params: ConvT3dParams) -> int:
    """J_w where the column variant (width shifts as MMA columns) is offered, else 1."""
    jw = geometry(params)[0][2]
    return jw if jw > 1 and columns(params, jw) <= MAX_COLUMNS else 1


def _kshifts(params: ConvT3dParams, jn: int) -> tuple[int, int, int]:
    """The shifts taken as K steps: (J_d, J_h, 1) where the width ones are columns."""
    js = geometry(params)[0]
    return js if jn == 1 else (js[0], js[1], 1)


def _staged_box(params: ConvT3dParams, box: tuple[int, int, int], jn: int) -> list[int]:
    """The staged input box of an M box: the box plus J - 1 per dimension taken as K steps."""
    return [b + j - 1 for b, j in zip(box, _kshifts(params, jn))]


def _out_blocks(box: tuple[int, int, int], jn: int) -> tuple[int, int, int]:
    """Output blocks of a tile: the M box, less the jn - 1 rows along W that only feed the next."""
    return (box[0], box[1], box[2] - jn + 1)


def _kc(params: ConvT3dParams, itemsize: int) -> int:
    """Channels per staged chunk: Cin/g as a power of two within 32 bytes (ldmatrix) and 128 (banks)."""
    lo, hi = 32 // itemsize, 128 // itemsize
    return max(lo, min(hi, pow2_at_least(params.in_channels_per_group)))


@functools.lru_cache(maxsize=1024)
def unsupported_reason(params: ConvT3dParams, dtype: torch.dtype, precision: str) -> str | None:
    """Why the head kernel does not take this call (geometry, dtype, precision), or None; memoised."""
    if dtype == torch.float32:
        if precision != "tf32":
            return f"fp32 at precision {precision!r} (the head kernel computes fp32 on TF32 tensor cores only)"
    elif dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the head kernel takes float32, bfloat16 and float16)"
    if params.out_channels_per_group > MAX_HEAD_CHANNELS:
        return f"{params.out_channels_per_group} output channels per group (a head has at most {MAX_HEAD_CHANNELS})"
    if any(a.dilation != 1 and a.kernel != 1 for a in params.axes):
        return f"dilation {params.dilation} (the head kernel's shifts need dilation 1)"
    if columns(params) > MAX_COLUMNS:
        return (f"{math.prod(params.stride)} residues x {params.out_channels_per_group} output channels "
                f"(more than {MAX_COLUMNS} columns)")
    js, _, qn = geometry(params)
    if math.prod(js) > MAX_SHIFTS:
        return f"{math.prod(js)} shifts (kernel {params.kernel_size} over stride {params.stride}; at most {MAX_SHIFTS})"
    offered = tile_boxes(params, dtype)
    if not offered:
        return "no tile fits in shared memory"
    tiles = params.batch * params.groups * min(
        math.prod(cdiv(q, b) for q, b in zip(qn, box)) for _, box in offered)
    if tiles > 2**31 - 1:  # the CTAs number tiles in 32 bits
        return f"{tiles} tiles (more than 2^31 - 1)"
    return None


def configs_for(params: ConvT3dParams, jn: int = 1) -> tuple[int, ...]:
    """The configurations of the narrowest BN that holds every column (BM 256 and 128 where BN <= 16)."""
    n = columns(params, jn)
    for widest, configs in ((8, (0, 5)), (16, (1, 6)), (32, (2,)), (64, (3,))):
        if n <= widest:
            return configs
    return (4,)


def _bm_bn(config: int) -> tuple[int, int]:
    mt, ntw, wm, wn = CONFIGS[config]
    return wm * mt * 16, wn * ntw * 8


def _row_pitch(params: ConvT3dParams, itemsize: int) -> int:
    """Bytes between staged rows (the .cu's RP): KC channels plus 16, so 8 rows start in 8 bank groups."""
    return _kc(params, itemsize) * itemsize + 16


def _epilogue_rows(params: ConvT3dParams, box: tuple[int, int, int]) -> int:
    """Rows of the epilogue's table at most (channel x depth x height outputs of a tile)."""
    (sd, sh, _) = params.stride
    return params.out_channels_per_group * box[0] * sd * box[1] * sh


@dataclass(frozen=True)
class _Smem:
    """Shared memory regions of one CTA (bytes); ``cs_off`` -1: the epilogue tile reuses a stage."""

    stages: int
    resident: bool
    stage_bytes: int
    w_off: int
    rtab_off: int
    etab_off: int
    cs_off: int
    total: int


def _ctas_per_sm(smem: int, threads: int) -> int:
    """CTAs an SM holds by shared memory and registers."""
    return max(0, min(SMEM_PER_SM // (smem + 1024), REGS_PER_SM // (threads * KERNEL_REGS)))


def _smem_layout(params: ConvT3dParams, itemsize: int, config: int, box: tuple[int, int, int],
                 stages: int | None = None, jn: int = 1) -> _Smem:
    """The regions of the best variant (1 or 2 stages; weights resident or staged per chunk): the most
    CTAs per SM (they hide each other's loads better than a stage), then resident weights, then stages."""
    js = _kshifts(params, jn)
    bm, bn = _bm_bn(config)
    threads = 32 * CONFIGS[config][2] * CONFIGS[config][3]
    rp = _row_pitch(params, itemsize)
    hr = math.prod(_staged_box(params, box, jn))
    nchunks = cdiv(params.in_channels_per_group, _kc(params, itemsize))
    w_chunk = math.prod(js) * bn * rp
    cs = bm * (bn + 4) * 4

    def layout(st: int, resident: bool) -> _Smem:
        stage = hr * rp + (0 if resident else w_chunk)
        w_off = st * stage
        rtab_off = w_off + (nchunks * w_chunk if resident else 0)
        etab_off = rtab_off + cdiv(2 * 8 * hr, 16) * 16
        end = etab_off + 16 * _epilogue_rows(params, box)
        cs_off = -1 if cs <= stage else end
        return _Smem(st, resident, stage, w_off, rtab_off, etab_off, cs_off, end + (cs if cs_off >= 0 else 0))

    variants = [layout(st, res) for st in ((1, 2) if stages is None else (stages,))
                for res in ((True, False) if params.groups == 1 else (False,))]
    fitting = [v for v in variants if v.total <= SMEM_LIMIT] or variants
    return max(fitting, key=lambda v: (_ctas_per_sm(v.total, threads), v.resident, v.stages, -v.total))


def tile_boxes(params: ConvT3dParams, dtype: torch.dtype, config: int | None = None,
               jn: int = 1) -> list[tuple[int, tuple]]:
    """(config, box) pairs to offer for variant ``jn``: power-of-two boxes of BM blocks within shared
    memory, best first by staged rows read plus blocks computed, one-CTA-per-SM boxes last."""
    itemsize = dtype.itemsize
    js, _, qn = geometry(params)
    ks = _kshifts(params, jn)
    out = []
    for cfg in (configs_for(params, jn) if config is None else (config,)):
        bm, _ = _bm_bn(cfg)
        for bw in (1, 2, 4, 8, 16, 32, 64, 128):
            for bh in (1, 2, 4, 8, 16, 32, 64, 128):
                if bm % (bw * bh) or bw < jn:
                    continue
                box = (bm // (bw * bh), bh, bw)
                smem = _smem_layout(params, itemsize, cfg, box, jn=jn).total
                if smem > SMEM_LIMIT:
                    continue
                tiles = math.prod(cdiv(q, b) for q, b in zip(qn, _out_blocks(box, jn)))
                rows = math.prod(_staged_box(params, box, jn))
                # staged rows, M rows times shifts (MMA work), and runs along W (about a sector each)
                runs = (box[0] + ks[0] - 1) * (box[1] + ks[1] - 1)
                cost = tiles * (rows + bm * math.prod(js) / 4 + 4 * runs)
                out.append((cost, smem > SMEM_TWO_CTAS, cfg, box))
    out.sort(key=lambda c: (c[1], c[0]))
    return [(cfg, box) for _, _, cfg, box in out]


def shift_masks(params: ConvT3dParams, jn: int = 1) -> list[int]:
    """Per K-step shift, the mask of n-tiles whose columns (jw' x R + r) x Cout/g + co hold a tap (j x s + r < k)."""
    ks = _kshifts(params, jn)
    cog = params.out_channels_per_group
    (sd, sh, sw), (kd, kh, kw) = params.stride, params.kernel_size
    res = sd * sh * sw
    masks = []
    for jd, jh, jw in itertools.product(*map(range, ks)):
        bits = 0
        for jc, rd, rh, rw in itertools.product(range(jn), range(sd), range(sh), range(sw)):
            if jd * sd + rd < kd and jh * sh + rh < kh and (jw + jc) * sw + rw < kw:
                r = jc * res + (rd * sh + rh) * sw + rw
                for nt in range(r * cog // 8, (r * cog + cog - 1) // 8 + 1):
                    bits |= 1 << nt
        masks.append(bits)
    return masks


@dataclass(frozen=True)
class HeadPlan:
    """One launch: configuration, box and the kernel's ``meta`` (``_launch`` appends the strides and
    staging mode); ``shifts``: the per-shift n-tile masks, then staged-row byte offsets."""

    config: int
    box: tuple[int, int, int]
    kc: int
    nchunks: int
    meta: tuple[int, ...]
    masks: tuple[int, ...]
    stages: int
    shifts: tuple[int, ...] = ()
    copy_cl: bool = False  # stage a channels-last copy of an input read element by element
    jn: int = 1  # width shifts as MMA columns; box is then the M rows' and yields mw - jn + 1 blocks


@functools.lru_cache(maxsize=256)
def plan(params: ConvT3dParams, dtype: torch.dtype, config: int | None = None,
         box: tuple[int, int, int] | None = None, stages: int | None = None, max_ctas: int = 0,
         jn: int = 1) -> HeadPlan:
    """The launch for a call the kernel takes: the given configuration and box, else the first of
    ``tile_boxes``; ``max_ctas`` caps the persistent grid (0: as many CTAs as the SMs hold); memoised."""
    itemsize = dtype.itemsize
    if jn not in (1, width_shifts(params)):
        raise ValueError(f"jn={jn}: this layer takes 1 or {width_shifts(params)} width shifts as columns")
    if config is None or box is None:
        offered = tile_boxes(params, dtype, config, jn)
        if not offered:
            raise BackendUnavailableError("backend='cuda': no head kernel tile fits this layer in shared memory")
        config, box = offered[0] if box is None else (offered[0][0], box)
    _, q0, qn = geometry(params)
    ks = _kshifts(params, jn)
    bm, bn = _bm_bn(config)
    if math.prod(box) != bm:
        raise ValueError(f"box {box} holds {math.prod(box)} blocks; configuration {config} takes {bm}")
    if box[2] < jn:
        raise ValueError(f"box {box}: {jn} width shifts as columns need at least {jn} M rows along W")
    kc = _kc(params, itemsize)
    nchunks = cdiv(params.in_channels_per_group, kc)
    tiles = tuple(cdiv(q, b) for q, b in zip(qn, _out_blocks(box, jn)))
    total = params.batch * params.groups * math.prod(tiles)
    lay = _smem_layout(params, itemsize, config, box, stages, jn)
    meta = (*params.in_size, *params.out_size, *params.stride, *params.padding, *ks, *q0, *box, *tiles,
            params.in_channels_per_group, params.out_channels_per_group, params.groups, columns(params, jn),
            nchunks, kc, total, lay.total, bn, lay.stages, int(lay.resident), lay.stage_bytes, lay.w_off,
            lay.rtab_off, lay.etab_off, lay.cs_off, max_ctas, jn)
    rp = _row_pitch(params, itemsize)
    hb = _staged_box(params, box, jn)
    offsets = [((jd * hb[1] + jh) * hb[2] + jw) * rp for jd, jh, jw in itertools.product(*map(range, ks))]
    masks = tuple(shift_masks(params, jn))
    return HeadPlan(config, tuple(box), kc, nchunks, tuple(int(v) for v in meta), masks, lay.stages,
                    masks + tuple(offsets), jn=jn)


def call_reason(x: torch.Tensor, params: ConvT3dParams, precision: str) -> str | None:
    """Why the head kernel cannot run this call here (device, compiler, geometry), or None; builds nothing."""
    if x.device.type != "cuda":
        return f"{x.device.type.upper()} tensor (the head kernel runs on CUDA devices only)"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major < 8:
        return f"GPU compute capability {major}.{minor} (the head kernel needs 8.0+: bf16 mma.sync, cp.async)"
    why = unsupported_reason(params, x.dtype, precision)
    if why is not None:
        return why
    if not loaded(x.dtype) and nvcc_path() is None and not library_path(x.device, x.dtype).exists():
        return "no CUDA compiler (nvcc) found to build the head kernel: set CUDA_HOME or put nvcc on PATH"
    return None


def pack_weight(weight: torch.Tensor, params: ConvT3dParams, hp: HeadPlan) -> torch.Tensor:
    """(Cin, Cout/g, kD, kH, kW) -> (g, chunk, shift, column, KC), zero-padded: column
    n = (jw' x R + r) x Cout/g + co holds W[ci, co, (j + jw') x s + r] for K-step shift j."""
    g, cin_g, cog = params.groups, params.in_channels_per_group, params.out_channels_per_group
    js, _, _ = geometry(params)
    (sd, sh, sw), (kd, kh, kw) = params.stride, params.kernel_size
    w = weight.reshape(g, cin_g, cog, kd, kh, kw)
    w = torch.nn.functional.pad(w, (0, js[2] * sw - kw, 0, js[1] * sh - kh, 0, js[0] * sd - kd))
    w = w.reshape(g, cin_g, cog, js[0], sd, js[1], sh, js[2], sw)
    # J_w next to the residues, so that it joins the columns where hp.jn takes it there
    ks = math.prod(_kshifts(params, hp.jn))
    w = w.permute(0, 3, 5, 7, 4, 6, 8, 2, 1).reshape(g, ks, -1, cin_g)
    np_ = columns(params, hp.jn)
    w = torch.nn.functional.pad(w, (0, hp.nchunks * hp.kc - cin_g, 0, np_ - w.shape[2]))
    w = w.reshape(g, ks, np_, hp.nchunks, hp.kc).permute(0, 3, 1, 2, 4).contiguous()
    return round_tf32(w) if w.dtype == torch.float32 else w


def pack_weight_cuda(weight: torch.Tensor, params: ConvT3dParams, hp: HeadPlan) -> torch.Tensor:
    """``pack_weight`` in one launch of the library's pack kernel (a CUDA weight, any strides)."""
    if weight.device.index is not None and weight.device.index != torch.cuda.current_device():
        with torch.cuda.device(weight.device):  # the runtime launches on the current device
            return pack_weight_cuda(weight, params, hp)
    load_library(weight.device, weight.dtype)
    ks = _kshifts(params, hp.jn)
    np_ = columns(params, hp.jn)
    out = torch.empty((params.groups, hp.nchunks, math.prod(ks), np_, hp.kc), dtype=weight.dtype,
                      device=weight.device)
    meta = (ctypes.c_int64 * 21)(*params.kernel_size, *params.stride, *ks, params.in_channels_per_group,
                                 params.out_channels_per_group, np_, hp.kc, hp.nchunks, params.groups,
                                 *weight.stride(), hp.jn)
    err = _state["pack"][_DTYPE_CODES[weight.dtype]](
        weight.data_ptr(), out.data_ptr(), meta, _DTYPE_CODES[weight.dtype], weight.element_size(),
        torch.cuda.current_stream(weight.device).cuda_stream)
    if err != 0:
        raise RuntimeError(f"convt3d head kernel: CUDA error {err} packing the weight")
    return out


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value as cuDNN rounds (tensor cores would truncate); inf and NaN kept."""
    bits = t.view(torch.int32)
    rounded = ((bits + 0x1000) & -8192).view(torch.float32)
    return torch.where(t.abs() < float("inf"), rounded, t)


@functools.cache
def _source() -> str:
    return resources.files("convt3d").joinpath("engines/cuda/head_shuffle.cu").read_text(encoding="utf-8")


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}a" if major == 9 else f"{major}{minor}"  # sm_90a: Hopper's native target


def library_path(device: torch.device, dtype: torch.dtype) -> Path:
    """The library's path in the cache directory, named by a digest of source, dtype, arch and nvcc."""
    from ...dispatch.cache import cache_dir
    arch = _arch(device)
    key = "\n".join([_source(), arch, str(_DTYPE_CODES[dtype]), " ".join(_NVCC_FLAGS), str(nvcc_path())])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "build" / f"convt3d_head_{str(dtype).replace('torch.', '')}_sm{arch}_{digest}.so"


# nvcc alone builds the library (no torch headers: far faster than load_inline), one per element type.
_NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def load_library(device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16):
    """Build the library of ``dtype`` once into the cache directory and load it with ctypes; the build
    renames a finished temporary file, so racing processes never load a half-written library."""
    code = _DTYPE_CODES[dtype]
    if code in _state["lib"]:
        return _state["lib"][code]
    with _lock:
        if code in _state["lib"]:
            return _state["lib"][code]
        device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        path = library_path(device, dtype)
        if not path.exists():
            nvcc = nvcc_path()
            if nvcc is None:
                raise BackendUnavailableError("backend='cuda': no CUDA compiler (nvcc) found; set CUDA_HOME or put "
                                              "nvcc on PATH to build the head kernel")
            path.parent.mkdir(parents=True, exist_ok=True)
            with _one_builder(path):
                if not path.exists():
                    _build(nvcc, device, code, path)
        lib = ctypes.CDLL(str(path))  # both entry points return an int, ctypes' default
        p64 = ctypes.POINTER(ctypes.c_int64)
        fn = lib.convt3d_head_launch
        fn.argtypes = [ctypes.c_void_p] * 4 + [p64, p64] + [ctypes.c_int] * 4 + [ctypes.c_void_p]
        pack = lib.convt3d_head_pack
        pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, p64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        _state["pack"][code] = pack
        _state["lib"][code] = fn
        return fn


@contextlib.contextmanager
def _one_builder(path: Path):
    """Processes that share the cache folder (the ranks of a node) build one library once: the others wait
    on a lock file beside it, then load what the first built."""
    import fcntl  # POSIX, as nvcc's builds here are

    with open(path.with_name(f".{path.name}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(nvcc: str, device: torch.device, code: int, path: Path) -> None:
    """nvcc into a temporary file renamed into place: a racing process never loads a half-written library."""
    arch = _arch(device)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / "head_shuffle.cu"
        src.write_text(_source(), encoding="utf-8")
        out = Path(tmp) / path.name
        cmd = [nvcc, *_NVCC_FLAGS, f"-DCONVT3D_HEAD_DTYPE={code}", f"-gencode=arch=compute_{arch},code=sm_{arch}",
               str(src), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BackendUnavailableError("backend='cuda': building the head kernel failed. Compiler output, last "
                                          "lines:\n" + (done.stdout + done.stderr)[-4000:])
        os.replace(out, path)


def staging_mode(x: torch.Tensor, hp: HeadPlan) -> int:
    """How the kernel stages the input: 0, 16-byte units (channels contiguous and aligned); 1, fp32
    element by element; 2, 16-bit element by element through registers."""
    v = 16 // x.element_size()
    cin_g = hp.meta[24]
    if (x.stride(1) == 1 and cin_g % v == 0 and x.data_ptr() % 16 == 0
            and all(st % v == 0 for i, st in enumerate(x.stride()) if i != 1)):
        return 0
    return 1 if x.element_size() == 4 else 2


def _launch(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, hp: HeadPlan) -> None:
    if x.device.index is not None and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):  # the runtime launches on the current device
            return _launch(x, wp, bias, y, hp)
    fn = load_library(x.device, x.dtype)
    meta = (ctypes.c_int64 * (len(hp.meta) + 11))(*hp.meta, *x.stride(), *y.stride(), staging_mode(x, hp))
    shifts = _shift_arrays.get(hp.shifts)
    if shifts is None:  # one ctypes array per plan's shift table, made once
        shifts = _shift_arrays.setdefault(hp.shifts, (ctypes.c_int64 * len(hp.shifts))(*hp.shifts))
    err = fn(x.data_ptr(), wp.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(), meta, shifts,
             len(hp.masks), _DTYPE_CODES[x.dtype], x.element_size(), hp.config,
             torch.cuda.current_stream(x.device).cuda_stream)
    if err != 0:
        raise RuntimeError(f"convt3d head kernel: CUDA error {err} at launch (configuration {hp.config}, box "
                           f"{hp.box})")


def _output(x: torch.Tensor, weight: torch.Tensor, params: ConvT3dParams) -> torch.Tensor:
    return torch.empty(params.out_shape, dtype=x.dtype, device=x.device,
                       memory_format=output_memory_format(x, weight))


def _copy_helps(x: torch.Tensor, hp: HeadPlan) -> bool:
    """Whether a channels-last copy of ``x`` would be staged by 16-byte units where ``x`` is not."""
    return staging_mode(x, hp) != 0 and hp.meta[24] % (16 // x.element_size()) == 0


def _staged_input(x: torch.Tensor, hp: HeadPlan) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last_3d) if hp.copy_cl else x


def variants(params: ConvT3dParams) -> list[int]:
    """The jn of each variant offered: 1 (plain), then J_w where ``width_shifts`` offers it."""
    return sorted({1, width_shifts(params)})


def candidate_plans(params: ConvT3dParams, dtype: torch.dtype, per_variant: int = 4) -> list[HeadPlan]:
    """What ``choose_tile`` times: the first ``per_variant`` tiles of each variant (each wins on some heads)."""
    return [plan(params, dtype, cfg, box, jn=jn) for jn in variants(params)
            for cfg, box in tile_boxes(params, dtype, jn=jn)[:per_variant]]


def choose_tile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: ConvT3dParams) -> HeadPlan:
    """The fastest of ``candidate_plans`` (and, for an input staged element by element, two of each
    variant on a channels-last copy) by CUDA events, once per signature; the first under capture."""
    key = (params, x.dtype, x.stride(), bias is not None, str(x.device))
    hp = _chosen.get(key)
    if hp is not None:
        return hp
    plans = candidate_plans(params, x.dtype)
    if not plans:
        raise BackendUnavailableError("backend='cuda': no head kernel tile fits this layer in shared memory")
    if _copy_helps(x, plans[0]):  # the first two of each variant again, on a channels-last copy
        plans += [dataclasses.replace(hp, copy_cl=True) for jn in variants(params)
                  for hp in [p for p in plans if p.jn == jn][:2]]
    if len(plans) == 1 or torch.cuda.is_current_stream_capturing():
        return plans[0]
    y = _output(x, weight, params)
    timed = []
    for hp in plans:
        wp = pack_weight_cuda(weight, params, hp)
        for _ in range(3):
            _launch(_staged_input(x, hp), wp, bias, y, hp)
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _launch(_staged_input(x, hp), wp, bias, y, hp)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        timed.append((sorted(times)[len(times) // 2], hp))
    _chosen[key] = hp = min(timed, key=lambda t: t[0])[1]  # the first of the fastest
    return hp


def loaded(dtype: torch.dtype) -> bool:
    """Whether this process has the library of ``dtype`` loaded already."""
    return _DTYPE_CODES[dtype] in _state["lib"]


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: ConvT3dParams,
            precision: str = "tf32", config: int | None = None, box: tuple[int, int, int] | None = None,
            jn: int = 1) -> torch.Tensor:
    """A validated 5-D CUDA call; ``config``, ``box`` and ``jn`` force a tile, else ``choose_tile``."""
    why = unsupported_reason(params, x.dtype, precision)
    if why is not None:
        raise BackendUnavailableError(f"backend='cuda' head kernel cannot run this call: {why}")
    y = _output(x, weight, params)
    if y.numel() == 0:
        return y
    bias = bias.contiguous() if bias is not None else None  # the kernel reads bias[g x Cout/g + co]
    hp = plan(params, x.dtype, config, box, jn=jn) if config is not None or box is not None or jn != 1 else \
        choose_tile(x, weight, bias, params)
    _launch(_staged_input(x, hp), pack_weight_cuda(weight, params, hp), bias, y, hp)
    return y


def nvcc_path() -> str | None:
    """The nvcc torch's extension builder would use, or None, without importing its slow module."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return found if os.path.isfile(found) else None
