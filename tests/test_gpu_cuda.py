"""GPU tests of the CUDA engine (``convt3d.engines.cuda.gemm``; skipped without CUDA).

Bar (issue 6): allclose(atol=rtol=1e-4) against float64 PyTorch on a randomised sweep and on all
seven KernelBench problems (batch reduced for the slow ones), element-wise bounds from
``conftest`` on the sweep, a cross-check against the Triton engine at "ieee", NaN/Inf
propagation, determinism, and an output above 2^31 elements when memory allows.

gemm_kernel (the register-blocked path, default for wide layers) also runs a sweep of its own
(wider channels so its tiles and tails are exercised: strides 1-3, dilation, padding,
output_padding, channel counts off the tile, groups, batch 1, channels_last input), every
variant on KB 77's geometry, NaN/Inf, determinism and the > 2^31 output.

TF32 mode (``precision="tf32"``, issue 14): on a sweep and on every variant, the output equals
float64 evaluated on TF32-rounded operands (round to nearest, ties away) to fp32 accumulation
error -- so the operands are rounded exactly as cuDNN rounds them and nothing else is -- and lies
within conftest's TF32 bound of the exact result; on the KernelBench problems it is within 2x of
the larger of cuDNN's own TF32 error and exact TF32 arithmetic's, and passes KernelBench's check
against PyTorch's default-flag output wherever cuDNN computes in TF32; the caller's tensors are
not written.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from convt3d.engines.cuda import gemm as E
from convt3d.dispatch.select import cudnn_conv_tf32
from convt3d.kernelbench.problems import PROBLEMS
from convt3d.core.validate import check_call

from conftest import (assert_close_to_reference, check_against_reference, magnitude, random_case,
                      round_tf32_reference, tolerance)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def _run(x, w, b, args, **kw):
    params, unbatched = check_call(x, w, b, *args)
    x5 = x.unsqueeze(0) if unbatched else x
    y = E.forward(x5, w, b, params, **kw)
    return y.squeeze(0) if unbatched else y


def _ref(x, w, b, args):
    return F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), *args)


def test_build_reports_seconds():
    x = torch.randn(1, 2, 3, 3, 3, device=DEV)
    w = torch.randn(2, 2, 3, 3, 3, device=DEV)
    _run(x, w, None, (1, 0, 0, 1, 1))
    assert E.build_seconds() is not None and E.build_seconds() > 0


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"sweep{s}")
def test_random_sweep(seed):
    rng = random.Random(1000 + seed)
    case = random_case(rng, max_channels=12, max_in=7, max_kernel=5)
    x, w, b = case.tensors(device=DEV)
    y = _run(x, w, b, case.args)
    assert y.device.type == "cuda" and y.dtype == torch.float32
    check_against_reference(y, x, w, b, *case.args, precision="ieee", context=case.id())
    ref = _ref(x, w, b, case.args)
    assert torch.allclose(y.double().cpu(), ref.cpu(), atol=1e-4, rtol=1e-4), case.id()
    if x.dim() == 5:
        assert y.is_contiguous(memory_format=E.output_memory_format(x, w))


@pytest.mark.parametrize("variant", E.variant_names(), ids=lambda v: f"variant-{v}")
@pytest.mark.parametrize("hreuse", [False, True], ids=["generic", "hreuse"])
def test_every_variant_on_kb77_geometry(variant, hreuse):
    """All tile variants and both inner loops on KB 77's geometry with tile tails (small batch,
    odd channel counts)."""
    x = torch.randn(2, 7, 5, 9, 37, device=DEV)
    w = torch.randn(7, 13, 3, 3, 3, device=DEV)
    b = torch.randn(13, device=DEV)
    args = (2, 1, 0, 1, 2)
    y = _run(x, w, b, args, variant=variant, hreuse=hreuse)
    check_against_reference(y, x, w, b, *args, precision="ieee", context=f"{variant} hreuse={hreuse}")


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"kb{p.id}")
def test_kernelbench_problems(problem):
    layer = torch.nn.ConvTranspose3d(**problem.layer_args(), device=DEV)
    n = problem.input_shape[0] if problem.id in (77, 72, 73) else 1  # batch 1 for the slow stride-1 ones
    x = torch.rand(n, *problem.input_shape[1:], device=DEV)
    args = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    b = torch.randn(layer.out_channels, device=DEV) * 0.1
    y = _run(x, layer.weight.detach(), b, args)
    ref = _ref(x, layer.weight.detach(), b, args)
    err = (y.double() - ref).abs().max().item()
    assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4), f"max abs err {err:.3g}"


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.id in (72, 73, 77)], ids=lambda p: f"kb{p.id}")
def test_matches_triton_engine_ieee(problem):
    from convt3d.engines.triton import engine as triton_engine

    layer = torch.nn.ConvTranspose3d(**problem.layer_args(), device=DEV)
    x = torch.rand(2, *problem.input_shape[1:], device=DEV)
    args = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    w, b = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    params, _ = check_call(x, w, b, *args)
    ours = E.forward(x, w, b, params)
    theirs = triton_engine.forward(x, w, b, params, "ieee")
    ref = _ref(x, w, b, args)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # both exact fp32: each within a few ulps-of-magnitude of float64, so they agree to ~1e-5
    assert (ours.double() - ref).abs().max() <= 2 * (theirs.double() - ref).abs().max() + 1e-6


@pytest.mark.parametrize("variant", [None, *E.GEMM_VARIANTS], ids=lambda v: v or "default")
def test_nan_inf_propagate_like_pytorch(variant):
    x = torch.randn(1, 8, 4, 5, 6, device=DEV)
    x[0, 3, 2, 2, 2] = float("nan")
    x[0, 5, 0, 1, 4] = float("inf")
    w = torch.randn(8, 4, 3, 3, 3, device=DEV)
    args = (2, 1, 0, 1, 2)
    ours = _run(x, w, None, args, variant=variant)
    theirs = _ref(x, w, None, args)
    assert torch.equal(ours.isnan().cpu(), theirs.isnan().cpu())
    assert torch.equal(ours.isinf().cpu(), theirs.isinf().cpu())


def test_channels_last_and_noncontiguous_input():
    base = torch.randn(2, 6, 4, 5, 12, device=DEV)
    w = torch.randn(6, 5, 2, 3, 3, device=DEV)
    args = (2, 1, 1, 1, 1)
    for x in (base.contiguous(memory_format=torch.channels_last_3d), base[..., ::2], base.transpose(2, 3)):
        y = _run(x, w, None, args)
        check_against_reference(y, x, w, None, *args, precision="ieee")
        assert y.is_contiguous(memory_format=E.output_memory_format(x, w))


def test_batch_zero_and_unbatched():
    w = torch.randn(3, 2, 3, 3, 3, device=DEV)
    y = _run(torch.randn(0, 3, 4, 4, 4, device=DEV), w, None, (2, 1, 0, 1, 1))
    assert y.shape == (0, 2, 7, 7, 7)
    x = torch.randn(3, 4, 4, 4, device=DEV)
    check_against_reference(_run(x, w, None, (2, 1, 0, 1, 1)), x, w, None, 2, 1, 0, 1, 1)


def test_depthwise_and_grouped():
    for groups, cin, cout in ((8, 8, 8), (4, 8, 12), (2, 6, 70)):
        x = torch.randn(2, cin, 5, 6, 7, device=DEV)
        w = torch.randn(cin, cout // groups, 3, 3, 3, device=DEV)
        b = torch.randn(cout, device=DEV)
        args = (2, 1, 1, groups, 1)
        check_against_reference(_run(x, w, b, args), x, w, b, *args, precision="ieee", context=f"g{groups}")


@pytest.mark.parametrize("variant", [None, *E.GEMM_VARIANTS], ids=lambda v: v or "default")
def test_deterministic_bitwise(variant):
    x = torch.randn(2, 16, 6, 10, 10, device=DEV)
    w = torch.randn(16, 24, 3, 3, 3, device=DEV)
    args = (2, 1, 0, 1, 2)
    assert torch.equal(_run(x, w, None, args, variant=variant), _run(x, w, None, args, variant=variant))


@pytest.mark.parametrize("variant", [None, "g64"], ids=["default", "g64"])
def test_output_above_2_pow_31_elements(variant):
    # k3 s2 p0 doubles each size (+1): 261 x 261 x 131 x 256 channels = 2.28e9 elements (9.1 GB)
    n, c, d, h, w_, cout = 1, 1, 130, 130, 65, 256
    x_elems = n * c * d * h * w_
    out = (2 * d + 1) * (2 * h + 1) * (2 * w_ + 1) * cout
    need = (x_elems + out) * 4 * 2
    free, _ = torch.cuda.mem_get_info()
    if out < 2**31 or need > free * 0.8:
        pytest.skip(f"needs {need / 2**30:.1f} GiB (free {free / 2**30:.1f} GiB)")
    x = torch.randn(n, c, d, h, w_, device=DEV)
    w = torch.randn(c, cout, 3, 3, 3, device=DEV)
    y = _run(x, w, None, (2, 0, 0, 1, 1), variant=variant)
    assert y.numel() > 2**31
    # spot-check the far end (int64 offsets) against a float64 reference of the last depth slices
    xs = x[:, :, -2:].double()
    ref = F.conv_transpose3d(xs, w.double(), None, 2)[:, :, -3:]
    assert torch.allclose(y[:, :, -3:].double(), ref, atol=1e-4, rtol=1e-4)
    del y
    torch.cuda.empty_cache()


# ---- gemm_kernel -------------------------------------------------------------------------------
def _gemm_case(rng: random.Random):
    """A random layer for the gemm tiles: 8-40 input and 17-80 output channels per group (tails
    of BK = 16 and BN = 32/64), groups 1-2, strides 1-3, dilation 1-3, padding, output_padding,
    batch 1-2, sizes up to 9 (compact planes over one 256-position tile)."""
    while True:
        g = rng.choice([1, 1, 2])
        cin_g, cout_g = rng.randint(8, 40), rng.randint(17, 80)
        k = tuple(rng.randint(1, 4) for _ in range(3))
        s = tuple(rng.randint(1, 3) for _ in range(3))
        d = tuple(rng.randint(1, 3) for _ in range(3))
        p = tuple(rng.randint(0, (d[i] * (k[i] - 1)) // 2 + 1) for i in range(3))
        op = tuple(rng.randint(0, max(s[i], d[i]) - 1) for i in range(3))
        size = tuple(rng.randint(1, 9) for _ in range(3))
        out = [(size[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1 for i in range(3)]
        if min(out) >= 1:
            return rng.randint(1, 2), g, cin_g, cout_g, size, k, s, p, op, d


def _gemm_tensors(seed: int):
    """(x, w, b, args) of the gemm sweep's case ``seed``: channels-last input every third case,
    bias every other."""
    rng = random.Random(5000 + seed)
    n, g, cin_g, cout_g, size, k, s, p, op, d = _gemm_case(rng)
    x = torch.randn(n, g * cin_g, *size, device=DEV)
    if seed % 3 == 0:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(g * cin_g, cout_g, *k, device=DEV) * 0.1
    b = torch.randn(g * cout_g, device=DEV) if seed % 2 else None
    return x, w, b, (s, p, op, g, d)


def _context(variant, x, w, args) -> str:
    """The failure message's case: tile variant, batch, groups, channels, size and geometry."""
    s, p, op, g, d = args
    return (f"{variant} n{x.shape[0]} g{g} {x.shape[1] // g}->{w.shape[1]} in{tuple(x.shape[2:])} "
            f"k{tuple(w.shape[2:])} s{s} p{p} op{op} d{d}")


