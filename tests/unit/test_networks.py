"""CPU tests of the networks suite (``convt3d bench --suite networks``): the in-project networks'
layouts, every network at its tiny size patched (Triton interpreter) against untouched and
float64, the row logic with a fake timer, the ConvTranspose3d share, skips for missing extras, and
the CLI. The GPU side is tests/gpu/test_gpu_networks.py."""
from __future__ import annotations

import importlib.util
import io
import json
import statistics
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.autograd import DeviceType

from conftest import requires_interpreter
from convt3d.bench import cli, networks, report, stats, suites
from convt3d.bench.networks import NET_MODES, NetMode


def _net(name: str) -> networks.Network:
    return networks.select_networks([name])[0]


def _skip_if_unavailable(net: networks.Network) -> None:
    reason = networks.unavailable_reason(net)
    if reason is not None:
        pytest.skip(reason)


def _convt_layers(model: nn.Module) -> list[nn.ConvTranspose3d]:
    return [m for m in model.modules() if isinstance(m, nn.ConvTranspose3d)]


# ---- the in-project networks follow their published layouts -------------------------------------
def test_gan3d_layout_is_the_papers():
    model, x = networks.build_network(_net("gan3d"), "meta")
    assert tuple(x.shape) == (32, 200, 1, 1, 1)
    layers = [(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.bias is None)
              for m in _convt_layers(model)]
    assert layers == [(200, 512, (4,) * 3, (1,) * 3, (0,) * 3, True)] + [
        (a, b, (4,) * 3, (2,) * 3, (1,) * 3, True) for a, b in ((512, 256), (256, 128), (128, 64), (64, 1))]
    assert sum(isinstance(m, nn.BatchNorm3d) for m in model.modules()) == 4
    assert isinstance(model.net[-1], nn.Sigmoid)
    with torch.no_grad():
        assert tuple(model.eval()(x).shape) == (32, 1, 64, 64, 64)


def test_vqvae_decoder_layers_are_the_layer_suites():
    """The decoder's first up-convolution is the layers suite's videogpt_k4s2p3 (same input after
    the same-padding, same arguments); the second is its 3-channel head."""
    model, x = networks.build_network(_net("vqvae_video"), "meta")
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, a: seen.append((mod, tuple(a[0].shape))))
             for m in _convt_layers(model)]
    with torch.no_grad():
        y = model.eval()(x)
    for h in hooks:
        h.remove()
    assert tuple(x.shape) == (4, 240, 8, 32, 32) and tuple(y.shape) == (4, 3, 32, 128, 128)
    g = {g.name: g for g in suites.LAYERS}["videogpt_k4s2p3"]
    (first, first_in), (head, head_in) = seen
    assert first_in == (g.batch, g.in_channels) + g.in_size
    assert (first.out_channels, first.kernel_size, first.stride, first.padding, first.bias is not None) == \
        (g.out_channels, g.kernel, g.stride, g.padding, g.bias)
    assert (head.in_channels, head.out_channels, head.kernel_size, head.stride, head.padding) == \
        (240, 3, (4,) * 3, (2,) * 3, (3,) * 3)
    assert head_in == (4, 240, 18, 66, 66)
    blocks = [m for m in model.modules() if isinstance(m, networks.AxialAttention3d)]
    assert len(blocks) == 4 and all(b.heads == 2 for b in blocks)


@pytest.mark.parametrize("upsample, size", [((2, 2, 2), (3, 4, 5)), ((2, 4, 4), (1, 2, 3)), ((1, 2, 8), (2, 2, 1)),
                                            ((8, 1, 1), (1, 3, 3))],
                         ids=["iso-x2", "aniso-2-4-4", "aniso-1-2-8", "time-only-x8"])
def test_video_decoder_upsamples_exactly(upsample, size):
    model = networks.VideoDecoder(8, 1, 2, upsample, 3).eval()
    x = torch.randn(1, 8, *size)
    with torch.no_grad():
        y = model(x)
    assert tuple(y.shape) == (1, 3) + tuple(s * u for s, u in zip(size, upsample))


