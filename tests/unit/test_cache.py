"""CPU tests of the persistent cache (``convt3d.dispatch.cache``): round trip, corrupt / truncated / stale
files (one warning, ignored, rewritten), unwritable locations (one warning, works in memory),
concurrent writers (the file stays valid JSON and keeps every process's entries; a save waits
for the lock rather than writing unlocked), threads of one process, and the Triton
tuning results it seeds and persists (only the engine's own candidates are ever used)."""
from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from pathlib import Path

import pytest
import torch

from convt3d.dispatch import cache
from convt3d.engines.triton import engine as triton_engine
from convt3d.core.params import ConvT3dParams
from convt3d.engines.triton.persist import _flush_quietly, flush_triton, has_pending, prime_triton
from convt3d.engines.triton.configs import tuned_config, tuning_log

KEY = {"gpu": "Test GPU 9000", "convt3d": "0.1.0", "source": "0123456789ab", "torch": "2.99", "triton": "9.9"}


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    cache.reset()
    yield
    cache.reset()
    triton_engine.clear_caches()


def _store(directory, key=KEY) -> cache.Store:
    return cache.Store(directory, key).load()


def _cache_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, cache.CacheWarning)]


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- location and key ---------------------------------------------------------------------------
def test_cache_dir_env_override_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(cache.ENV_DIR)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "convt3d"


def test_environment_key_names_gpu_and_versions():
    import triton

    import convt3d

    from convt3d.version import source_digest

    key = cache.environment_key("NVIDIA H200")
    assert key == {"gpu": "NVIDIA H200", "convt3d": convt3d.__version__, "source": source_digest(),
                   "torch": torch.__version__, "triton": triton.__version__}
    assert cache.file_for(Path("/c"), "NVIDIA H200").name == "NVIDIA_H200.json"


# ---- round trip ---------------------------------------------------------------------------------
def test_round_trip_between_processes_and_no_temp_files_left(tmp_path):
    d = tmp_path / "rt"
    s = _store(d)
    s.put("decisions", "sig-a", {"engine": "triton", "timings_ms": {"triton": 1.0, "torch": 2.0}})
    s.put("triton_configs", "key-a", {"config": {"BLOCK_M": 64}})
    doc = _read(s.path)
    assert doc["format"] == cache.FORMAT and doc["key"] == KEY
    again = _store(d)  # a new process reads what the first wrote
    assert again.get("decisions", "sig-a")["engine"] == "triton"
    assert again.get("triton_configs", "key-a") == {"config": {"BLOCK_M": 64}}
    assert [p.name for p in d.iterdir() if p.suffix == ".tmp"] == []


def test_missing_file_is_silent(tmp_path):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s = _store(tmp_path / "none")
    assert _cache_warnings(rec) == [] and s.get("decisions", "x") is None
    assert not s.path.exists()  # nothing to save, nothing written


# ---- bad files: one warning, ignored, rewritten -------------------------------------------------
def _valid_text(key=KEY) -> str:
    return json.dumps({"format": cache.FORMAT, "key": key,
                       "decisions": {"sig": {"engine": "torch", "timings_ms": {"torch": 1.0}}},
                       "triton_configs": {}})


BAD_FILES = {
    "garbage-bytes": (b"\x00\xff\x13 not json at all", "corrupt"),
    "truncated-json": (_valid_text().encode()[:40], "corrupt"),
    "empty-file": (b"", "corrupt"),
    "json-but-a-list": (b"[1, 2, 3]", "corrupt"),
    "malformed-section": (json.dumps({"format": cache.FORMAT, "key": KEY, "decisions": {"sig": 5}}).encode(),
                          "corrupt"),
    "stale-torch-version": (_valid_text(dict(KEY, torch="1.0")).encode(), "stale"),
    "stale-gpu": (_valid_text(dict(KEY, gpu="Other GPU")).encode(), "stale"),
    # The same version string, other kernels (an editable install after a pull).
    "stale-sources": (_valid_text(dict(KEY, source="ba9876543210")).encode(), "stale"),
    "no-source-key": (_valid_text({k: v for k, v in KEY.items() if k != "source"}).encode(), "stale"),
    "stale-format": (json.dumps({"format": 0, "key": KEY, "decisions": {}}).encode(), "stale"),
}


@pytest.mark.parametrize("name", list(BAD_FILES), ids=list(BAD_FILES))
def test_bad_file_warns_once_is_ignored_and_rewritten(name, tmp_path):
    content, kind = BAD_FILES[name]
    d = tmp_path / "bad"
    d.mkdir()
    path = cache.file_for(d, KEY["gpu"])
    path.write_bytes(content)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s = _store(d)
        s.get("decisions", "sig")
        s.put("decisions", "new", {"engine": "triton", "timings_ms": {}})
        _store(d)  # a second load in this process: no second warning (the file is valid now)
    msgs = _cache_warnings(rec)
    assert len(msgs) == 1, msgs
    assert str(path) in msgs[0] and "ignoring" in msgs[0]
    assert ("written for" in msgs[0]) == (kind == "stale")
    assert s.get("decisions", "sig") is None  # nothing of the bad file is used
    doc = _read(path)  # rewritten: valid, this process's key, its entry only
    assert doc["key"] == KEY and list(doc["decisions"]) == ["new"]


