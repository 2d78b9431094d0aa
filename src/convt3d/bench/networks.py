"""The networks suite: whole 3-D networks, untouched against ``convt3d.patch``-ed, in one process.

    convt3d bench --suite networks                      # every network, three modes each
    convt3d bench --suite networks --case gan3d,monai_unet --mode fwd --dtype bf16

Networks. Two are written here from their published layouts (no code taken from their projects):

* ``gan3d`` -- the 3D-GAN generator of Wu et al. (2016): z (200) -> 512x4^3 -> 256x8^3 ->
  128x16^3 -> 64x32^3 -> 1x64^3, ConvTranspose3d k4 s2 p1 (the first k4 s1 p0 from 1^3), each
  followed by BatchNorm3d + ReLU, a sigmoid head; batch 32.
* ``vqvae_video`` -- a VQ-VAE video decoder laid out as VideoGPT's (Yan et al. 2021): 240 channels,
  four residual blocks (BN-ReLU-Conv3d k3 to 120 channels, BN-ReLU-Conv3d k1 back to 240, BN-ReLU
  and axial self-attention over T, H and W, 2 heads), then ConvTranspose3d k4 s2 after a
  "same" pre-pad of one voxel per side (so padding 3, the bench's ``videogpt_k4s2p3`` layer),
  240 -> 240 and 240 -> 3 (the RGB head); latent (4, 240, 8, 32, 32) -> video (4, 3, 32, 128, 128).

The others come from the packages their users install (the optional extra ``networks``: MONAI and
nnU-Net's dynamic-network-architectures). A network whose package is missing is skipped with a
one-line reason.

Modes. For each network: inference in fp32 (``torch.no_grad``, eval mode, PyTorch's default
flags: TF32 on for cuDNN convolutions), inference under ``torch.autocast(dtype=torch.bfloat16)``,
and a bf16-autocast training step (train mode; forward, an MSE loss against a fixed random target
computed in fp32, ``torch.autograd.grad`` of every parameter; no optimizer).

What a row holds (see :func:`run_networks`): the first call of each model in that mode (wall clock,
synchronised: for the patched model it includes Triton compilation, tuning and auto's measuring,
i.e. it is "cold" unless the persistent cache already holds the signatures), the steady time of
each (``CudaTimer.paired``: blocks of calls of the untouched and the patched model timed back to
back in ``DEFAULT_PAIRS`` pairs, alternating which goes first; the medians of each side's blocks),
the ratio untouched / patched (the median of the pairs' ratios, with their quartiles: see
``stats.paired_ratio``), the share of ConvTranspose3d in the untouched forward's GPU time, and
the agreement of the outputs (patched vs untouched, both vs a reference).

The ConvTranspose3d share is read from ``torch.profiler``: the GPU time of every kernel launched
inside an outermost ``aten::conv_transpose3d`` op (or, should a model call them directly,
``aten::cudnn_convolution_transpose`` / ``aten::slow_conv_transpose3d``), autocast's operand casts
included, over the GPU time of all kernels of one forward. Profiler op names identify the layers
whatever module wraps them; ``aten::convolution`` is not used because it serves both directions.
The patched forward is profiled the same way (its layers are ``convt3d::conv_transpose3d`` ops:
the custom op under torch.compile, a ``record_function`` range of that name in eager calls, which
holds the Triton kernels too):
``convt_us_patched`` next to ``convt_us`` says whether a patched network's time went into its
transposed convolutions or elsewhere, and ``layer_decisions`` holds each layer's decision with the
timings it was made from.

References. Inference rows are compared with the same (untouched) model in float64 on the same
input; training rows with the untouched model's fp32 step with TF32 off (its error, ~1e-6
relative, is far below bf16's ~4e-3, so it stands for the exact gradients at a fraction of a
float64 step's cost). Errors are relative. Inference: max |y - ref| / max |ref|. Training: the
norm-wise error of all parameter gradients together, ||g - ref|| / ||ref|| (a per-parameter
maximum would be ruled by gradients that are zero in exact arithmetic -- a bias followed by a
normalisation -- where both models' errors are pure rounding noise over ~1e-10, thousands of
times over in "relative" terms), and the same over the ConvTranspose3d
weights alone (``convt_grad_rel_err``: the layers convt3d computes). ``within_error_budget``: each
patched error is at most twice the untouched one (the project's budget), or one unit of the mode's
epsilon.

Without CUDA, :func:`check_networks` builds every network at a tiny size on the CPU and compares
the patched model (``backend="triton"`` through Triton's interpreter) with the untouched one and
float64, under the same budget.
"""
from __future__ import annotations

import copy
import importlib
import importlib.metadata
import math
import statistics
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .roofline import cudnn_tf32
from .stats import paired_ratio
from ..engines.op import OP_NAME
from ..engines.torch import cudnn_conv_allows_tf32

__all__ = ["GAN3DGenerator", "VideoDecoder", "AxialAttention3d", "Network", "NetMode", "NETWORKS", "NET_MODES",
           "network_names", "select_networks", "select_modes", "unavailable_reason", "build_network",
           "convt_layer_count", "transposed_share", "run_networks", "check_networks", "relative_error",
           "normwise_error"]

EXTRA_HINT = "pip install -e '.[networks]'"