@pytest.mark.parametrize("upsample", [(3, 2, 2), (1, 1, 1), (2, 2)], ids=["not-power-of-2", "no-upsampling",
                                                                             "two-axes"])
def test_video_decoder_rejects_bad_upsample(upsample):
    with pytest.raises(ValueError, match="upsample must be three powers of 2"):
        networks.VideoDecoder(8, 1, 2, upsample)


def test_axial_attention_needs_divisible_heads():
    with pytest.raises(ValueError, match="divisible by heads"):
        networks.AxialAttention3d(10, 4)


def test_gan3d_accepts_a_flat_latent():
    model = networks.GAN3DGenerator(8, (8,), 1).eval()
    z = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(z), model(z[:, :, None, None, None]))


# ---- every network at its tiny size: patched (Triton, interpreter) vs untouched vs float64 -------
@requires_interpreter
@pytest.mark.parametrize("name", networks.network_names(), ids=networks.network_names())
def test_network_tiny_patched_matches_untouched(name):
    net = _net(name)
    _skip_if_unavailable(net)
    rows, failures, _ = networks.check_networks([net])
    assert failures == [], failures
    (row,) = rows
    assert row["convt_layers"] > 0 and row["convt_layers_patched"] == row["convt_layers"], row
    assert row["output_layout_matches"] and row["precision"] == "tf32x3", row
    assert row["within_error_budget"], (f"{name}: patched error {row['rel_err_vs_reference']:.3g} vs float64, "
                                        f"untouched {row['torch_rel_err_vs_reference']:.3g}")
    assert row["ok"]


# ---- MONAI's MetaTensor through a patched network ------------------------------------------------
@pytest.mark.parametrize("backend", [None, pytest.param("triton", marks=requires_interpreter)],
                         ids=["auto", "triton"])
def test_a_metatensor_keeps_its_type_and_metadata_through_a_patched_monai_unet(backend):
    """MONAI networks fed a MetaTensor pass it through every layer; a patched layer hands it on
    as PyTorch's op does (the subclass's __torch_function__ wraps our result), so the output is a
    MetaTensor with the input's affine, and equal to the untouched network's."""
    monai_data = pytest.importorskip("monai.data")
    from monai.networks.nets import UNet

    import convt3d

    torch.manual_seed(0)
    model = UNet(3, 1, 2, (4, 8), (2,), num_res_units=0).eval()
    patched = convt3d.patch(UNet(3, 1, 2, (4, 8), (2,), num_res_units=0).eval(), backend=backend,
                            precision="ieee" if backend else None)
    patched.load_state_dict(model.state_dict())
    x = monai_data.MetaTensor(torch.randn(1, 1, 8, 8, 8), affine=torch.diag(torch.tensor([2.0, 3.0, 4.0, 1.0])))
    with torch.no_grad():
        y, y_ref = patched(x), model(x)
    assert type(y) is type(y_ref) is monai_data.MetaTensor
    assert torch.equal(y.affine, y_ref.affine)
    torch.testing.assert_close(y.as_tensor(), y_ref.as_tensor(), rtol=1e-5, atol=1e-5)


# ---- the row logic on CPU with a fake timer --------------------------------------------------------
class FakeTimer:
    """first_call: runs fn, 0.25 s. paired: runs both, then pair i is (untouched, patched) =
    ``times[2i]``, ``times[2i + 1]`` (cycled) seconds per call."""

    def __init__(self, times):
        self.times, self.released, self.pairs = list(times), 0, []

    def first_call(self, fn):
        return fn(), 0.25

    def paired(self, fn_a, fn_b, pairs):
        fn_a(), fn_b()
        self.pairs.append(pairs)
        n = len(self.times)
        return ([self.times[2 * i % n] for i in range(pairs)], [self.times[(2 * i + 1) % n] for i in range(pairs)])

    def release(self):
        self.released += 1


