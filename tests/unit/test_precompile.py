"""The compile workers: a specialisation sent to a worker lands in Triton's on-disk cache."""
import json
import os

import pytest

from convt3d.engines.triton import precompile


def _fill_rows_spec(has_bias: bool) -> str:
    # fill_rows_kernel(y_ptr, b_ptr, rows_ptr, 9 ints, HAS_BIAS, BLOCK_C, BLOCK_W), as a launch specialises it.
    names = ["y_ptr", "b_ptr", "rows_ptr", "C", "OW", "ROWS", "C_BLOCKS", "stride_yn", "stride_yc", "stride_yd",
             "stride_yh", "stride_yw", "HAS_BIAS", "BLOCK_C", "BLOCK_W"]
    types = ["*fp32", "*fp32", "*i32"] + ["i32"] * 9 + ["constexpr"] * 3
    return json.dumps({
        "name": "convt3d.engines.triton.kernels.phase_gemm.fill_rows_kernel",
        "signature": dict(zip(names, types)),
        "constant_keys": [[12], [13], [14]], "constant_vals": [has_bias, 32, 64],
        "attrs_keys": [[0], [1], [2]], "attrs_vals": [[["tt.divisibility", 16]]] * 3,
        "options": {"num_warps": 4, "num_stages": 2}, "key": "test",
    })


@pytest.mark.parametrize("workers", [1, 2], ids=["one-worker", "two-workers"])
def test_workers_compile_into_triton_cache(tmp_path, monkeypatch, workers):
    from triton.backends.compiler import GPUTarget
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CONVT3D_COMPILE_WORKERS", str(workers))
    monkeypatch.setattr(precompile, "_workers", [])
    jobs = [("convt3d.engines.triton.kernels.phase_gemm", "fill_rows_kernel", _fill_rows_spec(b)) for b in (True, False)]
    try:
        results = precompile.compile_all(jobs + jobs[:1], GPUTarget("cuda", 90, 32))
    finally:
        precompile._stop()
    assert results == {job: None for job in jobs}
    cubins = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".cubin")]
    assert len(cubins) == 2


def test_worker_reports_an_error(tmp_path, monkeypatch):
    from triton.backends.compiler import GPUTarget
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CONVT3D_COMPILE_WORKERS", "1")
    monkeypatch.setattr(precompile, "_workers", [])
    job = ("convt3d.engines.triton.kernels.phase_gemm", "no_such_kernel", _fill_rows_spec(True))
    try:
        results = precompile.compile_all([job], GPUTarget("cuda", 90, 32))
    finally:
        precompile._stop()
    assert "AttributeError" in results[job]


@pytest.mark.parametrize("value,expected", [("0", 0), ("3", 3), (" 5 ", 5)], ids=["off", "three", "spaces"])
def test_worker_count_from_environment(monkeypatch, value, expected):
    monkeypatch.setenv("CONVT3D_COMPILE_WORKERS", value)
    assert precompile.worker_count() == expected


def test_worker_count_rejects_text(monkeypatch):
    monkeypatch.setenv("CONVT3D_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="CONVT3D_COMPILE_WORKERS must be an integer, got 'many'"):
        precompile.worker_count()


def test_dry_launches_record_this_thread_only():
    import threading
    import types

    import triton
    info = dict(fn=types.SimpleNamespace(module="m", name="k"), compile={"specialization_data": "{}"}, key=1)
    other = []
    with precompile._dry_launches() as seen:
        hook = triton.knobs.runtime.jit_cache_hook
        assert hook(**info) is True  # this thread: recorded, not compiled
        t = threading.Thread(target=lambda: other.append(hook(**info)))
        t.start()
        t.join()
    assert seen == [("m", "k", "{}")] and other == [None]  # another thread compiles as usual
    assert triton.knobs.runtime.jit_cache_hook is None


def test_a_forked_child_does_not_inherit_the_workers(monkeypatch):
    monkeypatch.setattr(precompile, "_workers", precompile._workers)
    precompile._workers.append("the parent's worker")
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child reports how many workers it sees
            os.write(write, str(len(precompile._workers)).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 16) == b"0" and precompile._workers == ["the parent's worker"]
    finally:
        precompile._workers.remove("the parent's worker")


def test_workers_take_the_parents_installation_key(tmp_path, monkeypatch):
    """A job's key is the hash Triton files the compiled kernel under: a new key compiles anew, the same key finds it."""
    from triton.backends.compiler import GPUTarget
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CONVT3D_COMPILE_WORKERS", "1")
    monkeypatch.setattr(precompile, "_workers", [])
    job = ("convt3d.engines.triton.kernels.phase_gemm", "fill_rows_kernel", _fill_rows_spec(True))
    cubins = lambda: sorted(f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".cubin"))  # noqa: E731
    counts = []
    try:
        for key in ("installation-a", "installation-a", "installation-b"):
            assert precompile.compile_all([job], GPUTarget("cuda", 90, 32), key) == {job: None}
            counts.append(len(cubins()))
    finally:
        precompile._stop()
    assert counts == [1, 1, 2]


def test_a_worker_whose_parent_has_gone_exits_quietly(tmp_path):
    """A background compile in flight when the parent exits: the worker's answer meets a closed pipe."""
    import subprocess
    import sys

    from triton.backends.compiler import GPUTarget

    from convt3d.engines.triton.compile_worker import write_message

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    w = subprocess.Popen([sys.executable, str(precompile._WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    target = GPUTarget("cuda", 90, 32)
    write_message(w.stdin, ("convt3d.engines.triton.kernels.phase_gemm", "no_such_kernel", _fill_rows_spec(True),
                            (target.backend, target.arch, target.warp_size), None))
    w.stdout.close()  # the parent is gone before the answer
    w.stdin.close()
    assert w.wait(timeout=120) == 0
    assert b"BrokenPipeError" not in w.stderr.read()