# ---- networks written in the project ------------------------------------------------------------
class GAN3DGenerator(nn.Module):
    """3D-GAN generator (Wu et al. 2016): a latent vector to a voxel grid of occupancy.

    ``widths`` are the feature channels after each up-convolution but the last; the grid side is
    4 * 2^len(widths) (64 for the paper's four widths). Bias is off in every layer: BatchNorm
    follows each hidden layer, and the paper's generator (as DCGAN's) has none in the head.
    """

    def __init__(self, z_dim: int = 200, widths: Sequence[int] = (512, 256, 128, 64), out_channels: int = 1):
        super().__init__()
        if not widths:
            raise ValueError("GAN3DGenerator needs at least one hidden width")
        layers: list[nn.Module] = [nn.ConvTranspose3d(z_dim, widths[0], 4, 1, 0, bias=False),
                                   nn.BatchNorm3d(widths[0]), nn.ReLU(inplace=True)]
        for cin, cout in zip(widths, widths[1:]):
            layers += [nn.ConvTranspose3d(cin, cout, 4, 2, 1, bias=False), nn.BatchNorm3d(cout), nn.ReLU(inplace=True)]
        layers += [nn.ConvTranspose3d(widths[-1], out_channels, 4, 2, 1, bias=False), nn.Sigmoid()]
        self.net = nn.Sequential(*layers)
        self.z_dim = z_dim

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() == 2:  # (N, z_dim) -> (N, z_dim, 1, 1, 1)
            z = z[:, :, None, None, None]
        return self.net(z)


