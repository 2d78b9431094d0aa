"""Rank-consistent decisions (``convt3d.dispatch.distributed``) on the CPU with gloo process groups.

Each test starts 2 or 3 processes that form a gloo group and run one scenario; every rank writes
what it ended with to a file and the parent compares them. Ranks are given *different* answers
to the same question (fake timings that differ per rank, a warm disk cache on one rank only), so
a rank that decided on its own would be seen. Every process is joined with a timeout: a rank
waiting on something the others skipped fails the test instead of hanging it.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import socket
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from convt3d.dispatch import cache
from convt3d.dispatch import distributed
from convt3d.engines.triton import engine as triton_engine
from convt3d.core.params import ConvT3dParams
from convt3d.engines.triton.configs import tuned_config, tuning_log

JOIN_S = 60.0
GPU = "Agreement Test GPU"

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available in this build")


# ---- the harness ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(scenario: str, rank: int, world: int, port: int, out_dir: str, env: dict) -> None:
    os.environ.update(env)
    os.environ[cache.ENV_DIR] = os.path.join(out_dir, f"cache-rank{rank}")  # each rank its own disk
    cache.reset()
    distributed.reset()
    triton_engine.clear_caches()
    result: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        try:
            result = SCENARIOS[scenario](rank, world) or {}
            # Rank 0 hosts the store: it stays until every rank is done with it.
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run(scenario: str, world: int, tmp_path: Path, **env) -> list[dict]:
    # fork where it exists (a gloo group forms in well under a second; spawn would import
    # torch and triton again in every rank); nothing here has touched CUDA or a process group.
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(scenario, r, world, port, str(tmp_path), env)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"{scenario}: ranks {hung} did not finish within {JOIN_S:.0f} s (waiting on each other)"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res or scenario.startswith("error"), f"rank {r}: {res.get('traceback')}"
    return results


# ---- scenarios (run in each rank) ---------------------------------------------------------------
def _fake_measure(rank: int, calls: list):
    """A measurement whose fastest engine differs per rank (rank 0: triton, others: torch)."""
    def measure():
        calls.append(rank)
        timings = {"triton": 1.0 + rank, "torch": 2.0 - 0.5 * rank}
        return {"engine": min(timings, key=timings.get), "timings_ms": timings, "by": rank}
    return measure


def _different_timings(rank, world):
    calls: list = []
    got = [distributed.agree(_fake_measure(rank, calls), f"auto|sig{i}") for i in range(5)]
    again = distributed.agree(_fake_measure(rank, calls), "auto|sig0")  # agreed before: no wait, no compute
    return {"got": got, "again": again, "computed": len(calls), "active": distributed.active()}


def _decide_like_dispatch(rank, signature, calls):
    """What dispatch does at a signature's first sight: the disk cache, else measure and save."""
    def compute():
        entry = cache.load_decision(GPU, signature)
        if entry is not None:
            return dict(entry, source="disk")
        entry = _fake_measure(rank, calls)()
        cache.save_decision(GPU, signature, entry)
        return dict(entry, source="measured")
    return distributed.agree(compute, "auto|" + signature)


def _warm_disk_on(warm_rank):
    def scenario(rank, world):
        sig = "float32|x=cl|w=contiguous|bias|N2 8->8 g1 in4x4x4 k2x2x2 s2x2x2 p0x0x0 op0x0x0 d1x1x1|tf32"
        if rank == warm_rank:  # this rank's disk cache already holds a decision (from an earlier run)
            cache.save_decision(GPU, sig, {"engine": "conv3d", "timings_ms": {"conv3d": 0.5}, "by": "disk"})
            cache.reset()
        calls: list = []
        got = _decide_like_dispatch(rank, sig, calls)
        cache.reset()
        on_disk = cache.load_decision(GPU, sig)
        return {"got": got, "computed": len(calls), "on_disk": on_disk}
    return scenario


