"""The networks suite: whole 3-D networks, untouched against ``convt3d.patch``-ed in one process, in fp32 and
bf16-autocast inference and a bf16-autocast training step; a row's error against a reference (float64, or the fp32 step
with TF32 off, norm-wise over all gradients) is within budget when at most twice the untouched model's."""
from __future__ import annotations

import copy
import functools
import importlib.metadata
import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import convt3d
from ..core.flags import cudnn_conv_allows_tf32
from ..engines.op import OP_NAME
from ..nn import ConvTranspose3d as Patched
from .check import CHECK_BACKEND, failure_entry, round_tf32
from .models import AxialAttention3d, GAN3DGenerator, VideoDecoder  # noqa: F401 -- all three re-exported
from .roofline import cudnn_tf32
from .runner import CudaTimer, TimingSettings, max_abs_diff
from .stats import paired_ratio
from .suites import name_seed


# ---- the suite's networks -------------------------------------------------------------------------
def _build(name: str, tiny: bool) -> tuple[nn.Module, tuple[int, ...]]:
    """(model, input shape) of a suite network; ``tiny``: the CPU check's size, every kind of layer kept."""
    if name == "gan3d":  # tiny: 8 channels on the tensor-core path, the 1-channel head on the FMA path
        return (GAN3DGenerator(8, (8,), 1), (2, 8, 1, 1, 1)) if tiny else (GAN3DGenerator(), (32, 200, 1, 1, 1))
    if name == "vqvae_video":  # tiny: anisotropic, the second up-convolution has stride (1, 2, 2)
        return (VideoDecoder(8, 1, 2, (2, 4, 4), 3), (1, 8, 2, 2, 2)) if tiny else (VideoDecoder(), (4, 240, 8, 32, 32))
    shape = (1, 1, 8, 8, 8) if tiny else (2, 1, 128, 128, 128)
    n = 3 if tiny else 6  # nnU-Net's 3d_fullres plan for a 128^3 patch: 6 stages
    if name == "nnunet_plainconv":
        from dynamic_network_architectures.architectures.unet import PlainConvUNet

        features = [2, 4, 8] if tiny else [32, 64, 128, 256, 320, 320]
        return PlainConvUNet(1, n, features, nn.Conv3d, 3, [1] + [2] * (n - 1), 2, 3, 2, conv_bias=True,
                             norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
                             nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True}), shape
    from monai.networks import nets

    if name == "monai_unet":
        channels = (4, 8, 16) if tiny else (16, 32, 64, 128, 256)
        return nets.UNet(3, 1, 3, channels, (2,) * (len(channels) - 1), num_res_units=2), shape
    if name == "monai_dynunet":  # nnU-Net's layout in MONAI's terms; filters None: 32 * 2^i up to 320
        strides = [1] + [2] * (n - 1)
        return nets.DynUNet(3, 1, 3, [3] * n, strides, strides[1:], filters=(2, 4, 8) if tiny else None), shape
    if name == "monai_basicunet":  # four 2x poolings, and instance norm needs >1 voxel at the bottom
        features = (2, 2, 4, 4, 8, 2) if tiny else (32, 32, 64, 128, 256, 32)
        return nets.BasicUNet(3, 1, 3, features, upsample="deconv"), (1, 1, 32, 32, 32) if tiny else shape
    if name == "monai_unetr":  # MONAI's BTCV configuration (14 labels, 96^3 patches, ViT-B/16)
        kw = dict(feature_size=2, hidden_size=16, mlp_dim=32, num_heads=2) if tiny else dict(
            feature_size=16, hidden_size=768, mlp_dim=3072, num_heads=12)
        side = 16 if tiny else 96
        return nets.UNETR(1, 2 if tiny else 14, (side,) * 3, **kw), (1 if tiny else 2, 1, side, side, side)
    raise ValueError(f"no network {name!r}")


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


_MONAI, _DNA, _UNETS = "monai", "dynamic-network-architectures", ("monai.networks.nets",)


