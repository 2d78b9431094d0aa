"""Triton's installation hash, kept in convt3d's cache folder while the installation's stamp holds."""
import pytest
import triton

from convt3d.engines.triton import warm_up


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A cache folder, compiled-Triton mode and a counting stand-in for Triton's own hash."""
    calls = []

    def triton_key():
        calls.append(1)
        return f"hash-{len(calls)}"

    monkeypatch.setenv("CONVT3D_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(warm_up.triton_cache, "triton_key", triton_key)
    monkeypatch.setattr(warm_up, "_key", None)
    return tmp_path, calls, triton_key


def _new_process(monkeypatch, original):
    monkeypatch.setattr(warm_up, "_key", None)
    monkeypatch.setattr(warm_up.triton_cache, "triton_key", original)


def test_computed_once_then_read_from_the_cache(fresh, monkeypatch):
    folder, calls, original = fresh
    assert warm_up.installation_key() == "hash-1" and len(calls) == 1
    assert warm_up.triton_cache.triton_key() == "hash-1"  # Triton now takes it from here
    assert (folder / "build" / warm_up.KEY_FILE).is_file()
    _new_process(monkeypatch, original)
    assert warm_up.installation_key(compute=False) == "hash-1" and len(calls) == 1


@pytest.mark.parametrize("damage", ["stamp", "file"], ids=["installation-changed", "file-corrupt"])
def test_a_changed_installation_or_bad_file_computes_again(fresh, monkeypatch, damage):
    folder, calls, original = fresh
    warm_up.installation_key()
    _new_process(monkeypatch, original)
    if damage == "stamp":
        monkeypatch.setattr(warm_up, "_stamp", lambda: "another installation")
    else:
        (folder / "build" / warm_up.KEY_FILE).write_text("no newline")
    assert warm_up.installation_key(compute=False) is None and len(calls) == 1
    assert warm_up.installation_key() == "hash-2" and len(calls) == 2


def test_nothing_under_the_interpreter(fresh, monkeypatch):
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    assert warm_up.installation_key() is None and fresh[1] == []


def test_stamp_follows_the_files(monkeypatch):
    before = warm_up._stamp()
    assert before == warm_up._stamp()
    monkeypatch.setattr(triton, "__version__", triton.__version__ + ".changed")
    assert warm_up._stamp() != before


def test_a_fork_during_the_hashing_leaves_the_child_a_free_lock(monkeypatch):
    import os
    monkeypatch.setattr(warm_up, "_lock", warm_up._lock)
    with warm_up._lock:  # as the warm-up thread holds it while it hashes
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, b"1" if warm_up._lock.acquire(timeout=5) else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
