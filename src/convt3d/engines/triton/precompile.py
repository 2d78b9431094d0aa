"""Tile candidates compiled in parallel before the tuner times them: compiling is most of a first call's cost
and Triton's compiler holds the GIL, so the launches run dry (``jit_cache_hook`` records each specialisation),
worker processes compile those into Triton's on-disk cache, and the timed runs load them (or compile, and
report, what a worker could not). ``CONVT3D_COMPILE_WORKERS`` sets the number of workers (0: none)."""
from __future__ import annotations

import atexit
import collections
import contextlib
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable

import triton

from ...core.memo import memo
from .compile_worker import read_message, write_message
from .warm_up import installation_key, start_warm_up

_WORKER = Path(__file__).with_name("compile_worker.py")
_lock = threading.Lock()
_workers: list[subprocess.Popen] = []
# Tune keys whose candidates were compiled already (``background``): their tuning loads them from Triton's cache.
compiled: dict[tuple, bool] = memo("engines.triton.precompile.compiled")
# A forked child starts workers of its own: the parent's pipes are the parent's to use.
os.register_at_fork(after_in_child=lambda: _workers.clear())


def worker_count() -> int:
    """Workers to start: ``CONVT3D_COMPILE_WORKERS``, else one per CPU but one, at most 16."""
    env = os.environ.get("CONVT3D_COMPILE_WORKERS", "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(f"CONVT3D_COMPILE_WORKERS must be an integer, got {env!r}") from None
    return max(0, min(16, (os.cpu_count() or 1) - 1))


def start_workers() -> list[subprocess.Popen]:
    """Start the workers once per process (they import Triton meanwhile); each exits when its pipe closes."""
    with _lock:
        count = 0 if _workers else worker_count()
        if count:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            for _ in range(count):
                try:
                    _workers.append(subprocess.Popen([sys.executable, str(_WORKER)], stdin=subprocess.PIPE,
                                                     stdout=subprocess.PIPE, env=env))
                except OSError:
                    break
            atexit.register(_stop)
        return list(_workers)


def _stop() -> None:
    for w in _workers:
        with contextlib.suppress(OSError):
            w.stdin.close()


@contextlib.contextmanager
def _dry_launches():
    """Within the block, a launch of this thread that would compile records (module, name, specialisation) instead."""
    seen: list[tuple[str, str, str]] = []
    hooks = triton.knobs.runtime
    previous = hooks.jit_cache_hook
    me = threading.get_ident()

    def record(**kw):
        if threading.get_ident() != me:  # another thread's launches compile and run as usual
            return previous(**kw) if previous else None
        seen.append((kw["fn"].module, kw["fn"].name, kw["compile"]["specialization_data"]))
        return True

    hooks.jit_cache_hook = record
    try:
        yield seen
    finally:
        hooks.jit_cache_hook = previous


# One set of workers serves one batch of jobs at a time (a background batch and a tuning's alike).
_serving = threading.Lock()


def compile_all(jobs: Iterable[tuple[str, str, str]], target, key: str | None = None) -> dict[tuple, str | None]:
    """Compile each (module, kernel name, specialisation) for ``target`` on the workers, with ``key`` as Triton's
    installation hash (None: they compute it); returns each job's error text (None: compiled or cached)."""
    jobs = list(dict.fromkeys(jobs))
    workers = start_workers()
    results: dict[tuple, str | None] = {}
    if not jobs or not workers:
        return results
    todo = collections.deque(jobs)  # popleft is thread-safe
    target = (target.backend, target.arch, target.warp_size)

    def serve(w: subprocess.Popen) -> None:
        while True:
            try:
                job = todo.popleft()
            except IndexError:
                return
            try:
                write_message(w.stdin, job + (target, key))
                results[job] = read_message(w.stdout)
            except (OSError, ValueError, EOFError, pickle.PickleError) as exc:  # ValueError: a pipe closed at exit
                results[job] = f"{type(exc).__name__}: {exc}"
                return  # a broken worker takes no more jobs; the timed runs compile what is left

    with _serving:
        threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers if w.poll() is None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def available() -> bool:
    """Whether candidates can be compiled in worker processes here (not under the interpreter)."""
    return worker_count() > 0 and not triton.knobs.runtime.interpret


def dry_jobs(configs: Iterable, run: Callable[[object], object]) -> list[tuple[str, str, str]]:
    """The (module, kernel name, specialisation) of each kernel that ``run(config)`` would compile, run dry."""
    start_workers()  # before the dry runs: the workers import Triton meanwhile
    start_warm_up()  # and the installation's hash is found or computed meanwhile
    with _dry_launches() as jobs:
        for cfg in configs:
            with contextlib.suppress(Exception):  # the timed run meets the same error and reports it
                run(cfg)
    return jobs


def target():
    return triton.runtime.driver.active.get_current_target()


def compile_candidates(configs: Iterable, run: Callable[[object], object]) -> dict[tuple, str | None]:
    """Compile in parallel what running each config launches (``run(config)``, run dry here)."""
    configs = list(configs)
    if not configs or not available():
        return {}
    jobs = dry_jobs(configs, run)
    return compile_all(jobs, target(), installation_key())
