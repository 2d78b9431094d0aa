"""GPU tests of the CUDA head kernel (``convt3d.engines.cuda.head``, ``csrc/head_shuffle.cu``; skipped
without CUDA or nvcc).

Every offered tile of each geometry, at fp32 (TF32), bf16 and fp16, on NCDHW, channels-last and
strided input, with and without bias, against float64: the output is poisoned with NaN first, and
its error (max |y - ref| / max |ref|) must be within twice cuDNN's own at the same dtype and flags,
or within the dtype's rounding floor where cuDNN lands closer than that on a small layer. Then the
public call (``backend="cuda"``): unbatched input, non-contiguous weight and bias, a training
step, CUDA-graph replay and run-to-run determinism.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convt3d
from convt3d.engines.cuda import head as ch
from convt3d.engines.cuda.head import nvcc_path

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_cuda_head import REGIMES, _params  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc to build the head kernel")]
DEV = "cuda"
# Relative error floors: a TF32 product rounds at 2^-11, bf16 at 2^-8, fp16 at 2^-11, and a head
# sums up to a few hundred of them.
FLOOR = {torch.float32: 2e-3, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}

# Larger regimes on top of the CPU ones: several channel chunks (two stages), many tiles, tiles
# past the output, the layers suite's GAN and video heads at reduced size.
GPU_REGIMES = REGIMES + [
    ("gan-head-small", _params(2, 64, 1, 9, 4, 2, 1)),
    ("video-head-small", _params(2, 64, 3, (3, 9, 11), (1, 4, 4), (1, 2, 2), (0, 1, 1))),
    ("128to8-k3-small", _params(1, 128, 8, (3, 8, 9), 3, (1, 2, 2), 1, (0, 1, 1))),
    ("cin96-three-chunks", _params(1, 96, 5, (5, 6, 7), 3, 1, 1)),
    ("vqvae-k4s2p3", _params(1, 240, 3, (4, 6, 6), 4, 2, 3)),
    ("k244-s244-wide-columns", _params(1, 32, 3, (3, 4, 5), (2, 4, 4), (2, 4, 4))),
]


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "cl":
        return x.contiguous(memory_format=torch.channels_last_3d)
    if layout == "strided":  # every other width element of a wider tensor
        wide = torch.zeros(*x.shape[:4], 2 * x.shape[4], dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x.contiguous()


def _tensors(params, dtype, bias, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(params.in_shape, device=DEV, generator=gen, dtype=torch.float64)
    w = torch.randn(params.in_channels, params.out_channels_per_group, *params.kernel_size, device=DEV,
                    generator=gen, dtype=torch.float64)
    b = torch.randn(params.out_channels, device=DEV, generator=gen, dtype=torch.float64) if bias else None
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def _args(params):
    return params.stride, params.padding, params.output_padding, params.groups, params.dilation


def _errors(y, x, w, b, params):
    ref = F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), *_args(params))
    scale = ref.abs().max().item() or 1.0
    cudnn = F.conv_transpose3d(x, w, b, *_args(params))
    return (y.double() - ref).abs().max().item() / scale, (cudnn.double() - ref).abs().max().item() / scale


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layout", ["ncdhw", "cl", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("params", [r[1] for r in GPU_REGIMES], ids=[r[0] for r in GPU_REGIMES])
def test_every_offered_tile_against_float64(params, dtype, layout, bias):
    x, w, b = _tensors(params, dtype, bias)
    x = _layout(x, layout)
    for hp in ch.candidate_plans(params, dtype, 4):
        y = ch._output(x, w, params).fill_(float("nan"))
        ch._launch(x, ch.pack_weight(w, params, hp), b, y, hp)
        assert torch.isfinite(y).all(), f"unwritten or non-finite output, plan {hp}"
        err, err_cudnn = _errors(y, x, w, b, params)
        assert err <= max(2 * err_cudnn, FLOOR[dtype]), (hp, err, err_cudnn)


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided-weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("params", [r[1] for r in GPU_REGIMES], ids=[r[0] for r in GPU_REGIMES])
def test_pack_kernel_equals_the_torch_packing(params, dtype, contiguous):
    """The library's one-launch packing, bit for bit the reference ``pack_weight`` (zeros past the
    kernel, the residues and Cin/g; fp32 rounded to TF32), from a contiguous or strided weight."""
    _, w, _ = _tensors(params, dtype, False, seed=2)
    if not contiguous:  # every other input channel of a wider weight
        wide = torch.zeros(2 * w.shape[0], *w.shape[1:], dtype=dtype, device=DEV)
        wide[::2] = w
        w = wide[::2]
        assert w.shape[0] == 1 or not w.is_contiguous()
    for hp in ch.candidate_plans(params, dtype, 1):
        assert torch.equal(ch.pack_weight_cuda(w, params, hp), ch.pack_weight(w, params, hp)), hp


@pytest.mark.parametrize("jn", ["plain", "width-columns"])
@pytest.mark.parametrize("ctas", [1, 3], ids=["one-cta", "three-ctas"])
@pytest.mark.parametrize("stages", [1, 2], ids=["one-stage", "two-stages"])
@pytest.mark.parametrize("layout", ["ncdhw", "cl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("params", [r[1] for r in GPU_REGIMES], ids=[r[0] for r in GPU_REGIMES])
def test_persistent_ctas_walk_every_tile(params, dtype, layout, stages, ctas, jn):
    """A grid capped at one or three CTAs, so that each walks many tiles (groups and batch
    elements too): the next tile's row offsets, its staging during the last chunk (two stages),
    the accumulators zeroed between tiles and the resident weights reused; in both variants
    (the width shifts as columns: tiles that step mw - jn + 1 blocks along W)."""
    x, w, b = _tensors(params, dtype, True, seed=1)
    x = _layout(x, layout)
    if jn == "width-columns" and ch.width_shifts(params) == 1:
        pytest.skip("one width shift: no column variant")
    jn = 1 if jn == "plain" else ch.width_shifts(params)
    offered = ch.tile_boxes(params, dtype, jn=jn)
    if not offered:
        pytest.skip(f"no tile of {dtype} fits in shared memory")
    cfg, box = offered[0]
    hp = ch.plan(params, dtype, cfg, box, stages=stages, max_ctas=ctas, jn=jn)
    if hp.meta[31] > ch.SMEM_LIMIT:
        pytest.skip(f"{stages} stages of tile {cfg} {box} exceed the shared memory of a CTA")
    y = ch._output(x, w, params).fill_(float("nan"))
    ch._launch(x, ch.pack_weight(w, params, hp), b, y, hp)
    assert torch.isfinite(y).all(), f"unwritten or non-finite output, tile {cfg} {box}"
    err, err_cudnn = _errors(y, x, w, b, params)
    assert err <= max(2 * err_cudnn, FLOOR[dtype]), (cfg, box, err, err_cudnn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_public_call_on_the_cuda_engine(dtype):
    params = _params(2, 16, 3, (4, 5, 6), 4, 2, 1)
    x, w, b = _tensors(params, dtype, True)
    w_nc = w.transpose(3, 4).contiguous().transpose(3, 4)  # same values, non-contiguous
    b_nc = torch.stack([b, b], 1)[:, 0]  # a strided view
    assert not w_nc.is_contiguous() and not b_nc.is_contiguous()
    y = convt3d.conv_transpose3d(x, w_nc, b_nc, 2, 1, backend="cuda")
    err, err_cudnn = _errors(y, x, w, b, params)
    assert err <= max(2 * err_cudnn, FLOOR[dtype])
    y1 = convt3d.conv_transpose3d(x[0], w, b, 2, 1, backend="cuda")  # unbatched
    assert y1.shape == y.shape[1:] and torch.equal(y1, convt3d.conv_transpose3d(x[:1], w, b, 2, 1,
                                                                                backend="cuda")[0])


def test_runs_are_bitwise_equal_and_replay_in_a_cuda_graph():
    params = _params(2, 32, 2, (5, 6, 7), 4, 2, 1)
    x, w, b = _tensors(params, torch.bfloat16, True)
    first = convt3d.conv_transpose3d(x, w, b, 2, 1, backend="cuda")
    assert torch.equal(first, convt3d.conv_transpose3d(x, w, b, 2, 1, backend="cuda"))
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        convt3d.conv_transpose3d(static_x, w, b, 2, 1, backend="cuda")  # warm (tile chosen)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = convt3d.conv_transpose3d(static_x, w, b, 2, 1, backend="cuda")
    new_x = torch.randn_like(x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, convt3d.conv_transpose3d(new_x, w, b, 2, 1, backend="cuda"))


def test_training_step_matches_pytorch():
    params = _params(2, 16, 2, (4, 5, 5), 4, 2, 1)
    x, w, b = _tensors(params, torch.bfloat16, True)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref_leaves = [t.double().clone().requires_grad_() for t in (x, w, b)]
    y = convt3d.conv_transpose3d(*leaves, 2, 1, backend="cuda")
    y_ref = F.conv_transpose3d(*ref_leaves, 2, 1)
    dy = torch.randn_like(y_ref)
    y.backward(dy.to(y.dtype))
    y_ref.backward(dy)
    for ours, ref in zip(leaves, ref_leaves):
        rel = (ours.grad.double() - ref.grad).abs().max() / ref.grad.abs().max()
        assert rel < 3e-2
