"""The CUDA C++ engine (``backend="cuda"``): fp32 FFMA, exact or TF32, compiled at first use.

The kernel source is ``gemm.cu`` beside it (its header comment describes the design). It
is compiled by ``torch.utils.cpp_extension.load_inline`` for the running GPU's architecture,
under a module name that includes a hash of the source and the flags: the torch extensions
cache serves later processes, and a changed source builds afresh.

Geometry is not compiled in: ``geometry_table`` turns ``ConvT3dParams`` into a small int32 table
(per dimension and residue: taps, first tap, first input offset, compact size) and ``meta``
lists the sizes, so one compiled module serves every shape.

Precision: "ieee" (the default, the engine's exact grade) multiplies the fp32 operands as they
are; "tf32" first rounds the input and the packed weight to TF32 as cuDNN does (round to
nearest, ties away from zero) and accumulates in fp32, the numerics of PyTorch's default-flag
convolutions. Both run the same FFMA kernels (the .cu's header comment: TF32 mode).

This module is also copied verbatim into the KernelBench CUDA entry (``convt3d export-kernelbench``),
so it imports only torch, the standard library, ``params`` and ``errors``, and avoids the words
KernelBench's static checker refuses.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from importlib import resources

import torch

from ...core.errors import BackendUnavailableError
from ...core.params import ConvT3dParams

__all__ = ["PRECISIONS", "VARIANTS", "GEMM_VARIANTS", "MMA_VARIANTS", "variant_names", "unsupported_reason", "forward", "build_seconds",
           "geometry_table", "kernel_meta", "choose_variant", "gemm_applies", "cuda_source", "nvcc_path",
           "output_memory_format", "load_module", "launch_plan", "launch_limit_violations", "pack_weight",
           "pack_weight_padded", "HALO_VARIANTS", "halo_layout"]

# Tile variants of phase_kernel, as the .cu lists them: name -> (index, P rows, C channels per
# thread, warps along rows, warps along channels). Output channels per block = C x warps.
VARIANTS = {
    "p8c16": (0, 8, 16, 1, 4),
    "p4c16": (1, 4, 16, 2, 4),
    "p8c8": (2, 8, 8, 2, 4),
    "p16c8": (3, 16, 8, 1, 4),
    "p8c8w": (4, 8, 8, 4, 2),
    "p8c4": (5, 8, 4, 4, 1),
    "direct": (-1, 0, 0, 0, 0),
}
# gemm_kernel variants (register-blocked implicit GEMM, 256 threads of 8 x 8), as the .cu's
# GEMM_VARIANTS lists them: name -> (index, BN output channels, BM positions per block, BK input
# channels per K step, STAGES steps in flight). g64k8 and g64k32 are the 64-channel tile with a
# shallower (smaller unrolled loop) and a deeper (half the per-step overhead, two stages) K step,
# for timing against g64.
GEMM_VARIANTS = {
    "g64": (6, 64, 256, 16, 3),
    "g32": (7, 32, 512, 16, 3),
    "g64k8": (8, 64, 256, 8, 3),
    "g64k32": (9, 64, 256, 32, 2),
    "g64r": (10, 64, 256, 8, 3),
}
# gemm_kernel variants with the HALO loop (the .cu's GEMM_VARIANTS HALO column): the tile's input
# window is staged in shared memory once per (depth tap, chunk of BK channels), with the weights of
# all (h, w) taps, and reused across those taps (KB 77: 9 taps per window, 10 x 36 floats per
# channel gathered from L2 instead of 9 x 256). Where ``halo_layout`` refuses the geometry the
# launcher runs the plain variant of the same (BN, BK, STAGES) -- the value here -- which takes the
# same padded weight packing.
# g64r stays a selectable experiment, never the default: cutting the L2 gathers did not pay
# (tools/gpu_cuda.py variants), because its 90 KB window allows 2 blocks per SM and the gathers
# were not what held g64k32 back.
HALO_VARIANTS = {"g64r": "g64k8"}
# gemm_kernel's MMA form (the .cu's GEMM_VARIANTS MMA column), TF32 mode only: the same block tile,
# loader and epilogue, the products on the tensor cores (mma.sync m16n8k8 TF32, fp32 accumulation)
# from stage tiles whose rows are padded by MMA_PAD floats. Same tuple layout as GEMM_VARIANTS.
MMA_VARIANTS = {
    "g64t": (11, 64, 256, 32, 2),
    "g64t16": (12, 64, 256, 16, 3),
}
MMA_PAD = 8
_GEMM_ALL = {**GEMM_VARIANTS, **MMA_VARIANTS}
HALO_MAX_SHIFT = 4              # width shifts (Tw-1)*osw a thread's two float4 per row cover
HALO_SMEM_MAX = 110 * 1024      # bytes: two blocks per SM on H100/H200 (228 KB, 1 KB reserved each)
HEADER = 16  # int32 header of the geometry table (see the .cu)
PRECISIONS = ("ieee", "tf32")  # forward(precision=...): exact fp32, or operands rounded to TF32

# Set by the KernelBench export to the .cu text; the package reads gemm.cu instead.
CUDA_SOURCE = None

_CPP_DECL = ("torch::Tensor convt3d_forward(torch::Tensor x, torch::Tensor wpk, torch::Tensor bias, bool has_bias, "
             "torch::Tensor tab, std::vector<int64_t> meta, int64_t variant, bool hreuse, bool tf32);")

_state = {"module": None, "seconds": None}
_tables: dict[tuple, torch.Tensor] = {}


def cuda_source() -> str:
    if CUDA_SOURCE is not None:
        return CUDA_SOURCE
    return resources.files("convt3d").joinpath("engines/cuda/gemm.cu").read_text(encoding="utf-8")


def nvcc_path() -> str | None:
    """The CUDA compiler torch's extension builder would use, or None: found where that builder
    looks for CUDA_HOME ($CUDA_HOME, $CUDA_PATH, the nvcc on PATH, /usr/local/cuda) without
    importing ``torch.utils.cpp_extension``, which imports setuptools -- a large part of a
    process's first call, which every fp32 layer's support check would pay."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            candidate = os.path.join(home, "bin", "nvcc")
            if os.path.isfile(candidate):
                return candidate
    found = shutil.which("nvcc")
    if found:
        return found
    candidate = os.path.join("/usr/local/cuda", "bin", "nvcc")
    return candidate if os.path.isfile(candidate) else None


