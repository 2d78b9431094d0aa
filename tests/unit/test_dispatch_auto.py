"""CPU tests of the "auto" backend: the measured decision (once per signature, against PyTorch,
with a noise margin; injected slow, failing and noisy candidates), the heuristic that remains for
graph capture and tracing (on the README's H200 cases), the dispatcher's order and its engines,
set_benchmark, and decisions reused from memory and from the disk cache.

A meta tensor wrapped to report ``device cuda:0`` (``FakeCuda``) drives the CUDA branches; the
timing itself (``dispatch._measure`` or an engine's ``time``) is replaced by a recorder --
tests/gpu/test_gpu_auto.py times for real."""
from __future__ import annotations

import json

import pytest
import torch

import convt3d
from convt3d.dispatch import cache
from convt3d.dispatch import select as dispatch
from convt3d.engines.triton import engine as triton_engine
from convt3d.core.call import Call
from convt3d.dispatch.registry import ENGINES
from convt3d.dispatch.timing import Timing
from convt3d.bench import suites
from convt3d.core.params import ConvT3dParams
from convt3d.core.validate import check_call
from convt3d.engines.triton.configs import tuned_config
from convt3d.dispatch.heuristic import heuristic

GPU = "Fake GPU 9000"


class FakeCuda:
    """A CPU tensor that says it lives on cuda:0: what decide() and the Triton plan read."""

    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor):
        self._t = t

    dtype = property(lambda self: self._t.dtype)
    shape = property(lambda self: self._t.shape)

    def stride(self, *a):
        return self._t.stride(*a)

    def dim(self):
        return self._t.dim()

    def size(self, *a):
        return self._t.size(*a)

    def is_contiguous(self, **k):
        return self._t.is_contiguous(**k)

    def unsqueeze(self, i):
        return FakeCuda(self._t.unsqueeze(i))


@pytest.fixture(autouse=True)
def _isolated(auto_state, monkeypatch):
    """Fresh decisions, a private cache directory (conftest.auto_state), no real GPU queries,
    measuring at its default."""
    monkeypatch.setattr(dispatch, "device_name", lambda device: GPU if device.type == "cuda" else "cpu")
    for module in (convt3d.engines.triton.configs, convt3d.engines.triton.peer):
        monkeypatch.setattr(module, "device_name", lambda device: GPU if device.type == "cuda" else "cpu")
    monkeypatch.setattr(triton_engine, "unsupported_reason", lambda x, params=None: None)
    # The Triton plan asks about the (fake) GPU: say it is a Hopper.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: GPU)
    monkeypatch.setattr(dispatch, "_capturing", lambda: False)
    # PyTorch's call computes TF32 where allowed (its precision class), unless a test says otherwise.
    monkeypatch.setattr(ENGINES["torch"], "precision_class", lambda call: "tf32")
    yield
    triton_engine.clear_caches()


class Recorder:
    """Stands in for dispatch._measure: records the candidates, returns fixed timings (one value,
    or one per round)."""

    def __init__(self, times: dict[str, float | list[float]]):
        self.times, self.calls = times, []

    def __call__(self, call, cands, label):
        self.calls.append(tuple(cands))
        return {c: list(self.times[c]) if isinstance(self.times[c], list) else [self.times[c]] * 2
                for c in cands}, {}, {}


# A layer big enough to be timed (roofline floor 17-34 us > TINY_FLOOR_S), as meta tensors.
BIG = (4, 32, 32, (32, 32, 32), 3, 2, 1)


def _call(dtype=torch.float32, cl=False, bias=True, geometry=None):
    """(x, w, b, params) of a stride-2 layer as FakeCuda tensors (meta storage: no memory)."""
    n, cin, cout, size, k, s, p = geometry or BIG
    k3 = (k,) * 3 if isinstance(k, int) else tuple(k)
    x = torch.empty(n, cin, *size, dtype=dtype, device="meta")
    if cl:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    w = torch.empty(cin, cout, *k3, dtype=dtype, device="meta")
    b = torch.empty(cout, dtype=dtype, device="meta") if bias else None
    params, _ = check_call(x, w, b, s, p, 0, 1, 1)
    return FakeCuda(x), FakeCuda(w), None if b is None else FakeCuda(b), params


def _as_call(x, w, b, params, precision=None, training=False):
    return Call(x, w, b, params, dispatch.resolve_precision(precision), precision, training)


