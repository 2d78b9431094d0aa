"""KernelBench level 2 (``convt3d.kernelbench.level2``), on the CPU.

* for every problem, ``Reference`` and ``ModelNew`` built after the same seed at KernelBench's
  init arguments hold bitwise the same parameters and buffers, in the same order;
* through Triton's interpreter, at the problem's reduced size and with every parameter perturbed
  alike (so that ones, zeros and unit scales hide no step), ModelNew matches the reference run in
  float64 without reading a tensor on the host (58's one-value bias included), and a forward in
  training mode leaves the same state (BatchNorm's running statistics and batch count);
* the folds of problems 13 and 50 (a mean over depth, an average pool, computed by one transposed
  convolution) match PyTorch across layer geometries;
* with $CONVT3D_KERNELBENCH_LEVEL2 naming KernelBench's ``level2`` directory, each ``Reference``
  is that file's ``Model``: its init arguments, input shapes, parameters after seeding, and outputs;
* ``convt3d kernelbench --level 2`` gives KernelBench's verdict on a reduced problem, and its exit
  status follows it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from convt3d.kernelbench import command, evaluate, evaluate_level2, level2

from conftest import requires_interpreter

PROBLEMS = level2.PROBLEMS
KERNELBENCH_LEVEL2 = os.environ.get("CONVT3D_KERNELBENCH_LEVEL2")  # KernelBench's level2 directory, if at hand


def _id(p: level2.Problem) -> str:
    return f"kb{p.id}-" + p.name.split("ConvTranspose3d_")[1]


def _states_close(a: nn.Module, b: nn.Module, tol: float = 1e-5) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(
        torch.allclose(sa[k].double(), sb[k].double(), atol=tol, rtol=tol) for k in sa)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("problem", PROBLEMS, ids=_id)
def test_model_new_builds_the_reference_parameters(problem):
    """KernelBench's check before any trial: after the same seed, bitwise the same state, by name,
    in Model's order, and the RNG left where Model leaves it."""
    reference, candidate = evaluate_level2.build_level2(problem)
    assert evaluate.parameters_identical(reference, candidate)
    torch.manual_seed(evaluate.SEED)
    level2.Reference(problem)
    after_reference = torch.get_rng_state()
    torch.manual_seed(evaluate.SEED)
    level2.ModelNew(problem)
    assert torch.equal(after_reference, torch.get_rng_state())
    conv = candidate.conv_transpose
    assert (conv.in_channels, conv.out_channels) == problem.init_inputs[:2]


@pytest.mark.skipif(not KERNELBENCH_LEVEL2, reason="$CONVT3D_KERNELBENCH_LEVEL2 names no KernelBench level2 directory")
@pytest.mark.parametrize("problem", PROBLEMS, ids=_id)
def test_reference_is_kernelbench_model(problem):
    """The problem's record against KernelBench's own file: get_init_inputs(), get_inputs()'s shapes,
    Model's parameters after seeding and, at the reduced size, Model's outputs bitwise."""
    module = evaluate.load_model_file(Path(KERNELBENCH_LEVEL2) / problem.file_name)
    assert tuple(module.get_init_inputs()) == problem.init_inputs
    assert tuple(tuple(x.shape) for x in module.get_inputs()) == problem.input_shapes
    for p, seed in ((problem, evaluate.SEED), (problem.reduced(), 1)):
        torch.manual_seed(seed)
        model = module.Model(*p.init_inputs)
        torch.manual_seed(seed)
        reference = level2.Reference(p)
        assert evaluate.parameters_identical(model, reference)
    inputs = [torch.rand(*shape) for shape in p.input_shapes]
    with torch.no_grad():
        assert torch.equal(model(*inputs), reference(*inputs))