def output_memory_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """PyTorch's rule (the Triton engine's ``output_memory_format``): channels_last_3d out if the
    input or the weight suggests it. Restated here so this module needs nothing but torch."""
    for t in (x, weight):
        if t.dim() != 5 or t.is_contiguous():
            continue
        if t.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
        dims = [i for i in range(5) if t.shape[i] > 1]
        if 1 in dims and t.stride(1) == min(t.stride(i) for i in dims):
            return torch.channels_last_3d
    return torch.contiguous_format


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, params: ConvT3dParams) -> str | None:
    """Why the CUDA engine cannot run this call, or None. Never builds anything."""
    if x.device.type != "cuda":
        return f"{x.device.type.upper()} tensor (the cuda engine runs on CUDA devices only)"
    for name, t in (("input", x), ("weight", weight)):
        if t.dtype != torch.float32:
            return f"{name} dtype {t.dtype}: the cuda engine is fp32 only"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major < 8:
        return f"GPU compute capability {major}.{minor}: the cuda engine needs 8.0+ (cp.async)"
    if _state["module"] is None and nvcc_path() is None:
        return "no CUDA compiler (nvcc) found: set CUDA_HOME or put nvcc on PATH to build the cuda engine"
    if params.batch * params.out_channels * math.prod(params.out_size) > 0 and _grid_too_large(params):
        return "more than 2^31 thread blocks"
    return None


def build_seconds() -> float | None:
    """Wall time of the first-use build (or cache load) in this process; None before it."""
    return _state["seconds"]


