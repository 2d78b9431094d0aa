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