def test_problem_table_covers_the_nineteen_problems_with_kernelbench_file_names():
    assert [p.id for p in PROBLEMS] == [3, 13, 15, 20, 26, 34, 38, 49, 50, 58, 60, 61, 72, 74, 77, 78, 89, 96, 100]
    for p in PROBLEMS:
        assert p.file_name.startswith(f"{p.id}_ConvTranspose3d_") and p.file_name.endswith(".py")
        assert len(p.inputs) == len(p.input_shapes) == len(p.small[1])
    assert [p.id for p in PROBLEMS if p.tf32_sensitive] == [3, 15, 34, 60, 61, 72]
    assert level2.by_id(26).inputs == ("x", "add_input")
    with pytest.raises(KeyError, match="no KernelBench level-2 ConvTranspose3d problem 1"):
        level2.by_id(1)


@pytest.mark.parametrize("init,overrides,message", [
    ((64,), {}, "missing a required argument: 'out_channels'"),
    (tuple(range(8)), {}, "too many positional arguments"),
    (None, {"dilation": 2}, "got an unexpected keyword argument 'dilation'"),
], ids=["missing", "too-many", "unknown-keyword"])
def test_model_new_refuses_arguments_model_refuses(init, overrides, message):
    with pytest.raises(TypeError, match=message):
        level2.ModelNew(level2.by_id(100), *(init or ()), **overrides)


# ---------------------------------------------------------------------------------------------
# Outputs and state, through the interpreter at reduced sizes
# ---------------------------------------------------------------------------------------------
def _host_read(self, *args):
    raise AssertionError("ModelNew read a tensor on the host (a device sync on a GPU)")


@requires_interpreter
@pytest.mark.parametrize("problem", PROBLEMS, ids=_id)
def test_model_new_matches_the_reference_in_float64(problem, monkeypatch):
    small = problem.reduced()
    reference, candidate = evaluate_level2.build_level2(small)
    with torch.no_grad():  # perturbed alike: a dropped or misplaced step cannot hide behind a one or a zero
        for p, q in zip(reference.parameters(), candidate.parameters()):
            noise = torch.randn_like(p)
            p.add_(noise)
            q.add_(noise)
    reference64 = copy.deepcopy(reference).double()
    inputs = [torch.rand(*shape) for shape in small.input_shapes]
    assert reference.training and candidate.training  # as KernelBench builds them
    with torch.no_grad():
        y64 = reference64(*(x.double() for x in inputs))
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "__float__", _host_read)
            mp.setattr(torch.Tensor, "item", _host_read)
            y = candidate(*inputs)
    assert y.dtype == torch.float32 and y.shape == y64.shape
    err = (y.double() - y64).abs().max().item()
    assert torch.allclose(y.double(), y64, atol=1e-4, rtol=1e-4), f"max abs error {err:.2e}"
    assert _states_close(reference64, candidate), "the forward left another state (BatchNorm's running statistics)"
    if any(isinstance(m, nn.BatchNorm3d) for m in candidate.modules()):
        assert candidate.batch_norm.num_batches_tracked.item() == 1
        assert not torch.equal(candidate.batch_norm.running_var, reference.batch_norm.running_var)


@requires_interpreter
def test_batch_norm_in_eval_mode_uses_the_running_statistics():
    small = level2.by_id(77).reduced()
    reference, candidate = evaluate_level2.build_level2(small)
    with torch.no_grad():
        for m in (reference, candidate):
            m.batch_norm.running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
            m.batch_norm.running_var.uniform_(0.5, 2, generator=torch.Generator().manual_seed(2))
            m.eval()
        x = torch.rand(*small.input_shapes[0])
        y64, y = reference.double()(x.double()), candidate(x)
    assert torch.allclose(y.double(), y64, atol=1e-5, rtol=1e-4)
    assert candidate.batch_norm.num_batches_tracked.item() == 0


