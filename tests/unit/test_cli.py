"""CPU tests of the ``convt3d`` command line: ``--version``, the usage, ``info`` (text and JSON),
``explain`` from shapes (its report, and invalid arguments as one-line errors with exit status
2), and ``cache show|clear`` on private cache folders (convt3d's and Triton's)."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

from convt3d import cli
from convt3d.dispatch import cache
from convt3d.dispatch.registry import ENGINES
from convt3d.engines.triton import sites
from convt3d.version import __version__

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without a CUDA device")


@pytest.fixture(autouse=True)
def _isolated(auto_state, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    yield


# ---- version and usage --------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--version", "-V"], ids=["long", "short"])
def test_version_prints_the_package_version(flag, capsys):
    assert cli.main([flag]) == 0
    assert capsys.readouterr().out == f"convt3d {__version__}\n"
    assert __version__ == importlib.metadata.version("convt3d")  # version.py and pyproject agree


def test_usage_lists_every_command_with_its_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name, (_, help_) in cli.COMMANDS.items():
        assert f"  {name:<20} {help_}" in out


@pytest.mark.parametrize("argv", [["--version"], ["explain", "--input", "1,8,4,4,4", "--weight", "8,4,3,3,3",
                                                  "--stride", "0"]], ids=["version", "explain-bad-stride"])
def test_module_entry_point(argv):
    done = subprocess.run([sys.executable, "-m", "convt3d", *argv], capture_output=True, text=True, timeout=120)
    if argv == ["--version"]:
        assert (done.returncode, done.stdout) == (0, f"convt3d {__version__}\n")
    else:
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.strip() == "convt3d explain: RuntimeError: non-positive stride is not supported: " \
                                      "stride=(0, 0, 0)"


# ---- info ---------------------------------------------------------------------------------------
@no_cuda
@pytest.mark.parametrize("interpreter", [True, False], ids=["interpreter-on", "interpreter-off"])
def test_info_names_each_engine_and_no_cuda_device(interpreter, monkeypatch, capsys):
    monkeypatch.setattr(sites, "interpreter_active", lambda: interpreter)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"convt3d {__version__}" and "GPU: no CUDA device" in lines and len(lines) <= 25
    for name in ENGINES:
        assert any(line.split()[:1] == [name] for line in lines), name
    assert "  conv3d     yes" in lines and "  torch      yes" in lines
    triton_line = next(line for line in lines if line.split()[:1] == ["triton"])
    assert (triton_line == "  triton     yes") == interpreter
    assert ("TRITON_INTERPRET=1" in triton_line) != interpreter
    assert f"convt3d cache: {cache.cache_dir()} (0 files, 0 bytes;" in out


@no_cuda
def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["convt3d"] == __version__ and m["gpu"] is None
    assert list(m["engines"]) == list(ENGINES)
    assert m["engines"]["conv3d"] is None and m["engines"]["torch"] is None
    assert m["versions"]["torch"] == torch.__version__
    assert m["cache"] == {"dir": str(cache.cache_dir()), "files": 0, "bytes": 0}


# ---- explain ------------------------------------------------------------------------------------
BASE = ["--input", "1,16,4,6,6", "--weight", "16,8,4,4,4"]


@no_cuda
@pytest.mark.parametrize("extra, chosen", [
    (["--stride", "2", "--padding", "1"], "auto -> torch"),
    (["--stride", "2", "--padding", "1", "--dtype", "bf16", "--channels-last", "--bias"], "auto -> torch"),
    (["--stride", "1,2,2", "--output-padding", "0,1,1", "--groups", "2", "--dilation", "1"], "auto -> torch"),
    (["--padding", "1", "--backend", "conv3d"], "conv3d -> conv3d"),
    (["--stride", "2", "--backend", "torch", "--precision", "ieee"], "torch -> torch, precision ieee"),
], ids=["stride2-auto", "bf16-channels-last-bias", "anisotropic-grouped", "named-conv3d", "named-torch-ieee"])
def test_explain_prints_the_report_naming_the_backend(extra, chosen, capsys):
    assert cli.main(["explain", *BASE, *extra]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA device here: explained for CPU tensors")
    assert f"  backend: {chosen}" in out and "convt3d.explain: input (1, 16, 4, 6, 6)" in out
    if "--bias" in extra:
        assert "bias yes" in out and "bfloat16 (cl)" in out


@pytest.mark.parametrize("extra, message", [
    (["--stride", "0"], "RuntimeError: non-positive stride is not supported: stride=(0, 0, 0)"),
    (["--stride=-1,2,2"], "RuntimeError: non-positive stride is not supported: stride=(-1, 2, 2)"),
    (["--groups", "3"], "RuntimeError: Given groups=3, expected weight to be divisible by 3 at dimension 0"),
    (["--weight", "16,8,4,4"], "RuntimeError: expected weight to be 5-D"),
    (["--backend", "nope"], "ValueError: unknown backend='nope'"),
    (["--precision", "fp64"], "ValueError: unknown precision='fp64'"),
], ids=["stride-zero", "stride-negative", "groups-not-dividing", "weight-4d", "unknown-backend",
        "unknown-precision"])
def test_explain_invalid_arguments_exit_2_with_one_line(extra, message, capsys):
    assert cli.main(["explain", *BASE, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"convt3d explain: {message}")
    assert captured.err.count("\n") == 1


def test_explain_rejects_sizes_that_are_not_integers(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", "--input", "1,16,a", "--weight", "16,8,4,4,4"])
    assert exc.value.code == 2
    assert "argument --input: expected comma-separated integers, got '1,16,a'" in capsys.readouterr().err


# ---- cache show / clear -------------------------------------------------------------------------
def _fill(tmp_path):
    """A current file with entries, a stale one, Triton's kept installation hash, a file not
    convt3d's, and one compiled kernel in Triton's cache."""
    d = cache.cache_dir()
    store = cache.Store(d, cache.environment_key("Test GPU 9000")).load()
    store.put("decisions", "sig", {"engine": "triton", "timings_ms": {}})
    for name in ("a", "b"):
        store.put("triton_configs", name, {"config": {}})
    stale = dict(cache.environment_key("Old GPU"), torch="0.0")
    (d / "Old_GPU.json").write_text(json.dumps({"format": cache.FORMAT, "key": stale, "decisions": {"x": {}}}))
    (d / "build").mkdir()
    (d / "build" / "triton_key.txt").write_text("stamp\nhash")
    (d / "notes.txt").write_text("not convt3d's")
    (tmp_path / "triton" / "KEY").mkdir(parents=True)
    (tmp_path / "triton" / "KEY" / "kernel.cubin").write_bytes(b"\0" * 7)
    return d


def test_cache_show_lists_files_entries_and_triton_cache(tmp_path, capsys):
    d = _fill(tmp_path)
    assert cli.main(["cache", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"convt3d cache: {d} (3 files, ")
    current = next(line for line in lines if "Test_GPU_9000.json" in line)
    assert current.endswith(": decisions 1, triton_configs 2, backward 0, precision 0")
    stale = next(line for line in lines if "Old_GPU.json" in line)
    assert "decisions 1" in stale and "stale: written for torch 0.0" in stale
    assert "  build/triton_key.txt  10 bytes" in lines
    assert not any("notes.txt" in line for line in lines)
    assert lines[-1].startswith(f"Triton cache: {tmp_path / 'triton'} (1 file, 7 bytes;")


@pytest.mark.parametrize("triton", [False, True], ids=["convt3d-only", "with-triton"])
def test_cache_clear_removes_convt3d_files_only(triton, tmp_path, capsys):
    d = _fill(tmp_path)
    assert cli.main(["cache", "clear", *(["--triton"] if triton else [])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("convt3d cache: removed 3 files, ") and "Old_GPU.json" in out and "Test_GPU_9000.json" in out
    assert sorted(p.name for p in d.iterdir()) == [".lock", "notes.txt"]  # the lock, and what is not convt3d's
    assert (f"Triton cache: removed 1 file, 7 bytes from {tmp_path / 'triton'}" in out) == triton
    assert (tmp_path / "triton").is_dir() and any((tmp_path / "triton").iterdir()) != triton
    assert cli.main(["cache", "show"]) == 0
    assert capsys.readouterr().out.startswith(f"convt3d cache: {d} (empty)")
