"""Every output-head candidate the tuner is offered fits one block's shared memory, on layers no
suite holds: ``tools/head_tiles_smem.py`` builds each candidate's launches on meta tensors and
compiles its kernels for sm_90a on the Triton installed here (no GPU). One candidate that does
not fit fails at its first launch and takes the whole tuning of its layer with it; the offer
rules (``head_engine.head_smem``, ``_joint_fits``) are estimates, and this holds them to
Triton's own figure."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from clean_process import compile_in_clean_process

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "head_tiles_smem.py"


def _script():
    spec = importlib.util.spec_from_file_location("head_tiles_smem", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", [0, 7])
def test_every_candidate_records_its_launches(seed):
    # Without compiling (so under the interpreter too): every offered candidate of a generated
    # layer yields its kernels' launches, each a kernel of its module with the tensors first.
    mod = _script()
    for params in mod.generated_layers(seed, 2):
        for dtype in (torch.float32, torch.bfloat16):
            for cl in (True, False):
                for t in mod.HE.head_tiles(params, dtype, "tf32", channels_last=cl):
                    cfg = mod.HE.HeadConfig(**t)
                    launches = mod.launches(params, cfg, dtype, "tf32", cl)
                    assert launches, cfg.short()
                    for name, ints, consts, module, tensors in launches:
                        fn = getattr(module or mod.head_gemm, name)
                        assert all(isinstance(t, torch.Tensor) for t in tensors)
                        assert len(fn.arg_names) >= len(tensors) + len(ints)


def test_generated_layers_are_heads():
    mod = _script()
    layers = mod.generated_layers(3, 40)
    assert all(1 <= p.out_channels_per_group <= 15 and p.in_channels_per_group >= 8 for p in layers)
    assert len({(p.kernel_size, p.stride) for p in layers}) > 30, "kernels and strides vary"


def test_candidates_fit_shared_memory_when_compiled():
    # The row and dtype whose tuning once failed on a candidate's shared memory (the sweep's
    # 256 -> 7 k6 s2 head in bf16: 504 columns, the widest joint tiles), channels-last. In a
    # process of its own, without the interpreter (clean_process explains why). The script runs
    # the two suites and generated layers the same way, at more length.
    out = compile_in_clean_process([str(SCRIPT), "--case", "sweep09_256to7_k666s222", "--dtypes", "bf16",
                                    "--layouts", "cl"])
    assert " 0 over " in out, out