def _net(name: str, description: str, package: str | None = None, modules: tuple[str, ...] = ()) -> Network:
    return Network(name, description, package, modules, functools.partial(_build, name))


# Order: the networks a run must report first, so that an interrupted run keeps them.
NETWORKS: tuple[Network, ...] = (
    _net("gan3d", "3D-GAN generator, z 200 -> 1x64^3, batch 32"),
    _net("vqvae_video", "VQ-VAE video decoder (VideoGPT), 240 ch, (4,240,8,32,32) -> (4,3,32,128,128)"),
    _net("monai_unet", "MONAI UNet 16..256 ch, 2 res units, 2x1x128^3", _MONAI, _UNETS),
    _net("nnunet_plainconv", "nnU-Net PlainConvUNet, 3d_fullres-like (6 stages, 32..320), 2x1x128^3", _DNA,
         ("dynamic_network_architectures.architectures.unet",)),
    _net("monai_dynunet", "MONAI DynUNet, nnU-Net 3d_fullres layout, 2x1x128^3", _MONAI, _UNETS),
    _net("monai_basicunet", "MONAI BasicUNet, upsample='deconv', 2x1x128^3", _MONAI, _UNETS),
    # MONAI's self-attention block needs einops (an optional dependency of MONAI itself).
    _net("monai_unetr", "MONAI UNETR (BTCV: ViT-B/16, feature 16), 2x1x96^3", _MONAI, _UNETS + ("einops",)),
)


def network_names() -> list[str]:
    return [n.name for n in NETWORKS]


def select_networks(names: Sequence[str] | None = None) -> list[Network]:
    """The networks named (all when None), in the suite's order; an unknown name raises ValueError."""
    unknown = sorted(set(names or ()) - set(network_names()))
    if unknown:
        raise ValueError(f"unknown network {', '.join(map(repr, unknown))}; expected one of "
                         f"{', '.join(network_names())}")
    return [n for n in NETWORKS if names is None or n.name in names]


def unavailable_reason(net: Network) -> str | None:
    """None if ``net`` can be built here; else one line saying what is missing and how to get it."""
    for mod in net.modules:
        try:
            importlib.import_module(mod)
        except ImportError as exc:  # a missing package or a broken install: one line, never a traceback
            what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"needs {mod.split('.')[0]} (pip install -e '.[networks]'): {what}"
    return None


def build_network(net: Network, device: str | torch.device, tiny: bool = False,
                  seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """(model, input) on ``device``: the model built there (a large model is not initialised on the
    host) from a per-network seed, the input ~N(0, 1) from the same seed."""
    device = torch.device(device)
    s = name_seed(net.name, seed)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(s)
        with device:
            model, shape = net.build(tiny)
    return model.to(device), torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(s + 1)).to(device)


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
# convt3d bench's --mode of the layer suites, mapped onto these: fwd = inference, full = training step.
_BENCH_MODE = {"fwd": "infer", "full": "train"}


def select_modes(mode: str | None = None, dtypes: Iterable[str] | None = None) -> list[NetMode]:
    """The network modes of ``--mode`` (None: all; fwd: inference; full: the training step) and ``--dtype``."""
    if mode is not None and mode not in _BENCH_MODE:
        raise ValueError(f"--mode {mode} is not a network mode: the networks suite runs fwd (inference) and "
                         "full (training step)")
    dt = None if dtypes is None else set(dtypes)
    return [m for m in NET_MODES if (mode is None or m.name == _BENCH_MODE[mode]) and (dt is None or m.dtype in dt)]


