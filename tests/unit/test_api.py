"""The public API on the CPU: ``conv_transpose3d`` with backends "torch" and "auto", the module,
``patch``, backend and precision selection, and autograd through the custom op.

On CPU tensors "torch" and "auto" run PyTorch itself, so every result here must be *bitwise*
PyTorch's (same dtype, same strides) -- that checks our argument normalisation, unbatched handling
and memory-format plumbing exactly -- and also close to float64 PyTorch, which checks the
reference path the other test files trust.
"""
from __future__ import annotations

import copy
import random
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convt3d
import convt3d.functional
import convt3d.engines.triton.engine
from convt3d.dispatch import select as dispatch

from conftest import CL, LAYOUTS, Case, check_against_reference, memory_format_of, random_case, requires_interpreter


def _same_as_pytorch(y, x, w, b, args):
    """Bitwise PyTorch: values, dtype, shape and strides (memory format)."""
    ref = F.conv_transpose3d(x, w, b, *args)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert y.stride() == ref.stride(), f"strides {y.stride()} != PyTorch's {ref.stride()}"
    assert torch.equal(y, ref)


# ---------------------------------------------------------------------------------------------
# Randomised sweep against PyTorch
# ---------------------------------------------------------------------------------------------
_rng = random.Random(1234)
SWEEP = [random_case(_rng, max_channels=9, max_in=5, max_kernel=4, max_stride=3, max_dilation=3)
         for _ in range(120)]


def test_sweep_covers_every_regime():
    # The sweep is random; make sure it really contains what the issue asks it to cover.
    forms = {type(v).__name__ + str(len(v)) if isinstance(v, (tuple, list)) else "int"
             for c in SWEEP for v in (c.stride, c.padding, c.output_padding, c.dilation)}
    assert {"int", "tuple1", "tuple3", "list3"} <= forms
    assert {c.layout for c in SWEEP} == set(LAYOUTS)
    assert any(c.batch is None for c in SWEEP) and any(c.groups > 1 for c in SWEEP)
    assert any(c.bias for c in SWEEP) and any(not c.bias for c in SWEEP)
    as3 = [lambda v: v if isinstance(v, (tuple, list)) and len(v) == 3 else (v if isinstance(v, int) else v[0],) * 3]
    assert any(max(as3[0](c.dilation)) > 1 for c in SWEEP)
    assert any(max(as3[0](c.output_padding)) > 0 for c in SWEEP)
    assert any(c.cin == c.groups or c.cout == c.groups for c in SWEEP)  # one channel per group somewhere


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("case", SWEEP, ids=[c.id() for c in SWEEP])
def test_sweep_matches_pytorch(case, backend):
    x, w, b = case.tensors(torch.float32)
    y = convt3d.conv_transpose3d(x, w, b, *case.args, backend=backend)
    _same_as_pytorch(y, x, w, b, case.args)
    check_against_reference(y, x, w, b, *case.args, precision="ieee", context=case.id())


