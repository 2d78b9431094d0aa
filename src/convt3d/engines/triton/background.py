"""A new signature's tile candidates compiled off the call's path (first-call mode "background"): compiling
costs seconds and timing a fraction of one, so auto decides without this engine while the workers compile the
dry-run launches into Triton's cache, and the next call after that times them as "wait" mode would. Ready: tuned
here, compiled here, or in the cache file; where workers cannot run (interpreter, no spare CPU) nothing waits."""
from __future__ import annotations

import threading

from ...core.call import Call
from ...core.memo import memo
from ...dispatch import first_call
from ...dispatch.cache import store_for, tune_key_text
from . import engine as triton_engine
from . import precompile
from .configs import device_name, tuned_config
from .warm_up import installation_key

# Tune keys whose candidates are compiling now (``precompile.compiled`` holds those done).
_compiling: dict[tuple, bool] = memo("engines.triton.background.compiling")


def _key(call: Call) -> tuple | None:
    """The call's tune key where its candidates compile in the background, else None."""
    if call.device.type == "cuda" and first_call.background() and precompile.available():
        return triton_engine.plan(call.params, call.x, call.weight, call.precision).tune_key
    return None


def not_ready(call: Call) -> str | None:
    """Why auto does not time the engine on ``call`` yet (its candidates are not compiled), or None."""
    key = _key(call)
    if key is None or key in precompile.compiled or tuned_config(key) is not None:
        return None
    if key in _compiling:
        return ("its tile candidates are compiling in background processes; "
                "the next call after they are ready times them")
    if store_for(device_name(call.device)).get("triton_configs", tune_key_text(key)) is not None:
        precompile.compiled[key] = True  # tuned or compiled by an earlier process: its kernels are in Triton's cache
        return None
    return ("its tile candidates are not compiled yet (they compile in background processes; "
            f"{first_call.ENV}=wait or convt3d.tune compiles and times them on the first call)")


def start(call: Call) -> None:
    """Compile ``call``'s candidates in the background once per tune key, then mark it compiled (cache file too)."""
    key = _key(call)
    if key is None or key in _compiling or key in precompile.compiled:
        return
    _compiling[key] = True
    launch = triton_engine.prepare(call.x, call.weight, call.bias, call.params, call.precision)
    jobs = (precompile.dry_jobs(triton_engine.first_candidates(launch, call.params, call.x, call.precision), launch.run)
            if launch.y.numel() else [])
    target, gpu = precompile.target(), device_name(call.device)

    def compile_them() -> None:
        try:
            precompile.compile_all(jobs, target, installation_key())
            store = store_for(gpu)
            if store.get("triton_configs", tune_key_text(key)) is None:
                store.put("triton_configs", tune_key_text(key), {"compiled": True})  # compiled, not yet tuned
        finally:
            # Failures are the timed run's to meet and report, as in "wait" mode.
            precompile.compiled[key] = True
            _compiling.pop(key, None)
            first_call.became_ready()

    threading.Thread(target=compile_them, name="convt3d-compile", daemon=True).start()


def forget() -> None:
    """Forget which keys are compiled (a compile in flight still marks its key when done)."""
    _compiling.clear()
    precompile.compiled.clear()