ROW_FIELDS = {"case", "suite", "source", "description", "mode", "dtype", "autocast", "layout", "precision",
              "cudnn_allow_tf32", "backend", "input_shape", "parameters", "convt_layers", "convt_layers_patched",
              "engine", "torch_first_call_s", "first_call_s", "torch_us", "convt3d_us", "speedup",
              "speedup_quartiles", "torch_us_rounds",
              "convt3d_us_rounds", "convt_share", "convt_us", "forward_kernel_us", "max_abs_diff_vs_torch",
              "max_abs_torch", "reference", "reference_s", "rel_err_vs_reference", "torch_rel_err_vs_reference",
              "within_error_budget", "output_layout_matches"}


@pytest.fixture(scope="module")
def gan_rows():
    # Untouched 3 ms, patched 1 ms in every pair: ratio 3.
    timer = FakeTimer([3e-3, 1e-3])
    rows, failures, skipped = networks.run_networks([_net("gan3d")], list(NET_MODES), "auto", device="cpu",
                                                    timer=timer, tiny=True)
    return rows, failures, skipped, timer


@pytest.mark.parametrize("times,ratio,quartiles", [
    ([3e-3, 1e-3], 3.0, (3.0, 3.0)),
    # The host swings by 2x between pairs and hits both sides of a pair alike: the lowest of each
    # side (3 ms untouched, 1 ms patched, from different pairs) would read 3x; the pairs say 2x.
    ([4e-3, 1e-3, 3e-3, 1.5e-3, 4e-3, 2e-3, 8e-3, 4e-3], 2.0, (2.0, 2.5)),
], ids=["steady-host", "swinging-host-pairs-cancel-it"])
def test_the_ratio_is_the_median_of_the_pairs(times, ratio, quartiles):
    timer = FakeTimer(times)
    rows, failures, _ = networks.run_networks([_net("gan3d")], [NET_MODES[0]], "auto", device="cpu",
                                              timer=timer, tiny=True, rounds=4)
    assert not failures
    (r,) = rows
    assert timer.pairs == [4]
    assert len(r["torch_us_rounds"]) == len(r["convt3d_us_rounds"]) == 4
    assert r["speedup"] == pytest.approx(ratio)
    assert r["speedup_quartiles"] == pytest.approx(list(quartiles))
    assert r["torch_us"] == pytest.approx(statistics.median(r["torch_us_rounds"]))
    assert r["convt3d_us"] == pytest.approx(statistics.median(r["convt3d_us_rounds"]))


@pytest.mark.parametrize("a,b,expected", [
    ([2.0], [1.0], (2.0, 2.0, 2.0)),
    ([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 1.0, 1.0, 1.0], (3.0, 2.0, 4.0)),
    ([10.0, 1.0, 10.0], [5.0, 2.0, 1.0], (2.0, 1.25, 6.0)),
], ids=["one-pair", "five-pairs", "outlier-pair"])
def test_paired_ratio(a, b, expected):
    assert stats.paired_ratio(a, b) == pytest.approx(expected)


@pytest.mark.parametrize("a,b", [([], []), ([1.0], [1.0, 2.0])], ids=["empty", "unequal"])
def test_paired_ratio_rejects_unpaired_lists(a, b):
    with pytest.raises(ValueError, match="paired_ratio: expected two equal-length non-empty lists"):
        stats.paired_ratio(a, b)