class AxialAttention3d(nn.Module):
    """Multi-head self-attention along each of the T, H and W axes of (N, C, T, H, W), summed
    (VideoGPT's axial block): a sequence is one line of voxels along the axis."""

    def __init__(self, channels: int, heads: int):
        super().__init__()
        if channels % heads:
            raise ValueError(f"channels ({channels}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(channels, 3 * channels, bias=False) for _ in range(3))
        self.proj = nn.ModuleList(nn.Linear(channels, channels) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        xl = x.movedim(1, -1)  # (N, T, H, W, C)
        out = None
        for axis in range(3):
            xa = xl.movedim(axis + 1, -2)  # the attended axis next to the channels
            lead, length = xa.shape[:-2], xa.shape[-2]
            seq = xa.reshape(-1, length, c)
            q, k, v = self.qkv[axis](seq).view(seq.shape[0], length, 3, self.heads, c // self.heads).permute(2, 0, 3,
                                                                                                             1, 4)
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(seq.shape[0], length, c)
            o = self.proj[axis](o).view(*lead, length, c).movedim(-2, axis + 1)
            out = o if out is None else out + o
        return out.movedim(-1, 1)


class _VideoResidualBlock(nn.Module):
    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.block = nn.Sequential(
            nn.BatchNorm3d(channels), nn.ReLU(), nn.Conv3d(channels, channels // 2, 3, padding=1, bias=False),
            nn.BatchNorm3d(channels // 2), nn.ReLU(), nn.Conv3d(channels // 2, channels, 1, bias=False),
            nn.BatchNorm3d(channels), nn.ReLU(), AxialAttention3d(channels, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class _SamePadConvTranspose3d(nn.Module):
    """Pre-pad by kernel - stride (the larger half first), then ConvTranspose3d with padding
    kernel - 1: the output is exactly stride x the input, for any kernel and stride."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: Sequence[int]):
        super().__init__()
        k = (kernel,) * 3
        # F.pad takes the last dimension first: (W_lo, W_hi, H_lo, H_hi, D_lo, D_hi).
        self.pad = tuple(p for kd, s in reversed(list(zip(k, stride))) for p in ((kd - s + 1) // 2, (kd - s) // 2))
        self.conv = nn.ConvTranspose3d(cin, cout, k, tuple(stride), padding=tuple(kd - 1 for kd in k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.pad))


class VideoDecoder(nn.Module):
    """VQ-VAE video decoder in VideoGPT's layout: residual blocks with axial attention, then one
    k4 up-convolution per factor of 2 of ``upsample`` (stride 1 along axes already at their
    factor), ReLU between them, ``out_channels`` (RGB) at the end."""

    def __init__(self, channels: int = 240, res_blocks: int = 4, heads: int = 2,
                 upsample: Sequence[int] = (4, 4, 4), out_channels: int = 3):
        super().__init__()
        steps = [int(math.log2(u)) for u in upsample]
        if len(steps) != 3 or any(u < 1 or 2 ** s != u for u, s in zip(upsample, steps)) or max(steps) < 1:
            raise ValueError(f"upsample must be three powers of 2, one of them >= 2; got {tuple(upsample)}")
        self.res = nn.Sequential(*[_VideoResidualBlock(channels, heads) for _ in range(res_blocks)],
                                 nn.BatchNorm3d(channels), nn.ReLU())
        n = max(steps)
        self.up = nn.ModuleList(
            _SamePadConvTranspose3d(channels, out_channels if i == n - 1 else channels, 4,
                                    tuple(2 if s > i else 1 for s in steps)) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.res(x)
        for i, up in enumerate(self.up):
            h = up(h)
            if i < len(self.up) - 1:
                h = F.relu(h)
        return h


# ---- the suite's networks -------------------------------------------------------------------------
# Builders take tiny=True for the CPU check (a few thousand voxels, a handful of channels; every
# kind of layer kept) and return (model, input shape). Sizes at tiny=False keep one network's three
# modes well under a minute on an H200.
def _gan3d(tiny: bool):
    if tiny:  # 8 channels: the tensor-core path; the 1-channel head: the FMA path
        return GAN3DGenerator(8, (8,), 1), (2, 8, 1, 1, 1)
    return GAN3DGenerator(200, (512, 256, 128, 64), 1), (32, 200, 1, 1, 1)


def _vqvae_video(tiny: bool):
    if tiny:  # anisotropic upsampling: the second up-convolution has stride (1, 2, 2)
        return VideoDecoder(8, 1, 2, (2, 4, 4), 3), (1, 8, 2, 2, 2)
    return VideoDecoder(240, 4, 2, (4, 4, 4), 3), (4, 240, 8, 32, 32)


def _monai_unet(tiny: bool):
    from monai.networks.nets import UNet

    if tiny:
        return UNet(3, 1, 3, (4, 8, 16), (2, 2), num_res_units=2), (1, 1, 8, 8, 8)
    return UNet(3, 1, 3, (16, 32, 64, 128, 256), (2, 2, 2, 2), num_res_units=2), (2, 1, 128, 128, 128)


def _monai_unetr(tiny: bool):
    from monai.networks.nets import UNETR

    # MONAI's BTCV configuration (14 organ labels, 96^3 patches, ViT-B/16); tiny keeps 16^3 patches.
    if tiny:
        return UNETR(1, 2, (16, 16, 16), feature_size=2, hidden_size=16, mlp_dim=32, num_heads=2), (1, 1, 16, 16, 16)
    return UNETR(1, 14, (96, 96, 96), feature_size=16, hidden_size=768, mlp_dim=3072, num_heads=12), (2, 1, 96, 96, 96)


def _monai_dynunet(tiny: bool):
    from monai.networks.nets import DynUNet

    # nnU-Net's 3d_fullres layout as MONAI's DynUNet expresses it: k3 everywhere, stride 1 then 2.
    n = 3 if tiny else 6
    strides = [1] + [2] * (n - 1)
    filters = (2, 4, 8) if tiny else None  # None: MONAI's default, 32 * 2^i up to 320
    shape = (1, 1, 8, 8, 8) if tiny else (2, 1, 128, 128, 128)
    return DynUNet(3, 1, 3, [3] * n, strides, strides[1:], filters=filters), shape


def _monai_basicunet(tiny: bool):
    from monai.networks.nets import BasicUNet

    features = (2, 2, 4, 4, 8, 2) if tiny else (32, 32, 64, 128, 256, 32)
    # Four 2x poolings, and instance norm needs >1 voxel at the bottom: 32^3 at least.
    shape = (1, 1, 32, 32, 32) if tiny else (2, 1, 128, 128, 128)
    return BasicUNet(3, 1, 3, features, upsample="deconv"), shape


def _nnunet_plainconv(tiny: bool):
    from dynamic_network_architectures.architectures.unet import PlainConvUNet

    # nnU-Net's 3d_fullres plan for a 128^3 patch: 6 stages, 32..320 features, 2 convs per stage.
    n = 3 if tiny else 6
    features = [2, 4, 8] if tiny else [32, 64, 128, 256, 320, 320]
    shape = (1, 1, 8, 8, 8) if tiny else (2, 1, 128, 128, 128)
    model = PlainConvUNet(1, n, features, nn.Conv3d, 3, [1] + [2] * (n - 1), 2, 3, 2, conv_bias=True,
                          norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
                          nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True})
    return model, shape


@dataclass(frozen=True)
class Network:
    name: str
    description: str
    package: str | None  # distribution it comes from (None: written in convt3d)
    modules: tuple[str, ...]  # what must import for it to build
    build: Callable[[bool], tuple[nn.Module, tuple[int, ...]]]

    @property
    def source(self) -> str:
        if self.package is None:
            return "convt3d"
        try:
            return f"{self.package} {importlib.metadata.version(self.package)}"
        except importlib.metadata.PackageNotFoundError:
            return self.package


_MONAI, _DNA = "monai", "dynamic-network-architectures"
# Order: the networks a run must report first, so that an interrupted run keeps them.
NETWORKS: tuple[Network, ...] = (
    Network("gan3d", "3D-GAN generator, z 200 -> 1x64^3, batch 32", None, (), _gan3d),
    Network("vqvae_video", "VQ-VAE video decoder (VideoGPT), 240 ch, (4,240,8,32,32) -> (4,3,32,128,128)", None, (),
            _vqvae_video),
    Network("monai_unet", "MONAI UNet 16..256 ch, 2 res units, 2x1x128^3", _MONAI, ("monai.networks.nets",),
            _monai_unet),
    Network("nnunet_plainconv", "nnU-Net PlainConvUNet, 3d_fullres-like (6 stages, 32..320), 2x1x128^3", _DNA,
            ("dynamic_network_architectures.architectures.unet",), _nnunet_plainconv),
    Network("monai_dynunet", "MONAI DynUNet, nnU-Net 3d_fullres layout, 2x1x128^3", _MONAI, ("monai.networks.nets",),
            _monai_dynunet),
    Network("monai_basicunet", "MONAI BasicUNet, upsample='deconv', 2x1x128^3", _MONAI, ("monai.networks.nets",),
            _monai_basicunet),
    # MONAI's self-attention block needs einops (an optional dependency of MONAI itself).
    Network("monai_unetr", "MONAI UNETR (BTCV: ViT-B/16, feature 16), 2x1x96^3", _MONAI,
            ("monai.networks.nets", "einops"), _monai_unetr),
)


def network_names() -> list[str]:
    return [n.name for n in NETWORKS]


def select_networks(names: Iterable[str] | None = None) -> list[Network]:
    """The networks named (all when None), in the suite's order; an unknown name raises ValueError."""
    if names is None:
        return list(NETWORKS)
    wanted = set(names)
    unknown = sorted(wanted - set(network_names()))
    if unknown:
        raise ValueError(f"unknown network {', '.join(map(repr, unknown))}; expected one of "
                         f"{', '.join(network_names())}")
    return [n for n in NETWORKS if n.name in wanted]


def unavailable_reason(net: Network) -> str | None:
    """None if ``net`` can be built here; else one line saying what is missing and how to get it."""
    for mod in net.modules:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            # Missing package or a broken install: either way one line, never a traceback.
            what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"needs {mod.split('.')[0]} ({EXTRA_HINT}): {what}"
    return None


def _seed_of(name: str, seed: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def build_network(net: Network, device: str | torch.device, tiny: bool = False,
                  seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """(model, input) on ``device``: the model built there (so that a 90M-parameter UNETR is not
    initialised on the host), from a per-network seed with PyTorch's and the package's own
    initialisation; the input ~N(0, 1) from the same seed."""
    device = torch.device(device)
    s = _seed_of(net.name, seed)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(s)
        with device:
            model, shape = net.build(tiny)
    gen = torch.Generator(device="cpu").manual_seed(s + 1)
    x = torch.randn(shape, generator=gen)
    return model.to(device), x.to(device)


def convt_layer_count(model: nn.Module) -> tuple[int, int]:
    """(ConvTranspose3d layers, of which computed by convt3d) in ``model``."""
    from convt3d.nn import ConvTranspose3d as Patched

    mods = [m for m in model.modules() if isinstance(m, nn.ConvTranspose3d)]
    return len(mods), sum(isinstance(m, Patched) for m in mods)


# ---- modes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NetMode:
    name: str  # "infer" or "train"
    dtype: str  # "fp32" (no autocast) or "bf16" (torch.autocast bfloat16)

    @property
    def label(self) -> str:
        return f"{self.name} {self.dtype}"

    @property
    def training(self) -> bool:
        return self.name == "train"

    @property
    def autocast(self) -> bool:
        return self.dtype == "bf16"


NET_MODES: tuple[NetMode, ...] = (NetMode("infer", "fp32"), NetMode("infer", "bf16"), NetMode("train", "bf16"))
# convt3d bench's --mode for the layer suites, mapped onto these: fwd = inference, full = training step.
_BENCH_MODE = {"fwd": "infer", "full": "train"}


def select_modes(mode: str | None = None, dtypes: Iterable[str] | None = None) -> list[NetMode]:
    """The network modes for ``convt3d bench --mode`` (None: all; "fwd": inference; "full": the
    training step; "bwd" has no network meaning) and ``--dtype`` (None: both)."""
    if mode is not None and mode not in _BENCH_MODE:
        raise ValueError(f"--mode {mode} is not a network mode: the networks suite runs fwd (inference) and "
                         "full (training step)")
    dt = None if dtypes is None else set(dtypes)
    return [m for m in NET_MODES if (mode is None or m.name == _BENCH_MODE[mode]) and (dt is None or m.dtype in dt)]


def _first_tensor(out) -> torch.Tensor:
    """A network's output tensor (the first, for models that return a list or tuple)."""
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


def _inference(model: nn.Module, x: torch.Tensor, autocast: bool) -> Callable[[], torch.Tensor]:
    model.eval()

    def run() -> torch.Tensor:
        with torch.no_grad(), torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
            return _first_tensor(model(x))

    return run


def _training(model: nn.Module, x: torch.Tensor, target: torch.Tensor, autocast: bool) -> Callable[[], tuple]:
    """A training step without the optimizer: (loss, gradient of every parameter). Parameters the
    forward does not use (nnU-Net's deep-supervision heads when it is off, MONAI's unused
    cross-attention norms) get zero gradients, so that every model's tuple lines up."""
    model.train()
    params = _trainable(model)

    def step() -> tuple:
        with torch.enable_grad():
            with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
                out = _first_tensor(model(x))
            loss = F.mse_loss(out.float(), target)
            grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        return (loss.detach(),) + tuple(grads)

    return step


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _convt_weight_index(model: nn.Module) -> list[int]:
    """Positions of the ConvTranspose3d weights in ``_trainable(model)``."""
    weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.ConvTranspose3d)}
    return [i for i, p in enumerate(_trainable(model)) if id(p) in weights]


def normwise_error(a: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """||a - ref|| / ||ref|| over all tensors together (2-norm, in float64)."""
    num = sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, ref))
    den = sum(float(y.double().square().sum()) for y in ref)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return math.sqrt(num / den)


def _target_for(model: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed random target (fp32, ~N(0, 1)) shaped like the model's output."""
    was_training = model.training
    model.eval()  # no BatchNorm statistics update for a shape
    with torch.no_grad():
        shape = _first_tensor(model(x)).shape
    model.train(was_training)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen).to(x.device)


def relative_error(a, ref) -> float:
    """max |a - ref| / max |ref|; for sequences of tensors, the worst element pair (so that a small
    gradient's error is not hidden by a large one's scale)."""
    if isinstance(a, (tuple, list)):
        return max((relative_error(x, y) for x, y in zip(a, ref)), default=0.0)
    diff = (a.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / scale


def _budget_ok(err: float, ref_err: float, dtype: str) -> bool:
    """The project's error budget: twice PyTorch's own error, or one unit of the mode's epsilon
    (so that an exact reference does not demand bit-identity)."""
    eps = torch.finfo(torch.bfloat16 if dtype == "bf16" else torch.float32).eps
    return err <= max(2 * ref_err, eps)


# ---- ConvTranspose3d share of the GPU time --------------------------------------------------------
# PyTorch's own ops, and convt3d's (the patched model's layers, whichever engine runs inside).
TRANSPOSED_OPS = frozenset({"aten::conv_transpose3d", "aten::cudnn_convolution_transpose",
                            "aten::slow_conv_transpose3d", OP_NAME})


def is_kernel(e) -> bool:
    """A GPU event that is a kernel, copy or memset -- not the GPU span of a ``record_function``
    range (convt3d names each eager call's span after its op), which would count its kernels twice."""
    from torch.autograd import DeviceType

    return e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def transposed_share(events, device_type: str) -> tuple[float, float, float]:
    """(share, transposed-conv microseconds, total microseconds) of one profiled run.

    ``events``: ``torch.profiler.profile(...).events()``. On CUDA the total is the GPU time of every
    kernel (device events), the transposed part the device time of the outermost op of
    ``TRANSPOSED_OPS`` (its kernels and its children's); on CPU both are CPU times of ops.
    """
    def outermost(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name in TRANSPOSED_OPS:
                return False
            p = p.cpu_parent
        return True

    from torch.autograd import DeviceType

    def is_cpu_op(e) -> bool:
        return e.device_type == DeviceType.CPU and not e.is_async

    convt = [e for e in events if e.name in TRANSPOSED_OPS and is_cpu_op(e) and outermost(e)]
    if device_type == "cuda":
        total = sum(e.device_time_total for e in events if is_kernel(e))
        part = sum(e.device_time_total for e in convt)
    else:
        total = sum(e.cpu_time_total for e in events if is_cpu_op(e) and e.cpu_parent is None)
        part = sum(e.cpu_time_total for e in convt)
    return (part / total if total > 0 else math.nan), part, total


def top_kernels(events, count: int | None = 8) -> dict[str, float]:
    """The ``count`` kernels (None: all) of one profiled run with the most GPU time: name (first
    80 characters) -> microseconds, summed over launches. Next to the share, they say where a
    patched network's time went when the totals disagree."""
    per: dict[str, float] = {}
    for e in events:
        if is_kernel(e):
            name = e.name[:80]
            per[name] = per.get(name, 0.0) + e.device_time_total
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:count])


def kernel_changes(before: dict[str, float], after: dict[str, float], count: int = 10) -> dict[str, float]:
    """The ``count`` kernels whose GPU time changed most between two profiles (patched minus
    untouched, microseconds; a kernel only one side launches counts as 0 on the other): where
    the time of a patched network went, kernel by kernel, when its transposed convolutions got
    faster but its total did not."""
    names = set(before) | set(after)
    change = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}
    return dict(sorted(change.items(), key=lambda kv: -abs(kv[1]))[:count])


def _profile_share(fn: Callable[[], object], device_type: str) -> tuple[float, float, float, dict[str, float]]:
    """(share, transposed-conv us, total us, every kernel's us) of one profiled call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with warnings.catch_warnings():
        # One profiled call, no schedule: torch warns that events do not accumulate across cycles.
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=acts) as prof:
            fn()
            if device_type == "cuda":
                torch.cuda.synchronize()
    events = prof.events()
    return (*transposed_share(events, device_type), top_kernels(events, None))


# ---- engines the patched layers run on ------------------------------------------------------------
def _layer_engines(patched: nn.Module, fn: Callable[[], object]) -> str:
    """What convt3d decides for each patched layer, summarised ("triton 3, torch 1"), from
    ``convt3d.explain`` of the tensors each layer receives in one extra (untimed) call."""
    import convt3d
    from convt3d.nn import ConvTranspose3d as Patched

    seen: list[str] = []
    reasons: list[str] = []

    def hook(module, args):
        x = args[0]
        dev = x.device.type
        w, b = module.weight, module.bias
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w, b = x.to(dt), w.to(dt), None if b is None else b.to(dt)
        op = module._output_padding(x, None, module.stride, module.padding, module.kernel_size, 3, module.dilation)
        try:
            e = convt3d.explain(x, w, b, module.stride, module.padding, op, module.groups, module.dilation,
                                backend=module.backend, precision=module.precision)
            seen.append(e.engine or "none")
            reasons.append(f"{e.engine}: {e.reason}")
        except Exception as exc:  # noqa: BLE001 -- a report, not a check: say what went wrong
            seen.append(f"? ({type(exc).__name__})")
            reasons.append(f"? {type(exc).__name__}: {exc}"[:300])

    handles = [m.register_forward_pre_hook(hook) for m in patched.modules() if isinstance(m, Patched)]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    counts: dict[str, int] = {}
    for s in seen:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in counts.items()), reasons


# ---- GPU timing -----------------------------------------------------------------------------------
def _row_head(net: Network, mode: NetMode, backend: str, model: nn.Module, x: torch.Tensor) -> dict:
    layers, _ = convt_layer_count(model)
    return {"case": net.name, "suite": "networks", "source": net.source, "description": net.description,
            "mode": mode.name, "dtype": mode.dtype, "autocast": mode.autocast, "layout": "ncdhw",
            "precision": "default", "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32), "backend": backend,
            "input_shape": list(x.shape), "parameters": sum(p.numel() for p in model.parameters()),
            "convt_layers": layers}


def _reference(model: nn.Module, x: torch.Tensor, mode: NetMode, target: torch.Tensor | None):
    """The inference reference (float64 forward of a copy) or the training one (fp32 step, TF32 off)."""
    if not mode.training:
        ref_model = copy.deepcopy(model).double()
        out = _inference(ref_model, x.double(), autocast=False)()
        del ref_model
        return out, "float64"
    with cudnn_tf32(False):
        out = _training(model, x, target, autocast=False)()
    return out, "fp32 step, TF32 off"


def _tf32_arithmetic(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The float64 forward with every ConvTranspose3d's input and weight rounded to TF32 first:
    what exact TF32 arithmetic gives on those layers. With TF32 allowed, cuDNN still computes
    some layers in full fp32 (the 240-channel VQ-VAE up-convolution: its untouched network error
    is an order of magnitude below TF32's), so PyTorch's own error is not the
    whole budget of a TF32 engine there: the budget is twice the larger of the two."""
    from .check import round_to_tf32

    ref_model = copy.deepcopy(model).double()

    def hook(module, args):
        return (round_to_tf32(args[0].float()).double(),) + tuple(args[1:])

    handles = []
    for m in ref_model.modules():
        if isinstance(m, nn.ConvTranspose3d):
            with torch.no_grad():
                m.weight.copy_(round_to_tf32(m.weight.float()).double())
            handles.append(m.register_forward_pre_hook(hook))
    try:
        return _inference(ref_model, x.double(), autocast=False)()
    finally:
        for h in handles:
            h.remove()
        del ref_model


def _compare(row: dict, y_patched, y_untouched, ref, mode: NetMode, convt_index: list[int],
             y_tf32=None) -> None:
    from .runner import _max_abs_diff

    diff, scale = _max_abs_diff(y_patched, y_untouched)
    row.update(max_abs_diff_vs_torch=diff, max_abs_torch=scale, output_layout_matches=True)
    if not mode.training:
        err, ref_err = relative_error(y_patched, ref), relative_error(y_untouched, ref)
        budget_ref = ref_err
        if y_tf32 is not None:
            row["tf32_arithmetic_rel_err"] = relative_error(y_tf32, ref)
            budget_ref = max(ref_err, row["tf32_arithmetic_rel_err"])
        row.update(rel_err_vs_reference=err, torch_rel_err_vs_reference=ref_err,
                   within_error_budget=_budget_ok(err, budget_ref, mode.dtype), output_shape=list(y_untouched.shape))
        return
    grads_p, grads_u, grads_r = y_patched[1:], y_untouched[1:], ref[1:]
    err, ref_err = normwise_error(grads_p, grads_r), normwise_error(grads_u, grads_r)

    def pick(gs):
        return [gs[i] for i in convt_index]

    c_err, c_ref_err = (normwise_error(pick(grads_p), pick(grads_r)), normwise_error(pick(grads_u), pick(grads_r)))
    row.update(rel_err_vs_reference=err, torch_rel_err_vs_reference=ref_err, convt_grad_rel_err=c_err,
               torch_convt_grad_rel_err=c_ref_err,
               within_error_budget=_budget_ok(err, ref_err, mode.dtype) and _budget_ok(c_err, c_ref_err, mode.dtype),
               loss=y_patched[0].item(), torch_loss=y_untouched[0].item(), reference_loss=ref[0].item())


def _tune(patched: nn.Module, x: torch.Tensor, mode: NetMode) -> dict:
    """``convt3d.tune`` of the patched model as the mode runs it (autocast, train or eval mode)."""
    import convt3d

    patched.train(mode.training)
    t0 = time.perf_counter()
    with torch.autocast(x.device.type, torch.bfloat16, enabled=mode.autocast):
        with torch.enable_grad() if mode.training else torch.no_grad():
            rep = convt3d.tune(patched, x, backward=mode.training, progress=False)
    return {"tune_s": time.perf_counter() - t0, "network_check": rep.network}


def _run_mode(net: Network, mode: NetMode, model: nn.Module, patched: nn.Module, x: torch.Tensor, backend: str,
              timer, status: Callable[[str], None], refs: dict, seed: int, rounds: int, measure: bool = True,
              tune: bool = False) -> dict:
    """One row. ``measure=False``: agreement only (first calls and the reference; no engines,
    profile or steady timing). ``tune``: convt3d.tune first (see :func:`run_networks`)."""
    # Training steps move BatchNorm's running statistics, and each model is called a different
    # number of times: start every mode from the same state.
    patched.load_state_dict(model.state_dict())
    row = _row_head(net, mode, backend, model, x)
    row["convt_layers_patched"] = convt_layer_count(patched)[1]
    target = _target_for(model, x, _seed_of(net.name, seed) + 2) if mode.training else None
    if mode.training:
        fn_u, fn_p = _training(model, x, target, mode.autocast), _training(patched, x, target, mode.autocast)
    else:
        fn_u, fn_p = _inference(model, x, mode.autocast), _inference(patched, x, mode.autocast)

    status(f"{net.name} {mode.label}: untouched first call")
    y_u, first_u = timer.first_call(fn_u)
    if tune and backend == "auto":
        status(f"{net.name} {mode.label}: convt3d.tune (network check included)")
        row.update(_tune(patched, x, mode))
        fn_p = _training(patched, x, target, mode.autocast) if mode.training else _inference(patched, x,
                                                                                                mode.autocast)
    status(f"{net.name} {mode.label}: patched first call (compile, tune, measure)")
    y_p, first_p = timer.first_call(fn_p)
    key = "train" if mode.training else "infer"
    if key not in refs:
        status(f"{net.name} {mode.label}: reference")
        t0 = time.perf_counter()
        refs[key] = _reference(model, x, mode, target)
        refs[key + "_s"] = time.perf_counter() - t0
    ref, ref_name = refs[key]
    y_tf32 = None
    if not mode.training and mode.dtype == "fp32" and x.device.type == "cuda" and cudnn_conv_allows_tf32():
        if "infer_tf32" not in refs:
            refs["infer_tf32"] = _tf32_arithmetic(model, x)
        y_tf32 = refs["infer_tf32"]
    row.update(reference=ref_name, reference_s=refs[key + "_s"])
    _compare(row, y_p, y_u, ref, mode, _convt_weight_index(model), y_tf32)
    row.update(torch_first_call_s=first_u, first_call_s=first_p, first_call_extra_s=first_p - first_u)
    del y_u, y_p
    if not measure:
        return row

    status(f"{net.name} {mode.label}: engines of the patched layers")
    row["engine"], row["layer_decisions"] = _layer_engines(patched, fn_p)
    status(f"{net.name} {mode.label}: profiling the untouched forward")
    fwd_u = _inference(model, x, mode.autocast) if not mode.training else _train_forward(model, x, mode.autocast)
    share, part_us, total_us, top_u = _profile_share(fwd_u, x.device.type)
    if mode.training:
        model.train()
    row.update(convt_share=share, convt_us=part_us, forward_kernel_us=total_us,
               top_kernels_us=dict(list(top_u.items())[:8]))
    # The same profile of the patched forward: where a patched network loses although each layer's
    # decision was measured faster, this tells whether its transposed convolutions are slower in
    # the network than when measured alone, or the time went elsewhere.
    status(f"{net.name} {mode.label}: profiling the patched forward")
    fwd_p = _inference(patched, x, mode.autocast) if not mode.training else _train_forward(patched, x, mode.autocast)
    _, part_p, total_p, top_p = _profile_share(fwd_p, x.device.type)
    if mode.training:
        patched.train()
    row.update(convt_us_patched=part_p, forward_kernel_us_patched=total_p,
               top_kernels_us_patched=dict(list(top_p.items())[:8]), kernel_changes_us=kernel_changes(top_u, top_p))

    status(f"{net.name} {mode.label}: timing untouched and patched ({rounds} interleaved pairs)")
    times_u, times_p = timer.paired(fn_u, fn_p, rounds)
    ratio, low, high = paired_ratio(times_u, times_p)
    t_u, t_p = statistics.median(times_u), statistics.median(times_p)
    status(f"{net.name} {mode.label}: untouched {t_u * 1e6:.0f} us, patched {t_p * 1e6:.0f} us, {ratio:.2f}x "
           f"(pairs {low:.2f}-{high:.2f}x)")
    row.update(torch_us=t_u * 1e6, convt3d_us=t_p * 1e6, speedup=ratio, speedup_quartiles=[low, high],
               torch_us_rounds=[t * 1e6 for t in times_u], convt3d_us_rounds=[t * 1e6 for t in times_p])
    return row


# Pairs of timing blocks per mode (``--rounds``). The U-Nets' steps are host-bound, and a host's
# speed can swing by nearly half between seconds, so whole rounds of one side then the other
# decided by their lowest read a few percent off where the paired blocks' ratios centre on
# 1.00x. 21 pairs put the median between quartiles of 5 pairs or more on each side.
DEFAULT_PAIRS = 21


def _train_forward(model: nn.Module, x: torch.Tensor, autocast: bool) -> Callable[[], torch.Tensor]:
    """The forward of a training step (train mode, grad on), for the profile of the share."""
    model.train()

    def run() -> torch.Tensor:
        with torch.enable_grad(), torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
            return _first_tensor(model(x))

    return run


def _failure(net: Network, mode: NetMode | None, exc: BaseException) -> dict:
    return {"case": net.name, "dtype": mode.dtype if mode else "-", "layout": "ncdhw", "precision": "default",
            "mode": mode.name if mode else "build",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc, limit=6))}


def run_networks(nets: list[Network], modes: list[NetMode], backend: str = "auto", settings=None,
                 status: Callable[[str], None] | None = None, advance: Callable[[], None] | None = None,
                 device: str = "cuda", timer=None, rounds: int = DEFAULT_PAIRS, tiny: bool = False,
                 measure: bool = True,
                 on_network: Callable[[list, list, list], None] | None = None, tune: bool = False
                 ) -> tuple[list[dict], list[dict], list[dict]]:
    """Time every network in every mode: (rows, failures, skipped).

    Per network: the untouched model and ``convt3d.patch(copy.deepcopy(model))`` (with
    ``backend`` unless "auto", the package default) on ``device``. ``timer`` defaults to the
    bench's :class:`~convt3d.bench.runner.CudaTimer`; the tests pass a CPU timer. A network that
    raises becomes a failure entry and the suite goes on; a missing extra a skipped entry
    ``{case, reason}``. ``advance`` is called once per (network, mode). ``tiny`` builds the CPU
    check's sizes (for tests of the row logic); ``measure=False`` only compares the outputs.
    ``on_network(rows, failures, skipped)`` is called after each network (the CLI rewrites its
    JSON there, so that an interrupted run keeps what it measured). ``tune``: the patched model
    goes through ``convt3d.tune`` (its network check included) in each mode before its first call;
    the row records the tuning time and what the check measured and reverted.
    """
    import convt3d

    from .runner import CudaTimer, TimingSettings

    settings = settings or TimingSettings()
    timer = timer if timer is not None else CudaTimer(settings)
    say = status or (lambda _msg: None)
    step = advance or (lambda: None)
    rows, failures, skipped = [], [], []
    done = on_network or (lambda *_lists: None)
    for net in nets:
        reason = unavailable_reason(net)
        if reason is not None:
            skipped.append({"case": net.name, "reason": reason})
            for _ in modes:
                step()
            done(rows, failures, skipped)
            continue
        model = patched = x = None
        refs: dict = {}
        try:
            say(f"{net.name}: building")
            model, x = build_network(net, device, tiny=tiny, seed=settings.seed)
            patched = convt3d.patch(copy.deepcopy(model), backend=None if backend == "auto" else backend)
        except Exception as exc:  # noqa: BLE001 -- one network's failure must not hide the others
            failures.append(_failure(net, None, exc))
            for _ in modes:
                step()
            model = patched = x = None
            timer.release()
            done(rows, failures, skipped)
            continue
        for mode in modes:
            try:
                rows.append(_run_mode(net, mode, model, patched, x, backend, timer, say, refs, settings.seed,
                                      rounds, measure, tune))
            except Exception as exc:  # noqa: BLE001
                failures.append(_failure(net, mode, exc))
            step()
        del model, patched, x, refs
        timer.release()
        done(rows, failures, skipped)
    return rows, failures, skipped


# ---- CPU check (Triton's interpreter) --------------------------------------------------------------
CHECK_BACKEND = "triton"


def check_network(net: Network, seed: int = 0, backend: str = CHECK_BACKEND) -> dict:
    """One network at its tiny size on the CPU: the patched model (``backend``) against the
    untouched one and float64, in fp32 inference with TF32 off (the CPU has no TF32; both engines
    then compute in full fp32). Returns a row (``ok``: every layer patched and within budget)."""
    import convt3d

    model, x = build_network(net, "cpu", tiny=True, seed=seed)
    patched = convt3d.patch(copy.deepcopy(model), backend=backend)
    layers, swapped = convt_layer_count(patched)
    with cudnn_tf32(False):
        t0 = time.perf_counter()
        y_p = _inference(patched, x, autocast=False)()
        seconds = time.perf_counter() - t0
        y_u = _inference(model, x, autocast=False)()
        ref = _inference(copy.deepcopy(model).double(), x.double(), autocast=False)()
    err, ref_err = relative_error(y_p, ref), relative_error(y_u, ref)
    ok_budget = _budget_ok(err, ref_err, "fp32")
    shape_ok = y_p.shape == y_u.shape and y_p.dtype == y_u.dtype
    return {"case": net.name, "suite": "networks", "source": net.source, "mode": "infer", "dtype": "fp32",
            "layout": "ncdhw", "precision": "exact", "backend": backend, "input_shape": list(x.shape),
            "output_shape": list(y_u.shape), "convt_layers": layers, "convt_layers_patched": swapped,
            "rel_err_vs_reference": err, "torch_rel_err_vs_reference": ref_err,
            "max_abs_diff_vs_torch": (y_p.double() - y_u.double()).abs().max().item(),
            "max_abs_torch": y_u.abs().max().item(), "within_error_budget": ok_budget, "shape_ok": shape_ok,
            "ok": ok_budget and shape_ok and layers > 0 and swapped == layers, "seconds": seconds}


def check_networks(nets: list[Network], seed: int = 0, status: Callable[[str], None] | None = None,
                   advance: Callable[[], None] | None = None,
                   backend: str = CHECK_BACKEND) -> tuple[list[dict], list[dict], list[dict]]:
    """:func:`check_network` for each network: (rows, failures, skipped)."""
    say = status or (lambda _msg: None)
    step = advance or (lambda: None)
    rows, failures, skipped = [], [], []
    for net in nets:
        reason = unavailable_reason(net)
        if reason is not None:
            skipped.append({"case": net.name, "reason": reason})
        else:
            say(f"{net.name}: tiny size, interpreter")
            try:
                rows.append(check_network(net, seed, backend))
            except Exception as exc:  # noqa: BLE001 -- report every network
                failures.append(_failure(net, NetMode("infer", "fp32"), exc))
        step()
    return rows, failures, skipped
