"""The bench cases: the seven KernelBench problems (fp32 NCDHW, tf32 and tf32x3), thirteen decoder
layers and output heads (fp32 and bf16, NCDHW and channels_last_3d), and a fixed random sweep of output
heads (``heads``, not part of "all"). Weights follow ``nn.ConvTranspose3d``'s initialisation; inputs
are never zeros, since power and clocks depend on the data."""
from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import asdict, dataclass, replace
from typing import Iterable, NamedTuple

import torch

from ..core.params import Axis

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = ("ncdhw", "cl")
# The library's names: "tf32" runs under PyTorch's default flags (TF32 allowed), "tf32x3" with
# cudnn.allow_tf32 = False, where convt3d computes at exact grade.
PRECISIONS = ("tf32", "tf32x3")
OLD_PRECISIONS = {"default": "tf32", "exact": "tf32x3"}
SUITES = ("kernelbench", "layers")
EXTRA_SUITES = ("heads",)


def precision_name(name: str) -> str:
    """``name`` in the library's spelling: the former "default" and "exact" mapped, with a DeprecationWarning."""
    new = OLD_PRECISIONS.get(name)
    if new is not None:
        warnings.warn(f"precision {name!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3)
    return new or name


@dataclass(frozen=True)
class Geometry:
    """One convolution layer: the arguments of ``conv_transpose3d`` and the tensor sizes."""

    name: str
    batch: int
    in_channels: int
    out_channels: int
    in_size: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int] = (1, 1, 1)
    padding: tuple[int, int, int] = (0, 0, 0)
    output_padding: tuple[int, int, int] = (0, 0, 0)
    dilation: tuple[int, int, int] = (1, 1, 1)
    groups: int = 1
    bias: bool = False

    @staticmethod
    def of(name: str, batch: int, cin: int, cout: int, in_size, kernel, stride=1, padding=0, output_padding=0,
           dilation=1, groups: int = 1, bias: bool = False) -> "Geometry":
        """A geometry whose sizes may each be one int for all three axes."""
        sizes = (in_size, kernel, stride, padding, output_padding, dilation)
        return Geometry(name, batch, cin, cout, *((v, v, v) if isinstance(v, int) else tuple(v) for v in sizes),
                        groups, bias)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.in_channels, self.out_channels // self.groups) + self.kernel

    def conv_args(self) -> tuple:
        """(stride, padding, output_padding, groups, dilation): positional order of F.conv_transpose3d."""
        return (self.stride, self.padding, self.output_padding, self.groups, self.dilation)

    def out_size(self) -> tuple[int, int, int]:
        return tuple(Axis(*a).out_size for a in zip(self.in_size, self.kernel, self.stride, self.padding,
                                                    self.dilation, self.output_padding))

    def as_dict(self) -> dict:
        """The fields but the name, sizes as lists (as JSON writes them)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "name"}


# KernelBench level 1 as its problem files define them. Problem 73's file passes groups=4 into
# the unused output_padding slot, so the layer it builds has groups 1 and output_padding 0.
KERNELBENCH: tuple[Geometry, ...] = (
    Geometry.of("kb58", 16, 32, 16, (16, 32, 64), (3, 5, 7), 1, 0, 0, 1, 1),
    Geometry.of("kb61", 8, 48, 48, (64, 64, 64), 3, 1, 0, 0, 1, 1),
    Geometry.of("kb68", 16, 32, 64, (64, 64, 64), (3, 5, 5), 1, 0, 0, 1, 1),
    Geometry.of("kb70", 8, 48, 24, (96, 96, 96), 3, 1, 0, 0, 1, 1),
    Geometry.of("kb72", 8, 32, 32, (12, 24, 48), (3, 5, 7), 2, (1, 2, 3), (1, 1, 1), 1, 4),
    Geometry.of("kb73", 4, 32, 32, (32, 64, 128), 3, 2, 1, 0, 1, 1),
    Geometry.of("kb77", 16, 32, 64, (16, 32, 32), 3, 2, 1, 0, 2, 1),
)

# Decoder layers, then output heads (the 8-class one on the tensor-core side of the FMA threshold, the
# networks suite's VQ-VAE 240 -> 3 head on its pre-padded input).
LAYERS: tuple[Geometry, ...] = (
    Geometry.of("nnunet_128_64", 2, 128, 64, 32, 2, 2, 0, bias=True),
    Geometry.of("nnunet_64_32", 2, 64, 32, 64, 2, 2, 0, bias=True),
    Geometry.of("monai_unet_k3", 4, 64, 32, 32, 3, 2, 1, 1, bias=True),
    Geometry.of("gan_k4s2p1", 8, 256, 128, 16, 4, 2, 1, bias=False),
    Geometry.of("videogpt_k4s2p3", 4, 240, 240, (10, 34, 34), 4, 2, 3, bias=True),
    Geometry.of("aniso_122", 2, 256, 128, (8, 64, 64), (1, 2, 2), (1, 2, 2), 0, bias=True),
    Geometry.of("refine_k3s1", 4, 64, 64, 32, 3, 1, 1, bias=True),
    Geometry.of("head_gan_64to1", 16, 64, 1, 32, 4, 2, 1, bias=True),
    Geometry.of("head_video_64to3", 8, 64, 3, (32, 64, 64), (1, 4, 4), (1, 2, 2), (0, 1, 1), bias=True),
    Geometry.of("head_128to8_k3", 4, 128, 8, (16, 64, 64), 3, (1, 2, 2), 1, (0, 1, 1), bias=True),
    Geometry.of("head_k2s2_8to2", 4, 8, 2, 64, 2, 2, 0, bias=True),
    Geometry.of("head_video_k4s2p1_3", 4, 128, 3, (8, 64, 64), 4, 2, 1, bias=True),
    Geometry.of("head_vqvae_240to3", 4, 240, 3, (18, 66, 66), 4, 2, 3, bias=True),
)


# Output heads drawn once at random (decoder-like kernel, stride, padding and dilation per axis, 16-256
# in and 1-15 out channels), so that nothing in the engine was fitted to them.
HEAD_SWEEP: tuple[Geometry, ...] = (
    Geometry.of("sweep00_96to5_k333s111", 4, 96, 5, (35, 32, 31), 3, 1, 1, bias=True),
    Geometry.of("sweep01_96to3_k244s244", 4, 96, 3, (30, 41, 32), (2, 4, 4), (2, 4, 4), bias=False),
    Geometry.of("sweep02_16to15_k444s444", 8, 16, 15, (10, 15, 13), 4, 4, bias=True),
    Geometry.of("sweep03_192to3_k444s222", 1, 192, 3, (55, 66, 73), 4, 2, 1, bias=True),
    Geometry.of("sweep04_16to2_k344s222", 1, 16, 2, (60, 115, 97), (3, 4, 4), 2, 1, (1, 0, 0), groups=2, bias=True),
    Geometry.of("sweep05_48to8_k333s111", 4, 48, 8, (40, 58, 68), 3, 1, 1, bias=True),
    Geometry.of("sweep06_64to4_k233s211", 1, 64, 4, (56, 61, 81),
                (2, 3, 3), (2, 1, 1), (0, 2, 2), 0, (1, 2, 2), bias=True),
    Geometry.of("sweep07_192to8_k366s222", 4, 192, 8, (20, 26, 34),
                (3, 6, 6), 2, (1, 2, 2), (1, 0, 0), groups=2, bias=True),
    Geometry.of("sweep08_16to14_k422s222", 2, 16, 14, (40, 49, 47), (4, 2, 2), 2, (1, 0, 0), bias=True),
    Geometry.of("sweep09_256to7_k666s222", 4, 256, 7, (28, 32, 37), 6, 2, 2, bias=True),
    Geometry.of("sweep10_256to10_k333s111", 2, 256, 10, (37, 54, 50), 3, 1, 1, bias=True),
    Geometry.of("sweep11_192to9_k133s111", 4, 192, 9, (19, 31, 25), (1, 3, 3), 1, (0, 1, 1), bias=True),
)


@dataclass(frozen=True)
class Case:
    """One row of the bench: a geometry at one dtype, input layout and precision."""

    suite: str
    geometry: Geometry
    dtype: str  # key of DTYPES
    layout: str  # "ncdhw" or "cl" (channels_last_3d input)
    precision: str  # a name of PRECISIONS
    input_dist: str  # "rand" (uniform [0, 1)) or "randn"

    def __post_init__(self):  # the former precision names, mapped with a DeprecationWarning
        object.__setattr__(self, "precision", precision_name(self.precision))

    @property
    def name(self) -> str:
        return self.geometry.name

    @property
    def label(self) -> str:
        return f"{self.name} {self.dtype} {self.layout} {self.precision}"

    @property
    def allow_tf32(self) -> bool:
        """The value of ``torch.backends.cudnn.allow_tf32`` this row runs under."""
        return self.precision != "tf32x3"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _suite_cases(suite: str) -> list[Case]:
    # Rows of one geometry are adjacent: the runner reuses their tensors and, for a tf32x3 row, the
    # default-flag cuDNN time measured just before.
    if suite == "kernelbench":
        return [Case(suite, g, "fp32", "ncdhw", p, "rand") for g in KERNELBENCH for p in PRECISIONS]
    geos = {"layers": LAYERS, "heads": HEAD_SWEEP}[suite]
    return [Case(suite, g, dt, lay, "tf32", "randn") for g in geos for dt in DTYPES for lay in LAYOUTS]


def all_cases() -> list[Case]:
    return [c for s in SUITES for c in _suite_cases(s)]


def case_names() -> list[str]:
    return [g.name for g in KERNELBENCH + LAYERS + HEAD_SWEEP]


def select(suite: str = "all", names: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
           layouts: Iterable[str] | None = None, precisions: Iterable[str] | None = None) -> list[Case]:
    """The cases of ``suite`` passing every filter given (None passes all); an unknown value raises ValueError."""
    if suite != "all" and suite not in SUITES + EXTRA_SUITES:
        raise ValueError(f"unknown suite {suite!r}; expected 'all' or one of {SUITES + EXTRA_SUITES}")
    precisions = None if precisions is None else [precision_name(p) for p in precisions]
    cases = all_cases() if suite == "all" else _suite_cases(suite)
    filters = {"case": (names, case_names()), "dtype": (dtypes, list(DTYPES)),
               "layout": (layouts, list(LAYOUTS)), "precision": (precisions, list(PRECISIONS))}
    for key, (values, choices) in filters.items():
        wanted = None if values is None else set(values)
        unknown = sorted((wanted or set()) - set(choices))
        if unknown:
            raise ValueError(f"unknown {key} {', '.join(map(repr, unknown))}; expected one of {', '.join(choices)}")
        cases = [c for c in cases if wanted is None or getattr(c, "name" if key == "case" else key) in wanted]
    return cases


# ---- reduced sizes for Triton's interpreter ------------------------------------------------------
# The interpreter is slow per program iteration: batch 1, at most 16 channels per group (the same
# side of the tensor-core threshold of 8, so the same kernel path runs) and 2 input positions per
# dimension, raised until every output phase occurs.
INTERP_MAX_CHANNELS_PER_GROUP = 16
INTERP_IN_SIZE = 2


def reduced_for_interpreter(g: Geometry) -> Geometry:
    """``g`` shrunk for the CPU interpreter check: kernel, stride, padding, dilation, output_padding, groups kept."""
    cin_g = min(g.in_channels // g.groups, INTERP_MAX_CHANNELS_PER_GROUP)
    cout_g = min(g.out_channels // g.groups, INTERP_MAX_CHANNELS_PER_GROUP)
    sizes = []
    for i, k, s, p, op, d in zip(g.in_size, g.kernel, g.stride, g.padding, g.output_padding, g.dilation):
        full_out = Axis(i, k, s, p, d, op).out_size
        n = min(i, INTERP_IN_SIZE)
        while n < i and Axis(n, k, s, p, d, op).out_size < min(s, full_out):
            n += 1
        sizes.append(n)
    return replace(g, batch=1, in_channels=cin_g * g.groups, out_channels=cout_g * g.groups, in_size=tuple(sizes))


# ---- tensors -------------------------------------------------------------------------------------
Tensors = NamedTuple("Tensors", [("x", torch.Tensor), ("w", torch.Tensor), ("b", torch.Tensor | None)])


def name_seed(name: str, seed: int) -> int:
    """A stable per-name seed (crc32, not hash(): Python salts str hashes per process)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def make_tensors(case: Case, device: str | torch.device, seed: int = 0, geometry: Geometry | None = None) -> Tensors:
    """``case``'s (or ``geometry``'s) input, weight and bias, drawn in fp32 then cast: equal values in fp32 and bf16."""
    g = geometry or case.geometry
    gen = torch.Generator(device=device).manual_seed(name_seed(case.name, seed))
    draw = torch.rand if case.input_dist == "rand" else torch.randn
    x = draw((g.batch, g.in_channels) + g.in_size, generator=gen, device=device)
    bound = 1.0 / math.sqrt((g.out_channels // g.groups) * math.prod(g.kernel))  # kaiming-uniform, a = sqrt(5)
    w = (torch.rand(g.weight_shape, generator=gen, device=device) * 2 - 1) * bound
    b = (torch.rand((g.out_channels,), generator=gen, device=device) * 2 - 1) * bound if g.bias else None
    x = x.to(case.torch_dtype)
    if case.layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return Tensors(x, w.to(case.torch_dtype), None if b is None else b.to(case.torch_dtype))
