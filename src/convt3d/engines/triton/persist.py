"""The Triton tuner's results on disk: a signature's first call seeds the config another process
measured (skipping its tuning), and the configs tuned here are saved to the cache file."""
from __future__ import annotations

import atexit
import contextlib
import functools

from ...dispatch.cache import config_from_dict, config_to_dict, on_reset, save_unsaved, store_for, tune_key_text
from . import engine as triton_engine
from ...core.memo import memo
from .configs import tuned_config, tuning_log


_seen: set = set()  # tune keys already looked up this process
# Tune key -> GPU of keys not tuned when first seen: persisted once tuned.
_pending: dict = memo("engines.triton.persist.pending")


def prime_triton(gpu: str, key, candidates) -> None:
    """Before the first call of a tune key: seed a persisted config, or let :func:`flush_triton` persist its tuning."""
    if key in _seen:
        return
    _seen.add(key)
    if tuned_config(key) is None:  # else tuned earlier in this process: persist it too
        entry = store_for(gpu).get("triton_configs", tune_key_text(key))
        cfg = config_from_dict(entry.get("config"), candidates) if entry else None
        if cfg is not None:
            timings = entry.get("timings_ms")
            triton_engine.seed_tuning(key, cfg, timings if isinstance(timings, dict) else None)
            return
    _pending[key] = gpu
    _flush_at_exit()


@functools.cache
def _flush_at_exit() -> None:
    """Flush at exit (registered on first use): the last signature's result would wait for a call that never comes."""
    atexit.register(_flush_quietly)


def _flush_quietly() -> None:
    with contextlib.suppress(Exception):
        flush_triton()
    save_unsaved()


def has_pending() -> bool:
    return bool(_pending)


def flush_triton() -> int:
    """Persist pending keys' timed results (not one candidate's, nor CONVT3D_AUTOTUNE=0's); returns how many."""
    done = [k for k in _pending if tuned_config(k) is not None]
    if not done:
        return 0
    log = tuning_log()
    saved, touched = 0, {}
    for key in done:
        gpu = _pending.pop(key)
        rec = log.get(key)
        if rec is None or not rec.timings_ms or rec.seconds <= 0:
            continue
        store = store_for(gpu)
        store.put("triton_configs", tune_key_text(key),
                  {"config": config_to_dict(rec.config), "timings_ms": dict(rec.timings_ms),
                   "tuning_s": rec.seconds, "short": rec.config.short()}, save=False)
        touched[id(store)] = store
        saved += 1
    for store in touched.values():  # one read-merge-write per file, however many keys
        store.save()
    return saved


def _forget() -> None:
    _seen.clear()
    _pending.clear()


on_reset(_forget)