NAMED = {
    # regime -> (case, dtype)
    "unbatched": (Case(None, 4, 6, (3, 4, 5), (3, 2, 3), 2, 1, 1), torch.float32),
    "unbatched-grouped-dilated": (Case(None, 6, 4, (3, 3, 3), (2, 3, 2), (1, 2, 1), 1, (0, 1, 0), 2, 2), torch.float32),
    "batch0": (Case(0, 4, 6, (3, 3, 3), (3, 3, 3), 2, 1, 1), torch.float32),
    "batch0-empty-spatial": (Case(0, 4, 6, (0, 3, 3), (3, 3, 3), 2), torch.float32),
    "cin1": (Case(2, 1, 5, (3, 3, 3), (2, 2, 2), 2), torch.float32),
    "cout1": (Case(2, 5, 1, (3, 3, 3), (2, 2, 2), 2), torch.float32),
    "cin1-cout1-unbatched": (Case(None, 1, 1, (4, 4, 4), (3, 3, 3), 1, 1), torch.float32),
    "depthwise": (Case(2, 6, 6, (4, 4, 4), (3, 3, 3), 2, 1, 1, 1, 6), torch.float32),
    "depthwise-multiplier2": (Case(2, 3, 6, (4, 4, 4), (3, 3, 3), 2, 1, 1, 1, 3), torch.float32),
    "output_padding-below-dilation-stride1": (Case(2, 4, 4, (3, 3, 3), (2, 2, 2), 1, 0, 1, 2), torch.float32),
    "kernel-below-stride": (Case(2, 4, 4, (3, 3, 3), (1, 2, 1), 3, 0, 2), torch.float32),
    "per-dim-everything": (Case(2, 4, 6, (3, 4, 5), (1, 2, 3), (1, 2, 3), (0, 1, 2), (0, 1, 2), (1, 1, 2), 2),
                           torch.float32),
    "channels_last_3d": (Case(2, 4, 6, (3, 4, 5), (3, 3, 3), 2, 1, 1, layout="channels_last_3d"), torch.float32),
    "permuted-view": (Case(2, 4, 6, (3, 4, 5), (3, 3, 3), 2, 1, 1, layout="permuted_view"), torch.float32),
    "sliced-w": (Case(2, 4, 6, (3, 4, 5), (3, 3, 3), 2, 1, 1, layout="slice_w"), torch.float32),
    "sliced-channels": (Case(2, 4, 6, (3, 4, 5), (3, 3, 3), 2, 1, 1, layout="slice_c"), torch.float32),
    "transposed-dh": (Case(2, 4, 6, (3, 4, 5), (3, 3, 3), 2, 1, 1, layout="transpose_dh"), torch.float32),
    "float64": (Case(2, 4, 6, (3, 4, 5), (3, 3, 3), 2, 1, 1, groups=2), torch.float64),
    "float64-channels_last_3d": (Case(2, 4, 6, (3, 4, 5), (3, 3, 3), 2, 1, 1, layout="channels_last_3d"),
                                 torch.float64),
    "float16": (Case(2, 4, 6, (3, 3, 3), (3, 3, 3), 2, 1, 1), torch.float16),
    "bfloat16": (Case(2, 4, 6, (3, 3, 3), (3, 3, 3), 2, 1, 1), torch.bfloat16),
}


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("name", list(NAMED))
def test_named_regime_matches_pytorch(name, backend):
    case, dtype = NAMED[name]
    x, w, b = case.tensors(dtype)
    y = convt3d.conv_transpose3d(x, w, b, *case.args, backend=backend)
    _same_as_pytorch(y, x, w, b, case.args)
    if dtype in (torch.float32, torch.float64):
        # (PyTorch's CPU kernels round 16-bit partial sums in 16 bits, outside the fp32-accumulate
        # bound of conftest.Tol; for them bitwise equality with PyTorch is the whole claim.)
        check_against_reference(y, x, w, b, *case.args, precision="ieee", context=name)
    if case.batch is None:
        assert y.dim() == 4
    if case.batch == 0:
        assert y.numel() == 0 and y.shape[0] == 0


def test_channels_last_in_gives_channels_last_out():
    # As PyTorch (and cuDNN) do for float32: channels_last_3d input -> channels_last_3d output.
    x = torch.randn(2, 4, 3, 4, 5).contiguous(memory_format=CL)
    y = convt3d.conv_transpose3d(x, torch.randn(4, 6, 3, 3, 3), stride=2, backend="torch")
    assert memory_format_of(y) == "channels_last_3d"


@pytest.mark.parametrize("value", [
    torch.tensor(2), (torch.tensor(2), 1, np.int64(2)), torch.tensor([2]), np.int64(2), torch.Size([2, 1, 2]), [2],
], ids=["int-tensor", "tuple-of-tensor-and-numpy", "one-element-tensor", "numpy-int", "torch-size", "list-of-one"])
def test_integer_like_arguments_accepted_like_pytorch(value):
    # PyTorch's argument parser takes these as ints; a drop-in must not refuse them.
    x, w = torch.randn(1, 4, 3, 3, 3), torch.randn(4, 2, 2, 2, 2)
    y = convt3d.conv_transpose3d(x, w, None, value, backend="torch")
    _same_as_pytorch(y, x, w, None, (value,))


@pytest.mark.parametrize("groups", [torch.tensor(2), np.int64(2), torch.tensor([2])],
                         ids=["int-tensor", "numpy-int", "one-element-tensor"])