# ---------------------------------------------------------------------------------------------
# The folds: a depth mean and an average pool computed by one transposed convolution
# ---------------------------------------------------------------------------------------------
FOLD_GEOMETRIES = {  # kernel, stride, padding, output_padding, dilation (depth; H and W differ), groups
    "k3-s1-p1": (3, 1, 1, 0, 1, 1), "k4-s2-p1-op1": (4, 2, 1, 1, 1, 1), "k5-s3-p2-op2-g2": (5, 3, 2, 2, 1, 2),
    "k3-s2-p2-dil2": (3, 2, 2, 1, 2, 1), "k2-s2-p0": (2, 2, 0, 0, 1, 1), "k1-s1-p0": (1, 1, 0, 0, 1, 1),
}


@pytest.mark.parametrize("geometry", FOLD_GEOMETRIES.values(), ids=FOLD_GEOMETRIES.keys())
def test_depth_mean_conv_matches_the_conv_then_its_depth_mean(geometry):
    k, s, p, op, dl, g = geometry
    m = nn.Module()
    m.conv_transpose = nn.ConvTranspose3d(4, 6, (k, 3, 2), stride=(s, 2, 1), padding=(p, 1, 0),
                                          output_padding=(op, 1, 0), dilation=(dl, 1, 1), groups=g)
    m.bias = nn.Parameter(torch.randn(1, 6, 1, 1, 1))
    x = torch.rand(2, 4, 5, 3, 4)
    with torch.no_grad():
        y = level2.DepthMeanConv(("add", "bias"))(m, x, {})
        y64 = m.double().conv_transpose(x.double()).mean(2, keepdim=True) + m.bias
    assert y.shape == y64.shape and torch.allclose(y.double(), y64, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("geometry", [g for g in FOLD_GEOMETRIES.values() if g[4] == 1],
                         ids=[n for n, g in FOLD_GEOMETRIES.items() if g[4] == 1])
@pytest.mark.parametrize("size", [(5, 6, 7), (2, 3, 4)], ids=["in5x6x7", "in2x3x4"])
def test_pooled_conv_matches_the_conv_then_its_pool(geometry, size, monkeypatch):
    """The pool is folded into the weights (no pooling runs) for windows the size of the stride."""
    k, s, p, op, _, g = geometry
    m = nn.Module()
    m.conv_transpose = nn.ConvTranspose3d(4, 6, (k, k, 3), stride=(s, s, 2), padding=(p, p, 1),
                                          output_padding=(op, op, 1), groups=g)
    m.avg_pool, m.scale = nn.AvgPool3d(kernel_size=(s, s, 2)), 1.5
    x = torch.rand(2, 4, *size)
    with torch.no_grad():
        want = m.avg_pool(m.double().conv_transpose(x.double())) * 1.5
        if min(want.shape[2:]) == 0:
            pytest.skip("the pooled output is empty")
        m.float()
        monkeypatch.setattr(level2, "Pool", None)  # a fallback to pooling would fail here
        y = level2.PooledConv("avg_pool", ("mul", "scale"))(m, x, {})
    assert y.shape == want.shape and torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)


@requires_interpreter
def test_pooled_conv_falls_back_to_the_pool_where_windows_differ_from_the_stride():
    m = nn.Module()
    m.conv_transpose = nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1)
    m.avg_pool = nn.AvgPool3d(kernel_size=3)
    x = torch.rand(1, 3, 4, 5, 6)
    with torch.no_grad():
        y = level2.PooledConv("avg_pool", ("mul", -2.0))(m, x, {})
        want = m.avg_pool(m.conv_transpose(x)) * -2.0
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-5)



