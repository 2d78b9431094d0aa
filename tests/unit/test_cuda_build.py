"""The CUDA head kernel's libraries are built off the critical path (``engines/cuda/build.py``):
CPU tests with the build replaced by a stand-in."""
import threading

import pytest
import torch

from convt3d.engines.cuda import build, head


@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """library_path in a temporary folder; load_library writes the file after ``gate`` opens (or raises)."""
    gate, calls = threading.Event(), []

    def path(device, dtype):
        return tmp_path / f"lib_{str(dtype).replace('torch.', '')}.so"

    def load(device, dtype):
        calls.append(dtype)
        gate.wait(5)
        if dtype == torch.float16:
            raise RuntimeError("nvcc failed")
        path(device, dtype).write_text("built")

    monkeypatch.setattr(head, "library_path", path)
    monkeypatch.setattr(head, "loaded", lambda dtype: False)
    monkeypatch.setattr(head, "load_library", load)
    monkeypatch.setattr(build, "_threads", {})
    monkeypatch.setattr(build, "_failed", {})
    return gate, calls


def test_a_background_build_reports_building_then_built(fake_builds):
    gate, calls = fake_builds
    device = torch.device("cuda", 0)
    assert build.status(device, torch.bfloat16) == "not built" and not build.ready(device, torch.bfloat16)
    build.start(device, torch.bfloat16)
    build.start(device, torch.bfloat16)  # once per process
    assert build.status(device, torch.bfloat16) == "building"
    gate.set()
    build._threads[build._key(device, torch.bfloat16)].join(5)
    assert build.status(device, torch.bfloat16) == "built" and build.ready(device, torch.bfloat16)
    assert calls == [torch.bfloat16]


def test_a_failed_build_is_kept_with_its_reason(fake_builds):
    gate, _ = fake_builds
    gate.set()
    device = torch.device("cuda", 0)
    build.start(device, torch.float16)
    build._threads[build._key(device, torch.float16)].join(5)
    assert build.status(device, torch.float16) == "failed: RuntimeError: nvcc failed"


def test_a_library_loaded_in_this_process_is_ready_wherever_the_cache_folder_points(fake_builds, monkeypatch):
    monkeypatch.setattr(head, "loaded", lambda dtype: dtype == torch.bfloat16)
    device = torch.device("cuda", 0)
    assert build.ready(device, torch.bfloat16) and not build.ready(device, torch.float32)


@pytest.mark.parametrize("out_channels,dilation,device,started", [
    (3, 1, "cuda", True), (64, 1, "cuda", False), (3, 2, "cuda", False), (3, 1, "cpu", False)],
    ids=["head-on-cuda", "not-a-head", "dilated", "on-cpu"])
def test_patch_starts_the_head_library_build_for_heads_on_cuda(out_channels, dilation, device, started, monkeypatch):
    from types import SimpleNamespace

    from convt3d import nn as cnn

    calls = []
    monkeypatch.setattr(head, "nvcc_path", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(build, "ready", lambda device, dtype: False)
    monkeypatch.setattr(build, "start", lambda device, dtype: calls.append((device.type, dtype)))
    weight = SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16)
    module = SimpleNamespace(weight=weight, dilation=(dilation,) * 3, out_channels=out_channels, groups=1)
    cnn._start_head_build(module)
    assert calls == ([("cuda", torch.bfloat16)] if started else [])


_CHILD = r'''
import sys, types, torch
from convt3d.engines.cuda import head
head.nvcc_path = lambda: sys.argv[1]
head._arch = lambda device: "90"
entry = types.SimpleNamespace(argtypes=None)
head.ctypes.CDLL = lambda path: types.SimpleNamespace(convt3d_head_launch=entry, convt3d_head_pack=entry)
head.load_library(torch.device("cuda", 0), torch.bfloat16)
print(open(head.library_path(torch.device("cuda", 0), torch.bfloat16)).read().strip())
'''


def test_processes_sharing_the_cache_folder_build_a_library_once(tmp_path):
    """Two processes (the ranks of a node, test workers) ask for the same library at once: one runs the
    compiler, the other waits on the lock file beside the library and loads what it built."""
    import os
    import subprocess
    import sys

    count = tmp_path / "compiles"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho x >> "{count}"\nsleep 1\n'
                    'while [ $# -gt 0 ]; do [ "$1" = "-o" ] && echo built > "$2"; shift; done\n')
    nvcc.chmod(0o755)
    env = dict(os.environ, CONVT3D_CACHE_DIR=str(tmp_path / "cache"))
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(nvcc)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [c.communicate(timeout=120) for c in children]
    assert [c.returncode for c in children] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["built", "built"]
    assert count.read_text().count("x") == 1
