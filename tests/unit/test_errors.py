"""Every error path of the foundation issue ("Errors") and of backend/precision selection.

For each invalid call:
* PyTorch's own exception is computed in the test (``F.conv_transpose3d`` on the same input), and
  ours must have exactly the same type -- where PyTorch raises at all (it accepts a CPU/meta
  device mix, which we refuse by design: the issue asks for a device-mismatch error);
* our message must name the argument and the offending value;
* with every backend ("torch", "triton", "auto") the error must come before any engine runs:
  the engines are replaced by tripwires for the call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convt3d
import convt3d.functional
import convt3d.engines.triton.engine
from convt3d import BackendUnavailableError

BACKENDS = ("torch", "triton", "auto", "conv3d")


class EngineRan(Exception):
    """Raised by the tripwires: an engine was entered although the call is invalid."""


@pytest.fixture
def engines_forbidden(monkeypatch):
    """Replace every engine entry point that ``convt3d.conv_transpose3d`` can reach with a
    tripwire. (PyTorch's own exception must be computed before this is switched on.)"""

    def arm():
        def tripwire(*args, **kwargs):
            raise EngineRan("an engine ran on an invalid call")

        monkeypatch.setattr(convt3d.engines.torch.peer, "torch_forward", tripwire)
        monkeypatch.setattr(convt3d.functional, "conv_transpose3d_op", tripwire)
        monkeypatch.setattr(convt3d.engines.op, "conv_transpose3d_autograd", tripwire)
        monkeypatch.setattr(convt3d.engines.op, "run_engine", tripwire)
        monkeypatch.setattr(convt3d.engines.triton.engine, "forward", tripwire)
        monkeypatch.setattr(F, "conv_transpose3d", tripwire)
    return arm


def x5(n=1, c=4, s=3):
    return torch.randn(n, c, s, s, s)


def w5(cin=4, cout_g=2, k=2):
    return torch.randn(cin, cout_g, k, k, k)


@dataclass(frozen=True)
class Bad:
    id: str
    make: Callable[[], tuple[tuple, dict]]  # -> (positional args, keyword args) of conv_transpose3d
    exc: type  # the type we raise; PyTorch's, where PyTorch raises
    names: tuple[str, ...]  # the message must contain these: the argument and its value
    pytorch_raises: bool = True


BAD = [
    # ---- rank ---------------------------------------------------------------------------------
    Bad("input-rank3", lambda: ((torch.randn(4, 3, 3), w5()), {}), RuntimeError, ("input", "[4, 3, 3]")),
    Bad("input-rank1", lambda: ((torch.randn(4), w5()), {}), RuntimeError, ("input", "[4]")),
    Bad("input-rank6", lambda: ((torch.randn(1, 1, 4, 3, 3, 3), w5()), {}), RuntimeError,
        ("input", "[1, 1, 4, 3, 3, 3]")),
    Bad("weight-rank4", lambda: ((x5(), torch.randn(4, 2, 2, 2)), {}), RuntimeError, ("weight", "[4, 2, 2, 2]")),
    Bad("weight-rank6", lambda: ((x5(), torch.randn(4, 2, 2, 2, 2, 1)), {}), RuntimeError,
        ("weight", "[4, 2, 2, 2, 2, 1]")),
    # ---- channels -----------------------------------------------------------------------------
    Bad("channels-batched", lambda: ((x5(c=3), w5()), {}), RuntimeError, ("input", "4 channels", "3 channels")),
    Bad("channels-unbatched", lambda: ((torch.randn(3, 3, 3, 3), w5()), {}), RuntimeError,
        ("input", "4 channels", "3 channels")),
    Bad("channels-grouped", lambda: ((x5(c=4), w5(cin=6, cout_g=1)), {"groups": 2}), RuntimeError,
        ("input", "6 channels", "4 channels")),
    # ---- stride / dilation / padding / output_padding -----------------------------------------
    Bad("stride-zero", lambda: ((x5(), w5()), {"stride": 0}), RuntimeError, ("stride", "0")),
    Bad("stride-negative-one-dim", lambda: ((x5(), w5()), {"stride": (1, -1, 1)}), RuntimeError, ("stride", "-1")),
    Bad("dilation-zero", lambda: ((x5(), w5()), {"dilation": 0}), RuntimeError, ("dilation", "0")),
    Bad("dilation-negative-one-dim", lambda: ((x5(), w5()), {"dilation": [1, 1, -2]}), RuntimeError,
        ("dilation", "-2")),
    Bad("padding-negative", lambda: ((x5(), w5()), {"padding": -1}), RuntimeError, ("padding", "-1")),
    Bad("padding-negative-one-dim", lambda: ((x5(), w5()), {"padding": (0, 0, -2)}), RuntimeError,
        ("padding", "-2")),
    Bad("output_padding-negative", lambda: ((x5(), w5()), {"output_padding": (0, -1, 0)}), RuntimeError,
        ("output_padding", "-1")),
    Bad("output_padding-equals-stride", lambda: ((x5(), w5()), {"stride": 2, "output_padding": 2}), RuntimeError,
        ("output_padding", "2", "stride", "dilation")),
    Bad("output_padding-equals-stride-and-dilation", lambda: ((x5(), w5()), {"output_padding": 1}), RuntimeError,
        ("output_padding", "1", "stride", "dilation")),
    Bad("output_padding-exceeds-dilation-one-dim",
        lambda: ((x5(), w5()), {"stride": (2, 1, 2), "dilation": (1, 2, 1), "output_padding": (1, 2, 1)}),
        RuntimeError, ("output_padding", "height", "2")),
    # ---- argument length ------------------------------------------------------------------------
    Bad("stride-length2", lambda: ((x5(), w5()), {"stride": (1, 2)}), RuntimeError, ("stride", "[1, 2]")),
    Bad("padding-length4", lambda: ((x5(), w5()), {"padding": (0, 0, 0, 0)}), RuntimeError,
        ("padding", "[0, 0, 0, 0]")),
    Bad("dilation-empty-tuple", lambda: ((x5(), w5()), {"dilation": ()}), RuntimeError, ("dilation", "[]")),
    # ---- groups -------------------------------------------------------------------------------
    Bad("groups-not-dividing", lambda: ((x5(), w5()), {"groups": 3}), RuntimeError, ("groups=3", "[4, 2, 2, 2, 2]")),
    Bad("groups-more-than-channels", lambda: ((x5(), w5()), {"groups": 8}), RuntimeError, ("groups=8",)),
    Bad("groups-zero", lambda: ((x5(), w5()), {"groups": 0}), RuntimeError, ("groups", "0")),
    Bad("groups-negative", lambda: ((x5(), w5()), {"groups": -2}), RuntimeError, ("groups", "-2")),
    # ---- dtype / device -----------------------------------------------------------------------
    Bad("dtype-weight-float64", lambda: ((x5(), w5().double()), {}), RuntimeError, ("weight", "torch.float64")),
    Bad("dtype-weight-float16", lambda: ((x5(), w5().half()), {}), RuntimeError, ("weight", "torch.float16")),
    Bad("dtype-bias-float64", lambda: ((x5(), w5(), torch.randn(2, dtype=torch.float64)), {}), RuntimeError,
        ("bias", "torch.float64")),
    Bad("dtype-bias-bfloat16", lambda: ((x5().bfloat16(), w5().bfloat16(), torch.randn(2)), {}), RuntimeError,
        ("bias", "torch.float32")),
    # PyTorch lets a CPU input meet a meta weight (the result is a meta tensor); the issue asks for
    # a device-mismatch error, and "meta" stands in for a second device on a CPU-only machine.
    Bad("device-weight-meta", lambda: ((x5(), w5().to("meta")), {}), RuntimeError, ("weight", "meta"),
        pytorch_raises=False),
    Bad("device-bias-meta", lambda: ((x5(), w5(), torch.randn(2, device="meta")), {}), RuntimeError,
        ("bias", "meta"), pytorch_raises=False),
    Bad("device-input-meta", lambda: ((x5().to("meta"), w5()), {}), RuntimeError, ("input", "meta"),
        pytorch_raises=False),
    # ---- bias ---------------------------------------------------------------------------------
    Bad("bias-size", lambda: ((x5(), w5(), torch.randn(3)), {}), RuntimeError, ("bias", "[3]", "2 elements")),
    Bad("bias-rank2", lambda: ((x5(), w5(), torch.randn(1, 2)), {}), RuntimeError, ("bias", "[1, 2]")),
    Bad("bias-rank0", lambda: ((x5(), w5(), torch.randn(())), {}), RuntimeError, ("bias", "[]")),
    Bad("bias-size-grouped", lambda: ((x5(), w5(cout_g=3), torch.randn(3)), {"groups": 2}), RuntimeError,
        ("bias", "[3]", "6 elements")),
    # ---- empty input / output / weight ----------------------------------------------------------
    Bad("empty-spatial-batched", lambda: ((torch.randn(1, 4, 0, 3, 3), w5()), {}), RuntimeError,
        ("input", "[1, 4, 0, 3, 3]")),
    Bad("empty-spatial-unbatched", lambda: ((torch.randn(4, 3, 0, 3), w5()), {}), RuntimeError,
        ("input", "[4, 3, 0, 3]")),
    Bad("output-negative", lambda: ((x5(s=1), w5(k=1)), {"padding": 3}), RuntimeError,
        ("Output size is too small", "-5 x -5 x -5", "padding")),
    Bad("output-zero-one-dim", lambda: ((x5(s=1), w5(k=1)), {"stride": 2, "padding": (0, 1, 0),
                                                              "output_padding": (0, 1, 0)}),
        RuntimeError, ("Output size is too small", "1 x 0 x 1")),
    Bad("weight-zero-kernel", lambda: ((x5(), torch.randn(4, 2, 0, 2, 2)), {}), RuntimeError,
        ("weight", "[4, 2, 0, 2, 2]")),
    Bad("weight-zero-out-channels", lambda: ((x5(), torch.randn(4, 0, 2, 2, 2)), {}), RuntimeError,
        ("weight", "[4, 0, 2, 2, 2]")),
    Bad("weight-zero-in-channels", lambda: ((x5(c=0), torch.randn(0, 2, 2, 2, 2)), {}), RuntimeError,
        ("weight", "[0, 2, 2, 2, 2]")),
    # ---- argument types -----------------------------------------------------------------------
    Bad("type-input-list", lambda: (([1.0, 2.0], w5()), {}), TypeError, ("input", "list")),
    Bad("type-weight-ndarray", lambda: ((x5(), w5().numpy()), {}), TypeError, ("weight", "ndarray")),
    Bad("type-bias-list", lambda: ((x5(), w5(), [1.0, 2.0]), {}), TypeError, ("bias", "list")),
    Bad("type-stride-float", lambda: ((x5(), w5()), {"stride": 1.5}), TypeError, ("stride", "float")),
    Bad("type-stride-str", lambda: ((x5(), w5()), {"stride": "1"}), TypeError, ("stride", "str")),
    Bad("type-stride-None", lambda: ((x5(), w5()), {"stride": None}), TypeError, ("stride", "NoneType")),
    Bad("type-stride-bool", lambda: ((x5(), w5()), {"stride": True}), TypeError, ("stride", "bool")),
    Bad("type-stride-float-tensor", lambda: ((x5(), w5()), {"stride": torch.tensor(2.0)}), TypeError,
        ("stride", "Tensor")),
    Bad("type-padding-float-element", lambda: ((x5(), w5()), {"padding": (0, 1.0, 0)}), TypeError,
        ("padding", "float", "pos 2")),
    Bad("type-dilation-ndarray", lambda: ((x5(), w5()), {"dilation": np.array([1, 1, 1])}), TypeError,
        ("dilation", "ndarray")),
    Bad("type-output_padding-range", lambda: ((x5(), w5()), {"output_padding": range(3)}), TypeError,
        ("output_padding", "range")),
    Bad("type-groups-float", lambda: ((x5(), w5()), {"groups": 2.0}), TypeError, ("groups", "float")),
    Bad("type-groups-bool", lambda: ((x5(), w5()), {"groups": True}), TypeError, ("groups", "bool")),
    Bad("type-groups-str", lambda: ((x5(), w5()), {"groups": "1"}), TypeError, ("groups", "str")),
]


def _pytorch_exception(args, kwargs):
    try:
        F.conv_transpose3d(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- we want whatever PyTorch raises
        return e
    return None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_invalid_call_raises_like_pytorch(bad, backend, engines_forbidden):
    args, kwargs = bad.make()
    pt = _pytorch_exception(args, kwargs)
    if bad.pytorch_raises:
        assert pt is not None, "PyTorch accepts this call: the case is not an error"
        assert type(pt) is bad.exc, f"PyTorch raises {type(pt).__name__}: {pt}"
    else:
        assert pt is None, f"PyTorch now raises {type(pt).__name__}: {pt}; compare types instead"

    engines_forbidden()
    with pytest.raises(Exception) as info:
        convt3d.conv_transpose3d(*args, **kwargs, backend=backend)
    assert type(info.value) is bad.exc, f"raised {type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    for name in bad.names:
        assert name in msg, f"message does not name {name!r}: {msg}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tripwires_catch_a_valid_call(backend, engines_forbidden):
    # The fixture must really cover the engines: a valid call trips it, with every backend and
    # on the autograd (custom-op) route too. Without this, the test above could pass vacuously.
    engines_forbidden()
    for requires_grad in (False, True):
        with pytest.raises(EngineRan):
            convt3d.conv_transpose3d(x5().requires_grad_(requires_grad), w5(), backend=backend)


# ---------------------------------------------------------------------------------------------
# Backend and precision selection
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadSelection:
    id: str
    kwargs: dict
    exc: type
    names: tuple[str, ...]
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


BAD_SELECTION = [
    BadSelection("backend-unknown", {"backend": "cudnn"}, ValueError, ("backend", "'cudnn'")),
    BadSelection("backend-wrong-case", {"backend": "Torch"}, ValueError, ("backend", "'Torch'")),
    BadSelection("backend-empty-string", {"backend": ""}, ValueError, ("backend", "''")),
    BadSelection("backend-not-a-string", {"backend": 3}, TypeError, ("backend", "int")),
    BadSelection("backend-cuda", {"backend": "cuda"}, ValueError, ("backend", "'cuda'")),
    BadSelection("torch-cannot-tf32x3", {"backend": "torch", "precision": "tf32x3"}, BackendUnavailableError,
                 ("torch", "tf32x3")),
    BadSelection("triton-float64", {"backend": "triton"}, BackendUnavailableError, ("triton", "float64"),
                 dtype=torch.float64),
    BadSelection("triton-int64", {"backend": "triton"}, BackendUnavailableError, ("triton", "int64"),
                 dtype=torch.int64),
    BadSelection("triton-meta-device", {"backend": "triton"}, BackendUnavailableError, ("triton", "meta"),
                 device="meta"),
] + [
    BadSelection(f"precision-{p or 'empty'}-{b}", {"backend": b, "precision": p}, ValueError, ("precision", repr(p)))
    for p in ("fp32", "TF32", "highest", "") for b in BACKENDS
] + [
    BadSelection(f"precision-float16-input-{b}", {"backend": b, "precision": "bf16"}, ValueError,
                 ("precision", "'bf16'"), dtype=torch.float16)
    for b in BACKENDS
] + [
    BadSelection(f"precision-not-a-string-{b}", {"backend": b, "precision": 32}, TypeError, ("precision", "int"))
    for b in BACKENDS
]


@pytest.mark.parametrize("sel", BAD_SELECTION, ids=[s.id for s in BAD_SELECTION])
def test_bad_backend_or_precision(sel, engines_forbidden):
    x = torch.randn(1, 4, 3, 3, 3).to(sel.dtype).to(sel.device)
    w = torch.randn(4, 2, 2, 2, 2).to(sel.dtype).to(sel.device)
    engines_forbidden()
    with pytest.raises(Exception) as info:
        convt3d.conv_transpose3d(x, w, **sel.kwargs)
    assert type(info.value) is sel.exc, f"raised {type(info.value).__name__}: {info.value}"
    for name in sel.names:
        assert name in str(info.value), f"message does not name {name!r}: {info.value}"


def test_backend_unavailable_is_a_runtime_error():
    # Callers that catch RuntimeError (as for PyTorch's own "not available" errors) keep working.
    assert issubclass(BackendUnavailableError, RuntimeError)
    with pytest.raises(RuntimeError):
        convt3d.conv_transpose3d(x5(), w5(), backend="torch", precision="tf32x3")


@pytest.mark.parametrize("backend", ["cuda", "cudnn"])
def test_cuda_is_refused_as_any_unknown_backend_is(backend, engines_forbidden):
    from convt3d.dispatch.select import BACKENDS as VALID

    assert "cuda" not in VALID
    engines_forbidden()
    with pytest.raises(ValueError) as info:
        convt3d.conv_transpose3d(x5(), w5(), backend=backend)
    assert type(info.value) is ValueError
    assert str(info.value) == f"unknown backend={backend!r}; expected one of {VALID}"


@pytest.mark.parametrize("value,exc,names", [
    ("bogus", ValueError, ("CONVT3D_BACKEND", "'bogus'")),
    ("TRITON", ValueError, ("CONVT3D_BACKEND", "'TRITON'")),
    ("cuda", ValueError, ("CONVT3D_BACKEND", "'cuda'")),
], ids=["env-unknown", "env-wrong-case", "env-cuda"])
def test_bad_environment_backend(value, exc, names, monkeypatch, engines_forbidden):
    monkeypatch.setenv("CONVT3D_BACKEND", value)
    engines_forbidden()
    with pytest.raises(Exception) as info:
        convt3d.conv_transpose3d(x5(), w5())
    assert type(info.value) is exc, f"raised {type(info.value).__name__}: {info.value}"
    for name in names:
        assert name in str(info.value)


def test_unknown_backend_is_refused_even_when_input_is_also_bad(engines_forbidden):
    # Validation of the tensors comes first (step 1 of the dispatcher): an invalid input reports
    # the input's problem, with PyTorch's type, not the backend's.
    engines_forbidden()
    with pytest.raises(RuntimeError, match="stride"):
        convt3d.conv_transpose3d(x5(), w5(), stride=0, backend="bogus")


# ---------------------------------------------------------------------------------------------
# The module: output_size
# ---------------------------------------------------------------------------------------------
BAD_OUTPUT_SIZE = [
    ("length-2", (1, 4, 3, 3, 3), [7, 7]),
    ("length-6", (1, 4, 3, 3, 3), [1, 2, 7, 7, 7, 7]),
    ("too-large", (1, 4, 3, 3, 3), [7, 7, 8]),  # valid range per dim is [6, 7] (stride 2)
    ("too-small", (1, 4, 3, 3, 3), [5, 6, 6]),
    ("unbatched-length-5", (4, 3, 3, 3), [1, 2, 6, 6, 6]),  # an unbatched input takes 3 or 4 elements
    ("unbatched-too-large", (4, 3, 3, 3), [2, 9, 6, 6]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,output_size", [c[1:] for c in BAD_OUTPUT_SIZE], ids=[c[0] for c in BAD_OUTPUT_SIZE])
def test_module_invalid_output_size(shape, output_size, backend, engines_forbidden):
    torch.manual_seed(1)
    ref = nn.ConvTranspose3d(4, 2, 2, stride=2)
    ours = convt3d.ConvTranspose3d(4, 2, 2, stride=2)
    ours.load_state_dict(ref.state_dict())
    ours.backend = backend
    x = torch.randn(shape)
    with pytest.raises(Exception) as pt:
        ref(x, output_size=output_size)
    engines_forbidden()
    with pytest.raises(Exception) as info:
        ours(x, output_size=output_size)
    assert type(pt.value) is ValueError  # what PyTorch raises for a bad output_size
    assert type(info.value) is type(pt.value)
    assert str(info.value) == str(pt.value)  # PyTorch's message names output_size and the sizes


def test_module_rejects_non_zero_padding_mode_like_pytorch():
    with pytest.raises(ValueError) as pt:
        nn.ConvTranspose3d(4, 2, 2, padding_mode="reflect")
    with pytest.raises(ValueError) as ours:
        convt3d.ConvTranspose3d(4, 2, 2, padding_mode="reflect")
    assert str(ours.value) == str(pt.value)


def test_patch_rejects_non_module():
    with pytest.raises(TypeError, match="list"):
        convt3d.patch([nn.ConvTranspose3d(2, 2, 2)])


# ---------------------------------------------------------------------------------------------
# check_call's memo of successful calls (host-time fast path) must never change an answer.
# ---------------------------------------------------------------------------------------------
def test_check_call_memo_keeps_every_error_and_answer():
    from convt3d.core.validate import check_call
    x, w, b = torch.randn(1, 4, 2, 3, 3), torch.randn(4, 2, 3, 3, 3), torch.randn(2)
    first = check_call(x, w, b, 2, 1, 1, 1, 1)
    assert check_call(x, w, b, 2, 1, 1, 1, 1) == first  # a memo hit gives the same geometry
    # the same shapes with a wrong argument still raise, every time
    for _ in range(2):
        with pytest.raises(RuntimeError, match="output padding must be smaller"):
            check_call(x, w, b, 2, 1, 2, 1, 1)
        with pytest.raises(RuntimeError, match="bias"):
            check_call(x, w, torch.randn(3), 2, 1, 1, 1, 1)
    # a one-element tensor argument hashes by identity: never memoised, so a changed value counts
    s = torch.tensor(2)
    p1, _ = check_call(x, w, b, (s, 2, 2), 1, 1, 1, 1)
    s.fill_(3)
    p2, _ = check_call(x, w, b, (s, 2, 2), 1, 0, 1, 1)
    assert (p1.stride[0], p2.stride[0]) == (2, 3)
