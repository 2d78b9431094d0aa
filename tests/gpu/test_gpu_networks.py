"""GPU tests of the networks suite: every network at its bench size, ``convt3d.patch``-ed, agrees
with the untouched model within the project's error budget -- inference in fp32 and in bf16
autocast against float64, the bf16-autocast training step's gradients against the fp32 step with
TF32 off (``bench/networks.py`` says why) -- under "auto" and with the Triton engine forced on every
layer (so that the engine is exercised even where auto keeps PyTorch's call). Networks whose
package is not installed are skipped with the reason. CPU side: tests/unit/test_networks.py."""
from __future__ import annotations

import pytest
import torch

from convt3d.bench import networks

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("large_gpu_memory")]


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("name", networks.network_names(), ids=networks.network_names())
def test_network_patched_agrees_with_untouched(name, backend):
    net = networks.select_networks([name])[0]
    reason = networks.unavailable_reason(net)
    if reason is not None:
        pytest.skip(reason)
    rows, failures, skipped = networks.run_networks([net], list(networks.NET_MODES), backend, measure=False)
    assert not failures, "\n".join(f["traceback"] for f in failures)
    assert not skipped and len(rows) == len(networks.NET_MODES)
    bad = []
    for r in rows:
        assert r["convt_layers"] > 0 and r["convt_layers_patched"] == r["convt_layers"], r
        if not r["within_error_budget"]:
            bad.append(f"{r['mode']} {r['dtype']}: patched {r['rel_err_vs_reference']:.3g} vs {r['reference']}, "
                       f"untouched {r['torch_rel_err_vs_reference']:.3g} (max |patched - untouched| "
                       f"{r['max_abs_diff_vs_torch']:.3g} of {r['max_abs_torch']:.3g})")
    assert not bad, f"{name} backend={backend}: " + "; ".join(bad)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", ["gan3d", "vqvae_video"])
def test_tune_network_check_leaves_a_consistent_state(name, tmp_path, monkeypatch):
    # convt3d.tune with its network check on a real network (bf16 autocast inference, a private
    # cache): whatever it reverts decides PyTorch afterwards, in this process and from the cache
    # file in a later one, and the tuned model's output still agrees with the untouched one.
    import copy

    import convt3d
    from convt3d.dispatch import cache
    from convt3d.dispatch import select as dispatch

    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    dispatch.clear_decisions()
    cache.reset()
    net = networks.select_networks([name])[0]
    model, shape = net.build(False)
    model = model.cuda().eval()
    x = torch.randn(shape, device="cuda")
    patched = convt3d.patch(copy.deepcopy(model))
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        report = convt3d.tune(patched, x, progress=False)
        y = patched(x)
        y_ref = model(x)
    assert report.entries, "tune saw no convt3d call"
    if report.network is not None:
        assert report.network["final_ms"] <= report.network["torch_ms"] * (1 + 1e-9)
        reverted = set(report.network["reverted"])
        for e in report.entries:
            if e["signature"] in reverted:
                assert e["engine"] == "torch" and e["source"] == "network check"
        gpu = torch.cuda.get_device_name()
        cache.reset()
        for sig in reverted:
            entry = cache.load_decision(gpu, sig)
            assert entry is not None and entry["engine"] == "torch" and "network check" in entry["network"]
    err = (y.float() - y_ref.float()).abs().max().item()
    assert err <= 0.05 * y_ref.float().abs().max().item(), f"tuned output differs by {err:.3g}"
    dispatch.clear_decisions()
    cache.reset()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("pairs", [1, 4], ids=["one-pair", "four-pairs"])
def test_paired_timer_blocks_alternate_and_cover_every_call(pairs):
    # The networks suite's timer: ``pairs`` blocks per side, each a whole number of calls, the
    # order alternating; a block's time per call is a positive number of seconds.
    from convt3d.bench.runner import CudaTimer, TimingSettings

    x = torch.randn(1024, 1024, device="cuda")
    order: list[str] = []

    def a():
        order.append("a")
        return x @ x

    def b():
        order.append("b")
        return x + 1

    times_a, times_b = CudaTimer(TimingSettings()).paired(a, b, pairs)
    assert len(times_a) == len(times_b) == pairs
    assert all(t > 0 for t in times_a + times_b)
    timed = order[2:]  # after one warm call of each
    steps = len(timed) // (2 * pairs)
    assert steps >= 1 and len(timed) == 2 * pairs * steps
    blocks = [timed[i * steps] for i in range(2 * pairs)]
    assert blocks == [side for i in range(pairs) for side in (("a", "b") if i % 2 == 0 else ("b", "a"))], blocks
    assert all(timed[i * steps:(i + 1) * steps] == [blocks[i]] * steps for i in range(2 * pairs))
