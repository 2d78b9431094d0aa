"""CPU tests of ``convt3d.explain`` (the report: choice and why, kernel configuration, phases and
empty ones, useful MACs, floors, cached timings; nothing is run), ``convt3d.tune`` (runs the model
once, restores gradients and buffers, progress output) and the ``convt3d tune`` command."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convt3d
from convt3d.core.call import Call
from convt3d import cli
from convt3d.dispatch import select as dispatch
from convt3d.engines.triton import engine as triton_engine
from convt3d.core.validate import check_call

from conftest import interpreter_active


@pytest.fixture(autouse=True)
def _isolated(auto_state):
    yield


# (input shape, weight shape, bias, stride, padding, output_padding, groups, dilation, empty phases)
REGIMES = {
    "stride2-dilated-7-of-8-empty": ((1, 16, 3, 4, 4), (16, 16, 3, 3, 3), True, 2, 1, 0, 1, 2, 7),
    "stride1-one-dense-phase": ((2, 8, 3, 3, 3), (8, 4, 3, 3, 3), False, 1, 1, 0, 1, 1, 0),
    "stride2-k3-output-padding": ((1, 8, 2, 3, 2), (8, 8, 3, 3, 3), True, 2, 1, 1, 1, 1, 0),
    "grouped-fma-path": ((1, 8, 3, 3, 3), (8, 1, 2, 2, 2), True, 2, 0, 0, 4, 1, 0),
    "unbatched-anisotropic": ((8, 2, 3, 4), (8, 8, 1, 2, 2), True, (1, 2, 2), 0, 0, 1, 1, 0),
}


def _tensors(regime):
    xs, ws, has_b, *args, _ = REGIMES[regime]
    x, w = torch.randn(xs), torch.randn(ws)
    b = torch.randn(ws[1] * args[3]) if has_b else None
    return x, w, b, tuple(args)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_explain_on_cpu_reports_everything(regime):
    x, w, b, args = _tensors(regime)
    rep = convt3d.explain(x, w, b, *args)
    params, _ = check_call(x, w, b, *args)
    assert rep.engine == "torch" and "CPU" in rep.reason
    assert rep.num_phases == params.num_phases and rep.empty_phases == REGIMES[regime][-1]
    assert rep.useful_macs == params.useful_macs <= rep.dense_macs
    assert rep.memory_floor_s == pytest.approx(params.min_bytes(4, b is not None) / 4.24e12)
    prec_peak = 374e12 if dispatch.resolve_precision(None) == "tf32" else 125e12
    assert rep.compute_floor_s == pytest.approx(params.useful_flops / prec_peak)
    text = str(rep)
    for phrase in ("backend: auto -> torch", "why:", "kernel configuration", "phases:", "useful MACs",
                   f"{params.useful_macs:,}", "floors", "measured: nothing cached", "heuristic on a CUDA device"):
        assert phrase in text, (phrase, text)
    assert text.count("empty (bias/zero fill)") == REGIMES[regime][-1]
    if "fma" in regime:
        assert "FMA path" in text


def test_explain_does_not_run_the_convolution(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("explain must not compute")

    monkeypatch.setattr(triton_engine, "forward", boom)
    monkeypatch.setattr(F, "conv_transpose3d", boom)
    x, w, b, args = _tensors("stride2-dilated-7-of-8-empty")
    assert "phases" in str(convt3d.explain(x, w, b, *args, backend="triton"))


@pytest.mark.skipif(not interpreter_active(), reason="backend='triton' on CPU needs TRITON_INTERPRET=1")
def test_explain_named_triton_shows_the_plan_and_config():
    x, w, b, args = _tensors("stride2-k3-output-padding")
    rep = convt3d.explain(x, w, b, *args, backend="triton", precision="tf32x3")
    assert rep.engine == "triton" and rep.precision == "tf32x3"
    text = str(rep)
    assert "Triton engine: phase GEMM on tensor cores" in text and "dot precision tf32x3" in text
    assert "config: dot M" in text and "untuned default" in text


def test_explain_named_backend_that_cannot_run_reports_instead_of_raising():
    x, w, b, args = _tensors("stride2-k3-output-padding")
    rep = convt3d.explain(x, w, b, *args, backend="conv3d")
    assert rep.engine is None and "backend='conv3d' cannot run this call" in rep.reason
    assert "(none: the named backend cannot run this call)" in str(rep)


def test_explain_shows_timings_measured_for_the_signature():
    x, w, b, args = _tensors("stride1-one-dense-phase")
    params, _ = check_call(x, w, b, *args)
    prec = dispatch.resolve_precision(None)
    dispatch._timings[Call(x, w, b, params, prec).key] = {"triton": 0.25, "torch": 0.5}
    rep = convt3d.explain(x, w, b, *args)
    assert rep.timings_ms == {"triton": 0.25, "torch": 0.5}
    assert "measured (ms, median): triton 0.25, torch 0.5" in str(rep)


@pytest.mark.parametrize("grad_mode,requires_grad,training", [
    (True, True, True), (True, False, False), (False, True, False),
], ids=["training-step", "no-tensor-requires-grad", "under-no-grad"])
def test_explain_decides_a_call_with_grad_as_a_training_step(grad_mode, requires_grad, training):
    # As conv_transpose3d: with grad on and a tensor requiring it, the call is a training step,
    # whose decision (and timings) are the step's, not the forward's.
    x, w, b, args = _tensors("stride1-one-dense-phase")
    params, _ = check_call(x, w, b, *args)
    prec = dispatch.resolve_precision(None)
    dispatch._timings[Call(x, w, b, params, prec, None, True).key] = {"torch+bwd": 0.2, "torch": 0.5}
    dispatch._timings[Call(x, w, b, params, prec).key] = {"triton": 0.25, "torch": 0.3}
    w = w.detach().requires_grad_(requires_grad)
    with torch.set_grad_enabled(grad_mode):
        rep = convt3d.explain(x, w, b, *args)
    assert rep.timings_ms == ({"torch+bwd": 0.2, "torch": 0.5} if training else {"triton": 0.25, "torch": 0.3})


@pytest.mark.parametrize("kwargs", [
    dict(stride=0), dict(padding=-1), dict(groups=3), dict(weight=torch.randn(3, 4, 3, 3, 3)),
    dict(input="not a tensor"), dict(backend="bogus"), dict(precision="fp8"),
], ids=["stride-0", "negative-padding", "groups-not-dividing", "weight-cin-mismatch", "input-not-tensor",
        "unknown-backend", "unknown-precision"])
def test_explain_raises_what_conv_transpose3d_raises(kwargs):
    call = dict(input=torch.randn(1, 8, 3, 3, 3), weight=torch.randn(8, 4, 3, 3, 3))
    call.update(kwargs)
    with pytest.raises(Exception) as ours:
        convt3d.explain(**call)
    with pytest.raises(Exception) as theirs:
        convt3d.conv_transpose3d(**call)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    assert isinstance(ours.value, (ValueError, RuntimeError, TypeError))


# ---- tune ---------------------------------------------------------------------------------------
class Decoder(nn.Module):
    def __init__(self, layer=convt3d.ConvTranspose3d):
        super().__init__()
        self.up = layer(4, 4, 2, stride=2)
        self.bn = nn.BatchNorm3d(4)
        self.refine = layer(4, 2, 3, padding=1)

    def forward(self, x):
        return self.refine(torch.relu(self.bn(self.up(x))))


def test_tune_runs_forward_and_backward_and_restores_the_model(capsys):
    model = Decoder()
    x = torch.randn(2, 4, 2, 3, 2, requires_grad=True)
    mean, count = model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone()
    model.refine.weight.grad = torch.full_like(model.refine.weight, 7.0)
    convt3d.set_benchmark(False)
    rep = convt3d.tune(model, x, progress="plain")
    assert rep.backward and len(rep.entries) == 2  # two distinct signatures
    assert all(e["engine"] == "torch" and e["source"] == "rule" for e in rep.entries)  # CPU: auto runs PyTorch
    assert any("nothing was measured" in n for n in rep.notes)
    assert torch.equal(model.bn.running_mean, mean) and torch.equal(model.bn.num_batches_tracked, count)
    assert model.up.weight.grad is None and x.grad is None
    assert torch.equal(model.refine.weight.grad, torch.full_like(model.refine.weight, 7.0))
    err = capsys.readouterr().err
    for line in ("[1/3] forward: up", "[2/3] forward: refine", "[3/3] backward"):
        assert line in err, err
    assert not dispatch.benchmark_enabled()  # measuring was forced on only during the run
    assert "2 call signature(s), forward + backward" in str(rep)


def test_tune_forward_only_when_nothing_needs_grad(capsys):
    model = Decoder().requires_grad_(False)
    rep = convt3d.tune(model, torch.randn(1, 4, 2, 2, 2), progress=False)
    assert not rep.backward and len(rep.entries) == 2
    assert capsys.readouterr().err == ""


def test_tune_warns_about_unpatched_layers():
    with pytest.warns(UserWarning, match=r"convt3d\.patch\(model\)"):
        rep = convt3d.tune(Decoder(layer=nn.ConvTranspose3d), torch.randn(1, 4, 2, 2, 2), progress=False)
    assert rep.entries == []


def test_tune_rich_progress_on_a_stream():
    from convt3d.tune import Progress as _Progress

    out = io.StringIO()
    bar = _Progress(2, "t", "rich", stream=out)
    bar.status("working")
    bar.advance("one")
    bar.advance("two")
    bar.close()
    assert bar.done == 2


def test_tune_rejects_a_non_callable():
    with pytest.raises(TypeError, match="model"):
        convt3d.tune(42)


# ---- convt3d tune -------------------------------------------------------------------------------
def test_cli_lists_tune_and_its_help(capsys):
    assert cli.main([]) == 0
    assert "tune" in capsys.readouterr().out
    assert cli.main(["tune", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--suite" in out and "--backward" in out and "CONVT3D_CACHE_DIR" in out


def test_cli_tune_list_selects_suite_cases(capsys):
    assert cli.main(["tune", "--list", "--suite", "layers", "--dtype", "bf16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 26 and all("bf16" in ln for ln in lines)


def test_cli_tune_rejects_unknown_case(capsys):
    assert cli.main(["tune", "--case", "nope"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_cli_tune_without_a_gpu_says_nothing_to_measure(capsys):
    assert cli.main(["tune", "--suite", "layers", "--case", "gan_k4s2p1"]) == 0
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("source,shown", [
    ("measured", "measured"), ("cache", "cached"), ("heuristic", "heuristic"), ("only", "only candidate"),
    ("rule", "rule"), ("requested", "named backend"),
], ids=["measured", "cached", "heuristic", "only", "rule", "named"])
def test_tune_report_names_where_a_decision_came_from(source, shown):
    from convt3d.tune import _source  # (convt3d.tune the attribute is the function)

    assert _source(source) == shown


def test_explain_names_the_output_head_tiles_of_a_narrow_layer():
    x, w = torch.randn(1, 16, 3, 3, 3), torch.randn(16, 1, 4, 4, 4)
    text = str(convt3d.explain(x, w, None, 2, 1, backend="triton"))
    # k4 s2 at dilation 1: both kinds, the rows GEMM's N = 1 x 4 x 4 x 2, the shuffle's 1 x 2^3 over 8 shifts
    assert "phase GEMM on the FMA path" in text and "output-head tiles (rows: " in text
    assert "W residues = 32" in text and "; shuffle: " in text and "8 shift(s), N = Cout/g x stride volume = 8" in text
    assert "runs one by default" in text and "config: head-rows" in text


def test_explain_reports_the_backward_choice():
    # A head layer: both gradients would time cuDNN against head tiles; after a backward, the
    # choice made for the signature is reported with its reason (static cuDNN on the CPU).
    from convt3d.engines.triton import backward as B

    B.clear_caches()
    x = torch.randn(1, 16, 2, 2, 2, requires_grad=True)
    w = torch.randn(16, 1, 4, 4, 4, requires_grad=True)
    text = str(convt3d.explain(x, w, None, 2, 1))
    # One tile per head kernel on the CPU: dY zero-padded, and dY split by phase.
    assert "dX: cuDNN against 2 Triton head tiles" in text and "dW: cuDNN against 2 Triton head tiles" in text
    assert "chosen" not in text
    convt3d.conv_transpose3d(x, w, None, 2, 1, backend="triton", precision="ieee").sum().backward()
    rep = convt3d.explain(x, w, None, 2, 1, precision="ieee")
    chosen = [line for line in rep.backward if "chosen" in line]
    assert len(chosen) == 2 and all("cudnn" in line and "static rule" in line for line in chosen), rep.backward
    B.clear_caches()
    # A depthwise layer: no Triton tile for either gradient.
    dw = convt3d.explain(torch.randn(1, 8, 2, 2, 2), torch.randn(8, 1, 3, 3, 3), None, 2, 1, 0, 8)
    assert dw.backward[0].startswith("dX: cuDNN against no Triton tile")