def _nested_in_another_thread(rank, world):
    """Rank 0's decision of A makes the decision of B inside it, on another thread (as auto's
    measurement runs the tuner, and autograd runs the backward's choice on its device thread).
    Rank 1 meets B later, on its own; rank 0 never asks for B again at top level."""
    calls: list = []

    def decide_b():
        calls.append("B")
        return {"config": f"tile-from-rank{rank}"}

    def decide_a():
        calls.append("A")
        box = {}
        t = threading.Thread(target=lambda: box.update(b=distributed.agree(decide_b, "triton-config|B")))
        t.start()
        t.join()
        return {"engine": "triton", "inner": box["b"]}

    a = distributed.agree(decide_a, "auto|A")
    b = distributed.agree(decide_b, "triton-config|B") if rank != 0 else a["inner"]
    return {"a": a, "b": b, "calls": calls}


def _tune_key(cin):
    params = ConvT3dParams.create(1, cin, 8, 1, (2, 3, 4), (3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    configs = triton_engine.candidate_configs(params, torch.float32, "tf32", False)
    return (GPU, torch.float32, "tf32", False, params), configs


def _fake_tuner(rank):
    """triton.testing.do_bench replaced by timings whose fastest candidate depends on the rank."""
    import triton.testing

    current = {}
    triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0 + current["rank"])[1]

    def tune(key, configs):
        best = rank % len(configs)

        def run(cfg):
            current["rank"] = (configs.index(cfg) - best) % len(configs)

        return triton_engine._choose(key, configs, run)
    return tune


def _tuning_inside_a_decision(rank, world):
    """agree_with_tuning: the tuning rank 0 did while deciding reaches every rank."""
    tune = _fake_tuner(rank)
    keys = [_tune_key(8 + i) for i in range(3)]

    def decide():
        for key, configs in keys:
            tune(key, configs)
        return "triton"

    engine = distributed.agree_with_tuning(decide, "auto|with-tuning", tuner=triton_engine)
    return {"engine": engine, "configs": [configs.index(tuned_config(key)) for key, configs in keys],
            "seeded": [tuning_log()[key].seconds == 0.0 for key, _ in keys]}


def _tuner_agreement_point(rank, world):
    """agree_config: the tuner's own agreement point -- rank 0 times, the others take its tile."""
    tune = _fake_tuner(rank)
    key, configs = _tune_key(16)
    cfg = distributed.agree_config(key, lambda: tune(key, configs), tuner=triton_engine)
    return {"config": configs.index(cfg), "tuned": configs.index(tuned_config(key)),
            "timed_here": tuning_log()[key].seconds > 0}


def _tuner_on_other_gpu_models(rank, world):
    """Rank 1 runs another GPU model: its tune key differs in the model name only, so it pairs
    with rank 0's; a tile that is one of its candidates is taken, one that is not is refused."""
    tune = _fake_tuner(rank)
    key, configs = _tune_key(40)
    key = (f"GPU model {rank}",) + key[1:]
    taken = distributed.agree_config(key, lambda: tune(key, configs), configs, tuner=triton_engine)
    key2, configs2 = _tune_key(48)
    key2 = (f"GPU model {rank}",) + key2[1:]
    mine = configs2 if rank == 0 else configs2[1:]  # rank 0's fastest (index 0) is not offered on rank 1
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        refused = distributed.agree_config(key2, lambda: tune(key2, mine), mine, tuner=triton_engine)
    return {"taken": configs.index(taken), "refused": configs2.index(refused),
            "warned": any("not a candidate" in str(w.message) for w in rec)}


def _tuner_overrides_own_disk_seed(rank, world):
    """Every rank seeded a config for the key from its own cache file; rank 0's wins."""
    key, configs = _tune_key(24)
    triton_engine.seed_tuning(key, configs[rank % len(configs)], {})
    cfg = distributed.agree_config(key, lambda: tuned_config(key), tuner=triton_engine)
    return {"config": configs.index(cfg), "tuned": configs.index(tuned_config(key))}


def _error_on_rank0(rank, world):
    def compute():
        raise MemoryError("out of memory while timing (fake)")
    try:
        distributed.agree(compute, "auto|fails")
    except distributed.AgreementError as exc:
        return {"raised": "AgreementError", "message": str(exc)}
    except MemoryError as exc:
        return {"raised": "MemoryError", "message": str(exc)}
    return {"raised": None}


def _unpicklable_on_rank0(rank, world):
    try:
        distributed.agree(lambda: (lambda: "a closure cannot be pickled"), "auto|unpicklable")
    except distributed.AgreementError as exc:
        return {"raised": "AgreementError", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 -- rank 0's own error
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def _not_spmd(rank, world):
    """Rank 1 meets a decision rank 0 never makes: it waits CONVT3D_AGREE_TIMEOUT_S, warns and
    decides locally; rank 0 does not wait at all."""
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = distributed.agree(lambda: f"local-{rank}", f"auto|only-on-rank{rank}")
    return {"got": got, "waited_s": time.monotonic() - t0,
            "warned": any("decides it locally" in str(w.message) for w in rec)}


def _mode_local(rank, world):
    return {"got": distributed.agree(lambda: rank, "auto|x"), "active": distributed.active()}


SCENARIOS = {
    "different-timings": _different_timings,
    "warm-disk-rank0": _warm_disk_on(0),
    "warm-disk-rank1": _warm_disk_on(1),
    "nested-thread": _nested_in_another_thread,
    "tuning-inside-decision": _tuning_inside_a_decision,
    "tuner-agreement": _tuner_agreement_point,
    "tuner-over-disk-seed": _tuner_overrides_own_disk_seed,
    "tuner-other-gpu-models": _tuner_on_other_gpu_models,
    "error-on-rank0": _error_on_rank0,
    "error-unpicklable": _unpicklable_on_rank0,
    "not-spmd": _not_spmd,
    "mode-local": _mode_local,
}


# ---- tests --------------------------------------------------------------------------------------
def test_without_a_process_group_agree_is_compute():
    assert not distributed.active()
    calls = []
    assert distributed.agree(lambda: calls.append(1) or 7, "auto|x") == 7
    assert distributed.agree(lambda: calls.append(1) or 8, "auto|x") == 8  # nothing remembered either
    assert calls == [1, 1] and distributed.rank() == 0


@pytest.mark.parametrize("value", ["sometimes", ""], ids=["unknown-mode", "empty-means-default"])
def test_mode_environment_variable(value, monkeypatch):
    monkeypatch.setenv(distributed.ENV_MODE, value)
    if value:
        with pytest.raises(ValueError, match=f"{distributed.ENV_MODE}='sometimes'"):
            distributed.active()
    else:
        assert not distributed.active()


@pytest.mark.parametrize("value", ["soon", "0", "-3"], ids=["not-a-number", "zero", "negative"])
def test_bad_timeout_environment_variable(value, monkeypatch):
    monkeypatch.setenv(distributed.ENV_TIMEOUT, value)
    with pytest.raises(ValueError, match=distributed.ENV_TIMEOUT):
        distributed._timeout_s()


@pytest.mark.parametrize("world", [2, 3], ids=["2-ranks", "3-ranks"])
def test_ranks_with_different_timings_all_take_rank0s_decision(world, tmp_path):
    res = _run("different-timings", world, tmp_path)
    expected = [{"engine": "triton", "timings_ms": {"triton": 1.0, "torch": 2.0}, "by": 0}] * 5
    for r, out in enumerate(res):
        assert out["active"]
        assert out["got"] == expected, f"rank {r}"
        assert out["again"] == expected[0]
    assert [out["computed"] for out in res] == [5] + [0] * (world - 1)  # only rank 0 measured


@pytest.mark.parametrize("warm", [0, 1], ids=["warm-cache-on-rank0", "warm-cache-on-rank1"])
def test_a_warm_disk_cache_on_one_rank_only(warm, tmp_path):
    res = _run(f"warm-disk-rank{warm}", 2, tmp_path)
    if warm == 0:  # rank 0 answers from its file, nobody measures
        expected = {"engine": "conv3d", "timings_ms": {"conv3d": 0.5}, "by": "disk", "source": "disk"}
        assert [out["computed"] for out in res] == [0, 0]
    else:  # rank 1's own file is not consulted: rank 0 measures, rank 1 follows
        expected = {"engine": "triton", "timings_ms": {"triton": 1.0, "torch": 2.0}, "by": 0, "source": "measured"}
        assert [out["computed"] for out in res] == [1, 0]
    assert [out["got"] for out in res] == [expected, expected]
    assert res[1]["on_disk"] == ({"engine": "conv3d", "timings_ms": {"conv3d": 0.5}, "by": "disk"} if warm == 1 else None)


def test_a_decision_made_inside_another_on_another_thread(tmp_path):
    res = _run("nested-thread", 2, tmp_path)
    inner = {"config": "tile-from-rank0"}
    assert res[0]["a"] == res[1]["a"] == {"engine": "triton", "inner": inner}
    assert res[1]["b"] == inner
    assert res[0]["calls"] == ["A", "B"] and res[1]["calls"] == []


def test_tuning_records_made_inside_a_decision_reach_every_rank(tmp_path):
    res = _run("tuning-inside-decision", 3, tmp_path)
    assert [out["engine"] for out in res] == ["triton"] * 3
    assert [out["configs"] for out in res] == [[0, 0, 0]] * 3  # rank 0's fake timings make index 0 fastest
    assert res[0]["seeded"] == [False] * 3 and res[1]["seeded"] == res[2]["seeded"] == [True] * 3


def test_tuner_agreement_point_gives_rank0s_tile(tmp_path):
    res = _run("tuner-agreement", 2, tmp_path)
    assert res[0] == {"config": 0, "tuned": 0, "timed_here": True}
    assert res[1] == {"config": 0, "tuned": 0, "timed_here": False}  # rank 1 alone would take index 1


def test_tuner_agreement_across_gpu_models_checks_the_tile_is_offered(tmp_path):
    res = _run("tuner-other-gpu-models", 2, tmp_path)
    assert res[0] == {"taken": 0, "refused": 0, "warned": False}
    # rank 1 takes rank 0's tile where it has it; where not, it tunes among its own candidates,
    # which lack rank 0's (index 0)
    assert res[1]["taken"] == 0 and res[1]["warned"]
    assert res[1]["refused"] != 0


def test_tuner_agreement_replaces_a_config_seeded_from_the_ranks_own_file(tmp_path):
    import inspect

    if "replace" not in inspect.signature(triton_engine.seed_tuning).parameters:
        pytest.skip("triton_engine.seed_tuning has no replace= parameter yet (needed to follow rank 0 here)")
    res = _run("tuner-over-disk-seed", 2, tmp_path)
    assert res == [{"config": 0, "tuned": 0}, {"config": 0, "tuned": 0}]


def test_an_error_on_rank0_reaches_the_others(tmp_path):
    res = _run("error-on-rank0", 2, tmp_path)
    assert res[0]["raised"] == "MemoryError"
    assert res[1]["raised"] == "AgreementError" and "out of memory while timing (fake)" in res[1]["message"]


def test_a_result_that_cannot_be_sent_fails_on_every_rank(tmp_path):
    res = _run("error-unpicklable", 2, tmp_path)
    assert res[0]["raised"] in ("PicklingError", "AttributeError", "TypeError")
    assert res[1]["raised"] == "AgreementError" and "cannot be sent to the other ranks" in res[1]["message"]


def test_a_decision_rank0_never_makes_times_out_to_a_local_one(tmp_path):
    res = _run("not-spmd", 2, tmp_path, **{distributed.ENV_TIMEOUT: "1"})
    assert res[0]["got"] == "local-0" and res[0]["waited_s"] < 1.0 and not res[0]["warned"]
    assert res[1]["got"] == "local-1" and res[1]["waited_s"] >= 1.0 and res[1]["warned"]


def test_mode_local_decides_per_rank(tmp_path):
    res = _run("mode-local", 2, tmp_path, **{distributed.ENV_MODE: "local"})
    assert res == [{"got": 0, "active": False}, {"got": 1, "active": False}]