# ---- the heuristic on the README's H200 measurements ---------------------------------------------
# Triton speedup over cuDNN per bench row (README "Measured" tables, forward, same flags).
README_SPEEDUP = {
    "kb58 fp32 ncdhw tf32": 5.77, "kb58 fp32 ncdhw tf32x3": 2.31,
    "kb61 fp32 ncdhw tf32": 2.00, "kb61 fp32 ncdhw tf32x3": 2.24,
    "kb68 fp32 ncdhw tf32": 2.87, "kb68 fp32 ncdhw tf32x3": 6.62,
    "kb70 fp32 ncdhw tf32": 3.43, "kb70 fp32 ncdhw tf32x3": 1.72,
    "kb72 fp32 ncdhw tf32": 2.32, "kb72 fp32 ncdhw tf32x3": 1.34,
    "kb73 fp32 ncdhw tf32": 1.82, "kb73 fp32 ncdhw tf32x3": 5.89,
    "kb77 fp32 ncdhw tf32": 2.86, "kb77 fp32 ncdhw tf32x3": 4.94,
}
for _name, _vals in {
    "nnunet_128_64": (1.16, 1.23, 1.71, 1.46), "nnunet_64_32": (2.89, 2.00, 2.62, 2.70),
    "monai_unet_k3": (1.56, 1.50, 1.86, 1.64), "gan_k4s2p1": (0.57, 0.63, 0.60, 0.68),
    "videogpt_k4s2p3": (5.84, 7.34, 0.76, 0.99), "aniso_122": (1.31, 0.58, 1.65, 1.36),
    "refine_k3s1": (1.03, 0.88, 0.49, 0.37),
}.items():
    for (_dt, _lay), _v in zip([("fp32", "ncdhw"), ("fp32", "cl"), ("bf16", "ncdhw"), ("bf16", "cl")], _vals):
        README_SPEEDUP[f"{_name} {_dt} {_lay} tf32"] = _v
# The heuristic ignores the layout; these two rows go the other way (documented in heuristic()).
KNOWN_MISSES = {"refine_k3s1 fp32 ncdhw tf32", "aniso_122 fp32 cl tf32"}
CASES = {c.label: c for c in suites.all_cases()}


def _heuristic_for(case) -> str:
    g = case.geometry
    params = ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel, g.stride,
                                  g.padding, g.output_padding, g.dilation)
    prec = "tf32" if case.precision == "tf32" else dispatch.EXACT_GRADE
    return heuristic(params, case.torch_dtype, prec, g.bias)[0]


def test_readme_table_covers_every_bench_case_but_the_heads():
    # The heads rows (head_*) came after the heuristic was calibrated; measured auto decides them.
    assert set(README_SPEEDUP) == {lab for lab in CASES if not lab.startswith("head_")}


@pytest.mark.parametrize("label", list(README_SPEEDUP), ids=[lab.replace(" ", "-") for lab in README_SPEEDUP])
def test_heuristic_picks_the_measured_winner(label):
    winner = "triton" if README_SPEEDUP[label] > 1 else "torch"
    choice = _heuristic_for(CASES[label])
    if label in KNOWN_MISSES:
        assert choice != winner  # documented miss: if it starts winning, update the docstring
    else:
        assert choice == winner


def test_heuristic_is_right_on_at_least_90_percent_of_the_bench():
    right = sum(_heuristic_for(CASES[lab]) == ("triton" if s > 1 else "torch") for lab, s in README_SPEEDUP.items())
    assert right / len(README_SPEEDUP) >= 0.9 and right == len(README_SPEEDUP) - len(KNOWN_MISSES)


def _p(n, cin, cout, size, k, s, p=0, groups=1):
    t3 = (lambda v: (v,) * 3 if isinstance(v, int) else tuple(v))
    return ConvT3dParams.create(n, cin, cout, groups, t3(size), t3(k), t3(s), t3(p), (0, 0, 0), (1, 1, 1))


@pytest.mark.parametrize("params,dtype,prec,engine,phrase", [
    (_p(1, 16, 8, 4, 2, 2), torch.float32, "tf32", "torch", "tiny"),
    (_p(8, 256, 128, 16, 4, 2, 1), torch.float32, "tf32x3", "triton", "exact-grade"),
    (_p(8, 256, 128, 16, 4, 2, 1), torch.float32, "ieee", "triton", "exact-grade"),
    (_p(8, 256, 128, 16, 4, 2, 1), torch.bfloat16, "tf32", "torch", "compute-bound with channels aligned"),
    (_p(8, 240, 120, 16, 4, 2, 1), torch.float32, "tf32", "triton", "not multiples of 64"),
    (_p(8, 240, 240, 16, 4, 2, 1), torch.float16, "tf32", "torch", "multiples of 16"),
    (_p(2, 128, 64, 32, 2, 2), torch.bfloat16, "tf32", "triton", "memory-bound"),
], ids=["tiny-host-bound", "exact-tf32x3", "exact-ieee", "bf16-compute-aligned", "fp32-compute-unaligned",
        "fp16-compute-16-aligned", "bf16-memory-bound"])
def test_heuristic_rules(params, dtype, prec, engine, phrase):
    got, why = heuristic(params, dtype, prec)
    assert got == engine and phrase in why, why


@pytest.mark.parametrize("name,dtype,expect", [
    ("nnunet_128_64", torch.bfloat16, "torch"),
    ("monai_unet_k3", torch.float32, "torch"),
    ("gan_k4s2p1", torch.bfloat16, dispatch.HYBRID),
    ("videogpt_k4s2p3", torch.bfloat16, dispatch.HYBRID),
    ("nnunet_64_32", torch.bfloat16, "triton"),
    ("videogpt_k4s2p3", torch.float32, "triton"),
], ids=["small-bf16-torch", "small-fp32-torch", "gan-bf16-hybrid", "videogpt-bf16-hybrid", "mid-bf16-triton",
        "videogpt-fp32-triton"])
