"""``convt3d.bench.ddp`` (``convt3d bench --suite networks --ddp N``) without GPUs: the one-line
refusal when fewer than N GPUs exist, argument errors, and the whole orchestration -- spawned
processes, a DDP step of patched and untouched models, lockstep rounds, the rows -- on 2 CPU
processes with gloo and tiny networks (timings there mean nothing and are not judged)."""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from convt3d.bench import ddp, networks


@pytest.mark.parametrize("count", [0, 1], ids=["no-gpu", "one-gpu"])
def test_fewer_gpus_than_processes_is_a_one_line_error(count, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ddp.DDPUnavailableError) as exc:
        ddp.run_ddp(2)
    msg = str(exc.value)
    assert "\n" not in msg and "--ddp 2 needs 2 CUDA GPUs" in msg
    assert msg.endswith("this machine has none" if count == 0 else "this machine has 1")


@pytest.mark.parametrize("nproc", [0, -1, "2", True, 1.5], ids=["zero", "negative", "string", "bool", "float"])
def test_bad_process_count(nproc):
    with pytest.raises(ddp.DDPUnavailableError, match="positive number of processes"):
        ddp.run_ddp(nproc, device="cpu")


def test_inference_modes_are_refused():
    with pytest.raises(ValueError, match="infer fp32 is not a training mode"):
        ddp.run_ddp(2, modes=networks.select_modes("fwd", ["fp32"]), device="cpu")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_two_cpu_processes_time_patched_and_untouched_steps():
    rows, failures, skipped = ddp.run_ddp(2, nets=networks.select_networks(["gan3d"]), device="cpu", tiny=True,
                                          round_s=0.01, rounds=2)
    assert failures == [] and skipped == []
    assert [r["case"] for r in rows] == ["gan3d"]
    for r in rows:
        assert (r["mode"], r["dtype"], r["ddp"], r["device"]) == ("train", "bf16", 2, "cpu")
        assert r["convt_layers"] > 0 and r["iters_per_round"] >= ddp.MIN_ITERS
        assert len(r["torch_us_rounds"]) == len(r["convt3d_us_rounds"]) == 2
        assert r["torch_us"] == pytest.approx(statistics.median(r["torch_us_rounds"]))
        assert r["convt3d_us"] == pytest.approx(statistics.median(r["convt3d_us_rounds"]))
        ratios = [u / p for u, p in zip(r["torch_us_rounds"], r["convt3d_us_rounds"])]
        assert r["speedup"] == pytest.approx(statistics.median(ratios))
        assert min(ratios) <= r["speedup_quartiles"][0] <= r["speedup"] <= r["speedup_quartiles"][1] <= max(ratios)
        assert r["first_step_s"] > 0 and r["torch_first_step_s"] > 0
    table = ddp.format_rows(rows, failures, skipped)
    assert "gan3d" in table and "speedup" in table


@pytest.mark.parametrize("argv,phrase", [
    (["--suite", "networks", "--ddp", "2"], "needs 2 CUDA GPUs"),
    (["--suite", "layers", "--ddp", "2"], "--ddp N needs --suite networks"),
    (["--suite", "networks", "--ddp", "0"], "--ddp must be >= 1"),
], ids=["too-few-gpus", "not-the-networks-suite", "zero-processes"])
def test_cli_ddp_errors_are_one_line(argv, phrase, capsys, monkeypatch):
    from convt3d.bench import cli

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