@pytest.mark.parametrize("seed", range(24), ids=lambda s: f"gemm-sweep{s}")
def test_gemm_random_sweep(seed):
    x, w, b, args = _gemm_tensors(seed)
    ref = _ref(x, w, b, args)
    for variant in E.GEMM_VARIANTS:
        y = _run(x, w, b, args, variant=variant)
        context = _context(variant, x, w, args)
        assert y.shape == ref.shape, context
        err = (y.double() - ref).abs().max().item()
        assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4), f"{context}: max abs err {err:.3g}"
        check_against_reference(y, x, w, b, *args, precision="ieee", context=context)
        assert y.is_contiguous(memory_format=E.output_memory_format(x, w)), context


@pytest.mark.parametrize("variant", list(E.GEMM_VARIANTS))
def test_gemm_tiles_over_rows_and_channel_tails(variant):
    """KB 77's geometry with a compact plane of 12 x 30 (tiles start mid-row), 19 input channels
    (a BK tail) and 70 output channels (two channel tiles of g64), batch 1, bias."""
    x = torch.randn(1, 19, 3, 12, 30, device=DEV)
    w = torch.randn(19, 70, 3, 3, 3, device=DEV) * 0.1
    b = torch.randn(70, device=DEV)
    args = (2, 1, 0, 1, 2)
    y = _run(x, w, b, args, variant=variant)
    ref = _ref(x, w, b, args)
    assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4), (y.double() - ref).abs().max().item()


