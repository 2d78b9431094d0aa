"""The Triton engine's real kernels on CPU tensors, through Triton's interpreter (``backend="triton"``).

These are the same ``@triton.jit`` functions the GPU runs, executed by ``TRITON_INTERPRET=1``; CI
has no GPU, so this is where every regime of the engine issue is exercised on every push. The
interpreter is slow (about 0.2-2 s per call here), so shapes are tiny: batch 1-2, <= 20 channels,
a few positions per dimension (one 12 x 12 plane, for tiles with tails) -- small, but chosen so
that each regime really occurs (several
phases, empty phases, tails of every tile, both the tensor-core path (>= 8 channels per group on
both sides) and the FMA path (fewer)).

What the interpreter does not show: tensor-core rounding. Its ``tl.dot`` multiplies in fp32
(NumPy), so "tf32x3" behaves like "ieee" here and "tf32" differs only by the launcher's own
rounding of the operands; bfloat16 ``tl.dot`` is not reliable in the interpreter (NumPy has no
bfloat16) and is left to the GPU tests.

Every comparison is against float64 PyTorch element by element (conftest.Tol explains the bounds),
so bias-only and empty-phase positions, where the bound is essentially zero, are checked too.
"""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F

import convt3d
import convt3d.engines.triton.engine as engine
import convt3d.engines.triton.configs as triton_configs
import convt3d.engines.triton.sites as triton_sites
from convt3d.core.params import ConvT3dParams
from convt3d.core.validate import check_call

from conftest import (CL, Case, PoisonedTorch, assert_close_to_reference, check_against_reference, magnitude,
                      memory_format_of, packed_weight_reference, padded_input_reference, poisoned_call, random_case,
                      reference, requires_interpreter, round_tf32_reference, tolerance)

pytestmark = requires_interpreter


def run(case: Case, x, w, b, precision="ieee"):
    return convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", precision=precision)


def tc(case: Case) -> bool:
    """Whether the case is meant for the tensor-core path (>= 8 channels per group both sides)."""
    return case.cin // case.groups >= 8 and case.cout // case.groups >= 8


# ---------------------------------------------------------------------------------------------
# The regimes (named; "tc" = tensor-core path, "fma" = exact FMA path)
# ---------------------------------------------------------------------------------------------
REGIMES = {
    # Depth is kept short (the engine launches programs per depth row and phase, and the
    # interpreter's cost is per program); H and W carry the odd sizes and the tails.
    # tensor-core path: >= 8 channels per group on both sides
    "tc-k3s2p1op1": Case(1, 16, 16, (2, 3, 4), (3, 3, 3), 2, 1, 1),
    "tc-cin8-cout16-odd-spatial": Case(2, 8, 16, (1, 2, 5), (2, 3, 2), 2, (0, 1, 0), (1, 0, 1)),
    "tc-cout-not-pow2": Case(1, 12, 10, (2, 3, 3), (2, 2, 2), 2),  # channel tails inside one tile
    "tc-groups2": Case(1, 16, 16, (2, 3, 3), (2, 2, 2), 2, groups=2),
    "tc-stride1-k3p1": Case(1, 8, 8, (2, 4, 4), (3, 3, 3), 1, 1),  # refine_k3s1, one phase
    "tc-kb77-scaled": Case(1, 8, 16, (2, 4, 4), (3, 3, 3), 2, 1, 0, 2, bias=False),  # 7 of 8 phases empty
    "tc-kernel-below-stride": Case(1, 8, 8, (2, 3, 3), (2, 2, 2), 3, 0, 2),  # residue 2 empty
    "tc-aniso-k=s=122": Case(2, 8, 8, (2, 3, 3), (1, 2, 2), (1, 2, 2)),
    "tc-per-dim-everything": Case(1, 8, 8, (3, 4, 3), (1, 2, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (1, 1, 2)),
    "tc-padding-above-stride": Case(1, 8, 8, (3, 4, 3), (4, 4, 4), 2, 3),  # videogpt k4 s2 p3
    "tc-multi-tile-plane": Case(1, 8, 8, (1, 12, 12), (1, 2, 2), (1, 2, 2), bias=False),  # 144 positions/phase
    "tc-stride2-odd-width": Case(1, 8, 8, (2, 3, 4), (3, 3, 3), 2, 1),  # W residues of unequal length (4, 3)
    # FMA path: fewer than 8 channels per group on some side
    "fma-k3s2p1op1": Case(1, 2, 3, (1, 3, 3), (3, 3, 3), 2, 1, 1),
    "fma-depthwise": Case(1, 3, 3, (1, 3, 4), (3, 2, 3), 2, 1, 1, groups=3),
    "fma-depthwise-c1": Case(1, 1, 1, (2, 4, 4), (3, 3, 3), 2, 1, 1),
    "fma-depthwise-multiplier2": Case(1, 2, 4, (2, 3, 3), (2, 2, 2), 2, groups=2),
    "fma-cin1": Case(1, 1, 6, (2, 3, 3), (2, 3, 2), 2, 1, 1),
    "fma-cout1": Case(2, 4, 1, (1, 3, 3), (2, 2, 2), 2),
    "fma-cin9-cout4": Case(1, 9, 4, (1, 3, 3), (2, 2, 2), 2),  # Cin/g >= 8, still FMA (Cout/g < 8)
    "fma-kb77-scaled": Case(1, 2, 4, (1, 4, 4), (3, 3, 3), 2, 1, 0, 2, bias=False),
    "fma-dilation3-stride2": Case(1, 2, 2, (2, 3, 3), (2, 3, 2), 2, 1, 1, 3),  # gcd(s, d) = 1
    "fma-k1s4": Case(1, 2, 2, (2, 3, 3), (1, 1, 1), 4, 0, 3),  # 63 of 64 phases empty
    "fma-stride2-odd-width": Case(1, 2, 2, (2, 3, 4), (2, 3, 3), 2, 1),
    "fma-output_padding-by-dilation": Case(1, 2, 2, (2, 3, 3), (2, 2, 2), 1, 0, 1, 2),
}
TC = [k for k in REGIMES if k.startswith("tc")]
FMA = [k for k in REGIMES if k.startswith("fma")]


def test_regime_names_match_the_path():
    # The "tc"/"fma" prefixes must describe what the launcher really does, or the coverage the
    # names claim is not there.
    for name, case in REGIMES.items():
        x, w, b = case.tensors()
        params, _ = check_call(x, w, b, *case.args[:3], case.groups, case.dilation)
        assert engine.uses_tensor_cores(params) == name.startswith("tc"), name


@pytest.mark.parametrize("name", list(REGIMES))
def test_fp32_ieee(name):
    case = REGIMES[name]
    x, w, b = case.tensors()
    check_against_reference(run(case, x, w, b, "ieee"), x, w, b, *case.args, precision="ieee", context=name)


def _sweep():
    rng = random.Random(31337)
    cases = []
    while len(cases) < 16:
        c = random_case(rng, max_channels=18, max_in=3, max_kernel=3, max_stride=3, max_dilation=2)
        # Keep the interpreter's bill bounded: it grows with programs (groups x batch x phases)
        # times loop steps (taps x input channels per group on the FMA path).
        steps = math.prod(c.kernel) * (1 if tc(c) else c.cin // c.groups)
        if c.in_size[0] <= 2 and (c.batch or 1) * c.groups * steps <= 40:
            cases.append(c)
    return cases


SWEEP = _sweep()


def test_sweep_covers_both_paths():
    assert any(tc(c) for c in SWEEP) and any(not tc(c) for c in SWEEP)


@pytest.mark.parametrize("case", SWEEP, ids=[c.id() for c in SWEEP])
def test_random_sweep(case):
    # Random arguments in every accepted form (int, 1-tuple, 3-tuple, list), every layout,
    # unbatched, groups, bias or not.
    x, w, b = case.tensors()
    check_against_reference(run(case, x, w, b, "ieee"), x, w, b, *case.args, context=case.id())


PRECISION_REGIMES = ["tc-k3s2p1op1", "tc-groups2", "tc-kb77-scaled", "tc-per-dim-everything", "fma-k3s2p1op1",
                     "fma-depthwise-multiplier2"]


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
@pytest.mark.parametrize("name", PRECISION_REGIMES)
def test_fp32_tf32_precisions(name, precision):
    case = REGIMES[name]
    x, w, b = case.tensors()
    check_against_reference(run(case, x, w, b, precision), x, w, b, *case.args, precision=precision,
                            context=f"{name} {precision}")


@pytest.mark.parametrize("allow_tf32,explicit", [(True, "tf32"), (False, None)],
                         ids=["allow_tf32-on", "allow_tf32-off"])
def test_precision_none_follows_allow_tf32(allow_tf32, explicit):
    # precision=None must give bitwise what the precision it resolves to gives.
    from convt3d.dispatch.select import EXACT_GRADE
    case = REGIMES["tc-k3s2p1op1"]
    x, w, b = case.tensors()
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=allow_tf32):
        y_none = run(case, x, w, b, None)
    y_explicit = run(case, x, w, b, explicit or EXACT_GRADE)
    assert torch.equal(y_none, y_explicit)
    check_against_reference(y_none, x, w, b, *case.args, precision=explicit or EXACT_GRADE)


FP16_REGIMES = ["tc-k3s2p1op1", "tc-groups2", "tc-kb77-scaled", "tc-multi-tile-plane", "fma-k3s2p1op1", "fma-depthwise",
                "fma-cout1", "fma-k1s4"]


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skip(
        reason="bfloat16 tl.dot is unreliable in Triton's interpreter (NumPy has no bfloat16); GPU tests cover it")),
], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", FP16_REGIMES)
def test_16bit(name, dtype):
    case = REGIMES[name]
    x, w, b = case.tensors(dtype)
    y = run(case, x, w, b)
    check_against_reference(y, x, w, b, *case.args, context=f"{name} {dtype}")


