"""CPU tests of ``convt3d.tune``'s network check: after each layer's decision (measured on the
layer alone), the whole model is timed with those decisions against PyTorch for every layer, and
the signatures that make it slower are reverted (``convt3d.dispatch.network_check``).

Timings are injected: ``measure``/``timer`` stand-ins compute a model time from which layers run
on PyTorch, so every branch (kept, one culprit, all reverted, ties and noise) is exercised without
a GPU; tests/gpu/test_gpu_networks.py runs the real thing.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import convt3d
from convt3d.dispatch import select as dispatch
from convt3d.dispatch import network_check as NC
from convt3d.tune import TuneReport


def _measure_from(costs: dict[frozenset, float] | None = None, *, base: float = 10.0, per_group=None,
                  noise: list[float] | None = None):
    """measure(reverted) = base + sum of per-group costs of the groups left on convt3d (per_group
    maps a group to (cost on convt3d, cost on PyTorch)); ``noise`` multiplies successive calls."""
    calls = []

    def measure(reverted: frozenset) -> float:
        calls.append(reverted)
        if costs is not None:
            t = costs[reverted]
        else:
            t = base + sum(torch_c if g in reverted else ours_c for g, (ours_c, torch_c) in per_group.items())
        return t * (noise[len(calls) - 1] if noise else 1.0)

    return measure, calls


CASES = {
    # name -> (per-group costs (convt3d, PyTorch), expected reverted)
    "every-layer-wins": ({"a": (1.0, 3.0), "b": (2.0, 4.0)}, set()),
    "one-culprit": ({"a": (1.0, 3.0), "b": (6.0, 2.0)}, {"b"}),
    "every-layer-loses": ({"a": (4.0, 3.0), "b": (6.0, 2.0)}, {"a", "b"}),
    "a-tie-goes-to-pytorch": ({"a": (3.0, 3.05)}, {"a"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_network_check_reverts_what_makes_the_model_slower(name):
    per_group, expect = CASES[name]
    measure, calls = _measure_from(per_group=per_group)
    reverted, times = NC.network_check(list(per_group), measure)
    assert set(reverted) == expect
    # Never slower than PyTorch everywhere; slower than convt3d's choices only within the noise
    # (a tie goes to PyTorch).
    assert times["final_ms"] <= times["torch_ms"]
    assert times["final_ms"] <= times["convt3d_ms"] * (1 + times["margin"])
    # The two ends come first, in two rounds of opposite order.
    every = frozenset(per_group)
    assert calls[:4] == [frozenset(), every, every, frozenset()]


def test_noisy_rounds_raise_the_bar():
    # convt3d's choices look 5% faster, but the rounds of the model itself spread by 10%: the
    # check cannot tell, and PyTorch keeps the layer.
    measure, _ = _measure_from(costs={frozenset(): 9.5, frozenset({"a"}): 10.0}, noise=[1.0, 1.0, 1.1, 1.1])
    reverted, times = NC.network_check(["a"], measure)
    assert reverted == frozenset({"a"}) and times["margin"] >= 0.09


def test_greedy_order_keeps_the_useful_layers():
    # Three groups: c alone loses; a and b win. Reverting in the given order keeps a and b.
    measure, calls = _measure_from(per_group={"c": (5.0, 1.0), "a": (1.0, 2.0), "b": (1.0, 2.0)})
    reverted, times = NC.network_check(["c", "a", "b"], measure)
    assert reverted == frozenset({"c"}) and times["final_ms"] == 10.0 + 1 + 1 + 1


# ---- _check_network on a real (CPU) model, with fabricated decisions and an injected timer --------
class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up1 = convt3d.ConvTranspose3d(4, 4, 2, stride=2)
        self.up2 = convt3d.ConvTranspose3d(4, 4, 2, stride=2)
        self.head = convt3d.ConvTranspose3d(4, 1, 3, padding=1)

    def forward(self, x):
        return self.head(self.up2(self.up1(x)))


class _Bar:
    def status(self, msg):
        pass


def test_check_network_reverts_the_slow_signature_and_restores_backends(monkeypatch):
    model = _Decoder()
    # up1 and up2 share a signature only if their inputs have the same size: they do not here.
    groups = {"sig-up1": [model.up1], "sig-up2": [model.up2], "sig-head": [model.head]}
    report = TuneReport(entries=[
        {"signature": "sig-up1", "engine": "triton", "source": "measured", "timings_ms": {"triton": 1.0, "torch": 2.0}},
        {"signature": "sig-up2", "engine": "triton", "source": "measured", "timings_ms": {"triton": 1.0, "torch": 1.1}},
        {"signature": "sig-head", "engine": "torch", "source": "measured", "timings_ms": {"triton": 3.0, "torch": 1.0}},
    ])
    seen_backends = []

    def timer(run):
        # up2 on convt3d costs 5 ms in the model (1.1 on PyTorch); up1 wins 1 ms.
        b = (model.up1.backend, model.up2.backend, model.head.backend)
        seen_backends.append(b)
        return 10.0 + (1.0 if b[0] is None else 2.0) + (5.0 if b[1] is None else 1.1)

    overrides = []
    monkeypatch.setattr(dispatch, "override", lambda sig, engine, why, device, detail=None: overrides.append(
        (sig, engine, why)) or 1)
    NC.check_network(report, groups, lambda: None, torch.device("cuda", 0), _Bar(), timer=timer)
    assert [o[:2] for o in overrides] == [("sig-up2", "torch")]
    assert "network check" in overrides[0][2]
    assert report.network["reverted"] == ["sig-up2"] and report.network["checked"] == ["sig-up2", "sig-up1"]
    entry = next(e for e in report.entries if e["signature"] == "sig-up2")
    assert entry["engine"] == "torch" and entry["source"] == "network check"
    # The head (PyTorch already) is never flipped; every layer is back on "auto" afterwards.
    assert all(b[2] is None for b in seen_backends)
    assert (model.up1.backend, model.up2.backend, model.head.backend) == (None, None, None)
    assert "network check" in str(report) and "reverted" in str(report)


def test_check_network_does_nothing_when_every_layer_is_pytorch(monkeypatch):
    model = _Decoder()
    report = TuneReport(entries=[{"signature": "s", "engine": "torch", "source": "measured", "timings_ms": {}}])
    NC.check_network(report, {"s": [model.up1]}, lambda: None, torch.device("cuda", 0), _Bar(),
                     timer=lambda run: pytest.fail("nothing to time"))
    assert report.network is None


def test_tune_on_cpu_has_no_network_check():
    rep = convt3d.tune(_Decoder(), torch.randn(1, 4, 2, 2, 2), progress=False)
    assert rep.network is None


def test_layer_signature_matches_the_dispatch_key_text():
    # The pre-hook's signature is the one dispatch keys decisions by (what override replaces).
    from convt3d.core.call import make_call

    model = _Decoder()
    x = torch.randn(1, 4, 2, 2, 2)
    sig = NC.layer_signature(model.up1, (x,))
    want = make_call(x, model.up1.weight, model.up1.bias, (2, 2, 2), (0, 0, 0), (0, 0, 0), 1, (1, 1, 1),
                     autograd=True).text
    assert sig == want