HALO_CASES = {
    # name: (input shape, Cout, kernel, stride, padding, output_padding, dilation); all take the window
    # path (tests/test_cuda_engine.py emulates the same index arithmetic on the CPU)
    "kb77-rows-over-tile": ((1, 19, 3, 30, 12), 70, 3, 2, 1, 0, 2),   # compact 30 x 12: tiles start mid-row
    "kb77-two-hw-tiles": ((2, 32, 3, 16, 32), 64, 3, 2, 1, 0, 2),     # KB 77's compact width, 2 tiles
    "osw2-shift4": ((1, 9, 2, 5, 14), 33, 3, 2, 2, 0, 4),              # width taps 4 columns apart
    "osw3-aniso": ((1, 8, 2, 3, 5), 40, (2, 3, 4), (3, 1, 2), (0, 1, 2), (1, 0, 1), (2, 1, 3)),
    "s1-k5-w": ((2, 24, 2, 3, 4), 64, (2, 2, 5), 1, (0, 1, 0), 0, 1),
}


@pytest.mark.parametrize("case", list(HALO_CASES))
@pytest.mark.parametrize("variant", list(E.HALO_VARIANTS))
def test_halo_window_tiles(case, variant):
    """The window variants on geometries where halo_layout accepts them: row-crossing tiles,
    channel tails (BK, BN), width tap steps 1-3, stride 1, bias; deterministic."""
    shape, cout, k, s, p, op, d = HALO_CASES[case]
    x = torch.randn(*shape, device=DEV)
    w = torch.randn(shape[1], cout, *((k,) * 3 if isinstance(k, int) else k), device=DEV) * 0.1
    b = torch.randn(cout, device=DEV)
    args = (s, p, op, 1, d)
    params, _ = check_call(x, w, b, *args)
    assert E.launch_plan(params, variant, False).get("halo"), "the case must take the window path"
    y = _run(x, w, b, args, variant=variant)
    ref = _ref(x, w, b, args)
    err = (y.double() - ref).abs().max().item()
    assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4), f"{case}: max abs err {err:.3g}"
    check_against_reference(y, x, w, b, *args, precision="ieee", context=f"{variant} {case}")
    assert torch.equal(y, _run(x, w, b, args, variant=variant)), "bitwise repeatable"


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.id in (61, 68, 70, 73, 77)], ids=lambda p: f"kb{p.id}")
@pytest.mark.parametrize("variant", list(E.GEMM_VARIANTS))
def test_gemm_on_kernelbench_geometries(problem, variant):
    """Every gemm tile on the KernelBench layers it is (or may become) the default for, batch 1."""
    layer = torch.nn.ConvTranspose3d(**problem.layer_args(), device=DEV)
    x = torch.rand(1, *problem.input_shape[1:], device=DEV)
    args = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    b = torch.randn(layer.out_channels, device=DEV) * 0.1
    y = _run(x, layer.weight.detach(), b, args, variant=variant)
    ref = _ref(x, layer.weight.detach(), b, args)
    err = (y.double() - ref).abs().max().item()
    assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4), f"max abs err {err:.3g}"


