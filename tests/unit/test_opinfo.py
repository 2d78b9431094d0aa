"""PyTorch's own OpInfo samples of ``nn.functional.conv_transpose3d`` through convt3d, on the CPU.

The samples come from ``torch.testing._internal.common_methods_invocations`` (the test extras
install ``expecttest``, which that module imports): batched and unbatched inputs, groups,
dilation, output_padding, with and without bias. Each runs through every backend that can take
it on the CPU -- "auto" and "torch" (bitwise PyTorch), "triton" (Triton's interpreter, float32),
"conv3d" (the stride-1 samples) -- against float64 PyTorch, forward and gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convt3d
from convt3d.core.errors import BackendUnavailableError

from conftest import check_against_reference, interpreter_active

pytest.importorskip("expecttest", reason="the OpInfo database imports expecttest (pip install -e '.[test]')")
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402



def _unfreeze_backend_flags() -> None:
    """Undo ``torch.backends.disable_global_flags()``: the flag lives in the globals of the
    module's functions (``torch.backends`` itself is a wrapper module, where setattr would not
    reach it)."""
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


# Importing PyTorch's test utilities froze torch.backends' flags for the whole process
# (disable_global_flags). Unfreeze them for the other test files collected in this worker;
# test_frozen_backend_flags below runs our calls with them frozen, as PyTorch's harness does.
_unfreeze_backend_flags()
assert not torch.backends.flags_frozen()

OPINFO = next(o for o in op_db if o.name == "nn.functional.conv_transpose3d")
# The sample list is PyTorch's; its length is printed in each id so a change in PyTorch shows.
SAMPLES = list(OPINFO.sample_inputs("cpu", torch.float64))


def _args(sample):
    """(input, weight, bias, stride, padding, output_padding, groups, dilation) of one sample, in
    PyTorch's positional order, with PyTorch's defaults for what the sample leaves out."""
    w, b = sample.args[0], sample.args[1] if len(sample.args) > 1 else None
    kw = sample.kwargs
    return (sample.input, w, b, kw.get("stride", 1), kw.get("padding", 0), kw.get("output_padding", 0),
            kw.get("groups", 1), kw.get("dilation", 1))


def _id(i: int) -> str:
    s = SAMPLES[i]
    return f"sample{i}of{len(SAMPLES)}-{'unbatched' if s.input.dim() == 4 else 'batched'}"


def test_the_opinfo_has_samples():
    assert len(SAMPLES) >= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "conv3d"])
@pytest.mark.parametrize("i", range(len(SAMPLES)), ids=_id)
def test_sample(i, backend, dtype):
    x, w, b, *args = _args(SAMPLES[i])
    x, w = x.to(dtype), w.to(dtype)
    b = None if b is None else b.to(dtype)
    if backend == "triton" and (dtype != torch.float32 or not interpreter_active()):
        pytest.skip("the Triton engine on CPU: float32 through Triton's interpreter (TRITON_INTERPRET=1)")
    stride_1 = args[0] in (1, (1, 1, 1))
    if backend == "conv3d" and not stride_1:
        with pytest.raises(BackendUnavailableError, match="stride"):
            convt3d.conv_transpose3d(x, w, b, *args, backend=backend)
        return
    leaves = [t if t is None else t.clone().requires_grad_() for t in (x, w, b)]
    # Exact grade for float32 where the backend computes it; the conv3d form is TF32's (on the
    # CPU its conv3d is exact fp32 either way).
    exact = dtype == torch.float32 and backend != "conv3d"
    y = convt3d.conv_transpose3d(*leaves, *args, backend=backend, precision="ieee" if exact else None)
    if backend in ("auto", "torch"):
        ref = F.conv_transpose3d(x, w, b, *args)
        assert y.stride() == ref.stride() and torch.equal(y.detach(), ref)
    x5 = x if x.dim() == 5 else x.unsqueeze(0)
    y5 = y.detach() if y.dim() == 5 else y.detach().unsqueeze(0)
    check_against_reference(y5, x5, w, b, *args, context=_id(i))
    # Gradients against float64 autograd, for a fixed output gradient.
    dy = torch.randn(y.shape, dtype=torch.float64)
    wanted = [t for t in leaves if t is not None]
    got = torch.autograd.grad(y, wanted, dy.to(dtype))
    ref_leaves = [t.detach().double().requires_grad_() for t in wanted]
    want = torch.autograd.grad(F.conv_transpose3d(*(ref_leaves + ([None] if b is None else [])), *args),
                               ref_leaves, dy)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for name, g, r in zip(("dX", "dW", "db"), got, want):
        scale = max(r.abs().max().item(), 1.0)
        assert (g.double() - r).abs().max().item() <= tol * scale, f"{_id(i)} {backend}: {name}"


@pytest.fixture
def frozen_flags():
    torch.backends.disable_global_flags()
    yield
    _unfreeze_backend_flags()


@pytest.mark.parametrize("backend", ["auto", "conv3d", "triton"])
def test_frozen_backend_flags(backend, frozen_flags):
    """Under PyTorch's own test harness the torch.backends flags are frozen: a plain assignment
    raises. convt3d sets cuDNN's TF32 and determinism flags around its calls (bracketed, restored
    on exit): they must still run, and leave the flags as they were."""
    if backend == "triton" and not interpreter_active():
        pytest.skip("the Triton engine on CPU: Triton's interpreter (TRITON_INTERPRET=1)")
    x, w, b, *args = _args(SAMPLES[-2])
    leaves = [t.float().clone().requires_grad_() for t in (x, w)] + [None if b is None else b.float()]
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32)
    y = convt3d.conv_transpose3d(*leaves, *args, backend=backend, precision="tf32" if backend == "conv3d" else "ieee")
    torch.autograd.grad(y.sum(), leaves[:2])
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32) == before
    assert torch.backends.flags_frozen()


def test_a_backend_flag_is_set_and_restored_while_frozen(frozen_flags):
    from convt3d.core.flags import cudnn_conv_allows_tf32, cudnn_conv_tf32, set_backend_flag

    old = torch.backends.cudnn.deterministic
    set_backend_flag(torch.backends.cudnn, "deterministic", not old)
    assert torch.backends.cudnn.deterministic is (not old)
    set_backend_flag(torch.backends.cudnn, "deterministic", old)
    tf32 = cudnn_conv_allows_tf32()
    with cudnn_conv_tf32(not tf32):
        assert cudnn_conv_allows_tf32() is (not tf32)
    assert cudnn_conv_allows_tf32() is tf32
    with pytest.raises(RuntimeError, match="not allowed to set"):
        torch.backends.cudnn.deterministic = not old  # the freeze is real
