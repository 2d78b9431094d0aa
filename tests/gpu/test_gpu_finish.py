"""The finishing kernels (engines/triton/finish.py) on CUDA (skipped without it): the cases of
tests/unit/test_finish.py with bfloat16 added and larger shapes, and one BatchNorm over
16 x 64 x 31 x 63 x 63 values around a mean of 5 against float64."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_finish as U  # noqa: E402  (the reference helpers, on any device)

pytestmark = [pytest.mark.gpu]
DEV = "cuda"
DTYPES = ["fp32", "fp16", "bf16"]

# The unit regimes, plus sizes where the GPU's tiles and grids are full: channels of a decoder,
# a width of 63 (many rows per program), all of space (one row per program).
REDUCTIONS = dict(U.REDUCTIONS, **{
    "channels-c64": ((4, 64, 9, 17, 17), 1),
    "channels-c300-three-blocks": ((2, 300, 5, 6, 7), 1),
    "depth-31": ((2, 16, 31, 15, 17), 2),
    "width-63": ((2, 16, 9, 17, 63), 4),
    "spatial-31-cubed": ((2, 8, 31, 31, 31), (2, 3, 4)),
})
POOLS = dict(U.POOLS, **{"k2-decoder": ((4, 32, 31, 63, 63), 2, None), "k4-s4": ((2, 16, 17, 33, 35), 4, 4)})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", U.FIN.REDUCE_OPS)
@pytest.mark.parametrize("regime", list(REDUCTIONS))
def test_reduce(regime, op, dtype):
    shape, dim = REDUCTIONS[regime]
    U.run_reduce(shape, dim, op, U.DT[dtype], DEV)


@pytest.mark.parametrize("op", U.FIN.REDUCE_OPS)
def test_reduce_without_programs(op):
    U.run_reduce((2, 16, 9, 17, 63), (2, 3, 4), op, torch.float32, DEV, programs=False, affine=False)


def test_softmax_and_logsumexp_of_a_column_of_minus_infinity():
    y = torch.randn(1, 4, 1, 1, 3, device=DEV)
    y[0, :, 0, 0, 1] = float("-inf")
    torch.testing.assert_close(U.FIN.reduce(y, 1, "softmax"), torch.softmax(y, 1), equal_nan=True)
    torch.testing.assert_close(U.FIN.reduce(y, 1, "logsumexp"), torch.logsumexp(y, 1, keepdim=True))


# The direct convolution's unit regimes, plus KernelBench level 2's 3 -> 16 layer at a quarter of its batch.
U.DIRECTS.setdefault("kb-level2-rgb-16", ((32, 3, 16, 32, 32), 16, 3, 2, 1, 1, 1))


@pytest.mark.parametrize("dtype", DTYPES + ["fp32-tf32"])
@pytest.mark.parametrize("finish", list(U.FINISHES))
@pytest.mark.parametrize("regime", list(U.DIRECTS))
def test_direct(regime, finish, dtype):
    U.run_direct(regime, finish, torch.float32 if dtype == "fp32-tf32" else U.DT[dtype], DEV,
                 tf32=dtype == "fp32-tf32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("regime", list(POOLS))
def test_pool(regime, kind, dtype):
    shape, k, s = POOLS[regime]
    U.run_pool(shape, kind, k, s, U.DT[dtype], DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum-0.1", "momentum-none-cumulative"])
@pytest.mark.parametrize("shape", [(3, 5, 3, 4, 5), (4, 32, 15, 31, 31)], ids=["small", "decoder"])
def test_batch_norm_train_updates_running_stats(shape, momentum, affine, dtype):
    U.run_batch_norm(shape, momentum, affine, U.DT[dtype], DEV)


def test_batch_norm_large():
    """123,039 values per (n, c) row, 16 rows per channel, around a mean of 5."""
    U.run_batch_norm((16, 64, 31, 63, 63), 0.1, True, torch.float32, DEV, steps=1, loc=5.0, programs=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("shape,groups", [((2, 6, 3, 5, 4), 3), ((2, 6, 3, 5, 4), 6), ((4, 64, 15, 31, 31), 8)],
                         ids=["groups-of-2", "group-per-channel", "decoder-8-groups"])
def test_group_norm(shape, groups, affine, dtype):
    U.run_group_norm(shape, groups, affine, U.DT[dtype], DEV)


def test_group_norm_large_mean():
    U.run_group_norm((2, 32, 31, 63, 63), 4, True, torch.float32, DEV, loc=1000.0, programs=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 16, 9, 17, 63), (4, 32, 31, 31, 31)], ids=["planes-9x17x63", "planes-31-cubed"])
def test_subtract_mean(shape, dtype):
    U.run_subtract_mean(shape, U.DT[dtype], DEV)
