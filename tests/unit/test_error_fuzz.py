"""tools/error_fuzz.py's verdict on one layer (the GPU run itself needs CUDA): twice PyTorch's own
error, at least one ulp of the dtype, and PyTorch's fp32 call classed as TF32 or exact."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def fuzz():
    sys.path.insert(0, str(TOOLS))  # the tool imports its sibling tuning_table
    try:
        spec = importlib.util.spec_from_file_location("error_fuzz", TOOLS / "error_fuzz.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(TOOLS))


def _outputs(torch_rel: float, ours_rel: float, exact_rel: float = 0.0, dtype=torch.float32):
    ref = torch.linspace(-2.0, 4.0, 64, dtype=torch.float64)  # largest magnitude 4
    bump = torch.zeros_like(ref)
    bump[10] = 4.0
    return ((ref + torch_rel * bump).to(dtype), (ref + ours_rel * bump).to(dtype),
            (ref + exact_rel * bump).to(torch.float32), ref)


@pytest.mark.parametrize("torch_rel,ours_rel,within", [(1e-3, 1.9e-3, True), (1e-3, 2.1e-3, False),
                                                       (0.0, 1e-7, True), (0.0, 1e-6, False)],
                         ids=["under-twice", "over-twice", "under-the-ulp-floor", "over-the-ulp-floor"])
def test_budget_is_twice_pytorchs_error_with_an_ulp_floor(fuzz, torch_rel, ours_rel, within):
    v = fuzz.judge(*_outputs(torch_rel, ours_rel), allow_tf32=False)
    assert v["within"] is within
    assert v["budget"] == pytest.approx(max(2 * v["torch_err"], torch.finfo(torch.float32).eps))


@pytest.mark.parametrize("allow,exact_rel,klass", [(True, 0.0, "tf32"), (True, 1e-3, "exact"), (False, 0.0, "exact")],
                         ids=["tf32-allowed-and-used", "tf32-allowed-not-used", "tf32-off"])
def test_pytorchs_precision_class(fuzz, allow, exact_rel, klass):
    assert fuzz.judge(*_outputs(1e-3, 1e-3, exact_rel), allow_tf32=allow)["torch_class"] == klass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_floor_is_its_ulp_and_takes_no_fp32_class(fuzz, dtype):
    theirs, ours, _, ref = _outputs(0.0, 0.0, dtype=dtype)
    verdict = fuzz.judge(theirs, ours, None, ref, allow_tf32=True)
    assert verdict["budget"] >= torch.finfo(dtype).eps
    assert verdict["torch_class"] is None


def test_the_triton_engines_output_is_judged_too(fuzz):
    theirs, ours, exact, ref = _outputs(1e-3, 1e-3)
    worse = _outputs(1e-3, 3e-3)[1]
    assert fuzz.judge(theirs, ours, exact, ref, allow_tf32=False, engine_out=ours)["within"]
    assert not fuzz.judge(theirs, ours, exact, ref, allow_tf32=False, engine_out=worse)["within"]
