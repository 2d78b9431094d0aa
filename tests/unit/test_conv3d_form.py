"""The "conv3d" engine: a stride-1 transposed convolution run as PyTorch's conv3d of the flipped,
channel-swapped weight (``torch_engine.conv3d_forward``), on the CPU.

Every geometry is checked against float64 PyTorch (``conftest.check_against_reference``) and for
the memory format PyTorch's own conv_transpose3d gives; the padding beyond d (K - 1) (the conv3d
padding would be negative: x is trimmed instead), groups, channels of 1, every input layout,
unbatched input and float64 run through the public API with ``backend="conv3d"``; the training
step runs convt3d's backward. Calls without a conv3d form raise BackendUnavailableError naming
the argument, and "auto" times the engine only where it can run.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convt3d
from convt3d.dispatch import select as dispatch
from convt3d.dispatch.registry import ENGINES
from convt3d.core.errors import BackendUnavailableError
from convt3d.engines.torch.calls import conv3d_weight
from convt3d.core.call import output_memory_format

from conftest import LAYOUTS, Case, assert_compiled_matches_eager, check_against_reference, reference

# (id, case): the regimes of the rewrite.
CASES = [
    ("k3-p1", Case(2, 4, 6, (5, 6, 7), (3, 3, 3), padding=1)),
    ("k3-p0-full-output", Case(2, 4, 6, (4, 5, 3), (3, 3, 3), padding=0)),
    ("asymmetric-kernel", Case(2, 3, 5, (5, 4, 6), (1, 3, 5), padding=(0, 1, 2))),
    ("dilated", Case(1, 4, 4, (6, 6, 6), (3, 2, 3), padding=(1, 0, 3), dilation=(2, 3, 1))),
    ("padding-past-the-kernel-trims-x", Case(2, 3, 4, (7, 8, 9), (3, 2, 3), padding=(3, 2, 1), dilation=(1, 1, 2))),
    ("padding-past-the-kernel-one-axis", Case(1, 2, 3, (6, 5, 4), (2, 2, 2), padding=(0, 2, 0))),
    ("groups-3", Case(2, 6, 9, (4, 5, 6), (3, 3, 3), padding=1, groups=3)),
    ("depthwise", Case(2, 4, 4, (5, 5, 5), (3, 3, 3), padding=1, groups=4)),
    ("channels-of-1", Case(1, 1, 1, (4, 5, 6), (3, 3, 3), padding=1)),
    ("kernel-1", Case(2, 5, 3, (3, 4, 5), (1, 1, 1))),
    ("tiny-1x1x1", Case(1, 2, 3, (1, 1, 1), (2, 2, 2))),
    ("unbatched", Case(None, 4, 6, (5, 6, 7), (3, 3, 3), padding=1)),
    ("no-bias", Case(2, 4, 6, (5, 6, 7), (3, 3, 3), padding=1, bias=False)),
]


def _run(case: Case, dtype=torch.float32, weight_cl=False, **kw):
    x, w, b = case.tensors(dtype)
    if weight_cl:
        w = w.contiguous(memory_format=torch.channels_last_3d)
    y = convt3d.conv_transpose3d(x, w, b, *case.args, backend="conv3d", **kw)
    return x, w, b, y


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_matches_float64_pytorch(case):
    x, w, b, y = _run(case)
    check_against_reference(y, x, w, b, *case.args, context=case.id())
    assert y.stride() == F.conv_transpose3d(x, w, b, *case.args).stride()


def _format_ok(y, x, w):
    """The output in the format of PyTorch's rule (channels-last when x or w suggests it), which
    the op's fake registration states; CPU PyTorch returns a channels-last batch of one
    contiguous."""
    x5 = x if x.dim() == 5 else x.unsqueeze(0)
    y5 = y if y.dim() == 5 else y.unsqueeze(0)
    return y5.is_contiguous(memory_format=output_memory_format(x5, w))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_cl", [False, True], ids=["weight-contiguous", "weight-channels-last"])
@pytest.mark.parametrize("batch", [1, 2], ids=["batch-1", "batch-2"])
def test_every_layout_and_the_output_format_of_pytorch(layout, weight_cl, batch):
    case = Case(batch, 4, 6, (4, 5, 6), (3, 2, 3), padding=(1, 0, 2), layout=layout)
    x, w, b, y = _run(case, weight_cl=weight_cl)
    check_against_reference(y, x, w, b, *case.args, context=case.id())
    assert _format_ok(y, x, w), (y.stride(), x.stride(), w.stride())


def test_float64_to_pytorch_precision():
    case = Case(2, 3, 4, (4, 5, 6), (3, 3, 2), padding=(1, 2, 0), dilation=(1, 2, 1))
    x, w, b, y = _run(case, torch.float64)
    assert y.dtype == torch.float64
    check_against_reference(y, x, w, b, *case.args, context=case.id())


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_conv3d_weight_is_the_flipped_channel_swap(groups):
    w = torch.randn(6, 2, 2, 3, 4, dtype=torch.float64)
    got = conv3d_weight(w, groups)
    assert got.shape == (2 * groups, 6 // groups, 2, 3, 4)
    for g in range(groups):
        for co in range(2):
            for ci in range(6 // groups):
                assert torch.equal(got[g * 2 + co, ci], w[g * (6 // groups) + ci, co].flip((0, 1, 2)))


@pytest.mark.parametrize("case", [CASES[0][1], CASES[4][1], CASES[6][1]], ids=["k3-p1", "trimmed", "groups-3"])
def test_training_gradients(case):
    x, w, b = case.tensors(torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = convt3d.conv_transpose3d(*leaves, *case.args, backend="conv3d")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(F.conv_transpose3d(*ref_leaves, *case.args), ref_leaves, dy)
    for name, g, r in zip(("dX", "dW", "db"), got, want):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-10), name


@pytest.mark.parametrize("kw,phrase", [
    ({"stride": 2}, "stride=(2, 2, 2)"),
    ({"stride": (1, 2, 1)}, "stride=(1, 2, 1)"),
    ({"output_padding": (0, 1, 0), "dilation": 2}, "output_padding=(0, 1, 0)"),
], ids=["stride-2", "stride-2-on-one-axis", "output-padding"])
def test_calls_without_a_conv3d_form_raise_backend_unavailable(kw, phrase):
    x = torch.randn(1, 2, 3, 3, 3)
    w = torch.randn(2, 2, 3, 3, 3)
    with pytest.raises(BackendUnavailableError, match=r"backend='conv3d' cannot run this call: "
                                                      + phrase.replace("(", r"\(").replace(")", r"\)")):
        convt3d.conv_transpose3d(x, w, None, backend="conv3d", **kw)


def test_exact_grade_tf32x3_is_not_claimed():
    x, w = torch.randn(1, 2, 3, 3, 3), torch.randn(2, 2, 3, 3, 3)
    with pytest.raises(BackendUnavailableError, match="precision 'tf32x3'"):
        convt3d.conv_transpose3d(x, w, backend="conv3d", precision="tf32x3")


def test_invalid_input_raises_pytorchs_error_first():
    x, w = torch.randn(1, 2, 3, 3, 3), torch.randn(3, 2, 3, 3, 3)
    with pytest.raises(RuntimeError) as ours:
        convt3d.conv_transpose3d(x, w, backend="conv3d")
    with pytest.raises(RuntimeError) as theirs:
        F.conv_transpose3d(x, w)
    assert str(ours.value) == str(theirs.value)


def test_module_and_explain():
    m = convt3d.ConvTranspose3d(4, 6, 3, padding=1)
    m.backend = "conv3d"
    x = torch.randn(2, 4, 5, 5, 5)
    check_against_reference(m(x), x, m.weight.detach(), m.bias.detach(), 1, 1, context="module")
    text = str(convt3d.explain(x, m.weight, m.bias, padding=1, backend="conv3d"))
    assert "backend: conv3d -> conv3d" in text and "conv3d of the flipped weight, padding (1, 1, 1)" in text
    strided = str(convt3d.explain(x, m.weight, m.bias, stride=2, padding=1))
    assert "conv3d  no: stride=(2, 2, 2): the conv3d form needs stride 1" in strided


def test_reference_is_what_the_rewrite_computes():
    """The identity itself, in float64 without convt3d: conv3d(pad(x), flip(w)^T) == conv_transpose3d."""
    x, w = torch.randn(2, 4, 5, 6, 7, dtype=torch.float64), torch.randn(4, 3, 3, 2, 3, dtype=torch.float64)
    y = F.conv3d(x, conv3d_weight(w, 1), None, 1, (1, 2, 0), (1, 2, 1))  # padding d (K - 1) - p
    assert torch.allclose(y, reference(x, w, None, 1, (1, 0, 2), 0, 1, (1, 2, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
def test_custom_op_registrations(layout):
    """The op torch.compile traces, with engine "conv3d": schema, autograd and fake tensor."""
    from convt3d.engines.op import conv_transpose3d_op

    case = Case(1, 8, 8, (2, 3, 2), (3, 3, 3), padding=1, layout=layout)
    x, w, b = case.tensors()
    args = (x.requires_grad_(), w.requires_grad_(), b, [1] * 3, [1] * 3, [0] * 3, 1, [1] * 3, "ieee", "conv3d")
    torch.library.opcheck(conv_transpose3d_op, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    m = convt3d.ConvTranspose3d(4, 6, 3, padding=2, dilation=(1, 2, 1))
    m.backend = "conv3d"
    assert_compiled_matches_eager(m, torch.randn(2, 4, 3, 5, 4, requires_grad=True))



@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_repeats_are_answered_by_the_weights_memo(batched):
    """A repeated inference call goes from its weight's steady.Repeat memo to the conv3d form,
    and sees the weight's current values."""
    case = Case(2 if batched else None, 4, 6, (4, 5, 6), (3, 3, 3), padding=1)
    x, w, b = case.tensors()
    with torch.no_grad():
        first = convt3d.conv_transpose3d(x, w, b, *case.args, backend="conv3d")
        for _ in range(2):
            assert torch.equal(convt3d.conv_transpose3d(x, w, b, *case.args, backend="conv3d"), first)
        memo = dispatch._direct[id(w)]
        assert type(memo).__name__ == "Repeat" and memo.hit.decision.engine == "conv3d"
        w.mul_(-0.5)
        y = convt3d.conv_transpose3d(x, w, b, *case.args, backend="conv3d")
    check_against_reference(y, x, w, b, *case.args, context="after an in-place weight update")


def test_timed_repeats_take_the_launcher(monkeypatch):
    """auto's timed repeats of an inference call take the path a repeat takes (the weight's memo,
    then the launcher), so the host time charged is the one the layer will cost."""
    from convt3d.core.call import Call

    engine = ENGINES["conv3d"]
    ran = []
    launcher = engine.steady_launcher
    monkeypatch.setattr(engine, "steady_launcher", lambda *a: ran.append(1) or launcher(*a))
    case = Case(2, 4, 6, (4, 5, 6), (3, 3, 3), padding=1)
    x, w, b = case.tensors()
    params, _ = convt3d.core.validate.check_call(x, w, b, *case.args)
    call = Call(x, w, b, params, "ieee", None, False)
    with torch.no_grad():
        y = engine._timed(call, call.given, False, True)
    assert ran == [1]
    check_against_reference(y, x, w, b, *case.args, context="timed repeat")
