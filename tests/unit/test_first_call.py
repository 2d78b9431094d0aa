"""The first-call modes (``dispatch.first_call``): in "background" mode auto decides a new signature
without the engines still compiling, keeps that decision off the steady path, and measures again
at the next call after one becomes ready; "wait" mode, ``convt3d.tune`` and multi-process runs time
every candidate at once. CPU tests: the readiness and the timings are injected."""
from __future__ import annotations

import threading

import pytest
import torch

import convt3d
from convt3d.core.call import Call
from convt3d.dispatch import cache, distributed, first_call
from convt3d.dispatch import select as dispatch
from convt3d.dispatch.registry import ENGINES
from convt3d.engines.triton import background, precompile
from convt3d.engines.triton import engine as triton_engine

from test_dispatch_auto import BIG, GPU, Recorder, _call, _isolated  # noqa: F401 -- the fixture is used


@pytest.fixture
def compiling(monkeypatch):
    """Background mode with the Triton engine's readiness scripted: ``state["ready"]`` says whether
    its candidates are compiled; ``state["started"]`` lists the calls it was asked to compile."""
    monkeypatch.setenv(first_call.ENV, "background")
    state = {"ready": False, "started": []}
    tri = ENGINES["triton"]
    monkeypatch.setattr(tri, "not_ready", lambda call: None if state["ready"] else "its candidates are compiling")
    monkeypatch.setattr(tri, "make_ready", lambda call: state["started"].append(call))
    monkeypatch.setattr(ENGINES["torch+bwd"], "not_ready", lambda call: None)
    return state


def _decide(geometry=BIG):
    x, w, b, params = _call(geometry=geometry)
    return dispatch.decide(x, "auto", None, params, weight=w, bias=b), (x, w, b, params)


