"""Rank-consistent decisions under ``torch.distributed``: rank 0 publishes each decision in the process
group's store and the other ranks wait for it; every rank goes through ``agree`` at a signature's first
sight, whatever its own cache holds, so SPMD ranks never diverge."""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar


T = TypeVar("T")

ENV_MODE = "CONVT3D_DISTRIBUTED"  # "agree" (default) or "local"
ENV_TIMEOUT = "CONVT3D_AGREE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
# Waiting in slices notices a rank 0 that died by the store's error, and bounds the wait by our timeout.
_WAIT_SLICE_S = 5.0


class AgreementError(RuntimeError):
    """Rank 0 failed to compute a decision the other ranks were waiting for."""


@dataclass
class _State:
    """This process's agreements within one process group (reset when the group changes)."""

    store: Any  # held: its identity tells a re-initialised process group apart
    prefix: str
    values: dict[str, Any] = field(default_factory=dict)


_lock = threading.Lock()  # guards _state and its values; never held while computing or waiting
_state: _State | None = None
_sessions = 0  # process groups seen by this process (same count on every rank under SPMD)
_group = None  # None: the default (world) group
_local_depth = 0  # > 0: inside local(), or inside a local fallback compute


def _mode() -> str:
    mode = os.environ.get(ENV_MODE) or "agree"
    if mode not in ("agree", "local"):
        raise ValueError(f"environment variable {ENV_MODE}={mode!r} is not a mode; expected 'agree' or 'local'")
    return mode


def _timeout_s() -> float:
    text = os.environ.get(ENV_TIMEOUT)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"environment variable {ENV_TIMEOUT}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"environment variable {ENV_TIMEOUT}={text!r} must be a positive number of seconds")
    return value