def test_integer_like_groups_accepted_like_pytorch(groups):
    x, w = torch.randn(1, 4, 3, 3, 3), torch.randn(4, 1, 2, 2, 2)
    y = convt3d.conv_transpose3d(x, w, None, 1, 0, 0, groups, backend="auto")
    _same_as_pytorch(y, x, w, None, (1, 0, 0, groups))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64], ids=["complex64", "int64"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_other_dtypes_go_to_pytorch(dtype, backend):
    # "dtypes other than float32/float16/bfloat16 go to 'torch' under 'auto'": whatever PyTorch
    # computes for them, we compute too.
    x = torch.randint(-3, 4, (1, 4, 3, 3, 3)).to(dtype)
    w = torch.randint(-3, 4, (4, 2, 2, 2, 2)).to(dtype)
    _same_as_pytorch(convt3d.conv_transpose3d(x, w, None, 2, backend=backend), x, w, None, (2,))


def test_bool_dtype_fails_like_pytorch():
    x, w = torch.ones(1, 4, 3, 3, 3, dtype=torch.bool), torch.ones(4, 2, 2, 2, 2, dtype=torch.bool)
    with pytest.raises(Exception) as pt:
        F.conv_transpose3d(x, w)
    with pytest.raises(Exception) as ours:
        convt3d.conv_transpose3d(x, w, backend="auto")
    assert type(ours.value) is type(pt.value)


# ---------------------------------------------------------------------------------------------
# ConvTranspose3d
# ---------------------------------------------------------------------------------------------
MODULE_CONFIGS = {
    "k3": dict(in_channels=4, out_channels=6, kernel_size=3),
    "k3s2p1op1": dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1),
    "per-dim-grouped-dilated-nobias": dict(in_channels=6, out_channels=4, kernel_size=(1, 2, 3), stride=(1, 2, 3),
                                           padding=(0, 1, 1), output_padding=(0, 1, 2), groups=2, bias=False,
                                           dilation=(1, 1, 2)),
    "depthwise": dict(in_channels=5, out_channels=5, kernel_size=2, stride=2, groups=5),
    "float64": dict(in_channels=3, out_channels=2, kernel_size=2, stride=2, dtype=torch.float64),
}


@pytest.mark.parametrize("name", list(MODULE_CONFIGS))
def test_module_same_parameters_as_pytorch(name):
    kwargs = MODULE_CONFIGS[name]
    torch.manual_seed(42)
    ref = nn.ConvTranspose3d(**kwargs)
    state_after_ref = torch.get_rng_state()
    torch.manual_seed(42)
    ours = convt3d.ConvTranspose3d(**kwargs)
    assert isinstance(ours, nn.ConvTranspose3d)
    # Same draws from the RNG, in the same order: later layers of a model initialise identically.
    assert torch.equal(torch.get_rng_state(), state_after_ref)
    ref_params, our_params = dict(ref.named_parameters()), dict(ours.named_parameters())
    assert list(ref_params) == list(our_params)
    for k in ref_params:
        assert our_params[k].dtype == ref_params[k].dtype
        assert torch.equal(our_params[k], ref_params[k]), k
    for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "output_padding", "groups",
                 "dilation", "padding_mode", "transposed"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.extra_repr() == ref.extra_repr()  # no backend/precision set: PyTorch's repr


@pytest.mark.parametrize("name", list(MODULE_CONFIGS))
def test_module_state_dict_interchange(name):
    kwargs = MODULE_CONFIGS[name]
    torch.manual_seed(1)
    ref = nn.ConvTranspose3d(**kwargs)
    torch.manual_seed(2)
    ours = convt3d.ConvTranspose3d(**kwargs)
    dtype = kwargs.get("dtype", torch.float32)
    x = torch.randn(2, kwargs["in_channels"], 3, 3, 3, dtype=dtype)
    assert not torch.equal(ours(x), ref(x))  # different seeds: the loads below must matter

    ours.load_state_dict(ref.state_dict(), strict=True)  # PyTorch -> convt3d
    assert torch.equal(ours(x), ref(x))
    assert list(ours.state_dict()) == list(ref.state_dict())

    torch.manual_seed(3)
    other = convt3d.ConvTranspose3d(**kwargs)
    ref.load_state_dict(other.state_dict(), strict=True)  # convt3d -> PyTorch
    assert torch.equal(ref(x), other(x))