# ---------------------------------------------------------------------------------------------
# Layouts: non-contiguous and channels_last_3d input, channels_last_3d output
# ---------------------------------------------------------------------------------------------
# Batch 2: PyTorch's CPU kernels then follow the cuDNN memory-format rule we compare with.
LAYOUT_BASE = {"tc": Case(2, 8, 8, (1, 3, 4), (2, 3, 2), 2, 1, 1), "fma": Case(2, 2, 3, (1, 3, 4), (2, 3, 2), 2, 1, 1)}
LAYOUTS = ["contiguous", "channels_last_3d", "slice_w", "slice_c", "transpose_dh", "permuted_view"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", list(LAYOUT_BASE))
def test_input_layouts(path, layout):
    base = LAYOUT_BASE[path]
    case = Case(base.batch, base.cin, base.cout, base.in_size, base.kernel, *base.args[:3], base.dilation,
                base.groups, layout=layout)
    x, w, b = case.tensors()
    y = run(case, x, w, b)
    check_against_reference(y, x, w, b, *case.args, context=f"{path} {layout}")
    # Output memory format as PyTorch gives for float32 (its CPU kernels follow the cuDNN rule for
    # batch >= 2: channels_last_3d out when the input or the weight suggests it).
    assert memory_format_of(y) == memory_format_of(F.conv_transpose3d(x, w, b, *case.args))
    if layout == "channels_last_3d":
        assert memory_format_of(y) == "channels_last_3d"


@pytest.mark.parametrize("path", list(LAYOUT_BASE))
def test_channels_last_weight_gives_channels_last_output(path):
    case = LAYOUT_BASE[path]
    x, w, b = case.tensors()
    w = w.contiguous(memory_format=CL)
    y = run(case, x, w, b)
    check_against_reference(y, x, w, b, *case.args, context=path)
    assert memory_format_of(y) == memory_format_of(F.conv_transpose3d(x, w, b, *case.args)) == "channels_last_3d"


@pytest.mark.parametrize("strided", ["bias", "weight", "both"])
@pytest.mark.parametrize("path", list(LAYOUT_BASE))
def test_strided_weight_and_bias(path, strided):
    """A bias every other element of a larger tensor, a weight whose strides are not its
    contiguous ones: the same values as the contiguous tensors (the kernels index the bias by
    channel, so a strided one must reach them as a copy)."""
    case = LAYOUT_BASE[path]
    x, w, b = case.tensors()
    if strided in ("bias", "both"):
        b = torch.stack([b, -b], 1)[:, 0]
        assert not b.is_contiguous()
    if strided in ("weight", "both"):
        w = w.permute(0, 1, 4, 3, 2).contiguous().permute(0, 1, 4, 3, 2)
        assert not w.is_contiguous()
    for _ in range(2):  # the first call and the steady path's repeat
        y = run(case, x, w, b)
        check_against_reference(y, x, w, b, *case.args, context=f"{path} strided {strided}")


@pytest.mark.parametrize("name", ["tc-k3s2p1op1", "fma-depthwise", "fma-cin1"])
def test_unbatched(name):
    base = REGIMES[name]
    case = Case(None, base.cin, base.cout, base.in_size, base.kernel, *base.args[:3], base.dilation, base.groups)
    x, w, b = case.tensors()
    y = run(case, x, w, b)
    assert y.dim() == 4
    check_against_reference(y, x, w, b, *case.args, context=name)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("path", list(LAYOUT_BASE))
def test_batch_zero(path, layout):
    base = LAYOUT_BASE[path]
    case = Case(0, base.cin, base.cout, base.in_size, base.kernel, *base.args[:3], base.dilation, base.groups,
                layout=layout)
    x, w, b = case.tensors()
    y = run(case, x, w, b)
    ref = F.conv_transpose3d(x, w, b, *case.args)
    assert y.shape == ref.shape and y.dtype == ref.dtype and y.numel() == 0


# ---------------------------------------------------------------------------------------------
# Every element written; special values; determinism
# ---------------------------------------------------------------------------------------------
POISON_REGIMES = ["tc-kb77-scaled", "tc-kernel-below-stride", "tc-multi-tile-plane", "tc-cout-not-pow2", "fma-k1s4",
                  "fma-kb77-scaled", "fma-cin1"]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("name", POISON_REGIMES)
def test_every_output_element_written(name, layout):
    base = REGIMES[name]
    case = Case(base.batch, base.cin, base.cout, base.in_size, base.kernel, *base.args[:3], base.dilation,
                base.groups, bias=False, layout=layout)  # no bias: empty phases must be written as 0
    x, w, b = case.tensors()
    y = poisoned_call(engine, lambda: run(case, x, w, b))
    check_against_reference(y, x, w, b, *case.args, context=name)


def test_poison_is_effective(monkeypatch):
    # The poisoned allocator really reaches the launcher's output buffer: a launcher that skips
    # its kernels would return NaN (so the test above cannot pass vacuously).
    case = REGIMES["fma-k1s4"]
    x, w, b = case.tensors()
    monkeypatch.setattr(engine, "torch", PoisonedTorch(torch))
    params, _ = check_call(x, w, b, *case.args[:3], case.groups, case.dilation)
    monkeypatch.setattr(triton_sites, "_kernel", lambda name, device, module=None: _NoLaunch())
    y = engine.forward(x, w, b, params, "ieee")
    assert torch.isnan(y).all()


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


# fill_planes_kernel's NCDHW path writes the 16-byte-aligned interior of each plane in rows of
# VEC elements and the ends element by element. Plane sizes around VEC (one element, inside one
# VEC group, exactly VEC, a tail and a head both partial) and a base pointer off by one element
# (as in a storage offset) must write exactly their own planes and nothing next to them.
@pytest.mark.parametrize("shift", [0, 1], ids=["aligned-base", "base-off-by-one"])
@pytest.mark.parametrize("seg", [1, 3, 4, 5, 13, 37], ids=lambda s: f"plane{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-vec4", "fp16-vec8"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["zero", "bias"])
def test_fill_planes_writes_exactly_its_planes(seg, shift, dtype, has_bias):
    from convt3d.engines.triton.kernels.phase_gemm import fill_planes_kernel
    n, c, d = 2, 3, 3
    buf = torch.full((n * c * d * seg + shift,), float("nan"), dtype=dtype)
    y = buf[shift:].view(n, c, d, seg)
    bias = torch.arange(1, c + 1, dtype=dtype)
    planes = torch.tensor([0, 2], dtype=torch.int32)
    fill_planes_kernel[(planes.numel() * n * c,)](
        y, bias, planes, c, seg, planes.numel(), y.stride(0), y.stride(1), y.stride(2),
        CHANNELS_LAST=False, HAS_BIAS=has_bias, BLOCK=16, VEC=16 // y.element_size())
    expect = torch.full_like(y, float("nan"))
    expect[:, :, [0, 2]] = bias.view(1, c, 1, 1) if has_bias else 0
    assert torch.equal(torch.isnan(y), torch.isnan(expect)), "wrote outside its planes or missed elements"
    assert torch.equal(y.nan_to_num(-7), expect.nan_to_num(-7))
    if shift:
        assert torch.isnan(buf[0]), "wrote before the tensor"


# ---------------------------------------------------------------------------------------------
# The operands of the flat and box GEMMs: the zero-haloed NDHWC copy of x (to_padded_kernel), the
# packed weight (pack_weight_kernel), and both in one launch (gemm_operands_kernel). Each is
# checked element by element against its definition, on NaN-filled outputs.
# ---------------------------------------------------------------------------------------------
# (Cin, Cout, groups, fold, kernel): fold > 1 packs for merged groups (the block-diagonal weight).
PACK_CASES = {
    "one-channel-k1": (1, 1, 1, 1, (1, 1, 1)),
    "odd-channels-k232": (3, 5, 1, 1, (2, 3, 2)),
    "kb77-like-k3": (32, 16, 1, 1, (3, 3, 3)),
    "cin-past-one-block": (33, 70, 1, 1, (1, 2, 1)),
    "groups2": (40, 24, 2, 1, (2, 2, 2)),
    "merged-groups-by-2": (16, 12, 4, 2, (3, 1, 2)),
    "depthwise-merged-by-4": (8, 8, 8, 4, (1, 1, 1)),
    "merged-by-3-k4": (48, 6, 6, 3, (4, 4, 4)),
}


@pytest.mark.parametrize("round_tf32", [False, True], ids=["as-is", "tf32-rounded"])
@pytest.mark.parametrize("name", list(PACK_CASES))
def test_pack_weight_kernel_packs_every_tap_k_major(name, round_tf32):
    cin, cout, groups, fold, k = PACK_CASES[name]
    params = ConvT3dParams.create(1, cin, cout, groups, (2, 2, 2), k, (2, 2, 2), (0, 0, 0), (0, 0, 0), (1, 1, 1))
    kp = params.fold_groups(fold) if fold > 1 else params
    w = torch.randn(cin, cout // groups, *k) * 3
    site = triton_sites._pack_site(kp, w, round_tf32, fold)
    packed = torch.full(triton_sites._packed_shape(kp), float("nan"))
    site.launch(w.device, w, packed)
    expect = packed_weight_reference(w, kp, fold)
    assert torch.equal(packed, round_tf32_reference(expect) if round_tf32 else expect)


# (x shape, ((PD, PH, PW), (DP, HP, WP)), layout): halos on every side, a padded grid that cuts
# the input off (the flat path's grid ends where the taps stop), rows wider than one 64-position
# block, channels past one 64-channel block.
PAD_CASES = {
    "halo-every-side": ((2, 3, 4, 5, 6), ((1, 2, 1), (6, 9, 9)), "contiguous"),
    "grid-cuts-the-input": ((1, 4, 4, 4, 5), ((0, 1, 0), (3, 4, 4)), "contiguous"),
    "row-past-one-block": ((1, 5, 2, 3, 67), ((0, 1, 2), (3, 5, 70)), "contiguous"),
    "one-channel-halo-past-input": ((1, 1, 2, 2, 2), ((2, 2, 2), (6, 6, 6)), "contiguous"),
    "channels-last": ((2, 5, 2, 3, 4), ((1, 1, 1), (4, 5, 6)), "channels_last_3d"),
    "channels-last-past-one-block": ((1, 70, 2, 2, 3), ((0, 0, 1), (2, 2, 4)), "channels_last_3d"),
    "strided-view": ((2, 6, 5, 5, 10), ((1, 1, 1), (7, 7, 7)), "slice"),
}


def _pad_input(shape, layout):
    x = torch.randn(shape)
    if layout == "channels_last_3d":
        return x.to(memory_format=torch.channels_last_3d)
    return x[:, ::2, :, :, ::2] if layout == "slice" else x


@pytest.mark.parametrize("round_tf32", [False, True], ids=["as-is", "tf32-rounded"])
@pytest.mark.parametrize("name", list(PAD_CASES))
def test_to_padded_kernel_copies_x_into_its_halo(name, round_tf32):
    shape, geo, layout = PAD_CASES[name]
    x = _pad_input(shape, layout)
    xp = triton_sites._prepare_padded_input(x, geo, round_tf32)
    expect = padded_input_reference(x, geo)
    assert torch.equal(xp, round_tf32_reference(expect) if round_tf32 else expect)


@pytest.mark.parametrize("pack", ["merged-groups-by-2", "cin-past-one-block", "one-channel-k1"])
@pytest.mark.parametrize("pad", ["halo-every-side", "channels-last", "strided-view"])
def test_gemm_operands_kernel_does_both_in_one_launch(pad, pack, monkeypatch):
    shape, geo, layout = PAD_CASES[pad]
    cin, cout, groups, fold, k = PACK_CASES[pack]
    x = _pad_input(shape, layout)
    params = ConvT3dParams.create(1, cin, cout, groups, (2, 2, 2), k, (2, 2, 2), (0, 0, 0), (0, 0, 0), (1, 1, 1))
    kp = params.fold_groups(fold) if fold > 1 else params
    w = torch.randn(cin, cout // groups, *k)
    launched = []
    kernel = triton_sites._kernel
    monkeypatch.setattr(triton_sites, "_kernel", lambda name, *a: launched.append(name) or kernel(name, *a))
    ops = triton_sites._operands_site(x, geo, kp, w, True, fold)
    monkeypatch.setattr(triton_sites, "torch", PoisonedTorch(torch))  # its allocations NaN-filled
    wp, xp = triton_sites._gemm_operands(x, w, geo, kp, True, ops)
    assert launched == ["gemm_operands_kernel"]
    assert torch.equal(wp, round_tf32_reference(packed_weight_reference(w, kp, fold)))
    assert torch.equal(xp, round_tf32_reference(padded_input_reference(x, geo)))


@pytest.mark.parametrize("path,layout,precision,copied", [
    ("flat", "contiguous", "ieee", True), ("tma-5d", "contiguous", "ieee", True),
    ("pointer", "contiguous", "ieee", True), ("tma-5d", "channels_last_3d", "tf32", True),
    ("tma-5d", "channels_last_3d", "ieee", False)],
    ids=["flat", "tma-ncdhw", "pointer-ncdhw", "tma-cl-tf32-rounded", "tma-cl-read-in-place"])
def test_a_call_prepares_its_operands_in_one_launch(path, layout, precision, copied, monkeypatch):
    """Where the GEMM reads a copy of x (the flat configs' haloed grid; NDHWC for an NCDHW input
    or TF32 rounding), a call launches gemm_operands_kernel, then the GEMM; otherwise the pack
    alone. The separate copy kernels are not launched."""
    base = PATH_CASES["kb77-like"]
    case = Case(base.batch, base.cin, base.cout, base.in_size, base.kernel, *base.args[:3], base.dilation,
                base.groups, bias=base.bias, layout=layout)
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    cfg = dataclasses.replace(engine.candidate_configs(params, torch.float32, precision, False, flat=True)[0],
                              **PATHS[path])
    if not cfg.flat:
        cfg = dataclasses.replace(cfg, BLOCK_W=triton_configs.block_w(params.compact_size[1:], cfg.BLOCK_M))
    launched = []
    kernel = triton_sites._kernel
    monkeypatch.setattr(triton_sites, "_kernel", lambda name, *a: launched.append(name) or kernel(name, *a))
    y = poisoned_call(engine, lambda: engine.forward(x5, w, b, params, precision, config=cfg))
    assert ("gemm_operands_kernel" in launched) == copied and ("pack_weight_kernel" in launched) != copied
    assert "to_padded_kernel" not in launched and "to_channels_last_kernel" not in launched
    check_against_reference(y, x5, w, b, *case.args, context=f"{path} {layout}", precision=precision)


SPECIAL_REGIMES = ["tc-k3s2p1op1", "tc-kb77-scaled", "fma-k3s2p1op1", "fma-depthwise-multiplier2"]


_HEAD_INF = pytest.mark.xfail(strict=True, reason=(
    "FINDING (kernels/head_gemm.py): the rows and shuffle head kinds, the FMA path's default here, multiply "
    "each input tile by weight columns that are zero where a (shift, residue) pair has no tap, so an Inf input "
    "turns outputs NaN that PyTorch leaves +-Inf or finite (Inf * 0 = NaN inside the GEMM); the lead decides "
    "whether it is accepted. strict: this turns into a failure the day the behaviour changes."))
SPECIAL_INPUTS = [pytest.param(name, special, id=f"{special}-{name}",
                               marks=_HEAD_INF if name.startswith("fma-k3s2") and "inf" in special else ())
                  for name in SPECIAL_REGIMES for special in ("nan-input", "inf-input", "nan-and-inf-input")]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in NumPy: expected
@pytest.mark.parametrize("name, special", SPECIAL_INPUTS)
def test_nan_inf_input_propagate_like_pytorch(name, special):
    case = REGIMES[name]
    x, w, b = case.tensors()
    flat_x = x.view(-1)
    if special in ("nan-input", "nan-and-inf-input"):
        flat_x[[0, flat_x.numel() // 2]] = float("nan")
    if special in ("inf-input", "nan-and-inf-input"):
        flat_x[1] = float("inf")
        flat_x[-1] = float("-inf")
    y = run(case, x, w, b)
    ref = reference(x, w, b, *case.args)
    assert torch.isnan(ref).any() or torch.isinf(ref).any(), "the special value must reach the output"
    assert_close_to_reference(y, ref, magnitude(x, w, b, *case.args), tolerance(torch.float32), f"{name} {special}")


def _nan_weight(case, tap):
    # "centre": lands inside the output for every input position here. "corner" (tap 0): with
    # padding, some of its would-be reads fall outside the input.
    x, w, b = case.tensors()
    t = (w.shape[2] // 2, w.shape[3] // 2, w.shape[4] // 2) if tap == "centre" else (0, 0, 0)
    w[(0, 0) + t] = float("nan")
    return x, w, b


@pytest.mark.parametrize("name", SPECIAL_REGIMES)
def test_nan_weight_reaches_every_output_it_feeds(name):
    # A NaN weight must poison at least every output PyTorch poisons, and leave the finite
    # outputs correct. (Whether it may also poison outputs whose tap reads only padding is the
    # strict test below.)
    case = REGIMES[name]
    x, w, b = _nan_weight(case, "centre")
    y = run(case, x, w, b)
    ref = reference(x, w, b, *case.args)
    assert torch.isnan(ref).any()
    assert torch.isnan(y)[torch.isnan(ref)].all(), "an output fed by the NaN weight is not NaN"
    both = ~torch.isnan(y)
    assert_close_to_reference(torch.where(both, y, 0.0), torch.where(both, ref, 0.0),
                              torch.where(both, magnitude(x, w, b, *case.args), 0.0), tolerance(torch.float32), name)


_PHASE_NAN = pytest.mark.xfail(strict=True, reason=(
    "FINDING (kernels/phase_gemm.py): a NaN/Inf weight tap also turns outputs NaN where that tap would read "
    "outside the input (masked loads give 0, and 0 * NaN = NaN inside the GEMM); PyTorch's CPU kernels leave "
    "those outputs finite. Inherent to implicit GEMM (cuDNN's likely behaves alike); the lead decides whether "
    "it is accepted. strict: this turns into a failure the day the behaviour changes."))


# The FMA-path regime runs the output-head path by default (the rows kind, whose tap sum adds only
# the depth and height taps that reach an output, so the corner tap, cropped along the depth of
# one input plane, never meets the output): like PyTorch.
@pytest.mark.parametrize("name", [pytest.param("tc-k3s2p1op1", marks=_PHASE_NAN), "fma-k3s2p1op1"])
def test_nan_weight_pattern_exactly_like_pytorch(name):
    case = REGIMES[name]
    x, w, b = _nan_weight(case, "corner")
    y = run(case, x, w, b)
    ref = reference(x, w, b, *case.args)
    assert_close_to_reference(y, ref, magnitude(x, w, b, *case.args), tolerance(torch.float32), name)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("name", ["tc-k3s2p1op1", "tc-groups2", "fma-depthwise-multiplier2"])
def test_deterministic(name, layout):
    base = REGIMES[name]
    case = Case(base.batch, base.cin, base.cout, base.in_size, base.kernel, *base.args[:3], base.dilation,
                base.groups, base.bias, layout)
    x, w, b = case.tensors()
    y1, y2 = run(case, x, w, b), run(case, x, w, b)
    assert torch.equal(y1, y2)  # no atomics: bitwise the same output
    assert y1.stride() == y2.stride()


# ---------------------------------------------------------------------------------------------
# The launcher, called directly, with forced configurations
# ---------------------------------------------------------------------------------------------
def _params(case, x, w, b):
    x5 = x if x.dim() == 5 else x.unsqueeze(0)
    params, _ = check_call(x5, w, b, *case.args[:3], case.groups, case.dilation)
    return x5, params


def _variant(cfg, **changes):
    """``cfg`` with some tile fields changed -- only fields this engine's Config has, so the test
    keeps working while the Config grows (BLOCK_W, W_GROUP, ...)."""
    names = {f.name for f in dataclasses.fields(cfg)}
    return dataclasses.replace(cfg, **{k: v for k, v in changes.items() if k in names})


def _distinct_tilings(configs):
    # num_warps and num_stages do not change what the interpreter computes: one run per tiling.
    seen = {}
    for c in configs:
        seen.setdefault(dataclasses.replace(c, num_warps=4, num_stages=1), c)
    return list(seen.values())


CANDIDATE_CASES = {
    "tc-odd-everything": Case(2, 8, 8, (1, 3, 5), (3, 2, 3), 2, 1, (1, 0, 0)),
    "tc-channels_last-out": Case(1, 8, 16, (2, 3, 5), (2, 2, 3), (1, 2, 2), (0, 1, 1), layout="channels_last_3d"),
    "fma-odd-everything": Case(1, 2, 3, (2, 3, 5), (3, 2, 3), 2, 1, (1, 0, 0)),
    # 4 groups of 8 -> 8 (KB 72's group shape): the merged-group candidates (fold 2 and 4).
    "tc-groups4-folds": Case(1, 32, 32, (1, 3, 4), (3, 2, 3), 2, (1, 0, 1), (1, 1, 0), groups=4),
}


@pytest.mark.parametrize("name", list(CANDIDATE_CASES))
def test_launcher_every_candidate_config(name):
    # Tuning on a GPU may pick any candidate: every one of them must compute the same thing.
    case = CANDIDATE_CASES[name]
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    out_cl = memory_format_of(F.conv_transpose3d(x5, w, b, *case.args)) == "channels_last_3d"
    configs = engine.candidate_configs(params, torch.float32, "ieee", out_cl)
    assert configs
    for cfg in _distinct_tilings(configs):
        y = engine.forward(x5, w, b, params, "ieee", config=cfg)
        check_against_reference(y, x5, w, b, *case.args, context=f"{name} {cfg}")


# 3 input channels to 16 or 24 (an RGB decoder input): at exact grade, tensor-core tiles with K padded too.
PADDED_K_CASES = {
    "rgb-to-16": Case(1, 3, 16, (2, 3, 5), (3, 2, 3), 2, 1, (1, 0, 0)),
    "rgb-to-24-stride1": Case(1, 3, 24, (2, 3, 4), (3, 3, 3), 1, 1),
}


@pytest.mark.parametrize("name", list(PADDED_K_CASES))
def test_padded_k_tiles_at_exact_grade(name):
    case = PADDED_K_CASES[name]
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    configs = engine.candidate_configs(params, torch.float32, "tf32x3")
    padded = [c for c in configs if c.use_dot]
    assert padded and all(c.BLOCK_K == 16 for c in padded)
    assert not any(c.use_dot for c in engine.candidate_configs(params, torch.float32, "tf32"))
    for cfg in _distinct_tilings(configs):
        y = engine.forward(x5, w, b, params, "tf32x3", config=cfg)
        check_against_reference(y, x5, w, b, *case.args, context=f"{name} {cfg}")


# Channel tails under forced small tiles: Cin/g = 20 (two K blocks of 16, the second partial) and
# Cout/g = 20 (two channel tiles of 16).
TAILS_CASE = Case(1, 20, 20, (1, 3, 4), (2, 2, 2), 2, (0, 1, 0), (1, 0, 1))


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_launcher_forced_channel_tiles(precision):
    case = TAILS_CASE
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    base = engine.candidate_configs(params, torch.float32, precision)[0]
    cfg = _variant(base, BLOCK_N=16, BLOCK_K=16)
    assert (cfg.BLOCK_N, cfg.BLOCK_K) == (16, 16)
    y = engine.forward(x5, w, b, params, precision, config=cfg)
    check_against_reference(y, x5, w, b, *case.args, precision=precision, context=str(cfg))


def test_launcher_default_config_and_candidates():
    case = REGIMES["tc-k3s2p1op1"]
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    cands = engine.plan(params, x5, w, "ieee").configs
    assert cands, "no candidate configuration"
    assert all(c.use_dot and c.BLOCK_K >= 16 and c.BLOCK_N >= 16 for c in cands)  # tl.dot minimum tile
    y_default = engine.forward(x5, w, b, params, "ieee")
    y_first = engine.forward(x5, w, b, params, "ieee", config=cands[0])
    assert torch.equal(y_default, y_first)  # untuned (CPU): the first candidate is the default
    fma_params = ConvT3dParams.create(1, 4, 4, 4, (3, 3, 3), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1))
    fma_cands = engine.candidate_configs(fma_params, torch.float32, "ieee")
    # Four output channels per group: the phase path's FMA tiles, and the output-head tiles the
    # tuner times against them.
    assert all(not c.use_dot and c.BLOCK_K == 1 for c in fma_cands if not getattr(c, "head", ""))
    assert any(getattr(c, "head", "") for c in fma_cands) and any(not getattr(c, "head", "") for c in fma_cands)


def test_launcher_rejects_unknown_precision():
    case = REGIMES["fma-cout1"]
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    with pytest.raises(ValueError, match="precision"):
        engine.forward(x5, w, b, params, "fp32")


def test_cpu_without_interpreter_is_refused(monkeypatch):
    # Without TRITON_INTERPRET=1 at import, CPU tensors cannot run Triton kernels: a clear error
    # that names the variable, never a silent fallback to PyTorch.
    monkeypatch.setattr(triton_sites, "interpreter_active", lambda: False)
    case = REGIMES["fma-cout1"]
    x, w, b = case.tensors()
    with pytest.raises(convt3d.BackendUnavailableError, match="TRITON_INTERPRET"):
        run(case, x, w, b)


# ---------------------------------------------------------------------------------------------
# The checker itself can fail (no tautologies)
# ---------------------------------------------------------------------------------------------
CHECK_CASE = Case(1, 16, 8, (3, 3, 3), (3, 3, 3), 2, 1, 1)


def _tf32_round(t):
    # Round to 10 explicit mantissa bits (nearest), as TF32 tensor cores see their operands.
    i = t.float().view(torch.int32)
    return ((i + 0x1000) & -8192).view(torch.float32)


def test_checker_rejects_tf32_result_at_ieee_grade():
    x, w, b = CHECK_CASE.tensors()
    args = CHECK_CASE.args
    tf32_result = F.conv_transpose3d(_tf32_round(x).double(), _tf32_round(w).double(), b.double(), *args).float()
    check_against_reference(tf32_result, x, w, b, *args, precision="tf32")  # fine at tf32 grade...
    with pytest.raises(AssertionError, match="outside tolerance"):
        check_against_reference(tf32_result, x, w, b, *args, precision="ieee")  # ...not at exact grade


def test_checker_rejects_one_wrong_element():
    x, w, b = CHECK_CASE.tensors()
    y = reference(x, w, b, *CHECK_CASE.args).float()
    check_against_reference(y, x, w, b, *CHECK_CASE.args)
    y[0, 3, 2, 2, 2] *= 1 + 1e-3
    with pytest.raises(AssertionError, match="1 of"):
        check_against_reference(y, x, w, b, *CHECK_CASE.args)


def test_checker_rejects_unwritten_bias_position():
    # KB77-like geometry: position (0, 0, 0) of every channel is in an empty phase, bias only.
    case = REGIMES["tc-kb77-scaled"]
    x, w, _ = case.tensors()
    b = torch.randn(case.cout)
    y = reference(x, w, b, *case.args).float()
    y[0, :, 0, 0, 0] = 0.0
    with pytest.raises(AssertionError, match="outside tolerance"):
        check_against_reference(y, x, w, b, *case.args)


def test_checker_rejects_missing_nan():
    x, w, b = CHECK_CASE.tensors()
    x.view(-1)[5] = float("nan")
    y = reference(x, w, b, *CHECK_CASE.args).float()
    y = torch.nan_to_num(y, nan=0.0)
    with pytest.raises(AssertionError, match="NaN pattern"):
        check_against_reference(y, x, w, b, *CHECK_CASE.args)


def test_fp16_tolerance_is_tight():
    # An fp16 result accumulated in fp16 (instead of fp32) must fail the fp16 bound.
    x, w, b = CHECK_CASE.tensors(torch.float16)
    y16 = torch.zeros(reference(x, w, b, *CHECK_CASE.args).shape, dtype=torch.float16)
    # Accumulate tap by tap in fp16: each partial sum rounded to fp16.
    k = CHECK_CASE.kernel
    for t in range(k[0] * k[1] * k[2]):
        wt = torch.zeros_like(w)
        wt.view(w.shape[0], w.shape[1], -1)[..., t] = w.view(w.shape[0], w.shape[1], -1)[..., t]
        y16 = (y16.double() + F.conv_transpose3d(x.double(), wt.double(), None, *CHECK_CASE.args)).half()
    y16 = (y16.double() + b.double()[None, :, None, None, None]).half()
    with pytest.raises(AssertionError, match="outside tolerance"):
        check_against_reference(y16, x, w, b, *CHECK_CASE.args)


# ---------------------------------------------------------------------------------------------
# Every kernel path of the launcher on the same inputs: flat_gemm_kernel (2-D TMA over a haloed
# copy), phase_gemm_kernel with 5-D TMA boxes and with pointer loads, and the three ways of
# writing rows no tap reaches (companion rows + plane fill, fill_rows_kernel, in-grid programs).
# The interpreter emulates TMA (out-of-range boxes read zeros), so CI runs the Hopper paths too.
# ---------------------------------------------------------------------------------------------
PATH_CASES = {
    "kb77-like": Case(1, 8, 16, (2, 4, 4), (3, 3, 3), 2, 1, 0, 2),  # empty planes, rows, W residue
    "k2s3-empty-residues": Case(1, 8, 8, (2, 3, 3), (2, 2, 2), 3, 0, 2),
    "per-dim-everything": Case(1, 8, 8, (3, 4, 3), (1, 2, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (1, 1, 2)),
    "groups2-cl": Case(1, 32, 32, (2, 3, 3), (3, 3, 3), 2, 1, 1, groups=2, layout="channels_last_3d"),
    "cin20-cout24": Case(1, 20, 24, (2, 3, 4), (3, 3, 3), 2, 1, 1),  # channel tails, Cout not pow2
    # Kernels wider than the input: tiles at the borders skip the taps that read only halo.
    "k5s1-border-taps": Case(1, 8, 16, (2, 10, 12), (3, 5, 5), 1, 0, 0),
    "dilated-border-taps": Case(1, 8, 8, (3, 6, 9), (3, 3, 3), 1, 2, 0, 2),
}
PATHS = {
    "flat": dict(flat=True, tma=False),
    "tma-5d": dict(flat=False, tma=True),
    "pointer": dict(flat=False, tma=False),
    "fill-rows-kernel": dict(flat=False, tma=False, companions=False, fill_separate=True),
    "in-grid-fill": dict(flat=False, tma=False, companions=False, fill_separate=False),
    "flat-fill-rows-kernel": dict(flat=True, companions=False, fill_separate=True),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(PATH_CASES))
def test_every_kernel_path(name, path):
    case = PATH_CASES[name]
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    out_cl = memory_format_of(F.conv_transpose3d(x5, w, b, *case.args)) == "channels_last_3d"
    base = engine.candidate_configs(params, torch.float32, "ieee", out_cl, flat=True)[0]
    cfg = dataclasses.replace(base, **PATHS[path])
    if not cfg.flat:
        cfg = dataclasses.replace(cfg, BLOCK_W=triton_configs.block_w(params.compact_size[1:], cfg.BLOCK_M))
    y = poisoned_call(engine, lambda: engine.forward(x5, w, b, params, "ieee", config=cfg))
    check_against_reference(y, x5, w, b, *case.args, context=f"{name} {cfg}")


def test_flat_path_is_the_default_where_tma_works():
    case = PATH_CASES["kb77-like"]
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    assert engine.candidate_configs(params, torch.float32, "tf32", False, flat=True)[0].flat
    # fp32 with 10 input channels: rows of 40 bytes are not 16-byte aligned, so no TMA.
    odd = ConvT3dParams.create(1, 10, 8, 1, (2, 3, 3), (3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1))
    assert triton_configs.flat_unsupported(odd, torch.float32, 16) == "channel rows not 16-byte aligned"
    assert not any(getattr(c, "flat", False) or getattr(c, "tma", False)
                   for c in engine.candidate_configs(odd, torch.float32, "tf32", False, flat=True))


# ---------------------------------------------------------------------------------------------
# The steady path: after a signature's first call, forward() replays the held plan, config and
# launch sites (triton_engine._Steps) instead of preparing the call again.
# ---------------------------------------------------------------------------------------------
STEADY_REGIMES = ["tc-kb77-scaled", "tc-k3s2p1op1", "tc-groups2", "tc-stride1-k3p1", "fma-k1s4",
                  "fma-depthwise", "tc-kernel-below-stride"]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d", "slice_w"])
@pytest.mark.parametrize("name", STEADY_REGIMES)
def test_steady_path_replays_the_first_call(name, layout, monkeypatch):
    base = REGIMES[name]
    case = Case(base.batch, base.cin, base.cout, base.in_size, base.kernel, *base.args[:3], base.dilation,
                base.groups, bias=base.bias, layout=layout)
    x, w, b = case.tensors()
    first = run(case, x, w, b)
    # The second call must not prepare the call again: prepare() now raises.
    monkeypatch.setattr(engine, "prepare", lambda *a, **k: pytest.fail("steady call went through prepare()"))
    # New tensors with the same signature (x's strides, views included).
    x2 = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype).copy_(x * 0.5)
    w2 = torch.empty_strided(w.size(), w.stride(), dtype=w.dtype).copy_(w * 2.0)
    second = run(case, x2, w2, b)
    third = run(case, x, w, b)
    assert torch.equal(third, first), "the steady path differs from the first call"
    assert second.stride() == first.stride()
    check_against_reference(second, x2, w2, b, *case.args, context=f"{name} {layout} steady")


def test_steady_path_follows_a_new_signature():
    # Same geometry, another input layout: a new signature, so a new first call (its own strides).
    case = REGIMES["tc-k3s2p1op1"]
    x, w, b = case.tensors()
    y1 = run(case, x, w, b)
    xs = x.to(memory_format=torch.channels_last_3d)
    y2 = run(case, xs, w, b)
    check_against_reference(y1, x, w, b, *case.args, context="contiguous")
    check_against_reference(y2, xs, w, b, *case.args, context="channels_last_3d")


def test_seeded_config_reaches_a_settled_signature():
    # A config seeded after a signature settled (the disk cache, tests) is the one used next.
    case = REGIMES["tc-k3s2p1op1"]
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    run(case, x, w, b)
    pl = engine.plan(params, x5, w, "ieee")
    other = pl.configs[-1]
    engine._tuned.pop(pl.tune_key, None)
    engine.seed_tuning(pl.tune_key, other)
    seen = []
    orig = engine._steps_for
    engine_steps = lambda params, pl, cfg, has_bias, x, *epi: seen.append(cfg) or orig(params, pl, cfg, has_bias, x, *epi)  # noqa: E731,E501
    try:
        engine._steps_for = engine_steps
        y = run(case, x, w, b)
    finally:
        engine._steps_for = orig
        engine._tuned.pop(pl.tune_key, None)
        engine._forget_settled()  # the signature settled on the seeded tile: later tests start untuned
    assert seen and seen[-1] == other
    check_against_reference(y, x, w, b, *case.args, context="seeded")


@pytest.mark.parametrize("groups,cin_g,cout_g,expected", [
    pytest.param(4, 8, 8, (2, 4), id="kb72-4x8to8-smallest-and-full"),
    pytest.param(2, 8, 16, (2,), id="2x8to16-full-is-smallest"),
    pytest.param(32, 8, 8, (2,), id="32x8to8-full-beyond-128-channels"),
    pytest.param(1, 8, 8, (), id="ungrouped"),
    pytest.param(4, 16, 16, (), id="groups-fill-tiles"),
    pytest.param(8, 4, 4, (), id="fma-path-groups"),
])
def test_group_folds(groups, cin_g, cout_g, expected):
    params = ConvT3dParams.create(1, groups * cin_g, groups * cout_g, groups, (3, 3, 3), (3, 3, 3), (2, 2, 2),
                                  (1, 1, 1), (0, 0, 0), (1, 1, 1))
    assert triton_configs.group_folds(params) == expected
    folds = {getattr(c, "fold", 1) for c in engine.candidate_configs(params, torch.float32, "ieee")}
    assert folds == {1, *expected}
    for f in expected:
        merged = params.fold_groups(f)
        assert (merged.groups, merged.in_channels, merged.out_channels) == (groups // f, params.in_channels,
                                                                            params.out_channels)


def test_fold_groups_rejects_a_non_divisor():
    params = ConvT3dParams.create(1, 24, 24, 3, (2, 2, 2), (2, 2, 2), (1, 1, 1), (0, 0, 0), (0, 0, 0), (1, 1, 1))
    with pytest.raises(ValueError, match="fold=2"):
        params.fold_groups(2)


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_flat_k64_candidate(precision):
    # 48 input channels: fp32 calls on tensor cores also get a 64-channel K step (one per tap),
    # which the tuner may pick (KB 70); every candidate must compute the same thing.
    case = Case(1, 48, 24, (2, 3, 4), (2, 3, 2), 1, (0, 1, 0))
    x, w, b = case.tensors()
    x5, params = _params(case, x, w, b)
    configs = engine.candidate_configs(params, torch.float32, precision, False, True)
    assert any(getattr(c, "flat", False) and c.BLOCK_K == 64 for c in configs)
    for cfg in _distinct_tilings(configs):
        y = engine.forward(x5, w, b, params, precision, config=cfg)
        check_against_reference(y, x5, w, b, *case.args, precision=precision, context=str(cfg))