def test_rows_have_the_fields_and_the_ratio(gan_rows):
    rows, failures, skipped, timer = gan_rows
    assert not failures, failures and failures[0]["traceback"]
    assert skipped == []
    assert [(r["mode"], r["dtype"]) for r in rows] == [("infer", "fp32"), ("infer", "bf16"), ("train", "bf16")]
    assert timer.released == 1
    for r in rows:
        missing = ROW_FIELDS - set(r)
        assert not missing, missing
        assert r["suite"] == "networks" and r["source"] == "convt3d"
        assert r["speedup"] == pytest.approx(3.0) and r["torch_us"] == pytest.approx(3e3)
        assert r["convt3d_us"] == pytest.approx(1e3)
        assert r["torch_us_rounds"] == pytest.approx([3e3] * networks.DEFAULT_PAIRS)
        assert r["convt3d_us_rounds"] == pytest.approx([1e3] * networks.DEFAULT_PAIRS)
        assert r["first_call_s"] == r["torch_first_call_s"] == 0.25
        assert r["convt_layers"] == r["convt_layers_patched"] == 2
        assert 0 < r["convt_share"] <= 1 and r["convt_us"] <= r["forward_kernel_us"]
        # On CPU "auto" runs PyTorch: the patched layers compute what the untouched ones do.
        assert r["engine"] == "torch 2"
        assert r["within_error_budget"]
    infer32, infer16, train = rows
    assert infer32["reference"] == infer16["reference"] == "float64"
    assert train["reference"] == "fp32 step, TF32 off"
    assert infer32["output_shape"] == [2, 1, 8, 8, 8] and {"loss", "torch_loss", "reference_loss"} <= set(train)
    assert infer32["rel_err_vs_reference"] < 1e-5 < infer16["rel_err_vs_reference"] < 1e-1
    # bf16 gradients against the fp32 step: rounding-sized, for all of them and for the convT weights.
    assert 1e-4 < train["rel_err_vs_reference"] < 1e-1 and 1e-4 < train["convt_grad_rel_err"] < 1e-1
    assert train["loss"] == pytest.approx(train["reference_loss"], rel=1e-2)


def test_rows_record_the_patched_profile_and_the_layer_decisions(gan_rows):
    rows = gan_rows[0]
    for r in rows:
        assert r["convt_us_patched"] <= r["forward_kernel_us_patched"]
        assert len(r["layer_decisions"]) == 2 and all(d.startswith("torch: auto") for d in r["layer_decisions"])


@pytest.mark.parametrize("mode", [NetMode("infer", "fp32"), NetMode("train", "fp32")], ids=["infer", "train"])
def test_tune_option_runs_convt3d_tune_first(mode):
    # On the CPU tune has nothing to measure and no network check (no CUDA): the row says so.
    rows, failures, _ = networks.run_networks([_net("gan3d")], [mode], "auto", device="cpu",
                                              timer=FakeTimer([1.0]), tiny=True, tune=True)
    assert not failures, failures[0]["traceback"]
    (r,) = rows
    assert r["tune_s"] > 0 and r["network_check"] is None and r["within_error_budget"]


@pytest.mark.parametrize("name", networks.network_names(), ids=networks.network_names())
def test_training_step_of_every_network(name):
    """The training step runs on every network, parameters the forward leaves unused included
    (nnU-Net's deep-supervision heads, MONAI's cross-attention norms get zero gradients). In fp32:
    PyTorch's bf16 CPU convolution backward (mkldnn, torch 2.13) returned a weight gradient of
    ~1e29 in one of four identical UNETR steps here, so bf16 steps are left to the GPU tests."""
    net = _net(name)
    _skip_if_unavailable(net)
    rows, failures, _ = networks.run_networks([net], [NetMode("train", "fp32")], device="cpu",
                                              timer=FakeTimer([1.0]), tiny=True, measure=False)
    assert not failures, failures[0]["traceback"]
    (r,) = rows
    # On the CPU, auto runs PyTorch and the reference is the same fp32 step: no error at all.
    assert r["rel_err_vs_reference"] == r["torch_rel_err_vs_reference"] == 0.0, r
    assert r["convt_grad_rel_err"] == 0.0 and r["loss"] == r["reference_loss"] and r["within_error_budget"]


