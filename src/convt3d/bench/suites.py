"""The bench cases: what is measured, with which data.

Two suites:

* ``kernelbench`` -- the seven KernelBench level-1 ConvTranspose3d problems, fp32 NCDHW, bias
  False, input ``torch.rand``, each at two precisions: "default" (PyTorch's default flags, i.e.
  TF32 on for cuDNN convolutions) and "exact" (``torch.backends.cudnn.allow_tf32 = False`` for
  both engines). 14 rows.
* ``layers`` -- seven real decoder layers and five output heads (``head_*``: 1-8 output
  channels) in fp32 and bf16, NCDHW and channels_last_3d, bias as listed, at default precision
  (the TF32 flag does not affect bf16). 48 rows.

Data. Weights and bias follow ``nn.ConvTranspose3d``'s own initialisation (kaiming-uniform with
a = sqrt(5), i.e. uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = Cout/groups * kD*kH*kW;
the same bound for the bias), which is what KernelBench's models hold. Inputs are
``torch.rand`` for KernelBench (as its ``get_inputs`` does) and ``torch.randn`` for the layers
(zero-mean activations). Never zeros: tensor-core power and clocks depend on the data.
The weight stays in its default contiguous layout; "cl" means a channels_last_3d input.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

__all__ = ["Geometry", "Case", "Tensors", "KERNELBENCH", "LAYERS", "HEAD_SWEEP", "SUITES", "EXTRA_SUITES", "DTYPES",
           "LAYOUTS", "PRECISIONS", "all_cases", "select", "case_names", "reduced_for_interpreter", "make_tensors"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = ("ncdhw", "cl")
PRECISIONS = ("default", "exact")
SUITES = ("kernelbench", "layers")
# Not part of "all": the generated head sweep (HEAD_SWEEP).
EXTRA_SUITES = ("heads",)


def _t3(v: int | Sequence[int]) -> tuple[int, int, int]:
    if isinstance(v, int):
        return (v, v, v)
    if len(v) != 3:
        raise ValueError(f"expected an int or 3 ints, got {v!r}")
    return tuple(int(i) for i in v)


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
        return Geometry(name, batch, cin, cout, _t3(in_size), _t3(kernel), _t3(stride), _t3(padding),
                        _t3(output_padding), _t3(dilation), groups, bias)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.in_channels, self.out_channels // self.groups) + self.kernel

    def conv_args(self) -> tuple:
        """(stride, padding, output_padding, groups, dilation): positional order of F.conv_transpose3d."""
        return (self.stride, self.padding, self.output_padding, self.groups, self.dilation)

    def out_size(self) -> tuple[int, int, int]:
        return tuple((i - 1) * s - 2 * p + d * (k - 1) + op + 1 for i, k, s, p, op, d in
                     zip(self.in_size, self.kernel, self.stride, self.padding, self.output_padding, self.dilation))


# KernelBench level 1, exactly as its problem files define them. Problem 73's file passes
# groups=4 into the output_padding slot, which is never used, so the layer KernelBench builds has
# groups 1 and output_padding 0 (see shared/CONTEXT.md); that is the layer measured here.
KERNELBENCH: tuple[Geometry, ...] = (
    Geometry.of("kb58", 16, 32, 16, (16, 32, 64), (3, 5, 7), 1, 0, 0, 1, 1),
    Geometry.of("kb61", 8, 48, 48, (64, 64, 64), 3, 1, 0, 0, 1, 1),
    Geometry.of("kb68", 16, 32, 64, (64, 64, 64), (3, 5, 5), 1, 0, 0, 1, 1),
    Geometry.of("kb70", 8, 48, 24, (96, 96, 96), 3, 1, 0, 0, 1, 1),
    Geometry.of("kb72", 8, 32, 32, (12, 24, 48), (3, 5, 7), 2, (1, 2, 3), (1, 1, 1), 1, 4),
    Geometry.of("kb73", 4, 32, 32, (32, 64, 128), 3, 2, 1, 0, 1, 1),
    Geometry.of("kb77", 16, 32, 64, (16, 32, 32), 3, 2, 1, 0, 2, 1),
)

# Real decoder layers: nnU-Net, MONAI UNet, a DCGAN-style 3-D generator, VideoGPT's
# decoder, an anisotropic (1,2,2) upsampler and a stride-1 refinement layer.
LAYERS: tuple[Geometry, ...] = (
    Geometry.of("nnunet_128_64", 2, 128, 64, 32, 2, 2, 0, bias=True),
    Geometry.of("nnunet_64_32", 2, 64, 32, 64, 2, 2, 0, bias=True),
    Geometry.of("monai_unet_k3", 4, 64, 32, 32, 3, 2, 1, 1, bias=True),
    Geometry.of("gan_k4s2p1", 8, 256, 128, 16, 4, 2, 1, bias=False),
    Geometry.of("videogpt_k4s2p3", 4, 240, 240, (10, 34, 34), 4, 2, 3, bias=True),
    Geometry.of("aniso_122", 2, 256, 128, (8, 64, 64), (1, 2, 2), (1, 2, 2), 0, bias=True),
    Geometry.of("refine_k3s1", 4, 64, 64, 32, 3, 1, 1, bias=True),
    # Output heads: the last layer of generators and decoders, 1-8 output channels,
    # memory-bound (a wide input read once, a thin output written once). A 3-D GAN's voxel head,
    # an RGB video head (k (1,4,4)), an 8-class head on the tensor-core side of the FMA
    # threshold, a k2 s2 segmentation head (taps never overlap) and a VQ-VAE-style 3-channel
    # k4 s2 p1 video head; the VQ-VAE video decoder's own 240 -> 3 head (networks suite,
    # ``vqvae_video``) as that network calls it, on its pre-padded input (k4 s2 p3).
    Geometry.of("head_gan_64to1", 16, 64, 1, 32, 4, 2, 1, bias=True),
    Geometry.of("head_video_64to3", 8, 64, 3, (32, 64, 64), (1, 4, 4), (1, 2, 2), (0, 1, 1), bias=True),
    Geometry.of("head_128to8_k3", 4, 128, 8, (16, 64, 64), 3, (1, 2, 2), 1, (0, 1, 1), bias=True),
    Geometry.of("head_k2s2_8to2", 4, 8, 2, 64, 2, 2, 0, bias=True),
    Geometry.of("head_video_k4s2p1_3", 4, 128, 3, (8, 64, 64), 4, 2, 1, bias=True),
    Geometry.of("head_vqvae_240to3", 4, 240, 3, (18, 66, 66), 4, 2, 3, bias=True),
)


def _head_sweep(count: int = 12, seed: int = 20261203) -> tuple[Geometry, ...]:
    """Output heads no other suite holds, drawn once from a fixed seed (``--suite heads``): the
    check of the head path and of auto on layers nobody tuned for. Per dimension a (kernel,
    stride, padding, output padding, dilation) of the kinds decoders use, the same on every
    dimension half of the time (else a depth of its own, as video heads have); 16-256 input and
    1-15 output channels, groups of 2 now and then; batch 1-8 and odd spatial sizes for 16-64 M
    input and output elements together. Nothing in the engine was fitted to these rows."""
    import random

    axis_kinds = [(1, 1, 0, 0, 1), (2, 2, 0, 0, 1), (3, 1, 1, 0, 1), (3, 2, 1, 1, 1), (4, 2, 1, 0, 1),
                  (3, 1, 2, 0, 2), (5, 1, 2, 0, 1), (4, 4, 0, 0, 1), (3, 3, 0, 0, 1), (6, 2, 2, 0, 1)]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        hw = rng.choice(axis_kinds)
        d = hw if rng.random() < 0.5 else rng.choice(axis_kinds[:5])
        k, s_, p_, op, dil = zip(d, hw, hw)
        groups = rng.choice([1, 1, 1, 1, 2])
        cin = rng.choice([16, 32, 48, 64, 96, 128, 192, 256])
        cout = groups * rng.randint(1, 15 // groups)
        batch = rng.choice([1, 2, 4, 8])
        # Input and output elements together 16-64 M.
        side = (rng.uniform(16, 64) * 2 ** 20 / (batch * (cin + cout * math.prod(s_)))) ** (1 / 3)
        size = (max(3, round(side * rng.uniform(0.5, 1.0))), max(3, round(side * rng.uniform(0.8, 1.2))),
                max(3, round(side * rng.uniform(0.8, 1.2))))
        tag = "k" + "".join(map(str, k)) + "s" + "".join(map(str, s_))
        out.append(Geometry.of(f"sweep{i:02d}_{cin}to{cout}_{tag}", batch, cin, cout, size, k, s_, p_, op, dil,
                               groups, bias=rng.random() < 0.7))
    return tuple(out)


HEAD_SWEEP: tuple[Geometry, ...] = _head_sweep()


@dataclass(frozen=True)
class Case:
    """One row of the bench: a geometry at one dtype, input layout and precision."""

    suite: str
    geometry: Geometry
    dtype: str  # key of DTYPES
    layout: str  # "ncdhw" or "cl" (channels_last_3d input)
    precision: str  # "default" (PyTorch's default flags) or "exact" (cudnn.allow_tf32 = False)
    input_dist: str  # "rand" (uniform [0, 1)) or "randn"

    @property
    def name(self) -> str:
        return self.geometry.name

    @property
    def label(self) -> str:
        return f"{self.name} {self.dtype} {self.layout} {self.precision}"

    @property
    def allow_tf32(self) -> bool:
        """The value of ``torch.backends.cudnn.allow_tf32`` this row runs under."""
        return self.precision != "exact"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _suite_cases(suite: str) -> list[Case]:
    # Rows of one geometry are adjacent so the runner reuses its tensors and, for an exact row,
    # the default-flag cuDNN time measured just before.
    if suite == "kernelbench":
        return [Case(suite, g, "fp32", "ncdhw", p, "rand") for g in KERNELBENCH for p in PRECISIONS]
    if suite == "layers":
        return [Case(suite, g, dt, lay, "default", "randn") for g in LAYERS for dt in DTYPES for lay in LAYOUTS]
    if suite == "heads":
        return [Case(suite, g, dt, lay, "default", "randn") for g in HEAD_SWEEP for dt in DTYPES for lay in LAYOUTS]
    raise ValueError(f"unknown suite {suite!r}; expected one of {SUITES + EXTRA_SUITES}")


def all_cases() -> list[Case]:
    return [c for s in SUITES for c in _suite_cases(s)]


def case_names() -> list[str]:
    return [g.name for g in KERNELBENCH + LAYERS + HEAD_SWEEP]


def select(suite: str = "all", names: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
           layouts: Iterable[str] | None = None, precisions: Iterable[str] | None = None) -> list[Case]:
    """The cases of ``suite`` ("kernelbench", "layers" or "all") that pass every filter given.

    A filter of None passes everything; an unknown value raises ValueError naming the choices.
    """
    if suite != "all" and suite not in SUITES + EXTRA_SUITES:
        raise ValueError(f"unknown suite {suite!r}; expected 'all' or one of {SUITES + EXTRA_SUITES}")
    filters = {"case": (names, case_names()), "dtype": (dtypes, list(DTYPES)),
               "layout": (layouts, list(LAYOUTS)), "precision": (precisions, list(PRECISIONS))}
    wanted: dict[str, set[str] | None] = {}
    for key, (values, choices) in filters.items():
        if values is None:
            wanted[key] = None
            continue
        values = set(values)
        unknown = sorted(values - set(choices))
        if unknown:
            raise ValueError(f"unknown {key} {', '.join(map(repr, unknown))}; expected one of {', '.join(choices)}")
        wanted[key] = values
    cases = all_cases() if suite == "all" else _suite_cases(suite)

    def keep(c: Case) -> bool:
        fields = {"case": c.name, "dtype": c.dtype, "layout": c.layout, "precision": c.precision}
        return all(wanted[k] is None or fields[k] in wanted[k] for k in fields)

    return [c for c in cases if keep(c)]


# ---- reduced sizes for Triton's interpreter ------------------------------------------------------
# The interpreter is slow per (program x tap x channel block) iteration of the GEMM kernel on one
# CPU core, so a case must stay at a few hundred iterations: batch 1, at most 16 channels per
# group (the same side of the tensor-core threshold of 8 as the full layer, so the same kernel
# path runs), and 2 input positions per dimension -- enough for taps of neighbouring inputs to
# overlap -- raised until every output residue (phase) occurs at least once.
INTERP_MAX_CHANNELS_PER_GROUP = 16
INTERP_IN_SIZE = 2


def reduced_for_interpreter(g: Geometry) -> Geometry:
    """``g`` shrunk for the CPU interpreter check; kernel, stride, padding, dilation, output_padding
    and groups are kept."""
    cin_g = min(g.in_channels // g.groups, INTERP_MAX_CHANNELS_PER_GROUP)
    cout_g = min(g.out_channels // g.groups, INTERP_MAX_CHANNELS_PER_GROUP)
    sizes = []
    for i, k, s, p, op, d in zip(g.in_size, g.kernel, g.stride, g.padding, g.output_padding, g.dilation):
        full_out = (i - 1) * s - 2 * p + d * (k - 1) + op + 1
        n = min(i, INTERP_IN_SIZE)
        while n < i and (n - 1) * s - 2 * p + d * (k - 1) + op + 1 < min(s, full_out):
            n += 1
        sizes.append(n)
    return replace(g, batch=1, in_channels=cin_g * g.groups, out_channels=cout_g * g.groups, in_size=tuple(sizes))


# ---- tensors -------------------------------------------------------------------------------------
@dataclass
class Tensors:
    x: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None


def case_seed(case: Case, seed: int) -> int:
    """A stable per-geometry seed (crc32, not hash(): Python salts str hashes per process)."""
    return (seed * 1_000_003 + zlib.crc32(case.name.encode())) % (2 ** 63)


def make_tensors(case: Case, device: str | torch.device, seed: int = 0, geometry: Geometry | None = None) -> Tensors:
    """Input, weight and bias of ``case`` (or of ``geometry``, e.g. its reduced form) on ``device``.

    Generated in fp32 on the device (no host round trip for the 1 GB inputs) and then cast, so a
    geometry gets the same values in fp32 and bf16 up to rounding.
    """
    g = geometry or case.geometry
    gen = torch.Generator(device=device)
    gen.manual_seed(case_seed(case, seed))
    shape_x = (g.batch, g.in_channels) + g.in_size
    if case.input_dist == "rand":
        x = torch.rand(shape_x, generator=gen, device=device)
    else:
        x = torch.randn(shape_x, generator=gen, device=device)
    fan_in = (g.out_channels // g.groups) * math.prod(g.kernel)
    bound = 1.0 / math.sqrt(fan_in)
    w = (torch.rand(g.weight_shape, generator=gen, device=device) * 2 - 1) * bound
    b = (torch.rand((g.out_channels,), generator=gen, device=device) * 2 - 1) * bound if g.bias else None
    dtype = case.torch_dtype
    x, w = x.to(dtype), w.to(dtype)
    b = b.to(dtype) if b is not None else None
    if case.layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return Tensors(x, w, b)
