"""docs/benchmarks.md is generated from docs/bench by one command: the committed page must be what
the command writes today, byte for byte, so that a record added without regenerating it fails here;
docs/bench keeps the latest runs only. No GPU."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench_md.py"
# The latest run of each suite per GPU; earlier runs live in git's history.
MAX_RECORDS = 12


def _tool():
    spec = importlib.util.spec_from_file_location("bench_md", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _row(precision: str, dtype: str = "fp32") -> dict:
    return {"case": "gan_k4s2p1", "suite": "layers", "mode": "fwd", "dtype": dtype, "layout": "ncdhw",
            "precision": precision, "engine": "triton", "convt3d_us": 100.0, "torch_us": 250.0, "speedup": 2.5}


def test_page_is_regenerated_byte_for_byte():
    # The documented command, run as a user runs it: from the repository root, output on stdout.
    out = subprocess.run([sys.executable, str(SCRIPT), "--docs", "docs/bench"], cwd=ROOT, capture_output=True,
                         check=True).stdout
    assert out == (ROOT / "docs" / "benchmarks.md").read_bytes(), (
        "docs/benchmarks.md is stale: python tools/bench_md.py --docs docs/bench > docs/benchmarks.md")


def test_bench_folder_keeps_latest_runs_only():
    records = sorted(p.name for p in (ROOT / "docs" / "bench").iterdir())
    assert 0 < len(records) <= MAX_RECORDS, records


@pytest.mark.parametrize("old,new", [("default", "tf32"), ("exact", "tf32x3")],
                         ids=["old-default-as-tf32", "old-exact-as-tf32x3"])
def test_old_precision_names_are_shown_as_today(tmp_path, old, new):
    (tmp_path / "run.json").write_text(json.dumps({"schema": "convt3d-bench/1", "rows": [_row(old)]}))
    text = _tool().page(str(tmp_path))
    assert f"| ncdhw | {new} | triton |" in text
    assert f"| {old} |" not in text


def test_missing_environment_says_not_recorded(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"schema": "convt3d-bench/1", "rows": [_row("tf32")]}))
    text = _tool().page(str(tmp_path))
    assert "### not recorded, forward" in text
    assert "torch not recorded" in text and "date not recorded" in text


def test_geomean_per_table_and_split_by_dtype(tmp_path):
    rows = [_row("tf32"), dict(_row("tf32", "bf16"), speedup=8.0)]
    (tmp_path / "run.json").write_text(json.dumps({"schema": "convt3d-bench/1", "rows": rows}))
    text = _tool().page(str(tmp_path))
    assert "over the 2 rows: **4.47x** (min 2.50x, gan_k4s2p1 fp32 ncdhw); fp32 2.50x, bf16 8.00x." in text


@pytest.mark.parametrize("name,content", [("notes.txt", "free text"), ("probe.json", "[1, 2]"),
                                          ("run.log", "no bench rows here")],
                         ids=["text-file", "json-of-unknown-shape", "log-without-rows"])
def test_a_file_that_is_no_record_stops_the_page(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=name):
        _tool().page(str(tmp_path))