@requires_interpreter
@pytest.mark.parametrize("pool", [nn.MaxPool3d(kernel_size=3), None], ids=["pool-window-not-the-stride", "no-pool"])
@pytest.mark.parametrize("cout", [4, 72], ids=["direct-kernel", "over-64-channels"])
def test_direct_conv_matches_the_stages_it_stands_for(pool, cout):
    """Where the direct kernel takes the layer and where it does not (the stages then run one by one)."""
    m = nn.Module()
    m.conv_transpose = nn.ConvTranspose3d(3, cout, 3, stride=2, padding=1)
    m.pool = pool
    x = torch.rand(1, 3, 4, 5, 6)
    stage = level2.DirectConv(("mul", 0.5), pool="pool" if pool else None, softmax=True, mid=("sigmoid",),
                              channel_op="max", mean=True, post=(("add", 1.0),))
    with torch.no_grad():
        y = stage(m, x, {})
        want = m.double().conv_transpose(x.double()) * 0.5
        want = torch.sigmoid(torch.softmax(pool(want) if pool else want, 1)).amax(1, keepdim=True)
        want = want.mean((2, 3, 4), keepdim=True) + 1.0
    assert y.shape == want.shape and torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)


@requires_interpreter
@pytest.mark.parametrize("pools", [(2, (2, 4, 2)), (3,)], ids=["direct-kernel", "window-not-a-multiple"])
def test_norm_pooled_conv_matches_batch_norm_then_the_pools(pools):
    """BatchNorm in training (its running statistics updated) then in evaluation, then the average pools: where
    the direct kernel takes them and where the stages run one by one."""
    m = nn.Module()
    m.conv_transpose = nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1)
    m.bn = nn.BatchNorm3d(4)
    for i, k in enumerate(pools):
        setattr(m, f"pool{i}", nn.AvgPool3d(k))
    with torch.no_grad():
        m.bn.weight.uniform_(0.5, 1.5), m.bn.bias.normal_(), m.bn.running_mean.normal_()
    ref = copy.deepcopy(m).double()
    x = torch.rand(2, 3, 4, 6, 5)
    stage = level2.NormPooledConv("bn", *(f"pool{i}" for i in range(len(pools))))
    for train in (True, False):
        m.train(train), ref.train(train)
        with torch.no_grad():
            y, want = stage(m, x, {}), ref.bn(ref.conv_transpose(x.double()))
            for i in range(len(pools)):
                want = getattr(ref, f"pool{i}")(want)
        assert y.shape == want.shape and torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)
        assert _states_close(m, ref)

# ---------------------------------------------------------------------------------------------
# The evaluator
# ---------------------------------------------------------------------------------------------
@requires_interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the evaluator times the full problems")
def test_evaluator_level2_checks_a_reduced_problem(tmp_path, capsys):
    out = tmp_path / "kb2.json"
    assert command.main(["--level", "2", "--problems", "100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "needs a CUDA GPU" in text
    assert "KernelBench's verdict (TF32 off for convolutions): 1/1 correct" in text
    data = json.loads(out.read_text())
    (row,) = data["problems"]
    assert data["schema"] == "convt3d-kernelbench-level2/1" and data["method"]["tolerance"] == 1e-4
    assert row["problem"] == 100 and row["parameters_identical"] and row["correct"]
    assert row["input_shapes"] == [list(level2.by_id(100).small[1][0])] and len(row["trials"]) == 1
    assert row["new_ms"] is None and row["trials"][0]["exact_passes"] is None  # no timing, no TF32 on a CPU


@requires_interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the evaluator times the full problems")
def test_evaluator_level2_exit_status_follows_the_verdict(monkeypatch, capsys):
    wrong = dataclasses.replace(level2.by_id(100), pipeline=(level2.Conv(("clamp_min", "min_value"), ("div", 1.9)),))
    monkeypatch.setattr(level2, "parse_ids", lambda text: [wrong])
    assert command.main(["--level", "2", "--problems", "100"]) == 1
    assert "KernelBench's verdict (TF32 off for convolutions): 0/1 correct" in capsys.readouterr().out


def test_evaluator_level2_refuses_an_unknown_problem(capsys):
    assert command.main(["--level", "2", "--problems", "58,2"]) == 2
    assert "no KernelBench level-2 ConvTranspose3d problem 2" in capsys.readouterr().err
