"""The Triton tuner (``triton_configs._choose``) on the CPU with injected timings: the fastest
candidate wins, and near-equal candidates are timed again in reverse order (a drifting first pass
does not decide)."""
from __future__ import annotations

import pytest

import convt3d.engines.triton.peer
import triton.testing

from convt3d.engines.triton import engine as triton_engine
from convt3d.engines.triton.configs import device_name, tuning_log


def _configs(n: int):
    base = triton_engine.Config(BLOCK_M=64, BLOCK_N=16, BLOCK_K=16, BLOCK_W=16, num_warps=4, num_stages=1)
    return [triton_engine.Config(**{**base.__dict__, "BLOCK_M": 16 * (i + 1)}) for i in range(n)]


class _Bench:
    """do_bench stand-in: runs the candidate and returns the next of its scripted timings (the
    last one repeats)."""

    def __init__(self, configs, script: dict[int, list[float]]):
        self.configs, self.script, self.calls, self.last = configs, script, [], None

    def run(self, cfg):
        self.last = self.configs.index(cfg)

    def do_bench(self, fn, **_):
        fn()
        i = self.last
        seq = self.script[i]
        n = sum(1 for c in self.calls if c == i)
        self.calls.append(i)
        return seq[min(n, len(seq) - 1)]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("CONVT3D_AUTOTUNE", raising=False)
    triton_engine.clear_caches()
    yield
    triton_engine.clear_caches()


@pytest.mark.parametrize("script,winner,retimed", [
    ({0: [2.0], 1: [1.0], 2: [3.0]}, 1, set()),  # clear winner: one pass
    ({0: [1.1, 0.9], 1: [1.0, 1.0], 2: [3.0]}, 0, {0, 1}),  # first pass drifted: the second decides
    ({0: [1.0, 1.0], 1: [1.2, 1.3], 2: [1.1, 1.05]}, 0, {0, 1, 2}),  # three close ones, at most 3
], ids=["clear-winner", "drifted-first-pass", "three-close"])
def test_tuner_picks_the_fastest_robustly(script, winner, retimed, monkeypatch):
    configs = _configs(3)
    bench = _Bench(configs, script)
    monkeypatch.setattr(triton.testing, "do_bench", bench.do_bench)
    key = ("test-gpu", "tuner", 0)
    cfg = triton_engine._choose(key, configs, bench.run)
    assert cfg == configs[winner]
    twice = {i for i in range(3) if bench.calls.count(i) == 2}
    assert twice == retimed
    rec = tuning_log()[key]
    assert rec.config == cfg and rec.seconds > 0
    assert set(rec.timings_ms) == {c.short() for c in configs}


@pytest.mark.parametrize("gpu,host,winner", [
    ({0: [0.112], 1: [0.080]}, {0: 0.070, 1: 0.186}, 0),  # host-bound: the faster kernel is slower per call
    ({0: [0.115], 1: [0.129]}, {0: 0.070, 1: 0.055}, 0),  # GPU-bound: the cheaper host is hidden
    ({0: [0.060], 1: [0.050]}, {0: 0.055, 1: 0.058}, 1),  # both host-bound by a little: the lower of the two
], ids=["host-bound", "gpu-bound", "near-balance"])
def test_tuner_costs_a_config_by_the_slower_of_gpu_and_host(gpu, host, winner, monkeypatch):
    """A config's cost is the larger of its GPU median and its host time per call
    (``triton_configs.host_charged``): what a stream of its calls costs each."""
    from convt3d.engines.triton import configs as triton_configs

    configs = _configs(2)
    bench = _Bench(configs, gpu)
    monkeypatch.setattr(triton.testing, "do_bench", bench.do_bench)

    def host_ms(fn, gpu_ms):
        fn()
        return host[bench.last]

    monkeypatch.setattr(triton_configs, "host_ms", host_ms)
    key = ("test-gpu", "tuner-host", 0)
    assert triton_engine._choose(key, configs, bench.run) == configs[winner]
    rec = tuning_log()[key]
    assert rec.host_ms == {configs[i].short(): host[i] for i in range(2)}
    assert rec.timings_ms == {configs[i].short(): gpu[i][0] for i in range(2)}