def test_rows_go_through_summary_table_json_and_plot(gan_rows, tmp_path):
    rows = gan_rows[0]
    summary = report.summarize(rows)
    groups = {s["group"]: s for s in summary}
    assert {"networks", "networks fp32", "networks bf16", "networks infer", "networks train"} <= set(groups)
    assert groups["networks"]["geomean_speedup"] == pytest.approx(3.0)
    assert groups["networks"]["min_speedup_case"] == "gan3d infer fp32"
    console = report.make_console(io.StringIO())
    report.print_network_table(console, rows, "networks")
    report.print_summary(console, summary)
    report.print_failures(console, [], [{"case": "monai_unet", "reason": "needs monai"}])
    text = console.file.getvalue()
    assert "gan3d" in text and "3.00x" in text and "skipped monai_unet: needs monai" in text
    path = tmp_path / "n.json"
    report.write_json(path, report.payload("timing", ["--suite", "networks"], {"convt3d": "x"}, {}, rows, [],
                                           summary, skipped=[{"case": "monai_unet", "reason": "needs monai"}]))
    data = json.loads(path.read_text())
    assert data["skipped"] == [{"case": "monai_unet", "reason": "needs monai"}]
    assert data["rows"][0]["speedup"] == pytest.approx(3.0)
    assert data["summary"][0]["geomean_roofline_pct"] is None  # networks have no roofline
    png = tmp_path / "n.png"
    report.write_plot(png, rows, "networks")
    assert png.stat().st_size > 0


def test_measure_false_only_compares():
    class NoSteady(FakeTimer):
        def paired(self, fn_a, fn_b, pairs):
            raise AssertionError("measure=False must not time")

    rows, failures, _ = networks.run_networks([_net("vqvae_video")], [NetMode("infer", "fp32")], device="cpu",
                                              timer=NoSteady([1.0]), tiny=True, measure=False)
    assert not failures and len(rows) == 1
    assert rows[0]["within_error_budget"] and "speedup" not in rows[0] and "convt_share" not in rows[0]


def test_a_failing_network_is_a_failure_entry(monkeypatch):
    def broken(tiny):
        raise RuntimeError("cannot build")

    net = networks.Network("broken", "raises", None, (), broken)
    rows, failures, skipped = networks.run_networks([net, _net("gan3d")], [NetMode("infer", "fp32")], device="cpu",
                                                    timer=FakeTimer([1e-3]), tiny=True)
    assert [f["case"] for f in failures] == ["broken"] and "RuntimeError: cannot build" in failures[0]["error"]
    assert [r["case"] for r in rows] == ["gan3d"] and skipped == []


# ---- the ConvTranspose3d share ----------------------------------------------------------------------
def _event(name, parent=None, device_type=DeviceType.CPU, device_us=0.0, cpu_us=0.0):
    return SimpleNamespace(name=name, cpu_parent=parent, device_type=device_type, is_async=False,
                           device_time_total=device_us, cpu_time_total=cpu_us)


def test_share_counts_the_outermost_transposed_op_once():
    top = _event("aten::conv_transpose3d", device_us=30.0, cpu_us=5.0)
    inner = _event("aten::cudnn_convolution_transpose", parent=top, device_us=30.0, cpu_us=4.0)
    conv = _event("aten::conv3d", device_us=60.0, cpu_us=3.0)
    kernels = [_event(k, device_type=DeviceType.CUDA, device_us=us) for k, us in
               (("convT_kernel", 25.0), ("cast_kernel", 5.0), ("conv_kernel", 70.0))]
    share, part, total = networks.transposed_share([top, inner, conv] + kernels, "cuda")
    assert (part, total) == (30.0, 100.0) and share == pytest.approx(0.3)
    share_cpu, part_cpu, total_cpu = networks.transposed_share([top, inner, conv], "cpu")
    assert (part_cpu, total_cpu) == (5.0, 8.0)


def test_share_of_a_real_profile():
    convt = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.ConvTranspose3d(4, 2, 2, 2)).eval()
    plain = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(1, 2, 6, 6, 6)
    with torch.no_grad():
        share, part, total = networks._profile_share(lambda: convt(x), "cpu")
        assert 0 < share < 1 and 0 < part < total
        assert networks._profile_share(lambda: plain(x), "cpu")[0] == 0.0


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_interpreter)],
                         ids=["torch-engine", "triton-engine-interpreted"])