def _dist():
    """torch.distributed if a process group is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def active() -> bool:
    """Whether decisions are agreed: a group (:func:`set_group`'s) of 2+ ranks, outside "local" mode and local()."""
    if _local_depth > 0 or _mode() == "local":
        return False
    dist = _dist()
    return dist is not None and dist.get_world_size(_group) > 1


def rank() -> int:
    """This process's rank in the agreeing group (0 without a process group)."""
    dist = _dist()
    return 0 if dist is None else dist.get_rank(_group)


def set_group(group) -> None:
    """Agree within ``group`` (a ProcessGroup whose ranks run the same layers, e.g. the data-parallel group;
    None: the default group); call it on every rank of the job, with that rank's group."""
    global _group, _state
    with _lock:
        _group = group
        _state = None


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Decide locally (as without a process group) for the duration of a block."""
    global _local_depth
    with _lock:
        _local_depth += 1
    try:
        yield
    finally:
        with _lock:
            _local_depth -= 1


def reset() -> None:
    """Forget this process's agreements (tests)."""
    global _state
    with _lock:
        _state = None


def _current_state() -> _State:
    """The current process group's state, new with another store; the prefix separates groups of one job
    that share a store (elastic restarts, :func:`set_group`)."""
    global _state, _sessions
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    with _lock:
        if _state is None or _state.store is not store:
            _sessions += 1
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            group = "world" if _group is None else "ranks" + "-".join(map(str, _dist().get_process_group_ranks(_group)))
            _state = _State(store, f"convt3d/agree/{restart}/{_sessions}/{group}/")
        return _state


def _store_key(state: _State, what: str) -> str:
    # The key is the digest of the free-form name; the entry holds the name, so a collision is detected.
    return state.prefix + hashlib.sha256(what.encode()).hexdigest()


def _publish(state: _State, what: str, status: str, payload: Any) -> None:
    state.store.set(_store_key(state, what), pickle.dumps((what, status, payload)))


def _receive(state: _State, what: str, timeout_s: float) -> tuple[str, Any] | None:
    """(status, payload) of rank 0's entry, or None when it did not come within ``timeout_s``."""
    key = _store_key(state, what)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            state.store.wait([key], timedelta(seconds=min(_WAIT_SLICE_S, left)))
            break
        except RuntimeError as exc:  # DistStoreError (a RuntimeError): this slice timed out
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
    got_what, status, payload = pickle.loads(state.store.get(key))
    if got_what != what:
        raise AgreementError(f"convt3d: two decisions share the store key {key!r}: {what!r} and {got_what!r}")
    return status, payload


def agree(compute: Callable[[], T], what: str) -> T:
    """``compute()`` on rank 0, its picklable result on every rank, which calls this at first sight, same ``what``."""
    if not active():
        return compute()
    state = _current_state()
    with _lock:
        if what in state.values:
            return state.values[what]
    if rank() == 0:
        try:
            value = compute()
        except Exception as exc:
            _publish(state, what, "error", f"{type(exc).__name__}: {exc}"[:2000])
            raise
        with _lock:  # another thread may have decided the same meanwhile: the first one stands
            value = state.values.setdefault(what, value)
        try:
            _publish(state, what, "ok", value)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # not picklable: tell the others
            _publish(state, what, "error", f"its result cannot be sent to the other ranks ({type(exc).__name__}: "
                                           f"{exc})"[:2000])
            raise
        return value
    timeout_s = _timeout_s()
    got = _receive(state, what, timeout_s)
    if got is None:
        warnings.warn(f"convt3d: rank {rank()} waited {timeout_s:.0f} s for rank 0's decision of {what!r} and "
                      f"decides it locally (ranks may differ). The ranks are not running the same layers in the same "
                      f"order: see convt3d.dispatch.distributed.set_group or {ENV_MODE}=local", RuntimeWarning, stacklevel=2)
        with local():
            return compute()
    status, payload = got
    if status == "error":
        raise AgreementError(f"convt3d: rank 0 failed to decide {what!r}: {payload}")
    with _lock:
        return state.values.setdefault(what, payload)


# ---- Triton tuning --------------------------------------------------------------------------------
# The tuner is passed in rather than imported, so that this module stays a leaf of the import graph.
def _install(tuner, key, config, timings_ms: dict | None) -> None:
    """Make ``config`` this process's tuned config of ``key`` (rank 0's choice wins over this rank's own)."""
    current = tuner.tuned_config(key)
    if current != config:
        tuner.seed_tuning(key, config, timings_ms, replace=current is not None)


def agree_with_tuning(compute: Callable[[], T], what: str, tuner) -> T:
    """:func:`agree`, with the Triton tuning results rank 0 recorded while computing seeded on the other
    ranks, so that their first Triton call of those keys takes rank 0's config without timing."""
    if not active():
        return compute()

    def with_records():
        before = tuner.tuning_log()
        result = compute()
        return result, [(key, rec.config, dict(rec.timings_ms)) for key, rec in tuner.tuning_log().items()
                        if before.get(key) is not rec]

    result, records = agree(with_records, what)
    if rank() != 0:
        for key, config, timings in records:
            _install(tuner, key, config, timings)
    return result


def agree_config(key, choose: Callable[[], Any], candidates=None, *, tuner):
    """``choose()`` of a tune key on rank 0, installed as the others' tuned config of ``key`` (named by the key
    without its GPU model); one not among this rank's ``candidates`` (a foreign tile could compute wrong
    values) is never installed: this rank then chooses for itself, with a warning."""
    if not active():
        return choose()

    def on_rank0():
        config = choose()
        rec = tuner.tuning_log().get(key)
        return config, dict(rec.timings_ms) if rec is not None and rec.config == config else {}

    config, timings = agree(on_rank0, "triton-config|" + repr(tuple(key)[1:]))
    if rank() == 0:
        return config
    if candidates is not None and config not in tuple(candidates):
        warnings.warn(f"convt3d: rank 0's Triton tile {config.short()} is not a candidate on rank {rank()} (another "
                      "GPU model?); this rank tunes for itself", RuntimeWarning, stacklevel=2)
        with local():
            return choose()
    _install(tuner, key, config, timings)
    return config