def _arch_flags(device: torch.device) -> tuple[list[str], str]:
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"{major}{minor}"
    suffix = "a" if major >= 9 and os.environ.get("CONVT3D_CUDA_ARCH_SUFFIX") == "a" else ""
    return [f"-gencode=arch=compute_{arch}{suffix},code=sm_{arch}{suffix}"], f"sm{arch}{suffix}"


class _BuildFailure:
    """Turns any build error into BackendUnavailableError with the compiler's output tail."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is None or isinstance(value, BackendUnavailableError):
            return False
        text = str(value)
        raise BackendUnavailableError(
            f"backend='cuda': building the CUDA engine failed ({type(value).__name__}). Compiler output, last "
            f"lines:\n{text[-4000:]}") from value


def load_module(device: torch.device | None = None):
    """Build (or load from the torch extensions cache) the compiled module, once per process."""
    module = _state["module"]
    if module is not None:
        return module
    # One build per process; a second thread racing here would only load the cached build.
    if nvcc_path() is None:
        raise BackendUnavailableError("backend='cuda': no CUDA compiler (nvcc) found; set CUDA_HOME or put nvcc "
                                      "on PATH to build the cuda engine")
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    arch, tag = _arch_flags(device)
    cflags = ["-O3", "--std=c++17"] + arch
    source = cuda_source()
    digest = hashlib.sha256("\n".join([source, _CPP_DECL, " ".join(cflags), torch.__version__]).encode())
    name = f"convt3d_cuda_{tag}_{digest.hexdigest()[:12]}"
    t0 = time.perf_counter()
    with _BuildFailure():
        from torch.utils.cpp_extension import load_inline

        module = load_inline(name=name, cpp_sources=_CPP_DECL, cuda_sources=source,
                             functions=["convt3d_forward"], extra_cuda_cflags=cflags,
                             extra_cflags=["-O2"], verbose=os.environ.get("CONVT3D_CUDA_VERBOSE") == "1")
    _state["seconds"] = time.perf_counter() - t0
    _state["module"] = module
    return module


# ---- geometry -----------------------------------------------------------------------------------
def geometry_table(params: ConvT3dParams) -> list[int]:
    """int32 values the kernel reads (layout in the .cu): a 16-value header, then per dimension
    and residue one row (taps T, first tap t0, first input offset off0, compact size Q)."""
    axes = params.axes
    header = [0] * HEADER
    rows: list[int] = []
    first = 0
    for i, axis in enumerate(axes):
        phases = axis.phases
        header[i] = axis.stride
        header[3 + i] = max(p.size for p in phases if p.num_taps > 0)
        header[6 + i] = axis.tap_step
        header[9 + i] = axis.offset_step
        header[12 + i] = first
        for p in phases:
            rows += [p.num_taps, p.first_tap, p.first_offset, p.size]
        first += len(phases)
    header[15] = first
    return header + rows


def kernel_meta(params: ConvT3dParams) -> list[int]:
    """The 28 sizes ``convt3d_forward`` takes (order as in the .cu)."""
    axes = params.axes
    live = [[p for p in a.phases if p.num_taps > 0] for a in axes]
    qc = _launch_qc(params)
    halo = [max((p.num_taps - 1) * a.offset_step for p in ph) for a, ph in zip(axes, live)]
    thw = max(p.num_taps for p in live[1]) * max(p.num_taps for p in live[2])
    return [params.batch, params.groups, params.in_channels_per_group, params.out_channels_per_group,
            *params.in_size, *params.out_size, *params.kernel_size, *qc, halo[1], halo[2], thw,
            *params.stride, *params.padding, *params.dilation]


def _launch_qc(params: ConvT3dParams) -> list[int]:
    """The compact grid the kernel launches over, per dimension: the largest compact size of a
    residue with taps, but at least 1. A residue can have taps and no outputs while an empty one
    has an output (sweep9: OD = 1 with stride 2 and padding 1, so the only depth output is residue 0,
    which has no taps, and residue 1 holds the tap but 0 outputs). A grid of 0 there launched
    nothing, and CUDA refuses a launch of 0 blocks; with 1, the block of the last compact index
    writes the extra index of the empty residues, i.e. the bias."""
    return [max(1, max(p.size for p in a.phases if p.num_taps > 0)) for a in params.axes]


def variant_names(precision: str = "ieee") -> list[str]:
    """Every name ``forward(variant=..., precision=precision)`` takes: the phase_kernel tiles,
    "direct", the gemm tiles, and for "tf32" also the tensor-core tiles (MMA_VARIANTS)."""
    return list(VARIANTS) + list(GEMM_VARIANTS) + (list(MMA_VARIANTS) if precision == "tf32" else [])


def gemm_applies(params: ConvT3dParams, name: str = "g64") -> bool:
    """Whether the launcher runs gemm_kernel ``name`` for these sizes (else it falls back to the
    direct kernel): 32-bit offsets inside one group's input and inside the compact (h, w) plane, a
    tap table of at most GEMM_MAX_TAPS entries, a grid below 2^31 blocks. Mirrors convt3d_forward."""
    _, bn, bm, _, _ = _GEMM_ALL[name]
    qc = _launch_qc(params)
    plane_q = qc[1] * qc[2]
    blocks = -(-params.out_channels_per_group // bn) * -(-plane_q // bm) * qc[0] * params.batch * params.groups
    return (blocks <= 2**31 - 1 and plane_q + bm <= 2**31 - 1 and math.prod(params.kernel_size) <= GEMM_MAX_TAPS
            and params.in_channels_per_group * math.prod(params.in_size) <= 2**31 - 1)


def halo_layout(params: ConvT3dParams, name: str = "g64r") -> dict | None:
    """The shared-memory window of HALO variant ``name`` (a mirror of the .cu's halo_layout), or
    None where it does not apply and the launcher runs ``HALO_VARIANTS[name]`` instead: the
    compact width not a multiple of 4 (a thread's groups of 4 positions must stay in one row and
    16-byte aligned), a width shift (Tw-1)*osw over HALO_MAX_SHIFT, more than HALO_SMEM_MAX bytes,
    or outside gemm_kernel's limits (``gemm_applies``: then the direct kernel). Keys: rows (compact
    rows one tile touches, at most), pitch (window row floats), ch (floats per input channel),
    a (window floats per stage), stage (window + weights per stage), region (pipeline or epilogue
    floats, the larger), smem (bytes, with the tap table)."""
    if not gemm_applies(params, name):
        return None
    _, bn, bm, bk, stages = GEMM_VARIANTS[name]
    meta = kernel_meta(params)
    qch, qcw, halo_h, halo_w, max_thw = meta[14], meta[15], meta[16], meta[17], meta[18]
    if qcw % 4 != 0 or halo_w > HALO_MAX_SHIFT:
        return None
    g = math.gcd(bm, qcw)  # a tile starts at a multiple of g within its compact row
    rows = min(qch, (bm - 1 + qcw - g) // qcw + 1)
    pitch = qcw + HALO_MAX_SHIFT
    ch = (rows + halo_h) * pitch
    a = bk * ch
    stage = a + max_thw * bk * bn
    region = max(stages * stage, bn // 2 * (bm + 4))
    smem = 4 * region + 16 * math.prod(params.kernel_size)
    if smem > HALO_SMEM_MAX:
        return None
    return {"rows": rows, "pitch": pitch, "ch": ch, "a": a, "stage": stage, "region": region, "smem": smem}


def hreuse_applies(params: ConvT3dParams) -> bool:
    """The H-reuse inner loop serves phases with offset step 1 along H and 2-3 taps there."""
    h = params.axes[1]
    return h.offset_step == 1 and any(p.num_taps in (2, 3) for p in h.phases)


def choose_variant(params: ConvT3dParams, precision: str = "ieee") -> str:
    """The tile variant by output channels per group (a block's channel tile should not be much
    wider than the group): 64 channels for wide layers, down to 4 for depthwise ones.

    gemm_kernel (g64 for more than 32 output channels per group, g64k8 when there are also fewer
    than 16 input channels per group, g32 for 17-32 output channels) is the default where it
    applies: its 8 x 8 register tile issues 64 FFMAs per 4 shared-memory loads at 128 registers
    and 16 warps per SM, where phase_kernel's best tile (p8c16, 252 registers, 8 warps per SM)
    reaches a third of the FFMA ceiling (``tools/gpu_cuda.py variants`` times every variant;
    g64k32 is the candidate where Cin/g is a multiple of 32). It needs at least 8 input channels
    per group (fewer would mostly multiply the zero padding of a K step) and the launcher's
    32-bit limits (``gemm_applies``); narrow groups (KB 58/72: 8-16 output channels per group)
    stay on phase_kernel's narrow tiles.

    In TF32 mode the 64-channel tiles for 16+ input channels per group run on the tensor cores
    (g64t where Cin/g is a multiple of 32, as g64k32; else g64t16): the same tile and traffic with
    the FFMA work (which held the FFMA tiles at half the FFMA ceiling) moved to mma.sync."""
    override = os.environ.get("CONVT3D_CUDA_VARIANT")
    if override:
        if override not in variant_names(precision):
            raise ValueError(f"CONVT3D_CUDA_VARIANT={override!r}; expected one of {sorted(variant_names(precision))}")
        return override
    cout_g = params.out_channels_per_group
    if params.in_channels_per_group >= 8:
        if precision == "tf32" and cout_g > 32 and params.in_channels_per_group >= 16:
            name = "g64t" if params.in_channels_per_group % 32 == 0 else "g64t16"
            if gemm_applies(params, name):
                return name
        if cout_g > 32 and gemm_applies(params, "g64"):
            # The 32-channel K step halves the per-step overhead where Cin/g fills it; g64k32 is
            # then the fastest of the variants (tools/gpu_cuda.py variants).
            if params.in_channels_per_group % 32 == 0 and gemm_applies(params, "g64k32"):
                return "g64k32"
            return "g64k8" if params.in_channels_per_group < 16 else "g64"
        if 16 < cout_g <= 32 and gemm_applies(params, "g32"):
            return "g32"
    if cout_g <= 4:
        return "p8c4"
    if cout_g <= 16:
        return "p8c8w"
    if cout_g <= 32:
        return "p8c8"
    return "p8c16"


def _grid_too_large(params: ConvT3dParams) -> bool:
    # The largest grid of any variant: 8 x 32 position tiles and 4 output channels per block.
    qc = _launch_qc(params)
    blocks = params.groups * params.batch * qc[0] * -(-qc[1] // 8) * -(-qc[2] // 32) * \
        -(-params.out_channels_per_group // 4)
    return blocks > 2**31 - 1


# The launcher's limits (convt3d_forward in the .cu), restated for launch_plan.
GEMM_THREADS = 256
GEMM_MAX_TAPS = 4096         # kD*kH*kW of gemm_kernel's tap table in shared memory
CI_MAX = 8                   # input channels per pipeline stage, at most
SMEM_TARGET = 100 * 1024     # bytes of dynamic shared memory per block: two blocks per SM (228 KB)
SMEM_DEFAULT = 48 * 1024     # above this a kernel needs cudaFuncAttributeMaxDynamicSharedMemorySize
SMEM_OPTIN_H100 = 232448     # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200 (227 KB)
DIRECT_THREADS, DIRECT_MAX_BLOCKS = 256, 65535 * 32


def launch_plan(params: ConvT3dParams, variant: str, hreuse: bool, smem_optin: int = SMEM_OPTIN_H100) -> dict:
    """The launch ``convt3d_forward`` in the .cu makes for these sizes: kernel ("phase" or
    "direct"), variant, grid and block (x, y, z), dynamic shared memory bytes, input channels per
    stage. A hand-kept mirror of the C++ arithmetic, so the CPU tests can hold every geometry
    of the sweep against the device's launch limits (``launch_limit_violations``). A HALO variant
    that runs its window path has ``"halo": True``; outside ``halo_layout`` the plan is its plain
    tile's (``HALO_VARIANTS``), as the launcher runs."""
    meta = kernel_meta(params)
    qcd, qch, qcw, halo_h, halo_w, max_thw = meta[13:19]
    cout_g, cin_g = params.out_channels_per_group, params.in_channels_per_group
    total = params.batch * params.out_channels * math.prod(params.out_size)
    if variant in HALO_VARIANTS:
        layout = halo_layout(params, variant)
        if layout is None:  # the launcher runs the plain tile of the same shape (or direct)
            return launch_plan(params, HALO_VARIANTS[variant], hreuse, smem_optin)
        return {"kernel": "gemm", "variant": variant, "grid": launch_plan(params, HALO_VARIANTS[variant], hreuse,
                                                                          smem_optin)["grid"],
                "block": (GEMM_THREADS, 1, 1), "smem": layout["smem"], "ci_chunk": GEMM_VARIANTS[variant][3],
                "halo": True}
    if variant in _GEMM_ALL:
        _, bn, bm, bk, stages = _GEMM_ALL[variant]
        if gemm_applies(params, variant):
            blocks = -(-cout_g // bn) * -(-(qch * qcw) // bm) * qcd * params.batch * params.groups
            # pipeline buffers and epilogue tile share one region (the larger), then the tap table;
            # the MMA form pads each stage row of A and B by MMA_PAD floats
            pad = 2 * MMA_PAD if variant in MMA_VARIANTS else 0
            smem = 4 * max(stages * bk * (bm + bn + pad), bn // 2 * (bm + 4)) + 16 * math.prod(params.kernel_size)
            return {"kernel": "gemm", "variant": variant, "grid": (blocks, 1, 1), "block": (GEMM_THREADS, 1, 1),
                    "smem": smem, "ci_chunk": bk}
        idx = -1
    else:
        idx, P, C, WP, WC = VARIANTS[variant]
    if idx >= 0:
        tqh, co_t = WP * P, WC * C
        blocks = -(-cout_g // co_t) * -(-qcw // 32) * -(-qch // tqh) * qcd * params.batch * params.groups
        xh_alloc = (tqh + max(halo_h, 2 if hreuse else 0)) | 1
        xw_alloc = 32 + halo_w
        for cc in range(min(CI_MAX, cin_g), 0, -1):
            xs = -(-(cc * xh_alloc * xw_alloc) // 4) * 4
            smem = 2 * (xs + cc * max_thw * co_t) * 4
            if smem <= SMEM_TARGET or (cc == 1 and smem <= smem_optin):
                if blocks <= 2**31 - 1:
                    return {"kernel": "phase", "variant": variant, "grid": (blocks, 1, 1),
                            "block": (32 * WP * WC, 1, 1), "smem": smem, "ci_chunk": cc}
                break
    blocks = min(-(-total // DIRECT_THREADS), DIRECT_MAX_BLOCKS)
    return {"kernel": "direct", "variant": "direct", "grid": (blocks, 1, 1), "block": (DIRECT_THREADS, 1, 1),
            "smem": 0, "ci_chunk": 0}


def launch_limit_violations(plan: dict, smem_optin: int = SMEM_OPTIN_H100) -> list[str]:
    """The CUDA launch limits a plan breaks (empty: it launches): every grid dimension at least 1,
    grid.x < 2^31 and grid.y/z <= 65535, at most 1024 threads, dynamic shared memory within the
    opt-in maximum (the launcher raises the attribute above 48 KB)."""
    gx, gy, gz = plan["grid"]
    bad = []
    if min(gx, gy, gz) < 1:
        bad.append(f"empty grid {plan['grid']}")
    if gx > 2**31 - 1 or gy > 65535 or gz > 65535:
        bad.append(f"grid {plan['grid']} over (2^31-1, 65535, 65535)")
    if math.prod(plan["block"]) > 1024 or min(plan["block"]) < 1:
        bad.append(f"block {plan['block']}")
    if plan["smem"] > smem_optin:
        bad.append(f"{plan['smem']} bytes of shared memory over {smem_optin}")
    return bad


def _table(params: ConvT3dParams, device: torch.device) -> torch.Tensor:
    key = (params.in_size, params.kernel_size, params.stride, params.padding, params.output_padding,
           params.dilation, str(device))
    tab = _tables.get(key)
    if tab is None:
        tab = torch.tensor(geometry_table(params), dtype=torch.int32).to(device)
        _tables[key] = tab
    return tab


def pack_weight(weight: torch.Tensor, params: ConvT3dParams) -> torch.Tensor:
    """(Cin, Cout/g, kD, kH, kW) -> (g, kD, kH, kW, Cin/g, Cout/g): a tap's (channel x output
    channel) block is contiguous, so each staged weight row is one coalesced read."""
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    return weight.reshape(g, cin_g, cout_g, *params.kernel_size).permute(0, 3, 4, 5, 1, 2).contiguous()


def pack_weight_padded(weight: torch.Tensor, params: ConvT3dParams, bn: int, bk: int) -> torch.Tensor:
    """gemm_kernel's packing: ``pack_weight``'s (g, kD, kH, kW, Cin/g, Cout/g) with Cin/g padded
    to a multiple of ``bk`` and Cout/g to a multiple of ``bn`` by zeros, so every staged weight row
    is whole float4s and needs no masks (the padded input channels are zero-filled too)."""
    packed = pack_weight(weight, params)
    cin_g, cout_g = params.in_channels_per_group, params.out_channels_per_group
    cin_pad, cout_pad = -(-cin_g // bk) * bk, -(-cout_g // bn) * bn
    if (cin_pad, cout_pad) == (cin_g, cout_g):
        # the kernel reads float4: a packing that is the caller's own (offset) view must be copied
        return packed if packed.data_ptr() % 16 == 0 else packed.clone()
    out = packed.new_zeros(packed.shape[:4] + (cin_pad, cout_pad))
    out[..., :cin_g, :cout_g] = packed
    return out


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: ConvT3dParams,
            precision: str = "ieee", variant: str | None = None, hreuse: bool | None = None) -> torch.Tensor:
    """Transposed convolution of a validated 5-D fp32 CUDA input.

    ``precision`` is "ieee" (exact fp32 FFMA) or "tf32" (input and weight rounded to TF32 as
    cuDNN rounds them, products accumulated in fp32). ``variant`` forces a tile variant (one of
    ``variant_names()``: a phase_kernel tile, "direct" for the one-thread-per-output fallback, or
    a gemm_kernel tile), ``hreuse`` the H-reuse inner loop of phase_kernel; by default both
    follow the geometry.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"backend='cuda': precision={precision!r}; expected one of {PRECISIONS}")
    why = unsupported_reason(x, weight, params)
    if why is not None:
        raise BackendUnavailableError(f"backend='cuda' cannot run this call: {why}")
    fmt = output_memory_format(x, weight)
    if params.batch * params.out_channels * math.prod(params.out_size) == 0:
        return torch.empty(params.out_shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    name = variant if variant is not None else choose_variant(params, precision)
    if name not in variant_names(precision):
        raise ValueError(f"variant={name!r} at precision={precision!r}; expected one of "
                         f"{sorted(variant_names(precision))}")
    module = load_module(x.device)
    use_hreuse = hreuse_applies(params) if hreuse is None else bool(hreuse)
    b = bias.contiguous() if bias is not None else x.new_empty(0)
    if name in _GEMM_ALL:
        index, bn, _, bk, _ = _GEMM_ALL[name]
        # the launcher's fallback for sizes gemm_kernel does not take is the direct kernel (plain packing)
        wpk = pack_weight_padded(weight, params, bn, bk) if gemm_applies(params, name) else pack_weight(weight, params)
        index = index if gemm_applies(params, name) else VARIANTS["direct"][0]
    else:
        index, wpk = VARIANTS[name][0], pack_weight(weight, params)
    y = module.convt3d_forward(x.contiguous(), wpk, b, bias is not None, _table(params, x.device),
                               kernel_meta(params), index, use_hreuse, precision == "tf32")
    if fmt == torch.channels_last_3d:
        y = y.contiguous(memory_format=torch.channels_last_3d)
    return y