def test_patched_layers_are_ops_of_the_profile(backend):
    # An eager convt3d call is one "convt3d::conv_transpose3d" op under a profiler, whichever
    # engine runs inside (Triton's kernels launch outside any aten op), counted once.
    import copy

    import convt3d

    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.ConvTranspose3d(4, 2, 2, 2)).eval()
    patched = convt3d.patch(copy.deepcopy(model), backend=backend)
    x = torch.randn(1, 2, 4, 4, 4)
    with torch.no_grad():
        share, part, total = networks._profile_share(lambda: patched(x), "cpu")
        assert 0 < share < 1 and 0 < part < total
        from torch.profiler import profile
        with profile() as prof:
            patched(x)
    names = [e.name for e in prof.events()]
    assert names.count(convt3d.engines.op.OP_NAME) == 1


def test_error_budget():
    assert networks._budget_ok(2e-3, 1e-3, "bf16") and not networks._budget_ok(2.1e-3, 1e-3, "fp32")
    # A reference without error still allows one unit of the dtype's epsilon.
    assert networks._budget_ok(1e-7, 0.0, "fp32") and not networks._budget_ok(1e-6, 0.0, "fp32")
    assert networks._budget_ok(7e-3, 0.0, "bf16")
    assert networks.normwise_error([torch.tensor([3.0]), torch.tensor([0.0])],
                                   [torch.tensor([0.0]), torch.tensor([4.0])]) == pytest.approx(1.25)
    assert networks.relative_error(torch.tensor([1.0, -10.0]), torch.tensor([1.5, -10.0])) == pytest.approx(0.05)


# ---- selection --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, dtypes, expected", [
    (None, None, ["infer fp32", "infer bf16", "train bf16"]),
    ("fwd", None, ["infer fp32", "infer bf16"]),
    ("full", None, ["train bf16"]),
    ("fwd", ["bf16"], ["infer bf16"]),
    ("full", ["fp32"], []),
], ids=["all", "fwd", "full", "fwd-bf16", "full-fp32-empty"])
def test_select_modes(mode, dtypes, expected):
    assert [m.label for m in networks.select_modes(mode, dtypes)] == expected


def test_select_rejects_unknown():
    with pytest.raises(ValueError, match="not a network mode"):
        networks.select_modes("bwd")
    with pytest.raises(ValueError, match="unknown network 'nope'; expected one of gan3d"):
        networks.select_networks(["nope"])
    assert [n.name for n in networks.select_networks(["monai_unet", "gan3d"])] == ["gan3d", "monai_unet"]


# ---- missing optional extras: a one-line reason, never a traceback ---------------------------------
def _block_imports(monkeypatch, *modules):
    # None in sys.modules makes `import` raise ImportError, whether the package is installed or not.
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


@pytest.mark.parametrize("name, blocked", [
    ("monai_unet", ("monai", "monai.networks", "monai.networks.nets")),
    ("monai_unetr", ("einops",)),
    ("nnunet_plainconv", ("dynamic_network_architectures", "dynamic_network_architectures.architectures",
                          "dynamic_network_architectures.architectures.unet")),
], ids=["monai", "einops", "dynamic-network-architectures"])
def test_missing_extra_is_a_skip_with_a_reason(monkeypatch, name, blocked):
    _block_imports(monkeypatch, *blocked)
    net = _net(name)
    reason = networks.unavailable_reason(net)
    assert reason is not None and "\n" not in reason
    # UNETR needs monai first: where monai itself is absent (CI), that is the reason named.
    first = blocked[0] if name != "monai_unetr" or importlib.util.find_spec("monai") is not None else "monai"
    assert reason.startswith(f"needs {first} (pip install -e '.[networks]')")
    rows, failures, skipped = networks.run_networks([net], list(NET_MODES), device="cpu", timer=FakeTimer([1.0]),
                                                    tiny=True)
    assert rows == [] and failures == [] and skipped == [{"case": name, "reason": reason}]
    rows, failures, skipped = networks.check_networks([net])
    assert rows == [] and failures == [] and skipped == [{"case": name, "reason": reason}]