# ---- TF32 mode -------------------------------------------------------------------------------------
def _check_tf32(y, x, w, b, args, context):
    """y equals float64 of the TF32-rounded operands to fp32 accumulation error (the exact-grade
    bound), and the exact result to the TF32 bound."""
    rx, rw = round_tf32_reference(x), round_tf32_reference(w)
    mag = magnitude(x, w, b, *args)
    assert_close_to_reference(y, _ref(rx.cpu(), rw.cpu(), None if b is None else b.cpu(), args), mag,
                              tolerance(torch.float32, "ieee"), f"{context} vs rounded operands")
    check_against_reference(y, x, w, b, *args, precision="tf32", context=context)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"tf32-sweep{s}")
def test_tf32_random_sweep(seed):
    rng = random.Random(5000 + seed)
    case = random_case(rng, max_channels=12, max_in=7, max_kernel=5)
    x, w, b = case.tensors(device=DEV)
    x0, w0 = x.clone(), w.clone()
    y = _run(x, w, b, case.args, precision="tf32")
    _check_tf32(y, x, w, b, case.args, case.id())
    assert torch.equal(x, x0) and torch.equal(w, w0), "TF32 mode wrote the caller's tensors"


@pytest.mark.parametrize("variant", E.variant_names("tf32"), ids=lambda v: f"variant-{v}")
def test_tf32_every_variant_on_kb77_geometry(variant):
    x = torch.randn(2, 7, 5, 9, 37, device=DEV)
    w = torch.randn(7, 13, 3, 3, 3, device=DEV)
    b = torch.randn(13, device=DEV)
    args = (2, 1, 0, 1, 2)
    y = _run(x, w, b, args, precision="tf32", variant=variant)
    _check_tf32(y, x, w, b, args, variant)