def test_bad_file_is_rewritten_even_without_new_entries(tmp_path):
    d = tmp_path / "bad2"
    d.mkdir()
    path = cache.file_for(d, KEY["gpu"])
    path.write_text("{ truncated")
    with pytest.warns(cache.CacheWarning):
        _store(d)
    assert _read(path) == {"format": cache.FORMAT, "key": KEY, **{s: {} for s in cache.SECTIONS}}
    assert set(cache.SECTIONS) == {"decisions", "triton_configs", "backward", "precision"}


# ---- unwritable locations -----------------------------------------------------------------------
def _unwritable_dir(tmp_path, how: str) -> Path:
    if how == "path-through-a-file":
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        return blocker / "cache"  # mkdir fails whoever we are (NotADirectoryError)
    if how == "read-only-directory":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            pytest.skip("root ignores directory permissions")
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d
    raise ValueError(how)


@pytest.mark.parametrize("how", ["path-through-a-file", "read-only-directory"])
def test_unwritable_location_warns_once_and_works_in_memory(how, tmp_path):
    d = _unwritable_dir(tmp_path, how)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            s = _store(d)
            for i in range(3):
                s.put("decisions", f"sig{i}", {"engine": "torch", "timings_ms": {}})
        msgs = _cache_warnings(rec)
        assert len(msgs) == 1 and "cannot be written" in msgs[0], msgs
        assert s.get("decisions", "sig2")["engine"] == "torch"  # kept in memory
        assert not s.writable
    finally:
        if how == "read-only-directory":
            d.chmod(0o755)


def test_read_only_location_still_serves_an_existing_file(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    _store(d).put("decisions", "sig", {"engine": "triton", "timings_ms": {"triton": 1.0}})
    calls = []

    def refuse(*a, **k):
        calls.append(a)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache.tempfile, "mkstemp", refuse)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s = _store(d)
        assert s.get("decisions", "sig")["engine"] == "triton"
        s.put("decisions", "other", {"engine": "torch", "timings_ms": {}})
    assert len(_cache_warnings(rec)) == 1 and calls
    assert list(_read(s.path)["decisions"]) == ["sig"]  # the file is untouched


# ---- concurrent writers -------------------------------------------------------------------------
WRITERS, ENTRIES = 4, 15


def _writer(directory: str, wid: int, barrier) -> None:
    barrier.wait()  # all start at once
    s = cache.Store(directory, KEY).load()
    for i in range(ENTRIES):
        s.put("decisions", f"w{wid}-e{i}", {"engine": "triton", "timings_ms": {"triton": float(i)}})


def test_concurrent_writers_leave_a_valid_file_with_every_entry(tmp_path):
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    d = tmp_path / "conc"
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_writer, args=(str(d), w, barrier)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    doc = _read(cache.file_for(d, KEY["gpu"]))  # valid JSON
    assert doc["key"] == KEY
    expected = {f"w{w}-e{i}" for w in range(WRITERS) for i in range(ENTRIES)}
    if cache.fcntl is not None:  # with the lock, merges lose nothing
        assert set(doc["decisions"]) == expected
    else:
        assert set(doc["decisions"]) <= expected
    assert [p.name for p in d.iterdir() if p.suffix == ".tmp"] == []


def test_a_save_waits_for_the_lock_another_process_holds(tmp_path):
    if cache.fcntl is None:
        pytest.skip("no fcntl: saves are not locked on this platform")
    import fcntl
    import threading
    import time

    d = tmp_path / "locked"
    s = _store(d)
    s.put("decisions", "first", {"engine": "torch", "timings_ms": {}})
    fd = os.open(d / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process holds the lock (flock: per open file)
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.put("decisions", "second", {"engine": "triton", "timings_ms": {}}),
                                         done.set()))
    t.start()
    time.sleep(0.3)
    try:
        assert not done.is_set()  # waiting, not writing unlocked
        assert list(_read(s.path)["decisions"]) == ["first"]
    finally:
        os.close(fd)  # released: the save goes through
    t.join(10)
    assert done.is_set() and set(_read(s.path)["decisions"]) == {"first", "second"}


def test_pending_entries_are_saved_at_exit(tmp_path, monkeypatch):
    d = tmp_path / "exit"
    s = _store(d)
    s.put("decisions", "later", {"engine": "torch", "timings_ms": {}}, save=False)
    assert not s.path.exists()
    _flush_quietly()  # what the exit hook runs
    assert list(_read(s.path)["decisions"]) == ["later"]