def test_heuristic_for_training_steps(name, dtype, expect):
    # The H200 rows behind TRAIN_SMALL_FLOOR_S and the hybrid (heuristic docstring).
    g = next(c.geometry for c in suites.all_cases() if c.geometry.name == name)
    params = ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel, g.stride,
                                  g.padding, g.output_padding, g.dilation)
    cands = ("triton", "torch", dispatch.HYBRID)
    got, why = heuristic(params, dtype, "tf32", g.bias, cands, training=True)
    assert got == expect, why
    # Without autograd the forward rules alone decide, and the hybrid is never an answer.
    assert heuristic(params, dtype, "tf32", g.bias, cands)[0] in ("triton", "torch")


def test_training_decisions_are_their_own_signature(monkeypatch):
    rec = Recorder({"triton": 2.0, "torch": 1.0, dispatch.HYBRID: 0.5})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    train = dispatch.decide(x, "auto", None, params, weight=w, bias=b, training=True)
    infer = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert rec.calls == [("triton", "torch", dispatch.HYBRID), ("triton", "torch")]
    assert (train.engine, train.ours_backward) == ("torch", True) and "training steps" in train.reason
    assert (infer.engine, infer.ours_backward) == ("torch", False)
    assert dispatch.signature_text(x, w, b, params, "tf32", True).endswith("|train")


def test_hybrid_autograd_matches_pytorch_autograd():
    # engine "torch" through our autograd.Function: PyTorch's forward, convt3d's backward (on CPU
    # its cuDNN branch is PyTorch's own convolution_backward: the same numbers as autograd).
    from convt3d.engines import op as ops

    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    params, _ = check_call(x, w, b, 2, 1, 1, 1, 1)
    y = ops.conv_transpose3d_autograd(x, w, b, params, "ieee", "torch")
    ref = torch.nn.functional.conv_transpose3d(x, w, b, 2, 1, 1)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    ours = torch.autograd.grad(y, (x, w, b), g)
    theirs = torch.autograd.grad(ref, (x, w, b), g)
    for a, c in zip(ours, theirs):
        assert torch.allclose(a, c, rtol=1e-12, atol=1e-12)


