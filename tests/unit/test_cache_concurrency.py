"""Many processes writing the persistent cache at the same moment (issue 18).

Eight writer processes start together (a barrier) and each saves many distinct auto decisions
and Triton tuning results into one cache directory through the public paths: ``save_decision``
and the tuner's path (``prime_triton`` before the first call of a tune key, the tuner recording
its choice, ``flush_triton`` persisting it). All eight also overwrite one shared decision.
Meanwhile a ninth process reads the raw file as fast as it can. Then a fresh process reads every
decision and seeds every tuning result back.

What must hold (the cache's contract, ``convt3d.dispatch.cache`` docstring):

* every raw read during the writes parses as a complete cache file (atomic replace: never a
  torn file), and no temporary file is left behind;
* nothing is lost: the fresh process finds every decision of every writer, each equal to what
  that writer saved (no torn or mixed entries), and the shared one equals one writer's entry;
* every tuning result comes back as the config its writer's tuner chose, seeded (not re-timed).

No GPU here: the tuner is ``triton_engine._choose`` itself, with ``triton.testing.do_bench``
replaced in each writer by fake timings that make a known candidate fastest for each key.
The test is repeated (``ROUNDS``) because a lost update is a race that one run can miss.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from convt3d.dispatch import cache
from convt3d.engines.triton.persist import flush_triton, prime_triton
from convt3d.engines.triton.configs import tuned_config, tuning_log

WRITERS = 8
DECISIONS = 30  # per writer; each one is a separate read-merge-write of the file
TUNE_KEYS = 6  # per writer
ROUNDS = 3
GPU = "Concurrency Test GPU"
# A round takes 1-2 s on an idle 2-core machine; the bound is for a machine busy with other
# work (fsync latency grows with the disk's queue), beyond which a writer counts as hung.
JOIN_S = 180.0
SHARED = "shared signature"


def _signature(w: int, i: int) -> str:
    return f"float32|x=contiguous|w=contiguous|bias|N{w} {i}->{w + i} g1|writer {w} entry {i}"


def _decision(w: int, i: int) -> dict:
    # Every field derives from (w, i): a torn or mixed entry cannot equal the expected one.
    return {"engine": ("triton", "torch", "conv3d")[(w + i) % 3],
            "timings_ms": {"triton": w + i / 1000, "torch": 2 * w + i / 100, "conv3d": 3.5 + w * i},
            "candidates": ["triton", "conv3d", "torch"], "failed": {}, "writer": w, "entry": i}


def _tune_key(w: int, i: int):
    import torch

    from convt3d.engines.triton import engine as triton_engine
    from convt3d.core.params import ConvT3dParams

    # A distinct geometry per (writer, key): channel counts 8+w -> 8+i.
    params = ConvT3dParams.create(1, 8 + w, 8 + i, 1, (2, 3, 4), (3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0),
                                  (1, 1, 1))
    configs = triton_engine.candidate_configs(params, torch.float32, "tf32", False)
    return (GPU, torch.float32, "tf32", False, params), configs


def _fastest(w: int, i: int, n: int) -> int:
    """The index of the candidate the fake timings make fastest for key (w, i)."""
    return (-(w + 3 * i)) % n


def _writer(directory: str, w: int, barrier, seed: int) -> None:
    import random

    import triton.testing

    from convt3d.engines.triton import engine as triton_engine

    os.environ[cache.ENV_DIR] = directory
    os.environ.pop("CONVT3D_AUTOTUNE", None)
    cache.reset()
    triton_engine.clear_caches()
    keys = {i: _tune_key(w, i) for i in range(TUNE_KEYS)}
    current = {}

    def fake_bench(fn, **kwargs):  # the candidate being timed is the one _choose passes to run
        fn()
        return 1.0 + current["rank"]

    triton.testing.do_bench = fake_bench
    # The order of saves differs per writer and per round.
    steps = [("decision", i) for i in range(DECISIONS)] + [("tune", i) for i in range(TUNE_KEYS)] + [("shared", 0)]
    random.Random(seed * 1000 + w).shuffle(steps)
    barrier.wait()  # all writers start at once
    for kind, i in steps:
        if kind == "decision":
            cache.save_decision(GPU, _signature(w, i), _decision(w, i))
        elif kind == "shared":
            cache.save_decision(GPU, SHARED, _decision(w, 999))
        else:
            key, configs = keys[i]
            prime_triton(GPU, key, configs)  # before the key's first call: nothing on disk yet
            best = _fastest(w, i, len(configs))

            def run(cfg, configs=configs, best=best):
                current["rank"] = (configs.index(cfg) - best) % len(configs)  # 0 for the fastest

            triton_engine._choose(key, configs, run)  # what the engine's first call on a GPU does
            flush_triton()


def _raw_reader(path: str, stop, out: str) -> None:
    """Parse the file continuously while the writers run; count reads and bad reads."""
    reads, bad, seen_entries = 0, [], 0
    while not stop.is_set():
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            time.sleep(0.001)
            continue
        reads += 1
        try:
            doc = json.loads(text)
            assert isinstance(doc, dict) and doc["format"] == cache.FORMAT and doc["key"]["gpu"] == GPU
            assert all(isinstance(v, dict) for s in cache.SECTIONS for v in doc[s].values())
            seen_entries = max(seen_entries, len(doc["decisions"]))
        except (ValueError, KeyError, AssertionError) as exc:
            bad.append(f"{type(exc).__name__}: {exc} (length {len(text)})")
    Path(out).write_text(json.dumps({"reads": reads, "bad": bad[:5], "n_bad": len(bad),
                                     "max_decisions": seen_entries}))


def _fresh_reader(directory: str, out: str) -> None:
    """A new process: read back every decision and seed every tuning result."""
    from convt3d.engines.triton import engine as triton_engine

    os.environ[cache.ENV_DIR] = directory
    cache.reset()  # nothing of the parent's state (forked): what it knows comes from the file
    triton_engine.clear_caches()
    missing, wrong, configs_wrong, retimed = [], [], [], []
    for w in range(WRITERS):
        for i in range(DECISIONS):
            entry = cache.load_decision(GPU, _signature(w, i))
            if entry is None:
                missing.append(_signature(w, i))
            elif entry != _decision(w, i):
                wrong.append(_signature(w, i))
        for i in range(TUNE_KEYS):
            key, configs = _tune_key(w, i)
            prime_triton(GPU, key, configs)
            got = tuned_config(key)
            if got != configs[_fastest(w, i, len(configs))]:
                configs_wrong.append(f"writer {w} key {i}: {None if got is None else got.short()}")
            elif tuning_log()[key].seconds != 0.0:
                retimed.append(f"writer {w} key {i}")
    shared = cache.load_decision(GPU, SHARED)
    shared_ok = shared is not None and shared in [_decision(w, 999) for w in range(WRITERS)]
    Path(out).write_text(json.dumps({"missing": missing, "wrong": wrong, "configs_wrong": configs_wrong,
                                     "retimed": retimed, "shared_ok": shared_ok}))


def _context():
    # fork where it exists: 10 processes per round start in milliseconds (spawn would import
    # torch ten times, ~10 s per round on a 2-core machine). The children touch no torch
    # threads and no CUDA, which is what makes forking safe here.
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def _join(procs) -> list:
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():  # a hung writer fails the test instead of hanging it
            p.kill()
            p.join()
    return codes


@pytest.mark.parametrize("round_", range(1, ROUNDS + 1), ids=[f"repeat{r}" for r in range(1, ROUNDS + 1)])
def test_eight_processes_writing_at_once_lose_nothing(round_, tmp_path, monkeypatch):
    ctx = _context()
    directory = tmp_path / "cache"
    path = cache.file_for(directory, GPU)
    monkeypatch.setenv(cache.ENV_DIR, str(directory))
    cache.reset()
    barrier, stop = ctx.Barrier(WRITERS), ctx.Event()
    raw_out = tmp_path / "raw.json"
    reader = ctx.Process(target=_raw_reader, args=(str(path), stop, str(raw_out)))
    reader.start()
    writers = [ctx.Process(target=_writer, args=(str(directory), w, barrier, round_)) for w in range(WRITERS)]
    for p in writers:
        p.start()
    codes = _join(writers)
    stop.set()
    reader_code = _join([reader])
    assert codes == [0] * WRITERS, f"writer exit codes {codes}"
    assert reader_code == [0]

    raw = json.loads(raw_out.read_text())
    assert raw["n_bad"] == 0, f"{raw['n_bad']} of {raw['reads']} reads saw a torn file: {raw['bad']}"
    assert raw["reads"] > 0
    assert [p.name for p in directory.iterdir() if p.suffix == ".tmp"] == []
    doc = json.loads(path.read_text())
    assert len(doc["decisions"]) == WRITERS * DECISIONS + 1
    assert len(doc["triton_configs"]) == WRITERS * TUNE_KEYS

    out = tmp_path / "fresh.json"
    fresh = ctx.Process(target=_fresh_reader, args=(str(directory), str(out)))
    fresh.start()
    assert _join([fresh]) == [0]
    res = json.loads(out.read_text())
    assert res["missing"] == [], f"{len(res['missing'])} decisions lost, e.g. {res['missing'][:3]}"
    assert res["wrong"] == [], f"{len(res['wrong'])} decisions differ from what was saved: {res['wrong'][:3]}"
    assert res["configs_wrong"] == [], res["configs_wrong"][:3]
    assert res["retimed"] == [], res["retimed"][:3]
    assert res["shared_ok"]
