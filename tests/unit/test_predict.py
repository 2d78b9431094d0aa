"""The tuner's shortlist (``engines.triton.predict``): a table of recorded costs ranks a call's
candidates, with CONVT3D_TUNE=predicted the shortlist keeps the best of each family, and by
default, without a table or on the CPU every candidate is timed. Tables are injected; the shipped one is checked
for the kinds today's candidates have."""
from __future__ import annotations

import random

import pytest
import torch

from convt3d.core.params import ConvT3dParams
from convt3d.engines.triton import predict
from convt3d.engines.triton.configs import candidate_configs

GEMM = ConvT3dParams.create(2, 64, 32, 1, (8, 8, 8), (4, 4, 4), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1))
HEAD = ConvT3dParams.create(2, 64, 1, 1, (8, 16, 16), (4, 4, 4), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1))


class _Cuda:
    type = "cuda"


def _table(params, configs, costs, dtype="float32", precision="tf32", cl=False):
    """A one-layer table recording ``costs`` (log ratio per candidate, in listed order)."""
    names = predict.labels(configs)
    row = dict(features=predict.features(params), dtype=dtype, costs=dict(zip(names, costs)),
               regime=predict.regime(dtype, precision, cl, params))
    return [row]


@pytest.mark.parametrize("params", [GEMM, HEAD], ids=["gemm", "head"])
def test_rank_follows_the_recorded_costs(params):
    configs = candidate_configs(params, torch.float32, "tf32", False, flat=True, gluon=True)
    names = predict.labels(configs)
    costs = [0.1 * ((i * 7) % len(configs)) for i in range(len(configs))]
    order = predict.rank(configs, params, torch.float32, "tf32", False, _table(params, configs, costs))
    by_name = {}
    for n, c in zip(names, costs):
        by_name[n] = min(by_name.get(n, 9), c)
    ranked = [by_name[names[i]] for i in order]
    assert ranked == sorted(ranked)


@pytest.mark.parametrize("params", [GEMM, HEAD], ids=["gemm", "head"])
def test_shortlist_keeps_the_best_of_each_family(params, monkeypatch):
    monkeypatch.setenv(predict.ENV_MODE, "predicted")
    configs = candidate_configs(params, torch.float32, "tf32", False, flat=True, gluon=True)
    rng = random.Random(0)
    costs = [rng.random() for _ in configs]
    table = _table(params, configs, costs)
    monkeypatch.setattr(predict, "table_for", lambda arch: table)
    monkeypatch.setattr(predict, "arch_of", lambda device: "sm90")
    short = predict.shortlist(configs, params, torch.float32, "tf32", False, _Cuda())
    families = {getattr(c, "head", "") or "gemm" for c in configs}
    assert len(short) == max(predict.SHORTLIST, len(families)) or len(short) == len(configs)
    assert families == {getattr(c, "head", "") or "gemm" for c in short}
    best = min(range(len(configs)), key=lambda i: (costs[i], i))
    assert short[0] == configs[best] or costs[configs.index(short[0])] == costs[best]


@pytest.mark.parametrize("why", ["no-table", "exhaustive", "default", "cpu"])
def test_every_candidate_is_timed_without_a_prediction(why, monkeypatch):
    configs = candidate_configs(HEAD, torch.float32, "tf32", False, flat=True, gluon=True)
    table = _table(HEAD, configs, [0.0] * len(configs))
    monkeypatch.setattr(predict, "table_for", lambda arch: None if why == "no-table" else table)
    monkeypatch.setattr(predict, "arch_of", lambda device: "sm90")
    if why != "default":
        monkeypatch.setenv(predict.ENV_MODE, "exhaustive" if why == "exhaustive" else "predicted")
    device = torch.device("cpu") if why == "cpu" else _Cuda()
    assert predict.shortlist(configs, HEAD, torch.float32, "tf32", False, device) == configs


def test_the_shipped_table_knows_a_kind_of_every_call():
    """Kinds the table never saw rank after the seen ones; every call must have some seen kind."""
    table = predict.table_for("sm90")
    assert table, "the sm90 tuning table ships with the package"
    known = set().union(*(row["costs"] for row in table))
    rng = random.Random(3)
    for _ in range(40):
        cin, cout = rng.choice([16, 32, 64, 128]), rng.choice([1, 3, 16, 64, 128])
        k, s = rng.choice([(4, 2), (3, 2), (2, 2), (3, 1)])
        p = ConvT3dParams.create(1, cin, cout, 1, (6, 10, 10), (k,) * 3, (s,) * 3, (1,) * 3, (0,) * 3, (1,) * 3)
        for dtype in (torch.float32, torch.bfloat16):
            names = predict.labels(candidate_configs(p, dtype, "tf32", False, flat=True, gluon=True))
            assert known & set(names), (p.describe(), dtype, names)


def test_an_unknown_mode_warns_and_times_every_candidate(monkeypatch):
    configs = candidate_configs(HEAD, torch.float32, "tf32", False, flat=True, gluon=True)
    monkeypatch.setattr(predict, "table_for", lambda arch: _table(HEAD, configs, [0.0] * len(configs)))
    monkeypatch.setattr(predict, "arch_of", lambda device: "sm90")
    monkeypatch.setenv(predict.ENV_MODE, "fastest")
    predict._warn_unknown_mode.cache_clear()
    with pytest.warns(UserWarning, match="CONVT3D_TUNE='fastest'"):
        assert predict.shortlist(configs, HEAD, torch.float32, "tf32", False, _Cuda()) == configs