OUTPUT_SIZES = {
    # regime -> (input shape, output_size): stride 2 (k3 p1) allows 2*I-1 or 2*I per dim
    "3-element-min": ((2, 4, 3, 4, 5), [5, 7, 9]),
    "3-element-max": ((2, 4, 3, 4, 5), [6, 8, 10]),
    "3-element-mixed-tuple": ((2, 4, 3, 4, 5), (6, 7, 10)),
    "5-element": ((2, 4, 3, 4, 5), [2, 6, 6, 7, 10]),
    "5-element-torch-size": ((2, 4, 3, 4, 5), torch.Size([2, 6, 5, 8, 9])),
    "unbatched-3-element": ((4, 3, 4, 5), [6, 7, 9]),
    "unbatched-4-element": ((4, 3, 4, 5), [6, 6, 8, 9]),
    "none": ((2, 4, 3, 4, 5), None),
}


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("name", list(OUTPUT_SIZES))
def test_module_output_size_like_pytorch(name, backend):
    shape, output_size = OUTPUT_SIZES[name]
    ref = nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1)
    ours = convt3d.ConvTranspose3d(4, 6, 3, stride=2, padding=1)
    ours.load_state_dict(ref.state_dict())
    ours.backend = backend
    x = torch.randn(shape)
    y_ref, y = ref(x, output_size), ours(x, output_size)
    assert y.shape == y_ref.shape
    if output_size is not None:
        assert list(y.shape[-3:]) == list(output_size)[-3:]
    assert torch.equal(y, y_ref)


def test_module_backend_and_precision_attributes(monkeypatch):
    # The per-layer attributes reach the function (here: "torch" refuses "tf32x3", which proves
    # both arrived) and show in the repr.
    layer = convt3d.ConvTranspose3d(4, 2, 2)
    layer.backend, layer.precision = "torch", "tf32x3"
    assert "backend='torch'" in repr(layer) and "precision='tf32x3'" in repr(layer)
    with pytest.raises(convt3d.BackendUnavailableError):
        layer(torch.randn(1, 4, 3, 3, 3))


