"""The geometry of ``convt3d.core.params`` against brute-force enumeration of every (input, tap) pair.

A transposed convolution sends input position ``i`` through kernel tap ``t`` to output
``o = i*s - p + t*d``; everything in ``convt3d.core.params`` (output size, the taps of each residue,
compact grids, empty phases, GEMM map, useful MACs, bytes) is a closed form of that one
mapping. Here each quantity is recomputed by enumerating the mapping directly, over hundreds of
random parameter sets per dimension and in 3-D. Pure Python: the whole file runs in seconds.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from convt3d.core.params import Axis, ConvT3dParams

from conftest import out_len


# ---------------------------------------------------------------------------------------------
# Brute force
# ---------------------------------------------------------------------------------------------
def brute_axis(i_size, k, s, p, op, d):
    """Everything about one dimension by enumeration.

    Returns (O, contributions, residue_taps, residue_sizes): the output length, the set of
    (o, i, t) with 0 <= i < I, 0 <= t < k that land inside [0, O), the taps that can land on each
    residue (for *some* integer input position: the congruence, found by enumerating a window of
    virtual positions wide enough to realise every residue), and how many outputs each residue has.
    """
    # The uncropped output spans [min o, max o] with p = 0; cropping p on each side and adding
    # op at the end gives O (this is how the length is defined, without using the formula).
    full = max(i * s + t * d for i in range(i_size) for t in range(k)) + 1
    o_len = full - 2 * p + op
    contributions = {(i * s - p + t * d, i, t) for i in range(i_size) for t in range(k)
                     if 0 <= i * s - p + t * d < o_len}
    residue_taps = {r: set() for r in range(s)}
    for t in range(k):
        for i in range(-s - p - k * d, i_size + s + p + k * d):
            residue_taps[(i * s - p + t * d) % s].add(t)
    residue_sizes = {r: sum(1 for o in range(max(o_len, 0)) if o % s == r) for r in range(s)}
    return o_len, contributions, residue_taps, residue_sizes


def random_axis(rng: random.Random, allow_nonpositive=False):
    while True:
        i = rng.randint(1, 12)
        k = rng.randint(1, 7)
        s = rng.randint(1, 6)
        d = rng.randint(1, 4)
        p = rng.randint(0, 2 + (d * (k - 1) + (i - 1) * s) // 2)
        op = rng.randint(0, max(s, d) - 1)
        if allow_nonpositive or out_len(i, k, s, p, op, d) >= 1:
            return i, k, s, p, op, d


def _axis_id(a):
    i, k, s, p, op, d = a
    return f"I{i}-k{k}-s{s}-p{p}-op{op}-d{d}"


_rng = random.Random(20240229)
# Hand-picked regimes first (all named in the issues), then random ones.
AXES = [
    (16, 3, 2, 1, 0, 2),  # KernelBench 77: only odd residues have taps
    (12, 3, 2, 1, 1, 1),  # monai k3 s2 p1 op1
    (32, 2, 2, 0, 0, 1),  # nnU-Net k2 s2: one tap per residue
    (16, 4, 2, 1, 0, 1),  # GAN k4 s2 p1
    (10, 4, 2, 3, 0, 1),  # videogpt k4 s2 p3 (padding > stride)
    (8, 1, 1, 0, 0, 1),  # aniso depth: k = s = 1
    (5, 2, 3, 0, 2, 1),  # kernel smaller than stride: residue 2 empty
    (5, 1, 4, 0, 3, 1),  # k1 s4: three empty residues
    (7, 5, 3, 2, 1, 2),  # gcd(s, d) = 1 with d > 1
    (6, 4, 4, 1, 1, 2),  # gcd(s, d) = 2: tap step 2, offset step 1
    (9, 3, 1, 0, 2, 3),  # output_padding < dilation with stride 1
    (1, 1, 1, 0, 0, 1),  # the smallest problem
    (1, 3, 5, 0, 0, 1),  # one input, stride larger than the whole kernel extent
] + [random_axis(_rng) for _ in range(400)]


# ---------------------------------------------------------------------------------------------
# One dimension
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ax", AXES, ids=[_axis_id(a) for a in AXES])
def test_axis_against_brute_force(ax):
    i_size, k, s, p, op, d = ax
    axis = Axis(i_size, k, s, p, d, op)
    o_len, contributions, residue_taps, residue_sizes = brute_axis(*ax)

    assert axis.out_size == o_len
    assert axis.tap_step == s // math.gcd(s, d) and axis.offset_step == d // math.gcd(s, d)
    assert len(axis.phases) == s
    for r, ph in enumerate(axis.phases):
        assert ph.residue == r
        # The taps of residue r: exactly the congruence set, as an arithmetic progression.
        taps = [ph.first_tap + j * axis.tap_step for j in range(ph.num_taps)]
        assert taps == sorted(residue_taps[r]), f"residue {r}"
        assert ph.size == residue_sizes[r], f"compact size of residue {r}"
        # The index formula of the kernel: compact q, tap j  ->  o = q*s + r, t = t0 + j*tstep,
        # i = q + off0 - j*ostep must satisfy o = i*s - p + t*d (for any q, in range or not).
        for j in range(ph.num_taps):
            t = ph.first_tap + j * axis.tap_step
            for q in range(-2, ph.size + 2):
                i = q + ph.first_offset - j * axis.offset_step
                assert q * s + r == i * s - p + t * d, f"residue {r} tap {t} q {q}"

    # Completeness: enumerating (residue, q < Q, j < T) and keeping in-range inputs -- exactly what
    # the kernel does -- reproduces every contribution once, and nothing else.
    from_phases = []
    for ph in axis.phases:
        for q in range(ph.size):
            for j in range(ph.num_taps):
                i = q + ph.first_offset - j * axis.offset_step
                if 0 <= i < i_size:
                    from_phases.append((q * s + ph.residue, i, ph.first_tap + j * axis.tap_step))
    assert len(from_phases) == len(set(from_phases)), "a contribution is enumerated twice"
    assert set(from_phases) == contributions

    assert axis.useful_taps() == len(contributions)


@pytest.mark.parametrize("seed", range(60), ids=lambda s: f"nonpositive-seed{s}")
def test_axis_out_size_formula_everywhere(seed):
    # Including parameter sets whose output is empty or negative (which validation rejects):
    # out_size must still be PyTorch's formula, since the validator relies on it to reject them.
    rng = random.Random(seed)
    for _ in range(20):
        i, k, s, p, op, d = random_axis(rng, allow_nonpositive=True)
        full = (i - 1) * s + (k - 1) * d + 1
        assert Axis(i, k, s, p, d, op).out_size == full - 2 * p + op


# ---------------------------------------------------------------------------------------------
# 3-D
# ---------------------------------------------------------------------------------------------
def random_params(rng: random.Random, small: bool):
    """A random 3-D problem; ``small`` keeps it enumerable in 3-D (about 10^4 contributions)."""
    dims = []
    while len(dims) < 3:
        if small:
            i, k, s = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
            d = rng.randint(1, 3)
            p = rng.randint(0, d * (k - 1))
            op = rng.randint(0, max(s, d) - 1)
            if out_len(i, k, s, p, op, d) < 1:
                continue
            dims.append((i, k, s, p, op, d))
        else:
            dims.append(random_axis(rng))
    groups = rng.choice([1, 2, 3, 4])
    cin = groups * rng.randint(1, 5)
    cout = groups * rng.randint(1, 5)
    batch = rng.randint(0, 3)
    i, k, s, p, op, d = (tuple(v) for v in zip(*dims))
    return ConvT3dParams.create(batch, cin, cout, groups, i, k, s, p, op, d)


def _params_id(pr: ConvT3dParams) -> str:
    return (f"n{pr.batch}-c{pr.in_channels}to{pr.out_channels}-g{pr.groups}-i{'x'.join(map(str, pr.in_size))}"
            f"-k{'x'.join(map(str, pr.kernel_size))}-s{'x'.join(map(str, pr.stride))}"
            f"-p{'x'.join(map(str, pr.padding))}-op{'x'.join(map(str, pr.output_padding))}"
            f"-d{'x'.join(map(str, pr.dilation))}")


_rng3 = random.Random(7)
KB77 = ConvT3dParams.create(16, 32, 64, 1, (16, 32, 32), (3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (2, 2, 2))
PARAMS_SMALL = [random_params(_rng3, small=True) for _ in range(120)]
PARAMS_LARGE = [KB77] + [random_params(_rng3, small=False) for _ in range(200)]


def _per_dim(pr: ConvT3dParams):
    return [brute_axis(pr.in_size[a], pr.kernel_size[a], pr.stride[a], pr.padding[a], pr.output_padding[a],
                       pr.dilation[a]) for a in range(3)]


def _check_3d_closed_forms(pr: ConvT3dParams, brute):
    """Everything of ConvT3dParams that follows from the per-dimension brute force."""
    out = tuple(b[0] for b in brute)
    assert pr.out_size == out
    assert pr.out_shape == (pr.batch, pr.out_channels) + out
    assert pr.in_shape == (pr.batch, pr.in_channels) + pr.in_size
    assert pr.in_channels_per_group * pr.groups == pr.in_channels
    assert pr.out_channels_per_group * pr.groups == pr.out_channels

    sd, sh, sw = pr.stride
    assert pr.num_phases == sd * sh * sw == len(pr.phases)
    for rd, rh, rw in itertools.product(range(sd), range(sh), range(sw)):
        ph = pr.phases[(rd * sh + rh) * sw + rw]  # residue of width varies fastest
        assert ph.index == (rd * sh + rh) * sw + rw
        assert ph.residue == (rd, rh, rw)
        taps = [brute[a][2][r] for a, r in enumerate((rd, rh, rw))]
        sizes = [brute[a][3][r] for a, r in enumerate((rd, rh, rw))]
        assert ph.num_taps == math.prod(len(t) for t in taps)
        assert tuple(a.size for a in ph.axes) == tuple(sizes)
        assert ph.positions == math.prod(sizes)
        # Empty: some dimension has no tap landing on its residue.
        assert ph.empty == any(len(t) == 0 for t in taps)
        # GEMM map: M = batch x phase positions, N = Cout/g, K = Cin/g x taps of the phase.
        assert pr.gemm_shape(ph) == (pr.batch * math.prod(sizes), pr.out_channels // pr.groups,
                                     pr.in_channels // pr.groups * math.prod(len(t) for t in taps))
    assert pr.compact_size == tuple(brute[a][3][0] for a in range(3))

    # Useful MACs: every (input, tap) pair landing inside the output, for every input channel and
    # every output channel of its group, for every batch element.
    pairs = math.prod(len(b[1]) for b in brute)
    assert pr.useful_macs == pr.batch * pr.in_channels * (pr.out_channels // pr.groups) * pairs
    assert pr.useful_flops == 2 * pr.useful_macs

    # Bytes: each tensor's element count from its shape.
    n_x = pr.batch * pr.in_channels * math.prod(pr.in_size)
    n_w = pr.in_channels * (pr.out_channels // pr.groups) * math.prod(pr.kernel_size)
    n_y = pr.batch * pr.out_channels * math.prod(out)
    for esize in (2, 4):
        assert pr.min_bytes(esize) == esize * (n_x + n_w + n_y)
        assert pr.min_bytes(esize, has_bias=True) == esize * (n_x + n_w + n_y + pr.out_channels)


@pytest.mark.parametrize("pr", PARAMS_LARGE, ids=[_params_id(p) for p in PARAMS_LARGE])
def test_params_3d_closed_forms(pr):
    _check_3d_closed_forms(pr, _per_dim(pr))


@pytest.mark.parametrize("pr", PARAMS_SMALL, ids=[_params_id(p) for p in PARAMS_SMALL])
def test_params_3d_against_full_enumeration(pr):
    """Small problems, enumerated in 3-D without assuming the dimensions separate."""
    brute = _per_dim(pr)
    _check_3d_closed_forms(pr, brute)
    s, p, d, k = pr.stride, pr.padding, pr.dilation, pr.kernel_size
    out = pr.out_size
    landed = {}  # output position -> number of (input position, tap) pairs landing there
    n_pairs = 0
    for ipos in itertools.product(*(range(n) for n in pr.in_size)):
        for tap in itertools.product(*(range(n) for n in k)):
            o = tuple(ipos[a] * s[a] - p[a] + tap[a] * d[a] for a in range(3))
            if all(0 <= o[a] < out[a] for a in range(3)):
                landed[o] = landed.get(o, 0) + 1
                n_pairs += 1
    assert pr.useful_macs == pr.batch * pr.in_channels * (pr.out_channels // pr.groups) * n_pairs

    # Every output position belongs to exactly one phase and to that phase's compact grid.
    per_phase = {}
    for o in itertools.product(*(range(n) for n in out)):
        r = tuple(o[a] % s[a] for a in range(3))
        per_phase.setdefault(r, []).append(o)
    for ph in pr.phases:
        positions = per_phase.get(ph.residue, [])
        assert ph.positions == len(positions)
        q_max = [a.size for a in ph.axes]
        assert all(o[a] // s[a] < q_max[a] for o in positions for a in range(3))
        # An empty phase receives nothing (its output is bias or zero); a phase that receives
        # something is not empty.
        received = sum(landed.get(o, 0) for o in positions)
        if ph.empty:
            assert received == 0, f"empty phase {ph.residue} receives {received} contributions"
        elif received:
            assert not ph.empty


@pytest.mark.parametrize("pr", PARAMS_SMALL[:25], ids=[_params_id(p) for p in PARAMS_SMALL[:25]])
def test_useful_macs_against_pytorch(pr):
    """An oracle independent of enumeration: with all-ones input and weight, the output sum of
    PyTorch's transposed convolution counts the multiply-adds landing inside the output."""
    x = torch.ones(pr.in_shape, dtype=torch.float64)
    w = torch.ones((pr.in_channels, pr.out_channels // pr.groups) + pr.kernel_size, dtype=torch.float64)
    y = F.conv_transpose3d(x, w, None, pr.stride, pr.padding, pr.output_padding, pr.groups, pr.dilation)
    assert tuple(y.shape) == pr.out_shape
    assert int(y.sum().item()) == pr.useful_macs


def test_kernelbench_77_is_mostly_empty():
    # The figures the engine issue quotes for KernelBench 77: 7 of 8 phases empty, 88% of a
    # 571 MB fp32 output is zero, and the one live phase is the odd residue in every dimension.
    assert KB77.out_size == (33, 65, 65)
    assert [ph.empty for ph in KB77.phases] == [True] * 7 + [False]
    live = KB77.phases[7]
    assert live.residue == (1, 1, 1) and live.num_taps == 27
    assert tuple(a.size for a in live.axes) == (16, 32, 32)
    assert KB77.gemm_shape(live) == (16 * 16 * 32 * 32, 64, 32 * 27)
    empty = sum(ph.positions for ph in KB77.phases if ph.empty) / math.prod(KB77.out_size)
    assert empty == pytest.approx(1 - 16 * 32 * 32 / (33 * 65 * 65))
    assert 0.88 <= empty < 0.89
    assert round(16 * 64 * 33 * 65 * 65 * 4 / 1e6) == 571
    assert KB77.min_bytes(4) == 4 * (16 * 32 * 16 * 32 * 32 + 32 * 64 * 27 + 16 * 64 * 33 * 65 * 65)


def test_create_is_cached_and_frozen():
    a = ConvT3dParams.create(2, 4, 6, 2, (3, 4, 5), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 0, 1), (1, 2, 1))
    b = ConvT3dParams.create(2, 4, 6, 2, (3, 4, 5), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 0, 1), (1, 2, 1))
    assert a is b  # the launcher and the tuning cache key on it: equal calls, one object
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.batch = 3
    assert hash(a) == hash(ConvT3dParams(2, 4, 6, 2, (3, 4, 5), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 0, 1), (1, 2, 1)))


@pytest.mark.parametrize("pr", PARAMS_LARGE[:20], ids=[_params_id(p) for p in PARAMS_LARGE[:20]])
def test_describe_lists_every_phase(pr):
    lines = pr.describe().splitlines()
    assert len(lines) == pr.num_phases
    for line, ph in zip(lines, pr.phases):
        assert str(ph.residue) in line
        assert ("empty" in line) == ph.empty
        if not ph.empty:
            m, n, k = pr.gemm_shape(ph)
            assert f"M={m} N={n} K={k}" in line
