"""The Triton launcher's geometry decisions, checked by brute force in pure Python (no kernels):
which programs write the rows no tap reaches, and the zero-haloed input of flat_gemm_kernel."""
from __future__ import annotations

import itertools
import random

import pytest

from convt3d.engines.triton import engine
from convt3d.core.params import ConvT3dParams


def _random_params(rng: random.Random) -> ConvT3dParams:
    while True:
        dims = [(rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(3)]
        i, k, s, d = zip(*dims)
        p = tuple(rng.randint(0, max(0, d[j] * (k[j] - 1) // 2 + 1)) for j in range(3))
        op = tuple(rng.randint(0, max(s[j], d[j]) - 1) for j in range(3))
        params = ConvT3dParams.create(1, 8, 8, 1, i, k, s, p, op, d)
        if min(params.out_size) >= 1:
            return params


PARAMS = [_random_params(random.Random(seed)) for seed in range(60)]
IDS = [f"s{p.stride}-k{p.kernel_size}-d{p.dilation}-p{p.padding}" for p in PARAMS]


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_every_empty_row_class_written_exactly_once(params):
    sd, sh = params.stride[:2]
    d_ok = [params.axes[0].phases[r].num_taps > 0 for r in range(sd)]
    h_ok = [params.axes[1].phases[r].num_taps > 0 for r in range(sh)]
    masks = engine.companion_masks(params)
    if masks is None:
        assert not any(h_ok)  # then the launcher falls back to fill_rows_kernel
        return
    writers = {}
    for (rd, rh), mask in masks.items():
        assert d_ok[rd] and h_ok[rh], "an owner must be a row class with GEMM programs"
        for bit in range(sd * sh):
            if mask >> bit & 1:
                writers.setdefault(divmod(bit, sh), []).append((rd, rh))
    planes = {od % sd for od in engine.empty_planes(params, "cpu").tolist()}
    for dd, hh in itertools.product(range(sd), range(sh)):
        if d_ok[dd] and h_ok[hh]:
            assert (dd, hh) not in writers  # the GEMM programs' own rows
        elif not d_ok[dd]:
            # whole planes: fill_planes_kernel (if the residue has any plane at all)
            assert (dd in planes or params.axes[0].phases[dd].size == 0) and (dd, hh) not in writers
        else:
            assert len(writers.get((dd, hh), [])) == 1 and writers[(dd, hh)][0][0] == dd


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_flat_halo_covers_every_tap_of_every_valid_position(params):
    pads, sizes = engine.flat_geometry(params)
    for a, axis in enumerate(params.axes):
        # every input index lands inside the padded buffer
        assert pads[a] >= 0 and pads[a] + axis.in_size <= sizes[a]
        for ph in axis.phases:
            for q in range(ph.size):
                for j in range(ph.num_taps):
                    i = q + ph.first_offset - j * axis.offset_step
                    assert 0 <= i + pads[a] < sizes[a], (a, ph, q, j)