def test_cli_says_what_is_skipped(monkeypatch, capsys, tmp_path):
    _block_imports(monkeypatch, "monai", "monai.networks", "monai.networks.nets")
    assert cli.main(["--suite", "networks", "--list", "--case", "monai_dynunet"]) == 0
    out = capsys.readouterr().out
    assert "monai_dynunet" in out and "[skipped: needs monai" in out
    if not torch.cuda.is_available():
        path = tmp_path / "skip.json"
        assert cli.main(["--suite", "networks", "--case", "monai_dynunet", "--json", str(path)]) == 0
        captured = capsys.readouterr()
        assert "Traceback" not in captured.out + captured.err
        assert "skipped monai_dynunet: needs monai" in captured.out
        assert json.loads(path.read_text())["skipped"][0]["case"] == "monai_dynunet"


# ---- CLI --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--suite", "networks", "--mode", "bwd"], "not a network mode"),
    (["--suite", "networks", "--mode", "full", "--dtype", "fp32"], "no network mode matches"),
    (["--suite", "networks", "--layout", "cl"], "runs ncdhw only"),
    (["--suite", "networks", "--precision", "tf32x3"], "runs tf32 only"),
    (["--suite", "networks", "--case", "kb77"], "unknown network 'kb77'"),
], ids=["bwd", "full-fp32", "layout", "precision", "layer-name"])
def test_cli_usage_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_lists_every_network(capsys):
    assert cli.main(["--suite", "networks", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in networks.network_names())


@requires_interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU check runs where there is no GPU")
def test_cli_cpu_check_end_to_end(tmp_path, capsys):
    path = tmp_path / "check.json"
    assert cli.main(["--suite", "networks", "--case", "vqvae_video", "--json", str(path), "--plot",
                     str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "timings need a GPU" in out and "--plot skipped" in out
    data = json.loads(path.read_text())
    assert data["kind"] == "interpreter-check" and data["summary"]["passed"] == 1
    (row,) = data["rows"]
    assert row["case"] == "vqvae_video" and row["ok"] and row["backend"] == "triton"


@pytest.fixture
def fake_gpu(monkeypatch):
    """The CLI's device check says CUDA, and the environment record is a fixed fake GPU's."""
    import functools

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(report, "environment", functools.partial(dict, convt3d="0.1.0", git_commit=None,
                                                                 torch="t", triton="t", cuda=None, cudnn=None,
                                                                 gpu="fake GPU", gpu_capability="9.0", sm_count=1))


def test_cli_timing_path_with_a_fake_gpu(fake_gpu, monkeypatch, tmp_path, capsys):
    """The GPU branch of the CLI (table, summary, JSON rewritten per network, plot), driven on the
    CPU: the device check and the environment are faked, the networks run tiny with a fake timer."""
    written = []
    real_run = networks.run_networks

    def run(*args, on_network=None, **kwargs):
        def spy(rows, failures, skipped):
            on_network(rows, failures, skipped)
            written.append(json.loads(path.read_text()))
        return real_run(*args, device="cpu", timer=FakeTimer([2e-3, 1e-3]), tiny=True, on_network=spy, **kwargs)

    path = tmp_path / "t.json"
    monkeypatch.setattr(networks, "run_networks", run)
    rc = cli.main(["--suite", "networks", "--case", "gan3d,vqvae_video", "--mode", "fwd", "--json", str(path),
                   "--plot", str(tmp_path / "t.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gan3d" in out and "vqvae_video" in out and "2.00x" in out and "4/4 network modes timed" in out
    assert [len(w["rows"]) for w in written] == [2, 4] and not any(w["settings"]["complete"] for w in written)
    data = json.loads(path.read_text())
    assert data["settings"]["complete"] and data["settings"]["modes"] == ["infer fp32", "infer bf16"]
    assert len(data["rows"]) == 4 and data["summary"][0]["geomean_speedup"] == pytest.approx(2.0)
    assert (tmp_path / "t.png").stat().st_size > 0


def test_cli_plot_without_matplotlib_is_a_line(fake_gpu, monkeypatch, tmp_path, capsys):
    # Without matplotlib the timing run still writes its table and JSON; --plot says why it is skipped.
    for m in ("matplotlib", "matplotlib.pyplot", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, m, None)
    real_run = networks.run_networks
    monkeypatch.setattr(networks, "run_networks", lambda *a, **kw: real_run(
        *a, **dict(kw, device="cpu", timer=FakeTimer([2e-3, 1e-3]), tiny=True)))
    path, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = cli.main(["--suite", "networks", "--case", "gan3d", "--mode", "fwd", "--dtype", "fp32", "--json", str(path),
                   "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--plot skipped: matplotlib is not installed (pip install matplotlib)" in out and "2.00x" in out
    assert json.loads(path.read_text())["rows"] and not png.exists()


def test_cli_first_calls_with_a_fake_gpu(fake_gpu, monkeypatch, tmp_path, capsys):
    """--first-calls: first calls and agreement only (no steady timing, no profile), the extra
    first-call seconds of the patched model in the table and the JSON."""
    def run(*args, **kwargs):
        assert kwargs["measure"] is False
        return real_run(*args, device="cpu", timer=FakeTimer([2e-3, 1e-3]), tiny=True, **kwargs)

    real_run = networks.run_networks
    path = tmp_path / "first.json"
    monkeypatch.setattr(networks, "run_networks", run)
    rc = cli.main(["--suite", "networks", "--case", "gan3d", "--mode", "fwd", "--first-calls", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "first calls" in out and "extra s" in out and "2/2 network modes' first calls" in out
    data = json.loads(path.read_text())
    assert data["settings"]["first_calls"] and len(data["rows"]) == 2
    for r in data["rows"]:
        assert "torch_us" not in r  # no steady timing
        assert r["first_call_extra_s"] == pytest.approx(r["first_call_s"] - r["torch_first_call_s"])


def test_tf32_arithmetic_reference_rounds_the_transposed_conv_operands():
    # The fp32 budget's second term: float64 with each ConvTranspose3d's input and weight rounded
    # to TF32. Its error against plain float64 is TF32-sized, and the model is left untouched.
    from convt3d.bench.check import round_tf32

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ConvTranspose3d(8, 4, 2, stride=2), torch.nn.ReLU())
    x = torch.randn(1, 8, 3, 3, 3)
    before = model[0].weight.detach().clone()
    got = networks._tf32_arithmetic(model, x)
    conv = model[0]
    expect = torch.relu(torch.nn.functional.conv_transpose3d(
        round_tf32(x).double(), round_tf32(conv.weight.detach()).double(), conv.bias.double(), 2))
    assert torch.allclose(got, expect, rtol=0, atol=1e-12)
    exact = model.double()(x.double())
    assert 1e-6 < networks.relative_error(got, exact) < 1e-2
    assert torch.equal(model[0].weight.float(), before)


@pytest.mark.parametrize("argv,rounds", [([], networks.DEFAULT_PAIRS), (["--rounds", "5"], 5)],
                         ids=["default-pairs", "five-pairs"])
def test_cli_rounds_reach_the_timing(fake_gpu, monkeypatch, tmp_path, capsys, argv, rounds):
    """--rounds N: N pairs of timing blocks, untouched and patched back to back."""
    real_run = networks.run_networks
    timer = FakeTimer([2e-3, 1e-3])

    def run(*args, **kwargs):
        assert kwargs["rounds"] == rounds
        return real_run(*args, device="cpu", timer=timer, tiny=True, **kwargs)

    monkeypatch.setattr(networks, "run_networks", run)
    path = tmp_path / "r.json"
    rc = cli.main(["--suite", "networks", "--case", "gan3d", "--mode", "fwd", "--dtype", "fp32", "--json", str(path)]
                  + argv)
    assert rc == 0, capsys.readouterr().out
    row = json.loads(path.read_text())["rows"][0]
    assert len(row["torch_us_rounds"]) == len(row["convt3d_us_rounds"]) == rounds


def test_cli_rejects_rounds_below_one(capsys):
    assert cli.main(["--suite", "networks", "--rounds", "0"]) == 2
    assert "--rounds: expected a positive integer, got '0'" in capsys.readouterr().err