def test_a_miss_rereads_the_file_another_process_changed(tmp_path):
    d = tmp_path / "refresh"
    mine, other = _store(d), _store(d)  # two processes that loaded the (empty) cache
    other.put("decisions", "theirs", {"engine": "triton", "timings_ms": {"triton": 1.0}})
    assert mine.get("decisions", "theirs")["engine"] == "triton"
    assert not mine.refresh()  # unchanged since: one stat, no read


def test_cache_file_is_readable_by_others(tmp_path):
    s = _store(tmp_path / "mode")
    s.put("decisions", "x", {"engine": "torch", "timings_ms": {}})
    assert s.path.stat().st_mode & 0o777 == cache.FILE_MODE


def test_threads_of_one_process_save_concurrently(tmp_path):
    import threading

    s = _store(tmp_path / "threads")
    errors = []

    def work(t):
        try:
            for i in range(20):
                s.put("decisions", f"t{t}-{i}", {"engine": "torch", "timings_ms": {"torch": float(i)}})
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert set(_read(s.path)["decisions"]) == {f"t{t}-{i}" for t in range(4) for i in range(20)}


# ---- Triton tuning results ----------------------------------------------------------------------
def _plan_key():
    params = ConvT3dParams.create(1, 16, 16, 1, (3, 4, 5), (3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    configs = triton_engine.candidate_configs(params, torch.float32, "tf32", False)
    key = ("Test GPU 9000", torch.float32, "tf32", False, params)
    return key, configs


def test_tune_key_text_is_stable_json():
    key, _ = _plan_key()
    text = cache.tune_key_text(key)
    assert json.loads(text)[0:4] == ["Test GPU 9000", "torch.float32", "tf32", False]
    assert text == cache.tune_key_text(key)


def test_persisted_config_is_seeded_before_the_first_call():
    key, configs = _plan_key()
    assert len(configs) > 1
    chosen = configs[-1]
    cache.store_for(KEY["gpu"]).put("triton_configs", cache.tune_key_text(key),
                                    {"config": cache.config_to_dict(chosen), "timings_ms": {"a": 1.0}})
    cache.reset()  # a new process
    prime_triton(KEY["gpu"], key, configs)
    assert tuned_config(key) == chosen
    assert tuning_log()[key].seconds == 0.0  # seeded, not timed


@pytest.mark.parametrize("bad", ["not-a-candidate", "unknown-field", "not-a-dict"])
def test_foreign_config_in_file_is_never_used(bad):
    key, configs = _plan_key()
    cfg = cache.config_to_dict(configs[0])
    entry = {"not-a-candidate": dict(cfg, W_GROUP=2 if cfg["W_GROUP"] == 1 else 1, BLOCK_M=8),
             "unknown-field": dict(cfg, FUTURE_FIELD=1), "not-a-dict": [1, 2]}[bad]
    cache.store_for(KEY["gpu"]).put("triton_configs", cache.tune_key_text(key), {"config": entry})
    cache.reset()
    prime_triton(KEY["gpu"], key, configs)
    assert tuned_config(key) is None  # the engine will tune as if no file existed


def test_tuning_result_is_persisted_once_known():
    key, configs = _plan_key()
    prime_triton(KEY["gpu"], key, configs)
    assert has_pending() and flush_triton() == 0  # not tuned yet
    # What triton_engine._choose records after timing the candidates.
    triton_engine._tuned[key] = triton_engine.TuneRecord(configs[1], 2.5, {configs[0].short(): 0.2,
                                                                            configs[1].short(): 0.1})
    assert flush_triton() == 1 and not has_pending()
    doc = _read(cache.file_for(cache.cache_dir(), KEY["gpu"]))
    entry = doc["triton_configs"][cache.tune_key_text(key)]
    assert entry["config"] == cache.config_to_dict(configs[1]) and entry["tuning_s"] == 2.5


def test_untimed_results_are_not_persisted():
    key, configs = _plan_key()
    prime_triton(KEY["gpu"], key, configs)
    triton_engine.seed_tuning(key, configs[0])  # e.g. CONVT3D_AUTOTUNE=0: configs[0], no timings
    assert flush_triton() == 0
    assert not cache.file_for(cache.cache_dir(), KEY["gpu"]).exists()


def test_seed_tuning_never_overrides_a_result_of_this_process():
    key, configs = _plan_key()
    triton_engine._tuned[key] = triton_engine.TuneRecord(configs[0], 1.0, {})
    triton_engine.seed_tuning(key, configs[1])
    assert tuned_config(key) == configs[0]


def test_the_precision_class_round_trips_and_a_bad_value_reads_as_unknown():
    cache.save_precision_class(KEY["gpu"], "sig-a", "fp32")
    cache.store_for(KEY["gpu"]).put("precision", "sig-b", {"class": "bf16"})
    cache.reset()
    assert cache.load_precision_class(KEY["gpu"], "sig-a") == "fp32"
    assert cache.load_precision_class(KEY["gpu"], "sig-b") is None
    assert cache.load_precision_class(KEY["gpu"], "sig-c") is None