def test_tf32_rounds_ties_away_and_keeps_inf_nan():
    """Operands on a TF32 tie (bit 12 set, bits 0-11 clear) round away from zero, as cuDNN's
    operands do; with a 1-tap kernel the output is the product of the rounded values."""
    base = torch.tensor([1.0, -1.0, 3.0, -3.0], device=DEV)
    tie = (base.view(torch.int32) | 0x1000).view(torch.float32)
    vals = torch.cat([tie, torch.tensor([float("inf"), float("nan")], device=DEV)])
    x = vals.reshape(1, 1, 1, 1, -1)
    w = torch.ones(1, 1, 1, 1, 1, device=DEV)
    y = _run(x, w, None, (1, 0, 0, 1, 1), precision="tf32")
    expected = round_tf32_reference(vals)
    assert torch.equal(expected[:4].abs(), base.abs() + torch.tensor([2.0 ** -10] * 2 + [2.0 ** -9] * 2, device=DEV))
    assert torch.equal(y.flatten()[:5], expected[:5]) and torch.isnan(y.flatten()[5])


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"kb{p.id}")
def test_tf32_kernelbench_problems(problem):
    """KernelBench's inputs; KB 77 at its full batch (the CUDA entry's problem), the others at
    batch 1-2. Against float64: within 2x the larger of cuDNN's TF32 error and exact TF32
    arithmetic's (float64 on rounded operands). Against PyTorch's default-flag output (TF32
    allowed): KernelBench's allclose(1e-4) where cuDNN computes in TF32 (all but 72)."""
    torch.manual_seed(0)
    layer = torch.nn.ConvTranspose3d(**problem.layer_args(), device=DEV)
    n = problem.input_shape[0] if problem.id == 77 else min(2, problem.input_shape[0])
    x = torch.rand(n, *problem.input_shape[1:], device=DEV)
    args = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    w = layer.weight.detach()
    y = _run(x, w, None, args, precision="tf32")
    ref = _ref(x, w, None, args)
    with torch.no_grad(), cudnn_conv_tf32(True):
        theirs = F.conv_transpose3d(x, w, None, *args)
    ours_err = (y.double() - ref).abs().max().item()
    cudnn_err = (theirs.double() - ref).abs().max().item()
    arith_err = (_ref(round_tf32_reference(x), round_tf32_reference(w), None, args) - ref).abs().max().item()
    assert ours_err <= 2 * max(cudnn_err, arith_err), (ours_err, cudnn_err, arith_err)
    if problem.cudnn_uses_tf32:
        diff = (y - theirs).abs().max().item()
        assert torch.allclose(theirs, y, atol=1e-4, rtol=1e-4), f"max abs diff from PyTorch's default output {diff:.3g}"


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"tf32-gemm-sweep{s}")
def test_tf32_gemm_random_sweep(seed):
    """The gemm sweep's geometries (8-40 input, 17-80 output channels per group: tiles and
    tails) in TF32 mode, on every gemm tile and the tensor-core ones."""
    x, w, b, args = _gemm_tensors(seed)
    for variant in [None, *E.GEMM_VARIANTS, *E.MMA_VARIANTS]:
        y = _run(x, w, b, args, precision="tf32", variant=variant)
        _check_tf32(y, x, w, b, args, _context(variant, x, w, args))
        assert y.is_contiguous(memory_format=E.output_memory_format(x, w))


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.id in (61, 68, 77)], ids=lambda p: f"kb{p.id}")
@pytest.mark.parametrize("variant", list(E.MMA_VARIANTS))
def test_tensor_core_tiles_on_kernelbench_geometries(problem, variant):
    """The tensor-core tiles on the KernelBench layers they are the TF32 default for (batch 1,
    bias), deterministic: within fp32 accumulation error of float64 on the rounded operands."""
    torch.manual_seed(1)
    layer = torch.nn.ConvTranspose3d(**problem.layer_args(), device=DEV)
    x = torch.rand(1, *problem.input_shape[1:], device=DEV)
    args = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    w, b = layer.weight.detach(), torch.randn(layer.out_channels, device=DEV) * 0.1
    y = _run(x, w, b, args, precision="tf32", variant=variant)
    ref = _ref(round_tf32_reference(x), round_tf32_reference(w), b, args)
    err = (y.double() - ref).abs().max().item()
    assert torch.allclose(y.double(), ref, atol=1e-5, rtol=1e-5), f"{variant}: {err:.3g} from the rounded operands"
    assert torch.equal(y, _run(x, w, b, args, precision="tf32", variant=variant)), "bitwise repeatable"
