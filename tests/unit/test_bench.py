"""CPU tests of ``convt3d bench``: suite definitions, filters, roofline arithmetic, the row and JSON
logic (driven on CPU with a fake timer), the plot, and the interpreter check end to end."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convt3d.bench import check, cli, report, roofline, runner, suites
from conftest import requires_interpreter
from convt3d.bench.suites import Case, Geometry
from convt3d.core.validate import check_call

SRC = str(Path(__file__).resolve().parents[2] / "src")

# ---- suites: exactly the numbers the suites were specified with ----------------------------------
# N, Cin, Cout, input (D,H,W), kernel, stride, padding, output_padding, dilation, groups
KERNELBENCH_SPEC = {
    "kb58": (16, 32, 16, (16, 32, 64), (3, 5, 7), 1, 0, 0, 1, 1),
    "kb61": (8, 48, 48, (64, 64, 64), 3, 1, 0, 0, 1, 1),
    "kb68": (16, 32, 64, (64, 64, 64), (3, 5, 5), 1, 0, 0, 1, 1),
    "kb70": (8, 48, 24, (96, 96, 96), 3, 1, 0, 0, 1, 1),
    "kb72": (8, 32, 32, (12, 24, 48), (3, 5, 7), 2, (1, 2, 3), (1, 1, 1), 1, 4),
    "kb73": (4, 32, 32, (32, 64, 128), 3, 2, 1, 0, 1, 1),
    "kb77": (16, 32, 64, (16, 32, 32), 3, 2, 1, 0, 2, 1),
}
# Output sizes from shared/CONTEXT.md (measured with PyTorch).
KERNELBENCH_OUT = {"kb58": (18, 36, 70), "kb61": (66, 66, 66), "kb68": (66, 68, 68), "kb70": (98, 98, 98),
                   "kb72": (24, 48, 96), "kb73": (63, 127, 255), "kb77": (33, 65, 65)}
# N, Cin, Cout, input, kernel, stride, padding, output_padding, bias
LAYERS_SPEC = {
    "nnunet_128_64": (2, 128, 64, 32, 2, 2, 0, 0, True),
    "nnunet_64_32": (2, 64, 32, 64, 2, 2, 0, 0, True),
    "monai_unet_k3": (4, 64, 32, 32, 3, 2, 1, 1, True),
    "gan_k4s2p1": (8, 256, 128, 16, 4, 2, 1, 0, False),
    "videogpt_k4s2p3": (4, 240, 240, (10, 34, 34), 4, 2, 3, 0, True),
    "aniso_122": (2, 256, 128, (8, 64, 64), (1, 2, 2), (1, 2, 2), 0, 0, True),
    "refine_k3s1": (4, 64, 64, 32, 3, 1, 1, 0, True),
}


def t3(v):
    return tuple(v) if isinstance(v, tuple) else (v, v, v)


@pytest.mark.parametrize("name", list(KERNELBENCH_SPEC), ids=list(KERNELBENCH_SPEC))
def test_kernelbench_geometry_matches_spec(name):
    g = {g.name: g for g in suites.KERNELBENCH}[name]
    n, cin, cout, size, k, s, p, op, d, groups = KERNELBENCH_SPEC[name]
    assert (g.batch, g.in_channels, g.out_channels, g.groups, g.bias) == (n, cin, cout, groups, False)
    assert (g.in_size, g.kernel, g.stride, g.padding, g.output_padding, g.dilation) == \
        tuple(t3(v) for v in (size, k, s, p, op, d))
    assert g.out_size() == KERNELBENCH_OUT[name]
    x = torch.empty((n, cin) + g.in_size, device="meta")
    w = torch.empty(g.weight_shape, device="meta")
    params, _ = check_call(x, w, None, *g.conv_args())
    assert params.out_size == KERNELBENCH_OUT[name]


@pytest.mark.parametrize("name", list(LAYERS_SPEC), ids=list(LAYERS_SPEC))
def test_layer_geometry_matches_spec(name):
    g = {g.name: g for g in suites.LAYERS}[name]
    n, cin, cout, size, k, s, p, op, bias = LAYERS_SPEC[name]
    assert (g.batch, g.in_channels, g.out_channels, g.groups, g.bias) == (n, cin, cout, 1, bias)
    assert (g.in_size, g.kernel, g.stride, g.padding, g.output_padding, g.dilation) == \
        tuple(t3(v) for v in (size, k, s, p, op, 1))


def test_suite_rows():
    kb = suites.select("kernelbench")
    assert len(kb) == 14
    assert {(c.dtype, c.layout, c.input_dist) for c in kb} == {("fp32", "ncdhw", "rand")}
    assert sorted(c.precision for c in kb) == ["tf32"] * 7 + ["tf32x3"] * 7
    layers = suites.select("layers")
    heads = [c for c in layers if c.geometry.name.startswith("head_")]
    assert len(layers) - len(heads) == 28 and len(heads) == 24  # 6 head layers x 2 dtypes x 2 layouts
    assert {(c.dtype, c.layout) for c in layers} == {("fp32", "ncdhw"), ("fp32", "cl"), ("bf16", "ncdhw"),
                                                     ("bf16", "cl")}
    assert {(c.precision, c.input_dist) for c in layers} == {("tf32", "randn")}
    assert len(suites.select("all")) == 14 + len(layers)
    labels = [c.label for c in suites.select("all")]
    assert len(set(labels)) == len(labels)


def test_heads_suite_is_a_fixed_sweep_of_heads_outside_all():
    # The sweep: 12 geometries, each a head (1-15 output channels per group) with a valid output
    # that the head path takes (head tiles offered), none in another suite, and not part of "all".
    from convt3d.engines.triton import head as head_engine
    from convt3d.engines.triton.head import MAX_HEAD_CHANNELS
    from convt3d.core.params import ConvT3dParams

    names = [g.name for g in suites.HEAD_SWEEP]
    assert len(set(names)) == 12 and not set(names) & {g.name for g in suites.KERNELBENCH + suites.LAYERS}
    for g in suites.HEAD_SWEEP:
        assert 1 <= g.out_channels // g.groups <= MAX_HEAD_CHANNELS and g.in_channels % g.groups == 0
        assert all(o > 0 for o in g.out_size()), g
        params = ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel,
                                      g.stride, g.padding, g.output_padding, g.dilation)
        assert params.out_size == g.out_size()
        assert head_engine.head_tiles(params, torch.bfloat16, "tf32"), g
    heads = suites.select("heads")
    assert len(heads) == 12 * 4 and {c.suite for c in heads} == {"heads"}
    assert not any(c.suite == "heads" for c in suites.select("all"))
    assert len(suites.select("heads", names=[names[0]], dtypes=["bf16"], layouts=["cl"])) == 1


@pytest.mark.parametrize("kwargs, expected", [
    ({"suite": "kernelbench", "precisions": ["tf32x3"]}, 7),
    ({"names": ["kb77"]}, 2),
    ({"names": ["kb77", "gan_k4s2p1"]}, 6),
    ({"dtypes": ["bf16"]}, 26),
    ({"layouts": ["cl"]}, 26),
    ({"names": ["gan_k4s2p1"], "dtypes": ["bf16"], "layouts": ["cl"]}, 1),
    ({"suite": "layers", "precisions": ["tf32x3"]}, 0),
    ({"suite": "kernelbench", "names": ["gan_k4s2p1"]}, 0),
], ids=["kb-tf32x3", "one-case", "two-cases", "bf16", "cl", "single-row", "layers-tf32x3-empty",
        "suite-and-case-disjoint"])
def test_select_filters(kwargs, expected):
    assert len(suites.select(**kwargs)) == expected


@pytest.mark.parametrize("kwargs", [{"names": ["kb99"]}, {"dtypes": ["fp16"]}, {"suite": "nope"},
                                    {"precisions": ["ieee"]}], ids=["case", "dtype", "suite", "precision"])
def test_select_rejects_unknown(kwargs):
    with pytest.raises(ValueError, match="expected"):
        suites.select(**kwargs)


def test_cli_parses_comma_lists_and_repeats():
    args = cli.build_parser().parse_args(["--case", "kb58,kb61", "--case", "kb77", "--dtype", "fp32,bf16"])
    assert args.case == ["kb58", "kb61", "kb77"]
    assert args.dtype == ["fp32", "bf16"]


@pytest.mark.parametrize("geometry", suites.KERNELBENCH + suites.LAYERS,
                         ids=[g.name for g in suites.KERNELBENCH + suites.LAYERS])
def test_reduced_geometry(geometry):
    r = suites.reduced_for_interpreter(geometry)
    assert (r.kernel, r.stride, r.padding, r.output_padding, r.dilation, r.groups, r.bias) == \
        (geometry.kernel, geometry.stride, geometry.padding, geometry.output_padding, geometry.dilation,
         geometry.groups, geometry.bias)
    assert r.batch == 1
    for full, small in ((geometry.in_channels, r.in_channels), (geometry.out_channels, r.out_channels)):
        per_group, small_per_group = full // geometry.groups, small // r.groups
        assert small_per_group <= suites.INTERP_MAX_CHANNELS_PER_GROUP
        assert (small_per_group >= 8) == (per_group >= 8)  # same side of the tensor-core threshold
    assert all(o >= min(s, full) for o, s, full in zip(r.out_size(), r.stride, geometry.out_size()))


def test_make_tensors_layout_and_init():
    case = suites.select("layers", ["monai_unet_k3"], ["bf16"], ["cl"])[0]
    g = suites.reduced_for_interpreter(case.geometry)
    t = suites.make_tensors(case, "cpu", 0, geometry=g)
    assert t.x.dtype == t.w.dtype == t.b.dtype == torch.bfloat16
    assert t.x.is_contiguous(memory_format=torch.channels_last_3d) and not t.x.is_contiguous()
    bound = 1 / math.sqrt(g.out_channels * 27)  # nn.ConvTranspose3d: fan_in = Cout/groups * kvol
    assert t.w.abs().max().item() <= bound * 1.01
    again = suites.make_tensors(case, "cpu", 0, geometry=g)
    assert torch.equal(t.x, again.x) and torch.equal(t.w, again.w)


# ---- roofline arithmetic -------------------------------------------------------------------------
H200 = roofline.Ceilings(copy_bytes_per_s=4.24e12, bf16_flops_per_s=683e12, tf32_flops_per_s=374e12,
                         fp32_flops_per_s=51e12)


def _params(g: Geometry):
    x = torch.empty((g.batch, g.in_channels) + g.in_size, device="meta")
    w = torch.empty(g.weight_shape, device="meta")
    return check_call(x, w, None, *g.conv_args())[0]


def test_kb77_memory_floor_is_about_140us():
    g = {g.name: g for g in suites.KERNELBENCH}["kb77"]
    p = _params(g)
    mem_s, comp_s = roofline.floors(p.useful_flops, p.min_bytes(4, False), H200, "tf32")
    assert 135e-6 < mem_s < 150e-6  # the specification's "memory floor of about 140 µs"
    assert comp_s < mem_s


@pytest.mark.parametrize("dtype, precision, key, peak", [
    ("bf16", "tf32", "bf16", 683e12), ("fp32", "tf32", "tf32", 374e12),
    ("fp32", "exact", "exact", 374e12 / 3)], ids=["bf16", "tf32", "exact"])
def test_peak_classes(dtype, precision, key, peak):
    assert roofline.peak_class(dtype, precision) == key
    assert H200.peak(key) == pytest.approx(peak)


def test_exact_grade_peak_is_the_faster_way():
    slow_tf32 = roofline.Ceilings(4e12, 600e12, 120e12, 51e12)
    assert slow_tf32.exact_grade_flops_per_s == 51e12


def test_roofline_percent_and_tflops():
    assert roofline.roofline_percent(200e-6, 140e-6, 50e-6) == pytest.approx(70.0)
    assert roofline.roofline_percent(100e-6, 10e-6, 100e-6) == pytest.approx(100.0)
    assert roofline.tflops(2e12, 0.5) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        roofline.roofline_percent(0.0, 1.0, 1.0)


def test_geomean():
    assert roofline.geomean([2, 8]) == pytest.approx(4.0)
    assert math.isnan(roofline.geomean([]))
    with pytest.raises(ValueError):
        roofline.geomean([1.0, 0.0])


@pytest.mark.parametrize("estimate_ms, warmup, rep", [(0.1, 10.0, 60.0), (185.0, 185.0, 5.5 * 185.0)],
                         ids=["fast-call", "kb68-exact-cudnn"])
def test_bench_budget(estimate_ms, warmup, rep):
    assert runner.bench_budget(estimate_ms, runner.TimingSettings()) == pytest.approx((warmup, rep))


def test_cudnn_tf32_flag_is_restored():
    before = torch.backends.cudnn.allow_tf32
    with roofline.cudnn_tf32(not before):
        assert torch.backends.cudnn.allow_tf32 is (not before)
    assert torch.backends.cudnn.allow_tf32 is before
    assert torch.backends.cudnn.enabled  # only the TF32 flag was touched


def test_round_tf32():
    # The check's TF32 stand-in for cuDNN rounds as cuDNN does: to nearest, ties away from zero.
    x = torch.tensor([1 + 2 ** -11, 1 + 2 ** -12, -(1 + 3 * 2 ** -11), float("inf"), float("nan")])
    y = check.round_tf32(x)
    assert y[0].item() == 1 + 2 ** -10  # tie: away from zero
    assert y[1].item() == 1.0
    assert y[2].item() == -(1 + 2 ** -9)
    assert math.isinf(y[3].item()) and math.isnan(y[4].item())


def _tf32_reference(v: float) -> float:
    """Round-to-nearest, ties away from zero, to 10 mantissa bits, on the float's bits."""
    import struct
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    if bits & 0x7F800000 == 0x7F800000:
        return v
    return struct.unpack("<f", struct.pack("<I", ((bits + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF))[0]


@pytest.mark.parametrize("value", [1 + 2**-11 + 2**-23, 1 + 3 * 2**-11, 3.0e38, 3.4028234e38, -0.0, 1e-40,
                                   float("-inf")],
                         ids=["above-tie", "odd-tie", "large", "max-to-inf", "negative-zero", "subnormal",
                              "minus-inf"])
def test_round_tf32_at_the_edges_of_float32(value):
    got = check.round_tf32(torch.tensor([value], dtype=torch.float32)).item()
    want = _tf32_reference(torch.tensor(value, dtype=torch.float32).item())
    assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


# ---- rows, summary, JSON, plot (CPU, fake timer) -------------------------------------------------
class FakeTimer:
    """Stands in for CudaTimer: convt3d calls 'take' 1 ms, PyTorch calls 3 ms with TF32 allowed
    (default flags) and 2 ms without, so every ratio below is known. The runner names its two
    callables ``ours`` and ``theirs``."""

    def first_call(self, fn):
        return fn(), 0.25

    def steady(self, fn):
        fn()
        if fn.__name__ == "ours":
            return 1e-3
        return 3e-3 if torch.backends.cudnn.allow_tf32 else 2e-3

    def release(self):
        pass


TINY = Geometry.of("tiny", 1, 8, 8, 3, 3, 2, 1, 1, bias=True)
TINY_CASES = [Case("kernelbench", TINY, "fp32", "ncdhw", "tf32", "rand"),
              Case("kernelbench", TINY, "fp32", "ncdhw", "tf32x3", "rand"),
              Case("layers", TINY, "bf16", "cl", "tf32", "randn")]


@pytest.fixture(scope="module")
def timing_rows():
    rows, failures = runner.run_cases(TINY_CASES, "fwd", "torch", H200, runner.TimingSettings(), device="cpu",
                                      timer=FakeTimer())
    assert failures == []
    return rows


def test_timing_rows(timing_rows):
    default, exact, bf16 = timing_rows
    assert [r["precision"] for r in timing_rows] == ["tf32", "tf32x3", "tf32"]
    assert default["speedup"] == pytest.approx(3.0)  # default flags: 3 ms / 1 ms
    assert exact["speedup"] == pytest.approx(2.0)  # TF32 off: 2 ms / 1 ms
    assert exact["speedup_vs_default_flags"] == pytest.approx(3.0)
    assert exact["torch_default_flags_reused"] is True  # same geometry, measured just before
    assert "speedup_vs_default_flags" not in default
    assert exact["peak_class"] == "exact" and default["peak_class"] == "tf32" and bf16["peak_class"] == "bf16"
    assert bf16["engine"] == "torch" and bf16["output_layout_matches"]
    for r in timing_rows:
        assert r["max_abs_diff_vs_torch"] == 0.0  # backend torch against itself
        assert r["roofline_pct"] == pytest.approx(100 * max(r["mem_floor_us"], r["compute_floor_us"]) / 1000)
        assert r["tflops"] == pytest.approx(r["useful_flop"] / 1e-3 / 1e12)


class SequenceTimer(FakeTimer):
    """steady: the next of each side's sequence of medians (seconds)."""

    def __init__(self, ours, theirs):
        self.seq = {"ours": list(ours), "theirs": list(theirs)}

    def steady(self, fn):
        fn()
        return self.seq[fn.__name__].pop(0)


@pytest.mark.parametrize("ours,theirs,pairs,ratio", [
    ([1.0e-3, 1.01e-3], [2.0e-3, 2.02e-3], 1, 2.0),
    ([1.0e-3, 1.5e-3, 1.01e-3, 1.2e-3], [2.0e-3, 2.01e-3, 2.0e-3, 2.0e-3], 2, 2.0),  # ours swings 50%: one more pair
    ([1e-3] * 6, [3e-3, 2.8e-3, 2.6e-3, 2.4e-3, 2.2e-3, 2e-3], runner.MAX_ABBA, 2.0),  # PyTorch never settles
], ids=["steady-one-pair", "noisy-ours-second-pair", "noisy-torch-capped"])
def test_rounds_repeat_while_noisy_and_keep_the_lowest(ours, theirs, pairs, ratio):
    rows, failures = runner.run_cases(TINY_CASES[:1], "fwd", "torch", H200, runner.TimingSettings(), device="cpu",
                                      timer=SequenceTimer(ours, theirs))
    assert failures == []
    (row,) = rows
    assert len(row["round_us"]["convt3d"]) == len(row["round_us"]["torch"]) == 2 * pairs
    assert row["convt3d_us"] == pytest.approx(min(row["round_us"]["convt3d"]))
    assert row["speedup"] == pytest.approx(ratio)


def test_exact_row_measures_default_flags_when_alone():
    rows, _ = runner.run_cases(TINY_CASES[1:2], "fwd", "torch", H200, runner.TimingSettings(), device="cpu",
                               timer=FakeTimer())
    assert rows[0]["torch_default_flags_reused"] is False
    assert rows[0]["speedup_vs_default_flags"] == pytest.approx(3.0)


def test_failing_backend_becomes_a_failure_row():
    rows, failures = runner.run_cases(TINY_CASES[:1], "fwd", "conv3d", H200, runner.TimingSettings(), device="cpu",
                                      timer=FakeTimer())
    assert rows == [] and len(failures) == 1
    assert "BackendUnavailableError" in failures[0]["error"]


@pytest.mark.parametrize("mode", ["bwd", "full"])
def test_training_modes_exist(mode):
    # Their row logic is tested in tests/unit/test_training.py.
    assert runner.get_mode(mode).needs_grad and runner.get_mode(mode).name == mode
    with pytest.raises(ValueError, match="unknown mode"):
        runner.get_mode("sideways")


def test_summary(timing_rows):
    summary = {s["group"]: s for s in report.summarize(timing_rows)}
    assert set(summary) == {"kernelbench", "kernelbench tf32", "kernelbench tf32x3", "layers"}
    assert summary["kernelbench"]["geomean_speedup"] == pytest.approx(math.sqrt(6))
    assert summary["kernelbench"]["min_speedup"] == pytest.approx(2.0)
    assert summary["kernelbench"]["min_speedup_case"] == "tiny fp32 ncdhw tf32x3"
    assert summary["kernelbench tf32x3"]["geomean_speedup_vs_default_flags"] == pytest.approx(3.0)
    assert "geomean_speedup_vs_default_flags" not in summary["layers"]


def test_json_schema(timing_rows, tmp_path):
    env = report.environment(cuda=False)
    data = report.payload("timing", ["--suite", "all"], env, {"backend": "torch"}, timing_rows, [],
                          report.summarize(timing_rows), H200)
    path = tmp_path / "out" / "bench.json"
    report.write_json(path, data)
    loaded = json.loads(path.read_text())
    assert loaded["schema"] == report.SCHEMA and loaded["kind"] == "timing"
    assert {"environment", "settings", "ceilings", "rows", "failures", "summary", "argv", "created"} <= set(loaded)
    for key in ("torch", "triton", "convt3d", "cudnn", "gpu", "python", "source_digest"):
        assert key in loaded["environment"]
    assert loaded["environment"]["source_digest"] == report.source_digest()
    assert loaded["ceilings"]["tf32_flops_per_s"] == 374e12
    assert loaded["ceilings"]["exact_grade_flops_per_s"] == pytest.approx(374e12 / 3)
    row_keys = {"case", "suite", "dtype", "layout", "precision", "geometry", "engine", "convt3d_us", "torch_us",
                "speedup", "tflops", "mem_floor_us", "compute_floor_us", "roofline_pct", "first_call_s",
                "useful_flop", "min_bytes", "bound", "max_abs_diff_vs_torch"}
    for row in loaded["rows"]:
        assert row_keys <= set(row)
    assert {"torch_default_flags_us", "speedup_vs_default_flags"} <= set(loaded["rows"][1])


def test_source_digest_follows_the_sources(tmp_path):
    import shutil

    import convt3d

    copy = tmp_path / "convt3d"
    shutil.copytree(Path(convt3d.__file__).resolve().parent, copy)
    before = report.source_digest(copy)
    assert len(before) == 12 and before == report.source_digest(copy) == report.source_digest()
    (copy / "core" / "params.py").write_text((copy / "core" / "params.py").read_text() + "\n# changed\n")
    assert report.source_digest(copy) != before


def test_json_writes_nan_as_null(tmp_path):
    path = tmp_path / "nan.json"
    report.write_json(path, report.payload("timing", [], {}, {}, [{"x": math.nan}], [], []))
    assert json.loads(path.read_text())["rows"] == [{"x": None}]


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain-text-without-rich"])
def test_tables_render(timing_rows, rich, monkeypatch, capsys):
    import io

    if not rich:  # None in sys.modules makes `import` raise ImportError, installed or not
        for m in ("rich", "rich.console", "rich.table", "rich.progress"):
            monkeypatch.setitem(sys.modules, m, None)
    buf = io.StringIO()
    console = report.make_console(buf)
    assert isinstance(console, report.PlainConsole) is not rich
    report.print_header(console, report.environment(cuda=False), H200)
    report.print_timing_table(console, timing_rows, "t")
    report.print_summary(console, report.summarize(timing_rows))
    text = buf.getvalue()
    assert "tiny" in text and "3.00x" in text and "ceilings" in text
    if not rich:
        assert "[bold]" not in text and "[/" not in text  # markup stripped
        assert capsys.readouterr().err.strip() == "rich is not installed: plain-text tables (pip install rich)"


def test_plot(timing_rows, tmp_path):
    path = tmp_path / "bench.png"
    report.write_plot(path, timing_rows, "test")
    assert path.stat().st_size > 1000


# ---- command line --------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--mode", "sideways"], "invalid choice"),
    (["--case", "kb99"], "unknown case"),
    (["--suite", "layers", "--precision", "tf32x3"], "no case matches"),
    (["--precision", "ieee"], "invalid choice(s) 'ieee' (choose from tf32, tf32x3)"),
    (["--jobs", "0"], "--jobs: expected a positive integer"),
], ids=["unknown-mode", "unknown-case", "nothing-selected", "unknown-precision", "no-jobs"])
def test_cli_usage_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_list(capsys):
    assert cli.main(["--list", "--case", "kb77"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["kernelbench  kb77 fp32 ncdhw tf32",
                                                        "kernelbench  kb77 fp32 ncdhw tf32x3"]


# ---- one precision vocabulary: the library's tf32 / tf32x3 -----------------------------------------
@pytest.mark.parametrize("old, new", [("default", "tf32"), ("exact", "tf32x3")], ids=["default-is-tf32",
                                                                                  "exact-is-tf32x3"])
def test_cli_takes_the_old_spelling_with_a_deprecation_warning(old, new, capsys):
    with pytest.warns(DeprecationWarning, match=f"{old!r} is deprecated; use {new!r}"):
        assert cli.main(["--list", "--case", "kb77", "--precision", old]) == 0
    assert capsys.readouterr().out.split() == ["kernelbench", "kb77", "fp32", "ncdhw", new]


@pytest.mark.parametrize("old, new", [("default", "tf32"), ("exact", "tf32x3")], ids=["default-is-tf32",
                                                                                  "exact-is-tf32x3"])
def test_tune_takes_the_old_spelling_with_a_deprecation_warning(old, new, capsys):
    from convt3d.bench import tune_suites

    with pytest.warns(DeprecationWarning, match=f"use {new!r}"):
        assert tune_suites.main(["--list", "--case", "kb61", "--precision", old]) == 0
    assert capsys.readouterr().out.split() == ["kernelbench", "kb61", "fp32", "ncdhw", new]


def test_python_callers_of_the_suites_get_the_new_names_with_a_warning():
    with pytest.warns(DeprecationWarning, match="'exact' is deprecated"):
        cases = suites.select("kernelbench", ["kb77"], precisions=["exact"])
    assert [c.precision for c in cases] == ["tf32x3"] and not cases[0].allow_tf32
    with pytest.warns(DeprecationWarning, match="'default' is deprecated"):
        case = Case("layers", TINY, "fp32", "ncdhw", "default", "randn")
    assert case.precision == "tf32" and case.allow_tf32 and case.label == "tiny fp32 ncdhw tf32"


def test_help_names_the_suites_defaults_and_examples(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for suite, text in cli.SUITE_HELP.items():
        assert f"  {suite:<12} {text}" in out
    assert "examples:" in out and "convt3d bench --suite kernelbench --precision tf32x3" in out
    assert "--precision {tf32,tf32x3}" in out and "(default: auto)" in out and "(default: 60.0)" in out
    assert "(default: None)" not in out and "(default: False)" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check is the no-CUDA mode")
def test_cli_interpreter_check(tmp_path):
    """End to end: in-process under TRITON_INTERPRET=1 (CI), otherwise through the re-run."""
    path = tmp_path / "check.json"
    rc = cli.main(["--case", "kb77", "--precision", "tf32", "--jobs", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["kind"] == "interpreter-check" and data["ceilings"] is None
    (row,) = data["rows"]
    assert (row["case"], row["engine"], row["reduced_geometry"]["batch"]) == ("kb77", "triton tf32", 1)
    assert row["max_abs_err"] >= 0 and row["bar"] > 0 and isinstance(row["ok"], bool)
    assert rc == (0 if row["ok"] else 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check is the no-CUDA mode")
def test_cli_reruns_itself_with_the_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC
    path = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "convt3d", "bench", "--case", "aniso_122", "--dtype", "fp32",
                           "--layout", "cl", "--jobs", "1", "--json", str(path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert "re-running with TRITON_INTERPRET=1" in proc.stderr
    assert "timings need a GPU" in proc.stdout
    data = json.loads(path.read_text())
    assert data["environment"]["env"]["TRITON_INTERPRET"] == "1"
    assert proc.returncode == (0 if data["rows"][0]["ok"] else 1), proc.stdout + proc.stderr


def test_interpreter_check_in_worker_processes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned workers import triton afresh
    cases = suites.select("layers", ["aniso_122"], ["fp32"])
    rows, failures = check.run_checks(cases, jobs=2)
    assert failures == []
    assert [(r["layout"], r["engine"]) for r in rows] == [("ncdhw", "triton tf32"), ("cl", "triton tf32")]


@requires_interpreter
@pytest.mark.parametrize("layout", ["ncdhw", "cl"])
def test_interpreter_check_passes_the_output_heads(layout):
    """The head rows (1-8 output channels; a one-channel output is dense in both layouts at once)
    meet the check's error bar and its layout test in both layouts."""
    cases = [c for c in suites.select("layers", None, ["fp32"], [layout]) if c.name.startswith("head_")]
    assert len(cases) == 6
    for case in cases:
        row = check.check_case(case)
        assert row["layout_ok"] and row["ok"], (case.label, row)


def test_measure_ceilings_arithmetic(monkeypatch):
    """The GPU measuring code, on CPU at toy sizes, with do_bench returning 1 ms per call."""
    import triton.testing

    tf32_flag_seen = []

    def fake_do_bench(fn, warmup, rep, return_mode):
        fn()
        tf32_flag_seen.append(torch.backends.cuda.matmul.allow_tf32)
        return 1.0

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(roofline, "COPY_BYTES", 4096)
    monkeypatch.setattr(roofline, "MATMUL_SIZE", 32)
    before = torch.backends.cuda.matmul.allow_tf32
    c = roofline.measure_ceilings("cpu")
    assert c.copy_bytes_per_s == pytest.approx(2 * 4096 / 1e-3)  # read + write bytes
    for flops in (c.bf16_flops_per_s, c.tf32_flops_per_s, c.fp32_flops_per_s):
        assert flops == pytest.approx(2 * 32 ** 3 / 1e-3)
    assert tf32_flag_seen[1:] == [False, True, False]  # bf16, tf32, exact fp32
    assert torch.backends.cuda.matmul.allow_tf32 is before