def test_a_new_signature_is_decided_without_the_compiling_engine_which_starts_compiling(compiling, monkeypatch):
    rec = Recorder({"triton": 1.0, "torch": 3.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    d, (x, w, b, params) = _decide()
    assert d.engine == "torch" and rec.calls == [("torch",)]
    assert len(compiling["started"]) == 1  # its compile was started, once
    record = dispatch.explain_pass(Call(x, w, b, params, "tf32"), "auto")
    assert record.skipped == {"triton": "its candidates are compiling"}
    # Until an engine becomes ready, the decision stands: nothing is measured again.
    assert _decide()[0].engine == "torch" and len(rec.calls) == 1


def test_the_next_call_after_the_engine_is_ready_measures_again_with_it(compiling, monkeypatch):
    rec = Recorder({"triton": 1.0, "torch": 3.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    assert _decide()[0].engine == "torch"
    compiling["ready"] = True
    first_call.became_ready()
    d = _decide()[0]
    assert d.engine == "triton" and d.source == "measured" and rec.calls[-1] == ("triton", "torch")
    # Final now: a later generation measures nothing again.
    first_call.became_ready()
    assert _decide()[0].engine == "triton" and len(rec.calls) == 2


def test_a_decision_made_while_compiling_stays_off_the_steady_path(compiling, monkeypatch):
    monkeypatch.setattr(dispatch, "_measure", Recorder({"triton": 1.0, "torch": 3.0}))
    d, (x, w, b, params) = _decide()
    call = Call(x, w, b, params, "tf32")
    key = ("a steady key",)
    dispatch.remember(key, call, d)
    assert key not in dispatch._steady
    compiling["ready"] = True
    first_call.became_ready()
    d = _decide()[0]
    dispatch.remember(key, call, d)
    assert dispatch._steady[key].decision.engine == "triton"


def test_an_exact_grade_call_decided_while_compiling_stays_off_the_steady_path(compiling, monkeypatch):
    """Where PyTorch's own call computes a TF32-allowed call in full fp32, ours runs it at exact grade: the
    provisional decision is still measured again once the engine is ready, not kept by the steady path
    (functional.conv_transpose3d, its tensors faked: the call it validates and the engine run it makes)."""
    import convt3d.functional as functional

    monkeypatch.setattr(ENGINES["torch"], "precision_class", lambda call: "fp32")
    monkeypatch.setattr(dispatch, "_without_data", lambda t: False)
    rec = Recorder({"triton": 1.0, "torch": 3.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    x, w, b, params = _call()
    monkeypatch.setattr(functional, "make_call", lambda *a, **k: Call(x, w, b, params, "tf32"))
    ran = []
    monkeypatch.setattr(functional, "_run", lambda engine, call: ran.append((engine.name, call.precision)))
    real = (torch.randn(1, 2, 3, 3, 3), torch.randn(2, 2, 2, 2, 2))  # what the steady path keys the call by
    with dispatch.cudnn_conv_tf32(True):
        functional.conv_transpose3d(*real, stride=2, backend="auto")
        assert ran == [("torch", "tf32x3")] and not dispatch._steady
        compiling["ready"] = True
        first_call.became_ready()
        functional.conv_transpose3d(*real, stride=2, backend="auto")
    assert ran[-1] == ("triton", "tf32x3") and rec.calls[-1] == ("triton", "torch")
    (steady,) = dispatch._steady.values()
    assert (steady.decision.engine, steady.precision) == ("triton", "tf32x3")


def test_a_new_process_measures_again_once_the_engine_is_ready(compiling, monkeypatch):
    rec = Recorder({"triton": 1.0, "torch": 3.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    assert _decide()[0].engine == "torch"
    entry = cache.load_decision(GPU, _as_text_call().text)
    assert entry["unready"] == ["triton"]
    # A new process where the candidates are still not compiled takes the entry, and compiles them.
    dispatch.clear_decisions()
    cache.reset()
    started = len(compiling["started"])
    d = _decide()[0]
    assert d.engine == "torch" and d.source == "cache" and len(compiling["started"]) == started + 1
    # One where they are: measured again, with them.
    dispatch.clear_decisions()
    cache.reset()
    compiling["ready"] = True
    d = _decide()[0]
    assert d.engine == "triton" and d.source == "measured"


def _as_text_call():
    x, w, b, params = _call()
    return Call(x, w, b, params, "tf32")


def test_a_tiny_layer_is_final_at_once(compiling, monkeypatch):
    """PyTorch's call below the host-bound floor decides without timing the others: nothing to wait for."""
    rec = Recorder({"triton": 0.001, "torch": 0.001})
    monkeypatch.setattr(dispatch, "_measure", rec)
    d, (x, w, b, params) = _decide(geometry=(1, 4, 4, (2, 2, 2), 2, 2, 0))
    assert d.engine == "torch" and not compiling["started"]
    call = Call(x, w, b, params, "tf32")
    dispatch.remember(("tiny",), call, d)
    assert ("tiny",) in dispatch._steady


@pytest.mark.parametrize("how", ["env-wait", "waiting-block", "tune-listener"])
def test_wait_mode_times_every_candidate_on_the_first_call(how, monkeypatch):
    monkeypatch.setenv(first_call.ENV, "wait" if how == "env-wait" else "background")
    monkeypatch.setattr(precompile, "available", lambda: True)
    rec = Recorder({"triton": 1.0, "torch": 3.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    if how == "env-wait":
        d = _decide()[0]
    elif how == "waiting-block":
        with first_call.waiting():
            d = _decide()[0]
    else:
        with dispatch.listening(lambda *a: None), first_call.waiting():
            d = _decide()[0]
    assert d.engine == "triton" and rec.calls == [("triton", "torch")]


def test_multi_process_runs_wait(monkeypatch):
    monkeypatch.setenv(first_call.ENV, "background")
    assert first_call.background()
    monkeypatch.setattr(distributed, "active", lambda: True)
    assert not first_call.background()


def test_an_unknown_mode_is_named(monkeypatch):
    monkeypatch.setenv(first_call.ENV, "later")
    with pytest.raises(ValueError, match="CONVT3D_FIRST_CALL='later'"):
        first_call.mode()


# ---- the Triton engine's side ---------------------------------------------------------------------
def _fake_call(geometry=None):
    x, w, b, params = _call(geometry=geometry)
    return Call(x, w, b, params, "tf32")


# Layers no suite holds: a one-channel head, a deep and narrow layer, an anisotropic kernel and stride.
GEOMETRIES = {"decoder": BIG, "head-64to1": (2, 64, 1, (16, 16, 16), 4, 2, 1),
              "deep-narrow-512to4": (1, 512, 4, (8, 8, 8), 2, 2, 0),
              "anisotropic-k133-s122": (1, 32, 16, (4, 32, 32), (1, 3, 3), (1, 2, 2), (0, 1, 1))}


@pytest.mark.parametrize("geometry", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_triton_readiness_follows_the_mode_the_state_and_the_cache_file(geometry, monkeypatch):
    monkeypatch.setenv(first_call.ENV, "background")
    monkeypatch.setattr(precompile, "available", lambda: True)
    call = _fake_call(geometry)
    assert "not compiled yet" in background.not_ready(call)
    with first_call.waiting():
        assert background.not_ready(call) is None
    monkeypatch.setattr(precompile, "available", lambda: False)  # the interpreter, or no spare CPU
    assert background.not_ready(call) is None
    monkeypatch.setattr(precompile, "available", lambda: True)
    key = triton_engine.plan(call.params, call.x, call.weight, call.precision).tune_key
    background._compiling[key] = True
    assert "compiling in background processes" in background.not_ready(call)
    # Another process compiled (or tuned) it: its entry in the cache file makes it ready here.
    background._compiling.clear()
    cache.store_for(GPU).put("triton_configs", cache.tune_key_text(key), {"compiled": True})
    assert background.not_ready(call) is None and key in precompile.compiled


def test_triton_start_compiles_in_a_thread_then_marks_the_key_ready(monkeypatch):
    monkeypatch.setenv(first_call.ENV, "background")
    monkeypatch.setattr(precompile, "available", lambda: True)
    jobs = [("mod", "kernel", "spec")]
    compiled = []
    gate = threading.Event()

    class Launch:  # what prepare returns, without allocating on the fake GPU
        y = torch.empty(1, device="meta")
        configs = ("cfg",)

        def __init__(self, plan):
            self.plan = plan

        def run(self, cfg):
            raise AssertionError("the launches run dry (dry_jobs is replaced here)")

    call = _fake_call()
    plan = triton_engine.plan(call.params, call.x, call.weight, call.precision)
    monkeypatch.setattr(triton_engine, "prepare", lambda *a, **k: Launch(plan))
    monkeypatch.setattr(triton_engine, "first_candidates", lambda launch, params, x, precision: launch.configs)
    monkeypatch.setattr(precompile, "dry_jobs", lambda configs, run: list(jobs))
    monkeypatch.setattr(precompile, "target", lambda: "sm_90a")
    monkeypatch.setattr(background, "installation_key", lambda: "hash")

    def compile_all(j, target, key):
        gate.wait(10)
        compiled.append((tuple(j), target, key))

    monkeypatch.setattr(precompile, "compile_all", compile_all)
    generation = first_call.generation()
    background.start(call)
    background.start(call)  # once per tune key
    assert "compiling" in background.not_ready(call)
    gate.set()
    for _ in range(200):
        if first_call.generation() != generation:
            break
        threading.Event().wait(0.01)
    assert compiled == [(tuple(jobs), "sm_90a", "hash")]
    assert background.not_ready(call) is None and plan.tune_key in precompile.compiled
    assert cache.store_for(GPU).get("triton_configs", cache.tune_key_text(plan.tune_key)) == {"compiled": True}


@pytest.mark.parametrize("geometry", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_the_first_timing_times_the_candidates_the_background_compiled(geometry, monkeypatch):
    """One rule says which candidates a first call times (every one, or the predicted shortlist): the
    background compile and the engine's first timing both take it, so nothing compiles on the call's path."""
    call = _fake_call(geometry)
    plan = triton_engine.plan(call.params, call.x, call.weight, call.precision)

    class Launch:  # what prepare returns, without allocating on the fake GPU
        y = torch.empty(1, device="meta")
        configs = plan.configs

        def __init__(self, plan):
            self.plan = plan

        def run(self, cfg):
            raise AssertionError("nothing launches here")

    monkeypatch.setattr(triton_engine, "prepare", lambda *a, **k: Launch(plan))
    short = plan.configs[-1:]  # a shortlist without the default order's first candidate
    monkeypatch.setattr(triton_engine, "first_candidates", lambda launch, params, x, precision: short)
    monkeypatch.setattr(precompile, "available", lambda: True)
    monkeypatch.setenv(first_call.ENV, "background")
    compiled, timed = [], []
    monkeypatch.setattr(precompile, "dry_jobs", lambda configs, run: compiled.append(tuple(configs)) or [])
    monkeypatch.setattr(precompile, "compile_all", lambda jobs, target, key: {})
    monkeypatch.setattr(precompile, "target", lambda: "sm_90a")
    monkeypatch.setattr(background, "installation_key", lambda: "hash")
    background.start(call)
    monkeypatch.setattr(triton_engine, "_choose", lambda key, configs, run: timed.append(tuple(configs)))
    ENGINES["triton"]._prime(call)
    assert compiled == [short] and timed == [short]


def test_a_traced_call_waits_for_every_candidate(monkeypatch):
    """torch.compile keeps the trace-time decision in its graph: it must be final."""
    from convt3d import functional

    monkeypatch.setenv(first_call.ENV, "background")
    seen = []

    def decide(*a, **k):
        seen.append(first_call.background())
        return dispatch.Decision("torch", "tf32", "recorded", source="rule")

    monkeypatch.setattr(functional.dispatch, "decide", decide)
    x, w = torch.randn(1, 4, 3, 3, 3), torch.randn(4, 2, 3, 3, 3)
    functional._decide_for_trace(x, w, None, 2, 1, 0, 1, 1, None, None)
    assert seen == [False] and first_call.background()


def test_a_training_step_waits_for_the_triton_candidates_before_timing_convt3ds_backward(monkeypatch):
    """PyTorch's forward with convt3d's backward is timed with the Triton engine, once its candidates compiled."""
    hybrid = ENGINES["torch+bwd"]
    started = []
    monkeypatch.setattr(background, "not_ready", lambda call: "its tile candidates are compiling")
    monkeypatch.setattr(background, "start", lambda call: started.append(call))
    call = _fake_call()
    assert hybrid.not_ready(call) == "waits for the Triton engine: its tile candidates are compiling"
    hybrid.make_ready(call)
    assert started == [call]


def test_a_cached_decision_measured_with_every_engine_is_final_without_measuring(compiling, monkeypatch):
    """With measuring off, a cache entry that no engine was missing from stays final even while
    this process has not compiled the Triton candidates (they would only be timed again)."""
    rec = Recorder({"triton": 3.0, "torch": 1.0})
    monkeypatch.setattr(dispatch, "_measure", rec)
    compiling["ready"] = True
    assert _decide()[0].engine == "torch"
    dispatch.clear_decisions()
    cache.reset()
    compiling["ready"] = False
    with dispatch.benchmark(False):
        d = _decide()[0]
    assert d.engine == "torch" and d.source == "cache" and len(rec.calls) == 1
    assert not dispatch._provisional