# ---------------------------------------------------------------------------------------------
# patch
# ---------------------------------------------------------------------------------------------
class CustomConvT(nn.ConvTranspose3d):
    """A user's subclass with its own forward: patch must leave it alone."""

    def forward(self, input, output_size=None):
        return super().forward(input, output_size) * 2


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up1 = nn.ConvTranspose3d(8, 6, 2, stride=2)
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.ReLU(), nn.ConvTranspose3d(6, 4, 3, padding=1, groups=2)),
            nn.Sequential(nn.ConvTranspose3d(4, 4, 3, stride=2, padding=1, output_padding=1, bias=False)),
        ])
        self.norm = nn.BatchNorm3d(4)
        self.head = nn.ModuleDict({"out": CustomConvT(4, 2, 1)})

    def forward(self, x):
        x = self.up1(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head["out"](self.norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_patch_swaps_nested_layers_in_place(dtype):
    model = Decoder().to(dtype).eval()
    x = torch.randn(2, 8, 3, 3, 3, dtype=dtype)
    with torch.no_grad():
        before = model(x)
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    hook_calls = []
    model.up1.register_forward_hook(lambda m, i, o: hook_calls.append(type(m)))

    assert convt3d.patch(model, backend="torch") is model
    assert type(model.up1) is convt3d.ConvTranspose3d
    assert type(model.blocks[0][1]) is convt3d.ConvTranspose3d
    assert type(model.blocks[1][0]) is convt3d.ConvTranspose3d
    assert type(model.head["out"]) is CustomConvT  # own forward: left alone
    assert model.up1.backend == "torch"
    # The same Parameter and buffer objects (optimisers holding them keep working), same dtype.
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(b is buffers[n] for n, b in model.named_buffers())
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in model.parameters())
    assert not model.training
    with torch.no_grad():
        after = model(x)
    assert hook_calls == [convt3d.ConvTranspose3d]  # hooks survive the swap
    assert torch.equal(after, before)


@pytest.mark.parametrize("cuda,interpreter,starts", [(True, False, True), (False, False, False),
                                                      (True, True, False)],
                         ids=["cuda-compiled", "no-cuda", "interpreter"])
def test_patch_starts_the_triton_warm_up_once(monkeypatch, tmp_path, cuda, interpreter, starts):
    # patch() computes Triton's per-process key in a daemon thread, once, and only where a
    # compiled kernel will need it (none is kept in this empty cache folder).
    import threading

    import triton
    from convt3d.engines.triton import warm_up as triton_warm_up

    calls = []
    monkeypatch.setenv("CONVT3D_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_warm_up.triton_cache, "triton_key",
                        lambda: calls.append(threading.current_thread().name) or "hash")
    monkeypatch.setattr(triton_warm_up, "_warm_up_started", False)
    monkeypatch.setattr(triton_warm_up, "_key", None)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", interpreter)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for _ in range(2):
        convt3d.patch(nn.Sequential(nn.ConvTranspose3d(2, 2, 2)))
    for t in threading.enumerate():
        if t.name == "convt3d-triton-warm-up":
            t.join(timeout=10)
    assert calls == (["convt3d-triton-warm-up"] if starts else [])


def test_patch_the_model_itself_and_training_mode():
    layer = nn.ConvTranspose3d(3, 2, 2).train()
    assert convt3d.patch(layer) is layer
    assert type(layer) is convt3d.ConvTranspose3d and layer.training
    assert layer.backend is None and layer.precision is None  # package defaults


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_interpreter)])
def test_patch_takes_parametrized_layers(norm, backend):
    """A ConvTranspose3d under torch.nn.utils.parametrizations (the spectral norm of GAN
    generators, weight norm) is patched with its parametrization working: the same outputs and
    gradients as the untouched layer, the weight recomputed from its parametrization on every
    call, a deepcopy that keeps both, and remove_parametrizations leaving a convt3d layer."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(3)
    wrap = getattr(parametrizations, norm)
    ref = wrap(nn.ConvTranspose3d(4, 2, 3, stride=2, padding=1, output_padding=1))
    layer = wrap(nn.ConvTranspose3d(4, 2, 3, stride=2, padding=1, output_padding=1))
    layer.load_state_dict(ref.state_dict())
    ref.eval(), layer.eval()  # spectral norm: no power iteration, so the two stay equal
    held = list(layer.parameters())
    assert convt3d.patch(layer, backend=backend, precision="ieee") is layer
    assert isinstance(layer, convt3d.ConvTranspose3d) and parametrize.is_parametrized(layer, "weight")
    assert all(p is q for p, q in zip(layer.parameters(), held))
    x = torch.randn(2, 4, 3, 3, 3, requires_grad=True)
    y, y_ref = layer(x), ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(y.square().sum(), [x] + held)
    g_ref = torch.autograd.grad(y_ref.square().sum(), [x] + list(ref.parameters()))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # a changed parametrization input changes the next call's weight
        held[-1].mul_(2.0)
        list(ref.parameters())[-1].mul_(2.0)
        torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(layer)
    assert isinstance(twin, convt3d.ConvTranspose3d) and parametrize.is_parametrized(twin, "weight")
    with torch.no_grad():
        torch.testing.assert_close(twin(x), ref(x), rtol=1e-5, atol=1e-5)
    parametrize.remove_parametrizations(layer, "weight")
    assert type(layer) is convt3d.ConvTranspose3d and layer.backend == backend


def test_patched_model_trains():
    # Parameters collected before patching (as an optimiser holds them) receive the gradients
    # of the patched model: training continues across the swap.
    torch.manual_seed(5)
    model = nn.Sequential(nn.ConvTranspose3d(3, 2, 2, stride=2))
    held = list(model.parameters())
    convt3d.patch(model, backend="torch")
    model(torch.randn(1, 3, 2, 2, 2)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in held)


# ---------------------------------------------------------------------------------------------
# Backend selection: argument, environment variable, "auto"
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def spies(monkeypatch):
    """Record which engine ran (both still run for real)."""
    calls = []
    real_torch, real_triton = convt3d.engines.torch.calls.torch_forward, convt3d.engines.triton.engine.forward

    def torch_spy(*a, **k):
        calls.append("torch")
        return real_torch(*a, **k)

    def triton_spy(*a, **k):
        calls.append("triton")
        return real_triton(*a, **k)

    monkeypatch.setattr(convt3d.engines.torch.peer, "torch_forward", torch_spy)
    monkeypatch.setattr(convt3d.engines.triton.engine, "forward", triton_spy)
    return calls


@requires_interpreter
@pytest.mark.parametrize("env,arg,engine", [
    (None, None, "torch"),  # nothing set: "auto", which is PyTorch on CPU tensors
    ("", None, "torch"),  # empty counts as unset
    ("auto", None, "torch"),
    ("torch", None, "torch"),
    ("triton", None, "triton"),
    ("triton", "torch", "torch"),  # the argument wins over the environment
    ("torch", "triton", "triton"),
    ("torch", "auto", "torch"),
], ids=["unset", "empty", "env-auto", "env-torch", "env-triton", "env-triton-arg-torch", "env-torch-arg-triton",
        "env-torch-arg-auto"])
def test_backend_environment_variable(env, arg, engine, monkeypatch, spies):
    if env is None:
        monkeypatch.delenv("CONVT3D_BACKEND", raising=False)
    else:
        monkeypatch.setenv("CONVT3D_BACKEND", env)
    x, w = torch.randn(1, 2, 2, 2, 2), torch.randn(2, 2, 2, 2, 2)
    y = convt3d.conv_transpose3d(x, w, stride=2, backend=arg, precision="ieee")
    assert spies == [engine]
    check_against_reference(y, x, w, None, 2, context=f"env={env} arg={arg}")


def test_environment_variable_read_at_call_time(monkeypatch):
    # Not cached at import: a test harness or user can switch it between calls.
    x, w = torch.randn(1, 2, 2, 2, 2), torch.randn(2, 2, 2, 2, 2)
    monkeypatch.setenv("CONVT3D_BACKEND", "torch")
    with pytest.raises(convt3d.BackendUnavailableError):
        convt3d.conv_transpose3d(x, w, precision="tf32x3")
    monkeypatch.setenv("CONVT3D_BACKEND", "auto")
    convt3d.conv_transpose3d(x, w, precision="tf32x3")  # "auto" on CPU: PyTorch, no error


@pytest.fixture
def restore_tf32_flags():
    """Precision flags are process-global: put them back whatever the test does."""
    conv = torch.backends.cudnn.conv.fp32_precision
    rnn = torch.backends.cudnn.rnn.fp32_precision
    yield
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.conv.fp32_precision = conv
    torch.backends.cudnn.rnn.fp32_precision = rnn


@pytest.mark.parametrize("allow_tf32,expected", [(True, "tf32"), (False, dispatch.EXACT_GRADE)],
                         ids=["allow_tf32-on", "allow_tf32-off"])
def test_precision_none_follows_cudnn_allow_tf32(allow_tf32, expected, restore_tf32_flags):
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=allow_tf32):
        assert dispatch.resolve_precision(None) == expected
        x = torch.randn(1, 2, 2, 2, 2)
        assert dispatch.decide(x, "triton", None).precision == expected
        assert dispatch.decide(x, "auto", None).precision == expected
    for explicit in dispatch.PRECISIONS:  # an explicit precision ignores the flag
        torch.backends.cudnn.allow_tf32 = not allow_tf32
        assert dispatch.resolve_precision(explicit) == explicit


@pytest.mark.parametrize("conv_precision,expected", [("ieee", dispatch.EXACT_GRADE), ("tf32", "tf32")],
                         ids=["conv-ieee", "conv-tf32"])
def test_precision_none_follows_new_fp32_precision_api(conv_precision, expected, restore_tf32_flags):
    # PyTorch >= 2.9 convolutions read torch.backends.cudnn.conv.fp32_precision. Setting it alone
    # (conv differs from rnn) makes the legacy allow_tf32 getter raise, so precision=None must
    # read the per-operator flag rather than crash.
    torch.backends.cudnn.conv.fp32_precision = conv_precision
    torch.backends.cudnn.rnn.fp32_precision = "tf32" if conv_precision == "ieee" else "ieee"
    assert dispatch.resolve_precision(None) == expected
    x, w = torch.randn(1, 2, 2, 2, 2), torch.randn(2, 2, 2, 2, 2)
    _same_as_pytorch(convt3d.conv_transpose3d(x, w, backend="auto"), x, w, None, ())


def test_exact_grade_is_a_known_precision():
    assert dispatch.EXACT_GRADE in ("tf32x3", "ieee")


def _fake_cuda_input(dtype):
    # decide() looks only at the device and the dtype; a stand-in lets the CUDA branch of "auto"
    # be tested on a CPU-only machine.
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)


@pytest.mark.parametrize("dtype,engine", [
    (torch.float32, "triton"), (torch.float16, "triton"), (torch.bfloat16, "triton"),
    (torch.float64, "torch"), (torch.complex64, "torch"), (torch.int32, "torch"),
], ids=["float32", "float16", "bfloat16", "float64", "complex64", "int32"])
def test_auto_on_cuda_picks_triton_for_its_dtypes(dtype, engine, monkeypatch):
    monkeypatch.setattr(convt3d.engines.triton.engine, "unsupported_reason",
                        lambda x, *a, **k: None if x.dtype in convt3d.engines.triton.engine.SUPPORTED_DTYPES else "dtype")
    d = dispatch.decide(_fake_cuda_input(dtype), "auto", "ieee")
    assert d.engine == engine and d.precision == "ieee" and d.reason


def test_auto_on_old_gpu_falls_back_but_triton_refuses(monkeypatch):
    monkeypatch.setattr(convt3d.engines.triton.engine, "unsupported_reason", lambda x, *a, **k: "compute capability 7.x")
    x = _fake_cuda_input(torch.float32)
    d = dispatch.decide(x, "auto", None)
    assert d.engine == "torch" and "compute capability 7.x" in d.reason
    with pytest.raises(convt3d.BackendUnavailableError, match="compute capability 7.x"):
        dispatch.decide(x, "triton", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=["float32", "float16", "float64"])
def test_auto_on_cpu_is_pytorch(dtype):
    d = dispatch.decide(torch.randn(1, 2, 2, 2, 2).to(dtype), "auto", None)
    assert d.engine == "torch"


# ---------------------------------------------------------------------------------------------
# Autograd through the custom op (Triton forward through the interpreter, PyTorch backward)
# ---------------------------------------------------------------------------------------------
GRAD_CASES = {
    "fma-k3s2p1op1-bias": Case(2, 2, 3, (1, 3, 2), (3, 3, 3), 2, 1, 1),
    "fma-grouped-dilated-unbatched": Case(None, 4, 2, (3, 3, 3), (2, 2, 2), 1, 1, 0, 2, 2),
    "tensor-core-k2s2-nobias": Case(1, 8, 8, (2, 3, 2), (2, 2, 2), 2, bias=False),
    "fma-channels_last": Case(2, 3, 2, (1, 3, 3), (2, 3, 2), (2, 1, 2), 0, 0, 1, layout="channels_last_3d"),
}


def _graph_has_node(fn, name: str) -> bool:
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        if name in f.name():
            return True
        todo.extend(nxt for nxt, _ in f.next_functions)
    return False


@requires_interpreter
@pytest.mark.parametrize("wrt", ["all", "weight-only"])
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_backward_through_our_autograd(name, wrt):
    case = GRAD_CASES[name]
    x, w, b = (t.double() if t is not None else None for t in case.tensors(torch.float32))
    leaves64 = [x.requires_grad_(wrt == "all"), w.requires_grad_(), b.requires_grad_() if b is not None else None]
    leaves32 = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None for t in leaves64]
    y = convt3d.conv_transpose3d(*leaves32, *case.args, backend="triton", precision="ieee")
    assert _graph_has_node(y.grad_fn, "EagerConvT3d")  # our autograd node (ops.conv_transpose3d_autograd)
    ref = F.conv_transpose3d(*leaves64, *case.args)
    check_against_reference(y, leaves32[0], leaves32[1], leaves32[2], *case.args, context=name)
    g = torch.randn(ref.shape, dtype=torch.float64)
    y.backward(g.float())
    ref.backward(g)
    for t32, t64, what in zip(leaves32, leaves64, ("input", "weight", "bias")):
        if t64 is None or not t64.requires_grad:
            assert t32 is None or t32.grad is None
            continue
        assert t32.grad is not None, f"no gradient for {what}"
        assert t32.grad.shape == t64.grad.shape
        # fp32 gradients from PyTorch's own backward kernels: 1e-4 of the gradient's scale.
        scale = t64.grad.abs().max().item()
        err = (t32.grad.double() - t64.grad).abs().max().item()
        assert err <= 1e-4 * scale + 1e-6, f"{what}: max error {err:.3g} at scale {scale:.3g}"


@requires_interpreter
def test_inference_and_autograd_routes_agree():
    # With no grad needed the engine is called directly; with grad, through our autograd.Function. Both
    # must give bitwise the same forward.
    case = Case(1, 3, 4, (1, 3, 3), (2, 2, 2), 2, 1, 1)
    x, w, b = case.tensors()
    with torch.no_grad():
        y0 = convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", precision="ieee")
    y1 = convt3d.conv_transpose3d(x.requires_grad_(), w, b, *case.args, backend="triton", precision="ieee")
    assert y1.requires_grad and not y0.requires_grad
    assert torch.equal(y0, y1.detach())


# ---------------------------------------------------------------------------------------------
# torch.jit.trace records ATen operations only
# ---------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("backend", [None, "auto", "torch"])
def test_jit_trace_records_pytorchs_op(backend):
    torch.manual_seed(0)
    m = convt3d.ConvTranspose3d(4, 6, 3, stride=2, padding=1, output_padding=1)
    m.backend = backend
    traced = torch.jit.trace(m, torch.randn(2, 4, 3, 3, 3))
    assert any(n.kind() == "aten::_convolution" or "conv_transpose3d" in n.kind() for n in traced.graph.nodes())
    x = torch.randn(2, 4, 3, 3, 3)
    assert torch.equal(traced(x), m(x))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("backend", ["triton", "conv3d"])
def test_jit_trace_of_a_named_engine_raises(backend):
    m = convt3d.ConvTranspose3d(4, 6, 3, padding=1)
    m.backend = backend
    with pytest.raises(convt3d.BackendUnavailableError, match=rf"backend='{backend}' cannot run this call under "
                                                              "torch.jit.trace"):
        torch.jit.trace(m, torch.randn(2, 4, 3, 3, 3))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("output_size", [None, [6, 6, 6]], ids=["plain", "output-size"])
def test_jit_script_compiles_pytorchs_op(output_size):
    """torch.jit.script of a patched layer (nn.ConvTranspose3d scripts): TorchScript compiles
    PyTorch's own op, and the scripted module saves and loads without convt3d's Python."""
    import io

    torch.manual_seed(0)
    m = convt3d.ConvTranspose3d(4, 6, 3, stride=2, padding=1)
    m.backend = "triton"  # read by the Python path only
    scripted = torch.jit.script(m)
    assert any(n.kind() == "aten::conv_transpose3d" for n in scripted.graph.nodes())
    x = torch.randn(2, 4, 3, 3, 3)
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    ref = nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1)
    ref.load_state_dict(m.state_dict())
    want = ref(x, output_size) if output_size else ref(x)
    for module in (scripted, loaded):
        assert torch.equal(module(x, output_size) if output_size else module(x), want)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_patch_takes_lazy_layers_at_their_first_call(backend):
    """nn.LazyConvTranspose3d builds its parameters at its first call and then turns into
    nn.ConvTranspose3d: after patch(), into convt3d's, with the backend patch() was given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConvTranspose3d(6, 3, stride=2, padding=1), nn.ReLU())
    convt3d.patch(model, backend=backend)
    x = torch.randn(2, 4, 3, 3, 3)
    y = model(x)
    layer = model[0]
    assert type(layer) is convt3d.ConvTranspose3d and layer.backend == backend
    assert torch.equal(y, F.relu(F.conv_transpose3d(x, layer.weight, layer.bias, 2, 1)))