def test_heuristic_never_guesses_the_conv3d_form():
    params = ConvT3dParams.create(2, 32, 32, 1, (16, 16, 16), (3, 3, 3), (1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    engine, why = heuristic(params, torch.float32, "tf32", True, candidates=("conv3d", "torch"))
    assert engine == "torch" and "only torch" in why


def test_heuristic_with_one_runnable_engine():
    params = _p(8, 256, 128, 16, 4, 2, 1)
    assert heuristic(params, torch.float32, "tf32x3", candidates=("conv3d", "torch"))[0] == "torch"
    assert heuristic(params, torch.bfloat16, "tf32", candidates=("triton",))[0] == "triton"


# ---- order and named backends ---------------------------------------------------------------------
def test_backend_name_is_resolved_before_precision():
    x = torch.randn(1, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="backend='bogus'"):
        dispatch.decide(x, "bogus", "bogus")
    with pytest.raises(ValueError, match="precision='bogus'"):
        dispatch.decide(x, "auto", "bogus")


def test_validation_comes_before_the_backend():
    x, w = torch.randn(1, 2, 2, 2, 2), torch.randn(3, 2, 2, 2, 2)  # weight's Cin is wrong
    with pytest.raises(RuntimeError, match="weight"):
        convt3d.conv_transpose3d(x, w, backend="bogus")


def test_env_backend_is_the_default(monkeypatch):
    monkeypatch.setenv("CONVT3D_BACKEND", "torch")
    assert dispatch.decide(torch.randn(1, 2, 2, 2, 2), None, None).engine == "torch"


def test_cpu_auto_is_torch_with_geometry_too():
    x, w = torch.randn(1, 16, 3, 3, 3), torch.randn(16, 8, 3, 3, 3)
    params, _ = check_call(x, w, None, 2, 1, 0, 1, 1)
    d = dispatch.decide(x, "auto", None, params, weight=w)
    assert d.engine == "torch" and "CPU" in d.reason


def test_legacy_callers_without_geometry_keep_the_old_rule():
    x, *_ = _call()
    d = dispatch.decide(x, "auto", None)
    assert d.engine == "triton"


# ---- measuring on or off ------------------------------------------------------------------------------
@pytest.mark.parametrize("ours,cudnn,expected", [
    (None, False, True), (None, True, True), (True, False, True), (False, True, False), (False, False, False)],
    ids=["default-on", "default-ignores-cudnn-flag", "forced-on", "forced-off-over-cudnn", "forced-off"])
def test_set_benchmark_toggling(ours, cudnn, expected, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", cudnn)
    convt3d.set_benchmark(ours)
    assert dispatch.benchmark_enabled() is expected


def test_set_benchmark_rejects_non_bool():
    with pytest.raises(TypeError, match="enabled"):
        convt3d.set_benchmark("yes")


def test_benchmark_context_restores():
    convt3d.set_benchmark(False)
    with dispatch.benchmark(True):
        assert dispatch.benchmark_enabled()
    assert not dispatch.benchmark_enabled()


def test_heuristic_decides_without_timing_when_measuring_is_off(monkeypatch):
    rec = Recorder({})
    monkeypatch.setattr(dispatch, "_measure", rec)
    convt3d.set_benchmark(False)
    x, w, b, params = _call(dtype=torch.bfloat16)
    d1 = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    d2 = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert rec.calls == [] and d1 is d2 and d1.reason.startswith("auto (heuristic)") and d1.source == "heuristic"
    assert d1.engine == heuristic(params, torch.bfloat16, "tf32", True)[0]
    # Switched back on: the next call of the signature measures and replaces the guess.
    convt3d.set_benchmark(None)
    monkeypatch.setattr(dispatch, "_measure", Recorder({"triton": 1.0, "torch": 2.0}))
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b).source == "measured"


def test_measuring_is_the_default_and_happens_once_per_signature(monkeypatch):
    rec = Recorder({"triton": 2.0, "torch": 1.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "torch" and d.source == "measured" and "measured" in d.reason and len(rec.calls) == 1
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b) is d and len(rec.calls) == 1
    # Another signature: the layout (strides class), the bias, the dtype each make one.
    xc, wc, bc, _ = _call(cl=True)
    dispatch.decide(xc, "auto", None, params, weight=wc, bias=bc)
    dispatch.decide(x, "auto", None, params, weight=w, bias=None)
    xh, wh, bh, _ = _call(dtype=torch.float16)
    dispatch.decide(xh, "auto", None, params, weight=wh, bias=bh)
    assert len(rec.calls) == 4


TINY = (1, 16, 8, (4, 4, 4), 2, 2, 0)  # roofline floor well below TINY_FLOOR_S


@pytest.mark.parametrize("torch_ms,triton_ms,timed,engine", [
    (0.02, 0.001, [("torch",)], "torch"),  # PyTorch below HOST_BOUND_S: nothing else timed
    (0.5, 0.2, [("torch",), ("triton", "torch")], "triton"),  # a tiny head far above its floor in cuDNN
    (0.5, 0.49, [("torch",), ("triton", "torch")], "torch"),  # ... but ours must still win beyond noise
], ids=["host-bound-torch-alone", "slow-cudnn-times-ours", "slow-cudnn-tie"])
def test_tiny_layers_time_pytorch_first(torch_ms, triton_ms, timed, engine, monkeypatch):
    rec = Recorder({"triton": triton_ms, "torch": torch_ms})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call(geometry=TINY)
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert rec.calls == timed and d.engine == engine and d.source == "measured", d.reason
    if len(timed) == 1:
        assert "tiny layer" in d.reason and "not timed" in d.reason
    # The decision is on disk: a new process times nothing.
    dispatch.clear_decisions()
    cache.reset()
    monkeypatch.setattr(dispatch, "_measure", Recorder({}))
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b).engine == engine


def test_tiny_layers_without_timing_take_the_heuristic_and_stay_a_guess(monkeypatch):
    rec = Recorder({"triton": 0.001, "torch": 1.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call(geometry=TINY)
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert rec.calls == [] and d.engine == "torch" and "tiny" in d.reason and d.source == "heuristic"
    monkeypatch.setattr(dispatch, "_capturing", lambda: False)
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b).source == "measured"


def test_no_measuring_during_graph_capture_or_tracing_without_data(monkeypatch):
    rec = Recorder({"triton": 1.0, "torch": 2.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert rec.calls == [] and d.reason.startswith("auto (heuristic)")
    monkeypatch.setattr(dispatch, "_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    # Traced with tensors that hold no values (torch.export's fake tensors, meta): the heuristic.
    monkeypatch.setattr(dispatch, "_without_data", lambda t: True)
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert rec.calls == [] and "traced" in d.reason
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    dispatch.decide(x, "auto", None, params, weight=w, bias=b)  # after capture: measured
    assert len(rec.calls) == 1


def test_torch_compile_decides_on_its_example_tensors_as_an_eager_call(monkeypatch):
    """functional._decide_for_trace runs eagerly at trace time with real tensors: the decision
    is measured (once per signature) and read from the disk cache by a later process, not
    guessed by the heuristic."""
    rec = Recorder({"triton": 1.0, "torch": 2.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x, w, b, params = _call()
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "triton" and d.source == "measured" and len(rec.calls) == 1
    dispatch.clear_decisions()
    cache.reset()
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "triton" and d.source == "cache" and len(rec.calls) == 1


def test_fake_and_meta_tensors_hold_no_data():
    assert dispatch._without_data(torch.empty(2, device="meta"))
    assert not dispatch._without_data(torch.empty(2))
    with torch._subclasses.FakeTensorMode():
        assert dispatch._without_data(torch.empty(2))


def test_no_measuring_without_the_weight_or_when_asked_not_to(monkeypatch):
    rec = Recorder({"triton": 1.0, "torch": 2.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    dispatch.decide(x, "auto", None, params)
    dispatch.decide(x, "auto", None, params, weight=w, bias=b, measure=False)
    assert rec.calls == []


def test_measured_decision_is_persisted_and_reused_by_a_new_process(monkeypatch):
    rec = Recorder({"triton": 3.0, "torch": 1.5})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call(dtype=torch.bfloat16)
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b).engine == "torch"
    doc = json.loads(cache.file_for(cache.cache_dir(), GPU).read_text())
    (sig, entry), = doc["decisions"].items()
    assert entry["engine"] == "torch" and entry["timings_ms"] == {"triton": 3.0, "torch": 1.5}
    assert entry["rounds_ms"] == {"triton": [3.0, 3.0], "torch": [1.5, 1.5]}
    assert sig == dispatch.signature_text(x, w, b, params, "tf32")
    # A new process, measuring off: the measurement is reused, nothing is timed again.
    dispatch.clear_decisions()
    cache.reset()
    convt3d.set_benchmark(False)
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "torch" and "cache file" in d.reason and d.source == "cache" and len(rec.calls) == 1
    assert dispatch.cached_timings(_as_call(x, w, b, params)) == {"triton": 3.0, "torch": 1.5}


# conv3d has no form at stride 2; a cache file may name an engine this version does not have.
@pytest.mark.parametrize("cached", ["conv3d", "retired"], ids=["engine-cannot-run", "engine-not-registered"])
def test_cached_decision_for_an_engine_that_cannot_run_is_ignored(cached, monkeypatch):
    x, w, b, params = _call()
    text = dispatch.signature_text(x, w, b, params, "tf32x3")
    cache.save_decision(GPU, text, {"engine": cached, "timings_ms": {cached: 0.1}})
    cache.reset()
    rec = Recorder({"triton": 1.0, "torch": 2.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    d = dispatch.decide(x, "auto", "tf32x3", params, weight=w, bias=b)
    # Exact grade asked of auto: cuDNN's exact fp32 is a candidate too (it is at least as exact).
    assert d.source == "measured" and rec.calls == [("triton", "torch")] and d.engine == "triton"


# A stride-1 layer big enough to be timed: it has a conv3d form (engines.Conv3dEngine).
STRIDE1 = (4, 32, 32, (32, 32, 32), 3, 1, 1)


@pytest.mark.parametrize("times,engine", [
    ({"triton": 2.0, "conv3d": 1.0, "torch": 3.0}, "conv3d"),
    ({"triton": 1.0, "conv3d": 2.0, "torch": 3.0}, "triton"),
    ({"triton": 4.0, "conv3d": 2.95, "torch": 3.0}, "torch"),  # inside the noise margin
], ids=["conv3d-fastest", "triton-fastest", "conv3d-within-noise"])
def test_conv3d_form_is_timed_on_stride_1_calls(times, engine, monkeypatch):
    rec = Recorder(times)
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call(geometry=STRIDE1)
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert "conv3d" in rec.calls[0] and d.engine == engine and d.source == "measured", d.reason


def test_conv3d_form_is_no_candidate_at_stride_2(monkeypatch):
    rec = Recorder({"triton": 2.0, "torch": 1.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert rec.calls == [("triton", "torch")]


def test_only_one_candidate_needs_no_measuring(monkeypatch):
    monkeypatch.setattr(triton_engine, "unsupported_reason", lambda x, params=None: "compute capability 7.x")
    rec = Recorder({})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "torch" and "compute capability 7.x" in d.reason and rec.calls == [] and d.source == "only"


# ---- the measured choice: margins, noise, failures, injected slow candidates --------------------------
@pytest.mark.parametrize("runs,expect", [
    ({"triton": [1.0, 1.0], "torch": [2.0, 2.0]}, "triton"),
    ({"triton": [2.0, 2.0], "torch": [1.0, 1.0]}, "torch"),
    ({"triton": [0.99, 0.99], "torch": [1.0, 1.0]}, "torch"),  # inside the noise margin: PyTorch
    ({"triton": [0.9, 1.2], "torch": [1.0, 1.0]}, "torch"),  # 10% faster but 33% spread between rounds
    ({"triton": [0.5, 0.55], "torch": [1.0, 1.3]}, "triton"),  # 2x faster beats a 30% spread
    ({"triton": [1.0, 1.0]}, "triton"),  # PyTorch failed to run
    ({"torch": [1.0, 1.0]}, "torch"),  # ours failed
    ({"triton": [0.8, 0.8], "conv3d": [0.5, 0.5], "torch": [1.0, 1.0]}, "conv3d"),
], ids=["ours-faster", "ours-slower", "tie-within-noise", "noisy-small-win", "big-win-over-noise",
        "torch-failed", "ours-failed", "fastest-of-ours"])
def test_pick_needs_a_win_beyond_the_noise(runs, expect):
    assert dispatch.pick(runs)[0] == expect


# (runs, hosts, expected): host ms per call charged beyond PyTorch's; the VQ-VAE decoder's
# 240 -> 240 layer on the H200 (2026-12-01) read Triton 0.674 ms against 0.760 with 0.186 ms of
# host against 0.058: faster alone, slower in its network.
@pytest.mark.parametrize("runs,hosts,expect", [
    ({"triton": [0.674, 0.68], "torch": [0.760, 0.76]}, {"triton": [0.186, 0.19], "torch": [0.058, 0.06]}, "torch"),
    ({"triton": [0.509, 0.51], "torch": [1.632, 1.64]}, {"triton": [0.177, 0.18], "torch": [0.127, 0.13]}, "triton"),
    ({"triton": [0.674, 0.68], "torch": [0.760, 0.76]}, {"triton": [0.050, 0.05], "torch": [0.058, 0.06]}, "triton"),
    ({"triton": [0.674, 0.68], "torch": [0.760, 0.76]}, {}, "triton"),
    ({"triton": [0.80, 0.80], "conv3d": [0.5, 0.5], "torch": [1.0, 1.0]}, {"conv3d": [0.6, 0.6], "torch": [0.1, 0.1],
                                                                            "triton": [0.1, 0.1]}, "triton"),
    ({"triton": [0.5, 0.5]}, {"triton": [9.0, 9.0]}, "triton"),
], ids=["host-cost-outweighs-a-small-win", "big-win-pays-its-host", "less-host-than-torch", "host-not-read",
        "host-decides-between-ours", "torch-failed"])
def test_pick_charges_the_host_time_beyond_pytorchs(runs, hosts, expect):
    assert dispatch.pick(runs, hosts=hosts)[0] == expect


def test_measure_reads_host_time_from_each_timing(monkeypatch):
    seq = {"triton": [Timing(0.674, 0.186), Timing(0.68, 0.19)], "torch": [Timing(0.76, 0.058), Timing(0.76, 0.06)]}
    for name in seq:
        monkeypatch.setattr(ENGINES[name], "time", lambda call, name=name: seq[name].pop(0))
    x, w, b, params = _call()
    runs, failed, hosts = dispatch._measure(_as_call(x, w, b, params), ["triton", "torch"], "sig")
    assert runs == {"triton": [0.674, 0.68], "torch": [0.76, 0.76]} and not failed
    assert hosts == {"triton": [0.186, 0.19], "torch": [0.058, 0.06]}


def test_a_measured_decision_records_each_candidates_host_time(monkeypatch):
    """The saved entry keeps each candidate's host time, and the reason the host time it was charged."""
    x, w, b, params = _call()
    sig = dispatch.signature_text(x, w, b, params, "tf32")
    times = {"triton": Timing(0.674, 0.186), "torch": Timing(0.76, 0.058)}
    for name, t in times.items():
        monkeypatch.setattr(ENGINES[name], "time", lambda call, t=t: t)
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "torch" and d.source == "measured"
    entry = cache.load_decision(GPU, sig)
    assert entry["engine"] == "torch" and entry["host_ms"] == {"triton": 0.186, "torch": 0.058}
    assert "host beyond torch's" in d.reason


def _inject(monkeypatch, times: dict[str, object]):
    """Engines' time() replaced: a number, a list (one per round, its last repeated), or an
    exception to raise."""
    for name, value in times.items():
        seq = list(value) if isinstance(value, list) else None

        def fake(call, value=value, seq=seq):
            if isinstance(value, Exception):
                raise value
            ms = value if seq is None else seq.pop(0) if len(seq) > 1 else seq[0]  # the last for any further round
            return Timing(ms, 0.0)

        monkeypatch.setattr(ENGINES[name], "time", fake)


@pytest.mark.parametrize("times,expect", [
    ({"triton": 9.0, "torch": 1.0}, "torch"),
    ({"triton": RuntimeError("ptxas failed"), "torch": 1.0}, "torch"),
    ({"triton": [0.5, 2.0], "torch": 1.0}, "torch"),
    ({"triton": 0.4, "torch": 1.0}, "triton"),
], ids=["injected-slow-candidate", "failed-candidate", "noisy-candidate", "fast-candidate"])
def test_a_slow_failed_or_noisy_candidate_never_gets_cached(times, expect, monkeypatch):
    _inject(monkeypatch, times)
    x, w, b, params = _call()
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == expect and d.source == "measured"
    entry = cache.load_decision(GPU, dispatch.signature_text(x, w, b, params, "tf32"))
    assert entry["engine"] == expect
    if isinstance(times["triton"], Exception):
        assert "ptxas failed" in entry["failed"]["triton"] and "failed" in d.reason
    # A new process reads the same choice without timing anything.
    dispatch.clear_decisions()
    cache.reset()
    _inject(monkeypatch, {"triton": RuntimeError("must not be timed"), "torch": RuntimeError("must not be timed")})
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b).engine == expect


def test_measure_raises_when_every_candidate_fails(monkeypatch):
    _inject(monkeypatch, {"triton": RuntimeError("boom"), "torch": RuntimeError("boom too")})
    x, w, b, params = _call()
    with pytest.raises(RuntimeError, match="boom"):
        dispatch.decide(x, "auto", None, params, weight=w, bias=b)


@pytest.mark.parametrize("times,rounds,expect", [
    ({"triton": [0.842, 1.03, 0.85, 0.86], "torch": [0.919, 0.92]}, 3, "triton"),  # a noisy round, then two close
    ({"triton": [0.9, 1.2, 1.3, 1.25], "torch": [1.0, 1.0]}, 4, "torch"),  # noisy to the end: PyTorch
    ({"triton": [0.5, 0.5], "torch": [1.0, 1.01]}, 2, "triton"),  # quiet: two rounds
], ids=["noise-settles", "noise-stays", "quiet"])
def test_noisy_rounds_are_repeated_before_the_choice(times, rounds, expect, monkeypatch):
    _inject(monkeypatch, times)
    x, w, b, params = _call()
    runs, _, _ = dispatch._measure(_as_call(x, w, b, params), ["triton", "torch"], "sig")
    assert all(len(v) == rounds for v in runs.values())
    assert dispatch.pick(runs)[0] == expect


def test_measure_times_each_candidate_in_two_rounds_in_opposite_orders(monkeypatch):
    order = []
    for name in ("triton", "torch"):
        monkeypatch.setattr(ENGINES[name], "time", lambda call, name=name: order.append(name) or Timing(1.0, 0.0))
    x, w, b, params = _call()
    runs, failed, _ = dispatch._measure(_as_call(x, w, b, params), ["triton", "torch"], "sig")
    assert order == ["triton", "torch", "torch", "triton"] and runs == {"triton": [1.0, 1.0], "torch": [1.0, 1.0]}


# Shapes no bench suite holds: output heads of 1-8 channels, depthwise, deep-narrow, anisotropic
# kernels. The decision must follow the measurement on every one, in both directions.
UNSEEN = {
    "head-64-to-1-k4s2": (16, 64, 1, (24, 24, 24), 4, 2, 1),
    "head-96-to-3-k3s2": (4, 96, 3, (20, 40, 40), 3, 2, 1),
    "head-32-to-8-k2s2": (4, 32, 8, (40, 40, 40), 2, 2, 0),
    "deep-narrow-512-to-16": (8, 512, 16, (12, 12, 12), 3, 2, 1),
    "aniso-k133-s122": (4, 64, 32, (8, 48, 48), (1, 3, 3), (1, 2, 2), (0, 1, 1)),
}


@pytest.mark.parametrize("winner", ["triton", "torch"])
@pytest.mark.parametrize("geometry", list(UNSEEN.values()), ids=list(UNSEEN))
def test_auto_follows_the_measurement_on_shapes_the_suites_do_not_hold(geometry, winner, monkeypatch):
    n, cin, cout, size, k, s, p = geometry
    k3 = (k,) * 3 if isinstance(k, int) else k
    x = FakeCuda(torch.empty(n, cin, *size, device="meta"))
    w = FakeCuda(torch.empty(cin, cout, *k3, device="meta"))
    params, _ = check_call(x._t, w._t, None, s, p, 0, 1, 1)
    _inject(monkeypatch, {"triton": 1.0 if winner == "triton" else 3.0, "torch": 2.0})
    for training in (False, True):
        if training:
            _inject(monkeypatch, {dispatch.HYBRID: 5.0})
        d = dispatch.decide(x, "auto", None, params, weight=w, training=training)
        assert d.candidate == winner and d.source == "measured", d.reason


def test_depthwise_layer_follows_the_measurement(monkeypatch):
    x = FakeCuda(torch.empty(8, 64, 24, 24, 24, device="meta"))
    w = FakeCuda(torch.empty(64, 1, 3, 3, 3, device="meta"))
    params, _ = check_call(x._t, w._t, None, 2, 1, 1, 64, 1)
    _inject(monkeypatch, {"triton": 3.0, "torch": 1.0})
    assert dispatch.decide(x, "auto", None, params, weight=w).engine == "torch"


def test_listeners_see_decisions_and_measurements(monkeypatch):
    monkeypatch.setattr(dispatch, "_measure", Recorder({"triton": 1.0, "torch": 2.0}))
    events = []
    x, w, b, params = _call()
    with dispatch.listening(lambda e, info: events.append((e, info["decision"].engine))):
        dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    dispatch.decide(x, "auto", None, params, weight=w, bias=b)  # not listening any more
    assert events == [("decision", "triton")]


def test_triton_choice_seeds_the_tuning_from_the_cache_file():
    x, w, b, params = _call()
    plan = triton_engine.plan(params, x, w, "tf32")
    chosen = plan.configs[-1]
    cache.store_for(GPU).put("triton_configs", cache.tune_key_text(plan.tune_key),
                             {"config": cache.config_to_dict(chosen), "timings_ms": {}})
    cache.reset()
    call = _as_call(x, w, b, params, "tf32")
    assert dispatch.select(call, "triton").engine == "triton"
    ENGINES["triton"]._prime(call)  # what the engine does before a signature's first run
    assert tuned_config(plan.tune_key) == chosen


def test_a_guess_is_answered_from_memory_without_asking_the_engines_again(monkeypatch):
    convt3d.set_benchmark(False)
    asked = []
    monkeypatch.setattr(triton_engine, "unsupported_reason", lambda x, params=None: asked.append(1))
    x, w, b, params = _call()
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    n = len(asked)
    assert n >= 1 and d.source == "heuristic"
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b) is d and len(asked) == n


# ---- override (convt3d.tune's network check) ------------------------------------------------------
def test_override_replaces_the_decision_in_memory_and_in_the_cache(monkeypatch):
    rec = Recorder({"triton": 1.0, "torch": 2.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    assert dispatch.decide(x, "auto", None, params, weight=w, bias=b).engine == "triton"
    sig = dispatch.signature_text(x, w, b, params, "tf32")
    assert dispatch.override(sig, "torch", "network check: slower in the model", torch.device("cuda", 0),
                             {"convt3d_ms": 5.0, "torch_ms": 4.0}) == 1
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "torch" and d.source == "network" and "network check" in d.reason
    entry = json.loads(cache.file_for(cache.cache_dir(), GPU).read_text())["decisions"][sig]
    assert entry["engine"] == "torch" and entry["replaced"] == "triton" and entry["network_ms"]["torch_ms"] == 4.0
    assert entry["timings_ms"] == {"triton": 1.0, "torch": 2.0}, "the layer's own measurement is kept beside it"
    # A later process takes the override from the file, measuring nothing.
    dispatch.clear_decisions()
    cache.reset()
    d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert d.engine == "torch" and d.source == "cache" and "network check" in d.reason and len(rec.calls) == 1


def test_override_of_an_unknown_engine_raises():
    with pytest.raises(ValueError, match="engine 'magic'"):
        dispatch.override("sig", "magic", "why", torch.device("cpu"))


# ---- PyTorch's precision class: never below PyTorch's own numerics ---------------------------------
class CallRecorder(Recorder):
    """A Recorder that also keeps the precision each measured call was made at."""

    def __call__(self, call, cands, label):
        self.precisions = getattr(self, "precisions", []) + [call.precision]
        return super().__call__(call, cands, label)


@pytest.fixture
def classified(monkeypatch):
    """PyTorch's call classified as the test says (counting the classifications); the fake tensors
    stand for real ones, so the class is measured."""
    asked = []

    def set_class(klass):
        monkeypatch.setattr(ENGINES["torch"], "precision_class", lambda call: asked.append(call.text) or klass)
        return asked

    monkeypatch.setattr(dispatch, "_without_data", lambda t: False)
    return set_class


@pytest.mark.parametrize("klass,expect", [("fp32", "tf32x3"), ("tf32", "tf32")], ids=["cudnn-exact", "cudnn-tf32"])
def test_auto_runs_at_exact_grade_where_pytorch_computes_full_fp32(klass, expect, classified, monkeypatch):
    asked = classified(klass)
    rec = CallRecorder({"triton": 1.0, "torch": 2.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    with dispatch.cudnn_conv_tf32(True):
        d = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
        call = dispatch.decided_call(Call(x, w, b, params, "tf32"), d)
    assert d.engine == "triton" and d.precision == expect and rec.precisions == [expect] and len(asked) == 1
    assert call.precision == expect
    assert (d.precision_class, "full fp32" in d.reason) == (("fp32", True) if klass == "fp32" else ("", False))
    # A later process reads the class from the cache file: nothing is classified again.
    dispatch.clear_decisions()
    cache.reset()
    with dispatch.cudnn_conv_tf32(True):
        again = dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    assert (again.precision, again.source, len(asked)) == (expect, "cache", 1)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"], ids=["explicit-tf32", "explicit-exact"])
def test_an_explicit_precision_is_never_reclassified(precision, classified, monkeypatch):
    asked = classified("fp32")
    monkeypatch.setattr(dispatch, "_measure", Recorder({"triton": 1.0, "torch": 2.0}))
    x, w, b, params = _call()
    d = dispatch.decide(x, "auto", precision, params, weight=w, bias=b)
    assert d.precision == precision and not asked and not d.precision_class


@pytest.mark.parametrize("noise,klass", [(0.0, "fp32"), (1e-7, "fp32"), (1e-3, "tf32")],
                         ids=["identical", "fp32-reordering", "tf32-rounding"])
def test_the_precision_class_separates_tf32_from_fp32_rounding(noise, klass, monkeypatch):
    """The classifier compares PyTorch's call at TF32 against it in exact fp32: on this CPU both are
    exact, and a TF32-sized error injected into the TF32 call makes it "tf32"."""
    import convt3d.engines.torch.peer as peer

    real = peer.torch_forward

    def forward(x, w, b, params, precision):
        y = real(x, w, b, params, precision)
        return y + noise * y.abs().max() if precision == "tf32" else y

    monkeypatch.setattr(peer, "torch_forward", forward)
    x, w = torch.randn(1, 4, 3, 3, 3), torch.randn(4, 2, 3, 3, 3)
    params, _ = check_call(x, w, None, 2, 1, 0, 1, 1)
    assert peer.TorchEngine.precision_class(Call(x, w, None, params, "tf32")) == klass


def test_the_first_measurement_says_so_once_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(dispatch, "_said", [])
    monkeypatch.setattr(dispatch, "_measure", Recorder({"triton": 1.0, "torch": 2.0}))
    for geometry in (BIG, (4, 32, 32, (32, 32, 32), 3, 2, 0)):
        x, w, b, params = _call(geometry=geometry)
        dispatch.decide(x, "auto", None, params, weight=w, bias=b)
    err = capsys.readouterr().err
    assert err.count("convt3d: first call of a new layer signature") == 1 and "triton, torch" in err