def test_host_charge_without_host_times_is_the_gpu_time():
    from convt3d.engines.triton.configs import host_charged

    assert host_charged({"a": 1.0, "b": 2.0}, {}) == {"a": 1.0, "b": 2.0}
    assert host_charged({"a": 1.0, "b": 0.05}, {"a": 0.2, "b": 0.09}) == pytest.approx({"a": 1.0, "b": 0.09})


@pytest.mark.parametrize("fails,winner", [({1}, 2), ({0}, 1), ({0, 1}, 2)],
                         ids=["fastest-fails", "first-fails", "two-fail"])
def test_a_candidate_that_fails_to_compile_is_left_out(fails, winner, monkeypatch):
    """A GPU with less shared memory than the offer rules assume fails some candidates at their
    compile. The engine's guarded run (engines._guarded) reports the failure; the tuner leaves
    those candidates out, records why, and chooses among the others."""
    from convt3d.engines.triton.peer import guarded as _guarded

    configs = _configs(3)
    bench = _Bench(configs, {0: [2.0], 1: [1.0], 2: [1.5]})
    monkeypatch.setattr(triton.testing, "do_bench", bench.do_bench)

    def run(cfg):
        if configs.index(cfg) in fails:
            raise RuntimeError("out of resource: shared memory, Required: 245760, Hardware limit: 232448")
        bench.run(cfg)

    key = ("test-gpu", "tuner-fail", len(fails))
    assert triton_engine._choose(key, configs, _guarded(run)) == configs[winner]
    rec = tuning_log()[key]
    assert set(rec.failed) == {configs[i].short() for i in fails}
    assert all(why.startswith("RuntimeError: out of resource") for why in rec.failed.values())
    assert set(rec.timings_ms) == {configs[i].short() for i in range(3) if i not in fails}


def test_the_tuner_raises_when_every_candidate_fails(monkeypatch):
    from convt3d.engines.triton.peer import guarded as _guarded

    configs = _configs(2)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **_: pytest.fail("nothing should be timed"))

    def run(cfg):
        raise RuntimeError(f"no compile for {cfg.short()}")

    with pytest.raises(RuntimeError, match=r"every tile configuration failed: \[.*\] RuntimeError: no compile for"):
        triton_engine._choose(("test-gpu", "tuner-all-fail"), configs, _guarded(run))


def test_an_unguarded_run_lets_the_error_through(monkeypatch):
    """The KernelBench files' path (no guard there: KernelBench's rules reject try/except): the
    first failing candidate's own error."""
    configs = _configs(2)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **_: 1.0)

    def run(cfg):
        raise ValueError("the compile's own error")

    with pytest.raises(ValueError, match="the compile's own error"):
        triton_engine._choose(("test-gpu", "tuner-unguarded"), configs, run)


def test_the_engine_tunes_a_new_signature_with_guarded_runs(monkeypatch):
    """TritonEngine._prime tunes a signature at its first sight on CUDA, every candidate's run
    guarded: the one that fails to compile is left out, and the call goes on."""
    from types import SimpleNamespace

    import torch
    from convt3d.dispatch import cache
    from convt3d.dispatch.registry import ENGINES

    configs = _configs(3)
    bench = _Bench(configs, {0: [2.0], 1: [1.0], 2: [1.5]})
    monkeypatch.setattr(triton.testing, "do_bench", bench.do_bench)

    def run(cfg):
        if cfg == configs[1]:
            raise RuntimeError("out of resource: shared memory")
        bench.run(cfg)

    launch = SimpleNamespace(y=torch.empty(4), configs=configs, run=run)
    monkeypatch.setattr(convt3d.engines.triton.peer, "prime_triton", lambda *a: None)
    monkeypatch.setattr(triton_engine, "plan", lambda *a: SimpleNamespace(tune_key="tk-guarded", configs=configs))
    monkeypatch.setattr(triton_engine, "prepare", lambda *a: launch)
    monkeypatch.setattr(triton_engine, "first_candidates", lambda launch, params, x, precision: launch.configs)
    monkeypatch.setattr(convt3d.engines.triton.peer, "device_name", lambda device: "gpu")
    call = SimpleNamespace(device=torch.device("cuda"), key=("signature-guarded",), bias=None, repeat=False,
                           params=None, x=None, weight=None, precision="tf32")
    engine = ENGINES["triton"]
    engine.forget()
    try:
        engine._prime(call)
    finally:
        engine.forget()
    rec = tuning_log()["tk-guarded"]
    assert rec.config == configs[2] and set(rec.failed) == {configs[1].short()}