# ---- calls, references, errors -------------------------------------------------------------------
def forward_fn(model: nn.Module, x: torch.Tensor, autocast: bool, training: bool = False) -> Callable[[], torch.Tensor]:
    """The model's forward, in eval mode without grad or train mode with grad; of a list or tuple, its first tensor."""
    model.train(training)

    def run() -> torch.Tensor:
        with torch.set_grad_enabled(training), torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
            out = model(x)
        while isinstance(out, (list, tuple)):
            out = out[0]
        return out

    return run


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def training_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, autocast: bool) -> Callable[[], tuple]:
    """A training step without the optimizer: (loss, gradient of every parameter). Parameters the
    forward leaves unused get zero gradients, so that every model's tuple lines up."""
    forward = forward_fn(model, x, autocast, training=True)
    params = _trainable(model)

    def step() -> tuple:
        with torch.enable_grad():
            loss = F.mse_loss(forward().float(), target)
            grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        return (loss.detach(),) + tuple(grads)

    return step


def normwise_error(a: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """||a - ref|| / ||ref|| over all tensors together (2-norm, in float64)."""
    num = sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, ref))
    den = sum(float(y.double().square().sum()) for y in ref)
    return math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    diff = (a.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


def _budget_ok(err: float, ref_err: float, dtype: str) -> bool:
    """Within twice PyTorch's own error or one unit of the mode's epsilon (lest an exact reference demand identity)."""
    return err <= max(2 * ref_err, torch.finfo(torch.bfloat16 if dtype == "bf16" else torch.float32).eps)


def _tf32_arithmetic(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The float64 forward with every ConvTranspose3d's input and weight rounded to TF32 first.
    With TF32 allowed cuDNN still computes some layers in full fp32, so PyTorch's own error is not
    the whole budget of a TF32 engine there: the budget is twice the larger of the two."""
    ref_model = copy.deepcopy(model).double()

    def hook(module, args):
        return (round_tf32(args[0].float()).double(),) + tuple(args[1:])

    for m in ref_model.modules():
        if isinstance(m, nn.ConvTranspose3d):
            with torch.no_grad():
                m.weight.copy_(round_tf32(m.weight.float()).double())
            m.register_forward_pre_hook(hook)
    return forward_fn(ref_model, x.double(), autocast=False)()


def _compare(row: dict, y_patched, y_untouched, ref, mode: NetMode, model: nn.Module, x: torch.Tensor) -> None:
    diff, scale = max_abs_diff(y_patched, y_untouched)
    row.update(max_abs_diff_vs_torch=diff, max_abs_torch=scale, output_layout_matches=True)
    if not mode.training:
        # A broadcast would hide a wrong shape from the errors below.
        row["output_layout_matches"] = y_patched.shape == y_untouched.shape and y_patched.dtype == y_untouched.dtype
        err, ref_err = relative_error(y_patched, ref), relative_error(y_untouched, ref)
        if mode.dtype == "fp32" and x.device.type == "cuda" and cudnn_conv_allows_tf32():
            row["tf32_arithmetic_rel_err"] = relative_error(_tf32_arithmetic(model, x), ref)
        budget_ref = max(ref_err, row.get("tf32_arithmetic_rel_err", ref_err))
        row.update(rel_err_vs_reference=err, torch_rel_err_vs_reference=ref_err,
                   within_error_budget=_budget_ok(err, budget_ref, mode.dtype), output_shape=list(y_untouched.shape))
        return
    grads_p, grads_u, grads_r = y_patched[1:], y_untouched[1:], ref[1:]
    err, ref_err = normwise_error(grads_p, grads_r), normwise_error(grads_u, grads_r)
    # The ConvTranspose3d weights' gradients alone: the layers convt3d computes.
    weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.ConvTranspose3d)}
    convt = [i for i, p in enumerate(_trainable(model)) if id(p) in weights]
    c_err, c_ref_err = (normwise_error([g[i] for i in convt], [grads_r[i] for i in convt]) for g in (grads_p, grads_u))
    row.update(rel_err_vs_reference=err, torch_rel_err_vs_reference=ref_err, convt_grad_rel_err=c_err,
               torch_convt_grad_rel_err=c_ref_err,
               within_error_budget=_budget_ok(err, ref_err, mode.dtype) and _budget_ok(c_err, c_ref_err, mode.dtype),
               loss=y_patched[0].item(), torch_loss=y_untouched[0].item(), reference_loss=ref[0].item())


# ---- ConvTranspose3d share of the GPU time --------------------------------------------------------
# PyTorch's transposed-convolution ops and convt3d's, found by name whatever module wraps them
# (aten::convolution serves both directions, so it is not one of them).
TRANSPOSED_OPS = frozenset({"aten::conv_transpose3d", "aten::cudnn_convolution_transpose",
                            "aten::slow_conv_transpose3d", OP_NAME})


def transposed_share(events, device_type: str) -> tuple[float, float, float]:
    """(share, transposed-conv us, total us) of one profiled run (``profile(...).events()``): on CUDA
    the device time of the outermost ``TRANSPOSED_OPS`` (their kernels and their children's, autocast's
    casts included) over every kernel's; on the CPU the same in CPU time of ops."""

    def outermost(e) -> bool:
        p = e.cpu_parent
        while p is not None and p.name not in TRANSPOSED_OPS:
            p = p.cpu_parent
        return p is None

    def is_cpu_op(e) -> bool:
        return e.device_type == DeviceType.CPU and not e.is_async

    convt = [e for e in events if e.name in TRANSPOSED_OPS and is_cpu_op(e) and outermost(e)]
    if device_type == "cuda":  # kernels, not a record_function range's GPU span (that would count them twice)
        total = sum(e.device_time_total for e in events
                    if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
        part = sum(e.device_time_total for e in convt)
    else:
        total = sum(e.cpu_time_total for e in events if is_cpu_op(e) and e.cpu_parent is None)
        part = sum(e.cpu_time_total for e in convt)
    return (part / total if total > 0 else math.nan), part, total


def _profile_share(fn: Callable[[], object], device_type: str) -> tuple[float, float, float]:
    """(share, transposed-conv us, total us) of one profiled call of ``fn``."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")  # one call, no schedule
        with profile(activities=acts) as prof:
            fn()
            if device_type == "cuda":
                torch.cuda.synchronize()
    return transposed_share(prof.events(), device_type)


def layer_engines(patched: nn.Module, fn: Callable[[], object]) -> tuple[str, list[str]]:
    """("triton 3, torch 1", each layer's "engine: reason"): ``convt3d.explain`` of each patched layer's input."""
    reasons: list[str] = []
    counts: dict[str, int] = {}

    def hook(module, args):
        x, w, b = args[0], module.weight, module.bias
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w, b = x.to(dt), w.to(dt), None if b is None else b.to(dt)
        op = module._output_padding(x, None, module.stride, module.padding, module.kernel_size, 3, module.dilation)
        try:
            e = convt3d.explain(x, w, b, module.stride, module.padding, op, module.groups, module.dilation,
                                backend=module.backend, precision=module.precision)
            seen, why = e.engine or "none", f"{e.engine}: {e.reason}"
        except Exception as exc:  # noqa: BLE001 -- a report, not a check: say what went wrong
            seen, why = f"? ({type(exc).__name__})", f"? {type(exc).__name__}: {exc}"[:300]
        counts[seen] = counts.get(seen, 0) + 1
        reasons.append(why)

    handles = [m.register_forward_pre_hook(hook) for m in patched.modules() if isinstance(m, Patched)]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return ", ".join(f"{k} {v}" for k, v in counts.items()), reasons


# ---- GPU timing -----------------------------------------------------------------------------------
# Pairs of timing blocks per mode (``--rounds``): the U-Nets' steps are host-bound, and 21 pairs put
# the median between quartiles of 5 pairs or more on each side.
DEFAULT_PAIRS = 21


def _run_mode(net: Network, mode: NetMode, model: nn.Module, patched: nn.Module, x: torch.Tensor, backend: str, timer,
              status: Callable[[str], None], refs: dict, seed: int, rounds: int, measure: bool, tune: bool) -> dict:
    """One row; ``measure=False``: agreement and first calls only."""
    # Training steps move BatchNorm's running statistics: every mode starts from the same state.
    patched.load_state_dict(model.state_dict())
    row = {"case": net.name, "suite": "networks", "source": net.source, "description": net.description,
           "mode": mode.name, "dtype": mode.dtype, "autocast": mode.autocast, "layout": "ncdhw",
           "precision": "tf32" if cudnn_conv_allows_tf32() else "tf32x3",
           "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32), "backend": backend,
           "input_shape": list(x.shape), "parameters": sum(p.numel() for p in model.parameters()),
           "convt_layers": sum(isinstance(m, nn.ConvTranspose3d) for m in model.modules()),
           "convt_layers_patched": sum(isinstance(m, Patched) for m in patched.modules())}
    target = None
    if mode.training:  # a fixed ~N(0, 1) fp32 target shaped like the output (eval mode: BatchNorm's statistics kept)
        gen = torch.Generator(device="cpu").manual_seed(name_seed(net.name, seed) + 2)
        target = torch.randn(forward_fn(model, x, autocast=False)().shape, generator=gen).to(x.device)

    def call(m: nn.Module):
        return training_step(m, x, target, mode.autocast) if mode.training else forward_fn(m, x, mode.autocast)

    fn_u, fn_p = call(model), call(patched)
    status(f"{net.name} {mode.label}: untouched first call")
    y_u, first_u = timer.first_call(fn_u)
    if tune and backend == "auto":  # convt3d.tune of the patched model as the mode runs it
        status(f"{net.name} {mode.label}: convt3d.tune (network check included)")
        patched.train(mode.training)
        t0 = time.perf_counter()
        with (torch.autocast(x.device.type, torch.bfloat16, enabled=mode.autocast),
              torch.enable_grad() if mode.training else torch.no_grad()):
            rep = convt3d.tune(patched, x, backward=mode.training, progress=False)
        row.update(tune_s=time.perf_counter() - t0, network_check=rep.network)
        fn_p = call(patched)
    status(f"{net.name} {mode.label}: patched first call (compile, tune, measure)")
    y_p, first_p = timer.first_call(fn_p)
    if mode.name not in refs:  # one reference per kind of mode, whatever its dtype
        status(f"{net.name} {mode.label}: reference")
        t0 = time.perf_counter()
        if mode.training:  # the fp32 step with TF32 off
            with cudnn_tf32(False):
                made = training_step(model, x, target, autocast=False)(), "fp32 step, TF32 off"
        else:  # the float64 forward of a copy
            made = forward_fn(copy.deepcopy(model).double(), x.double(), autocast=False)(), "float64"
        refs[mode.name] = (*made, time.perf_counter() - t0)
    ref, row["reference"], row["reference_s"] = refs[mode.name]
    _compare(row, y_p, y_u, ref, mode, model, x)
    row.update(torch_first_call_s=first_u, first_call_s=first_p, first_call_extra_s=first_p - first_u)
    del y_u, y_p
    if not measure:
        return row

    status(f"{net.name} {mode.label}: engines of the patched layers")
    row["engine"], row["layer_decisions"] = layer_engines(patched, fn_p)
    # Both forwards profiled alike: whether a patched network's time goes to its transposed convolutions.
    profiles = {}
    for side, m in (("untouched", model), ("patched", patched)):
        status(f"{net.name} {mode.label}: profiling the {side} forward")
        profiles[side] = _profile_share(forward_fn(m, x, mode.autocast, mode.training), x.device.type)
    (share, part_u, total_u), (_, part_p, total_p) = profiles["untouched"], profiles["patched"]
    row.update(convt_share=share, convt_us=part_u, forward_kernel_us=total_u, convt_us_patched=part_p,
               forward_kernel_us_patched=total_p)

    status(f"{net.name} {mode.label}: timing untouched and patched ({rounds} interleaved pairs)")
    times_u, times_p = timer.paired(fn_u, fn_p, rounds)
    ratio, low, high = paired_ratio(times_u, times_p)
    t_u, t_p = statistics.median(times_u), statistics.median(times_p)
    status(f"{net.name} {mode.label}: untouched {t_u * 1e6:.0f} us, patched {t_p * 1e6:.0f} us, {ratio:.2f}x "
           f"(pairs {low:.2f}-{high:.2f}x)")
    row.update(torch_us=t_u * 1e6, convt3d_us=t_p * 1e6, speedup=ratio, speedup_quartiles=[low, high],
               torch_us_rounds=[t * 1e6 for t in times_u], convt3d_us_rounds=[t * 1e6 for t in times_p])
    return row


def _failure(net: Network, mode: NetMode | None, exc: BaseException) -> dict:
    return failure_entry(exc, case=net.name, dtype=mode.dtype if mode else "-", layout="ncdhw", precision="tf32",
                         mode=mode.name if mode else "build")


def run_networks(nets: list[Network], modes: list[NetMode], backend: str = "auto", settings=None,
                 status: Callable[[str], None] = lambda _msg: None, advance: Callable[[], None] = lambda: None,
                 device: str = "cuda", timer=None, rounds: int = DEFAULT_PAIRS, tiny: bool = False,
                 measure: bool = True, on_network: Callable[[list, list, list], None] | None = None,
                 tune: bool = False) -> tuple[list[dict], list[dict], list[dict]]:
    """Time every network in every mode, untouched against ``convt3d.patch(copy.deepcopy(model))``:
    (rows, failures, skipped), a network that raises a failure entry, a missing extra a skipped one.
    ``measure=False`` only compares outputs; ``on_network(rows, failures, skipped)`` runs after each."""
    settings = settings or TimingSettings()
    timer = timer if timer is not None else CudaTimer(settings)
    rows, failures, skipped = [], [], []
    for net in nets:
        reason = unavailable_reason(net)
        model = patched = x = None
        if reason is not None:
            skipped.append({"case": net.name, "reason": reason})
        else:
            try:
                status(f"{net.name}: building")
                model, x = build_network(net, device, tiny=tiny, seed=settings.seed)
                patched = convt3d.patch(copy.deepcopy(model), backend=None if backend == "auto" else backend)
            except Exception as exc:  # noqa: BLE001 -- one network's failure must not hide the others
                failures.append(_failure(net, None, exc))
        refs: dict = {}
        for mode in modes:
            if patched is not None:
                try:
                    rows.append(_run_mode(net, mode, model, patched, x, backend, timer, status, refs, settings.seed,
                                          rounds, measure, tune))
                except Exception as exc:  # noqa: BLE001
                    failures.append(_failure(net, mode, exc))
            advance()
        del model, patched, x, refs
        if reason is None:
            timer.release()
        if on_network:
            on_network(rows, failures, skipped)
    return rows, failures, skipped


# ---- CPU check (Triton's interpreter) --------------------------------------------------------------
def check_networks(nets: list[Network], seed: int = 0, status: Callable[[str], None] = lambda _msg: None,
                   advance: Callable[[], None] = lambda: None) -> tuple[list[dict], list[dict], list[dict]]:
    """Each network at its tiny size on the CPU, fp32 inference with TF32 off, the patched model
    (``CHECK_BACKEND``) against the untouched one and float64: (rows, failures, skipped), a row ``ok``
    when every layer is patched and the output has the right shape and is within budget."""
    with cudnn_tf32(False):
        rows, failures, skipped = run_networks(nets, [NetMode("infer", "fp32")], CHECK_BACKEND,
                                               TimingSettings(seed=seed), status, advance, "cpu",
                                               tiny=True, measure=False)
    for r in rows:
        r.update(seconds=r["first_call_s"], ok=r["within_error_budget"] and r["output_layout_matches"]
                 and r["convt_layers_patched"] == r["convt_layers"] > 0)
    return rows, failures, skipped
