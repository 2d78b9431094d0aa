"""The output-head path (head_engine, kernels/head_gemm.py) through Triton's interpreter.

Layers with 1-15 output channels per group get head configurations as tuning candidates of the
Triton engine; on CPU nothing is timed, so these tests force them with the engine's ``config=``
argument (and once through the public API by seeding the tuner, as a persisted tuning result
would). Every output is compared with float64 PyTorch element by element (conftest.Tol), so
positions no tap reaches (bias only) are checked as well as the summed ones.

Shapes are tiny (the interpreter costs ~1 s per call here) but each regime really occurs:
overlapping taps (the rows kind, and the shuffle kind at dilation 1) and collision-free layers
(the shuffle kind, with and without positions no tap reaches), groups, several M tiles, several
N tiles, several K steps, output rows wider than the tap sum's span, every input layout,
unbatched input.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import convt3d
import convt3d.engines.triton.engine as engine
from convt3d.dispatch import cache
from convt3d.engines.triton import head as head_engine
from convt3d.core.params import ConvT3dParams, pow2_at_least
from convt3d.core.validate import check_call

from conftest import LAYOUTS, Case, check_against_reference, memory_format_of, requires_interpreter
from convt3d.engines.triton.persist import prime_triton

pytestmark = requires_interpreter


def head_configs(case: Case, x, w, precision="ieee"):
    params, _ = check_call(x, w, None, *case.args)
    x5 = x if x.dim() == 5 else x.unsqueeze(0)
    return params, x5, [c for c in engine.plan(params, x5, w, precision).configs if getattr(c, "head", "")]


def _variant(c):
    """What a head tile's program does, apart from its tile sizes and launch parameters."""
    return (c.head, c.use_dot, bool(c.persist), c.w_packed, c.n_joint, c.x_cl, c.shifts_n, c.z_bf16)


def run_head(case: Case, x, w, b, precision="ieee", pick=0, kind=None, **override):
    """The Triton engine's forward with the ``pick``-th head candidate (of ``kind``, if given)
    forced (fields in ``override`` replaced); unbatched input is given its batch of one here, as
    the API does."""
    params, x5, configs = head_configs(case, x, w, precision)
    configs = [c for c in configs if kind in (None, getattr(c, "head", ""))]
    assert configs, f"the case has no head candidate of kind {kind}"
    if pick == "widest":  # the first candidate's kernel variant at its tile of fewest programs
        configs = [max((c for c in configs if _variant(c) == _variant(configs[0])),
                       key=lambda c: c.BLOCK_M * c.BLOCK_N)]
        pick = 0
    cfg = dataclasses.replace(configs[pick], **override)
    y = engine.forward(x5, w, b, params, precision, config=cfg)
    return y if x.dim() == 5 else y.squeeze(0)


# ---------------------------------------------------------------------------------------------
# Regimes: Case(batch, cin, cout, in_size, kernel, stride, padding, output_padding, dilation, groups)
# ---------------------------------------------------------------------------------------------
REGIMES = {
    # overlap: taps meet on the output (the rows kind; the shuffle kind too at dilation 1)
    "overlap-c1-k4s2p1": Case(2, 4, 1, (2, 3, 4), (4, 4, 4), 2, 1),  # 3-D GAN voxel head
    "overlap-c3-k144-s122-cl": Case(2, 6, 3, (2, 3, 5), (1, 4, 4), (1, 2, 2), (0, 1, 1),
                                    layout="channels_last_3d"),  # RGB video head
    "overlap-c8-k3-s122-op011": Case(1, 8, 8, (2, 3, 4), (3, 3, 3), (1, 2, 2), 1, (0, 1, 1)),
    "overlap-c15-odd": Case(1, 5, 15, (1, 3, 5), (2, 3, 3), 2, (0, 1, 1), 1),
    "overlap-stride1-k3p1-c4": Case(1, 6, 4, (2, 3, 3), (3, 3, 3), 1, 1),
    "overlap-videogpt-p3-c5": Case(1, 4, 5, (3, 4, 4), (4, 4, 4), 2, 3, bias=False),  # padding above stride
    "overlap-dilation2-stride2-op": Case(1, 3, 2, (2, 3, 3), (2, 3, 2), 2, 1, 1, 2),
    "overlap-dilation3-stride2": Case(1, 2, 2, (2, 3, 3), (3, 2, 3), 2, 1, 1, 3),  # gcd(s, d) = 1
    "overlap-per-dim-everything": Case(1, 4, 3, (3, 4, 3), (2, 3, 3), (1, 2, 4), (0, 1, 1), (0, 1, 2), (1, 1, 2)),
    "overlap-groups2-c3": Case(2, 8, 6, (2, 3, 3), (3, 3, 3), 2, 1, 1, groups=2),
    "overlap-depthwise-c1": Case(1, 3, 3, (2, 3, 4), (3, 3, 3), 2, 1, 1, groups=3),
    "overlap-m-tiles": Case(1, 4, 2, (2, 9, 10), (3, 3, 3), 2, 1, bias=False),  # 180 positions: 2 M tiles of 128
    "overlap-k144-s2-unreached-planes": Case(1, 4, 2, (2, 3, 3), (1, 4, 4), 2, (0, 1, 1), (1, 0, 0)),  # odd od: bias
    "overlap-k-steps-n-tiles": Case(1, 40, 6, (1, 3, 3), (3, 3, 3), 2, 1),  # K 40 = 2 steps of 32; N 162 = 2 tiles
    # free: collision-free (dilation * (k - 1) < stride along every dimension), at dilation 1
    "free-c2-k2s2": Case(2, 8, 2, (2, 3, 4), (2, 2, 2), 2),  # every position reached
    "free-c3-k2s3-fill": Case(1, 4, 3, (2, 3, 3), (2, 2, 2), 3, 0, 1),  # residue 2 and the op row: bias only
    "free-pointwise-k1s1": Case(1, 5, 4, (2, 3, 4), (1, 1, 1), 1),
    "free-k2s2-p1-groups2": Case(1, 4, 4, (2, 3, 4), (2, 2, 2), 2, 1, 1, groups=2),  # cropped edges
    "free-k1s2-unreached": Case(1, 3, 1, (2, 3, 3), (1, 1, 1), 2, 0, 1),  # 7 of 8 phases empty
}
# Heads neither kind takes (the rows kind is offered where taps meet at a power-of-two width
# stride, the shuffle kind at dilation 1): collision-free layers and a width stride of 3, each
# with a dilation past 1.
NO_HEAD_REGIMES = {
    "free-k2-dilation3-stride2": Case(1, 2, 2, (2, 3, 3), (2, 2, 2), 2, 1, 1, 3),  # taps 3 apart
    "free-per-dim-everything": Case(1, 4, 3, (3, 4, 3), (1, 2, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (1, 1, 2)),
    "overlap-w-stride3-dilation2": Case(1, 4, 3, (3, 4, 3), (2, 3, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (1, 1, 2)),
}


def _kinds(case: Case) -> list[str]:
    x, w, _ = case.tensors()
    return list(dict.fromkeys(getattr(c, "head", "") for c in head_configs(case, x, w)[2]))


def test_regime_names_match_the_kind():
    # "overlap"/"free" must describe what the launcher really runs: taps that meet get the rows
    # kind where the W stride is a power of two, and every layer at dilation 1 the shuffle kind.
    for name, case in REGIMES.items():
        kinds = _kinds(case)
        sw = case.stride if isinstance(case.stride, int) else case.stride[2]
        params = check_call(*case.tensors()[:2], None, *case.args)[0]
        assert head_engine.collision_free(params) == name.startswith("free"), name
        want = (["rows"] if name.startswith("overlap") and sw & (sw - 1) == 0 else []) + (
            ["shuffle"] if head_engine.shuffle_layer(params) else [])
        assert kinds == want and kinds, name


@pytest.mark.parametrize("name", list(NO_HEAD_REGIMES))
def test_heads_neither_kind_takes_run_the_phase_path(name):
    # No head candidate: the plan's tiles are the phase GEMM's, and its default is right.
    case = NO_HEAD_REGIMES[name]
    x, w, b = case.tensors()
    params, x5, heads = head_configs(case, x, w)
    assert not heads and engine.plan(params, x5, w, "ieee").configs
    y = engine.forward(x5, w, b, params, "ieee")
    check_against_reference(y, x5, w, b, *case.args, precision="ieee", context=name)


KIND_CASES = [(name, kind) for name, case in REGIMES.items() for kind in _kinds(case)]


@pytest.mark.parametrize("name, kind", KIND_CASES, ids=[f"{n}-{k}" for n, k in KIND_CASES])
def test_fp32_ieee(name, kind):
    # The regime is what is checked here, not the tile: the widest tile of the default's variant runs
    # (the interpreter's time grows with the programs; the default tile runs in the tests of tiles).
    case = REGIMES[name]
    x, w, b = case.tensors()
    y = run_head(case, x, w, b, "ieee", kind=kind, pick="widest")
    check_against_reference(y, x, w, b, *case.args, precision="ieee", context=f"{name} {kind}")
    assert memory_format_of(y) == ("channels_last_3d" if case.layout == "channels_last_3d" else "contiguous")


PRECISION_REGIMES = ["overlap-c1-k4s2p1", "overlap-groups2-c3", "overlap-k-steps-n-tiles", "free-c3-k2s3-fill"]


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("name", PRECISION_REGIMES)
@pytest.mark.parametrize("pick", [0, -1], ids=["first", "last"])
def test_fp32_tf32_precisions(name, precision, pick):
    # The first head tile (the untuned default) and the last one offered.
    case = REGIMES[name]
    x, w, b = case.tensors()
    y = run_head(case, x, w, b, precision, pick=pick)
    check_against_reference(y, x, w, b, *case.args, precision=precision, context=f"{name} {precision} {pick}")


def test_tf32_rounds_operands_to_nearest():
    # "tf32" must be exactly TF32 arithmetic with round-to-nearest operands (cuDNN's numerics):
    # against float64 of the rounded operands the error is fp32 accumulation only, far below
    # the TF32 rounding itself (which the unrounded reference would show).
    case = REGIMES["overlap-c1-k4s2p1"]
    x, w, b = case.tensors()
    y = run_head(case, x, w, b, "tf32")

    def rnd(t):
        bits = t.contiguous().view(torch.int32)
        return ((bits + 0x1000) & -8192).view(torch.float32)

    check_against_reference(y, rnd(x), rnd(w), b, *case.args, precision="ieee", context="rounded operands")


@pytest.mark.parametrize("kind", ["rows", "shuffle"])
@pytest.mark.parametrize("name", ["overlap-c3-k144-s122-cl", "overlap-groups2-c3"])
def test_float16(name, kind):
    case = REGIMES[name]
    x, w, b = case.tensors(torch.float16)
    y = run_head(case, x, w, b, kind=kind, pick="widest")  # the dtype is checked, not the tile
    check_against_reference(y, x, w, b, *case.args, context=f"{name} {kind}")


def test_float16_collision_free():
    case = REGIMES["free-c3-k2s3-fill"]
    x, w, b = case.tensors(torch.float16)
    check_against_reference(run_head(case, x, w, b, kind="shuffle"), x, w, b, *case.args, context="float16")


LAYOUT_BASES = {"rows": "overlap-c3-k144-s122-cl", "shuffle": "free-c2-k2s2"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(LAYOUT_BASES))
def test_input_layouts(kind, layout):
    # slice_w and transpose_dh cannot walk D, H, W by one stride: the GEMM divides per row.
    case = dataclasses.replace(REGIMES[LAYOUT_BASES[kind]], layout=layout)
    x, w, b = case.tensors()
    y = run_head(case, x, w, b, kind=kind)
    check_against_reference(y, x, w, b, *case.args, context=f"{kind} {layout}")


@pytest.mark.parametrize("kind", ["rows", "shuffle"])
def test_unbatched_input(kind):
    base = REGIMES["free-c3-k2s3-fill" if kind == "shuffle" else "overlap-c1-k4s2p1"]
    case = dataclasses.replace(base, batch=None)
    x, w, b = case.tensors()
    assert x.dim() == 4
    y = run_head(case, x, w, b, kind=kind)
    check_against_reference(y, x, w, b, *case.args, context=f"{kind} unbatched")


@pytest.mark.parametrize("kind", ["rows", "shuffle"])
def test_first_tile_of_each_kind_over_m_tiles(kind):
    case = REGIMES["overlap-m-tiles"]
    x, w, b = case.tensors()
    check_against_reference(run_head(case, x, w, b, kind=kind), x, w, b, *case.args, context=kind)


PERSISTENT_ROWS = {
    "m-tail": REGIMES["overlap-m-tiles"],
    "groups2": REGIMES["overlap-groups2-c3"],
    "video-head-cl": REGIMES["overlap-c3-k144-s122-cl"],
    "gan-head-batch2": REGIMES["overlap-c1-k4s2p1"],
    # K 40 = 2 steps of 32, N 8 x 3 x 3 x 2 = 144 = 2 tiles of 128
    "k-steps-n-tiles": Case(1, 40, 8, (2, 5, 6), (3, 3, 3), 2, 1),
    "dilation2-op": Case(1, 3, 2, (2, 4, 7), (2, 3, 2), 2, 1, 1, 2),
}


@pytest.mark.parametrize("name", list(PERSISTENT_ROWS))
def test_persistent_rows_walks_every_tile(name):
    # The persistent rows tile (Config.persist): on the CPU three programs loop over all
    # (group, batch, M) tiles; BLOCK_M 16 makes several tiles per program in every regime
    # (M tails, K steps, N tiles, groups, channels-last, dilation).
    # (Forced on the first rows tile: where the shared-memory estimate offers none, as for the
    # K-steps/N-tiles layer, the kernel must still be right.)
    case = PERSISTENT_ROWS[name]
    x, w, b = case.tensors()
    params, x5, _ = head_configs(case, x, w)
    rows_m = math.prod(params.in_size[:2]) * -(-params.out_size[2] // params.stride[2])
    tiles = params.groups * params.batch * -(-rows_m // 16)
    assert tiles > head_engine.persistent_programs(x5.device, tiles, 1), "each program must walk several tiles"
    y = run_head(case, x, w, b, kind="rows", BLOCK_M=16, persist=1, num_stages=2)
    check_against_reference(y, x, w, b, *case.args, context=f"{name} persistent rows")


@pytest.mark.parametrize("block_n", [16, 32, 64], ids=["n16-9-tiles", "n32-5-tiles-tail", "n64-3-tiles-tail"])
def test_persistent_rows_feeds_every_n_tile_from_one_input_tile(block_n):
    # The persistent rows kernel loads each input tile once and steps every N tile's
    # accumulator with it: 144 columns (8 channels x 3 x 3 taps x SW 2) in 9, 5 or 3 N tiles,
    # the last two partly padding, with two K steps (40 channels) and two width shifts.
    case = PERSISTENT_ROWS["k-steps-n-tiles"]
    x, w, b = case.tensors()
    y = run_head(case, x, w, b, kind="rows", BLOCK_M=16, BLOCK_N=block_n, persist=1, num_stages=2)
    check_against_reference(y, x, w, b, *case.args, context=f"persistent rows, BLOCK_N {block_n}")


@pytest.mark.parametrize("name", list(PERSISTENT_ROWS))
def test_packed_weight_rows(name):
    # The single-sweep rows kernel on the packed weight (Config.w_packed): head_rows_pack_kernel's
    # dense copy (zeros where a width shift has no tap and past Cin/g) read at each (shift,
    # K step) of one flat loop; BLOCK_M 16 for several M tiles.
    case = PERSISTENT_ROWS[name]
    x, w, b = case.tensors()
    engine.clear_caches()  # no launch site of another test's tile
    y = run_head(case, x, w, b, kind="rows", BLOCK_M=16, persist=0, num_stages=2, w_packed=True)
    check_against_reference(y, x, w, b, *case.args, context=f"{name} packed rows")
    rows = [s for s in engine._sites.values() if s.name == "head_rows_kernel"]
    assert [(s.consts["W_PACKED"], s.consts["UNROLL"]) for s in rows] == [(True, False)]


@pytest.mark.parametrize("block_n", [16, 32, 64], ids=["n16-9-tiles", "n32-5-tiles-tail", "n64-3-tiles-tail"])
def test_packed_weight_rows_steps_every_n_tile_jointly(block_n):
    # Config.n_joint: the packed single sweep steps every N tile's accumulator with each input
    # tile (a tuple carried through its runtime loop): 144 columns in 9, 5 or 3 N tiles, two K
    # steps (40 channels, the second partly padding) and two width shifts, several M tiles.
    case = PERSISTENT_ROWS["k-steps-n-tiles"]
    x, w, b = case.tensors()
    engine.clear_caches()
    y = run_head(case, x, w, b, kind="rows", BLOCK_M=16, BLOCK_N=block_n, persist=0, num_stages=2,
                 w_packed=True, n_joint=True)
    check_against_reference(y, x, w, b, *case.args, context=f"packed rows, N joint, BLOCK_N {block_n}")
    rows = [s for s in engine._sites.values() if s.name == "head_rows_kernel"]
    assert [(s.consts["W_PACKED"], s.consts["N_JOINT"], s.consts["N_TILES"]) for s in rows] == \
        [(True, True, -(-144 // block_n))]


@pytest.mark.parametrize("name", [n for n in PERSISTENT_ROWS if n != "k-steps-n-tiles"])
def test_packed_weight_rows_jointly_in_every_regime(name):
    # Config.n_joint at BLOCK_N 16 (several N tiles wherever the columns pass 16): M tails,
    # groups, channels-last input, a batch of two, dilation with output padding.
    case = PERSISTENT_ROWS[name]
    x, w, b = case.tensors()
    engine.clear_caches()
    y = run_head(case, x, w, b, kind="rows", BLOCK_M=16, BLOCK_N=16, persist=0, num_stages=2,
                 w_packed=True, n_joint=True)
    check_against_reference(y, x, w, b, *case.args, context=f"{name} packed rows, N joint")


def test_joint_n_tiles_are_offered_where_the_columns_pass_one_tile():
    # head_engine._packed: joint tiles at BLOCK_N 64 where the rows columns exceed 128 (the
    # 128 -> 8 k3 head's 144), none where one N tile holds them.
    wide = _params(8, cin=128, size=(4, 8, 8), stride=(1, 2, 2), output_padding=(0, 1, 1))
    narrow = _params(3, cin=64, size=(4, 8, 8), kernel=(1, 4, 4), stride=(1, 2, 2), padding=(0, 1, 1))
    for params, joint in ((wide, True), (narrow, False)):
        tiles = head_engine.head_tiles(params, torch.float32, "tf32", channels_last=True)
        nj = [t for t in tiles if t.get("n_joint")]
        assert bool(nj) == joint and all(t["w_packed"] and t["BLOCK_N"] == 64 and not t.get("persist") for t in nj)


@pytest.mark.parametrize("override", [dict(persist=1), dict(head="shuffle")], ids=["persistent", "shuffle"])
def test_packed_weight_is_a_single_sweep_rows_option(override):
    case = PERSISTENT_ROWS["m-tail"]
    x, w, b = case.tensors()
    with pytest.raises(ValueError, match="w_packed"):
        run_head(case, x, w, b, kind="rows", w_packed=True, **override)


@pytest.mark.parametrize("head", ["gather", "direct", "fused", "box"])
def test_a_head_config_of_no_kind_is_refused(head):
    # Only the rows and shuffle kinds have kernels: a hand-built config naming another kind
    # (forward's config= takes any) raises instead of running the rows kernels.
    case = PERSISTENT_ROWS["m-tail"]
    x, w, b = case.tensors()
    with pytest.raises(ValueError, match="not a head kind"):
        run_head(case, x, w, b, kind="rows", head=head)


def test_joint_n_tiles_need_the_packed_weight():
    case = PERSISTENT_ROWS["m-tail"]
    x, w, b = case.tensors()
    with pytest.raises(ValueError, match="n_joint"):
        run_head(case, x, w, b, kind="rows", persist=0, n_joint=True)


@pytest.mark.parametrize("layout", ["contiguous", "slice_w"])
@pytest.mark.parametrize("tile", [dict(persist=1), dict(persist=0, w_packed=True)], ids=["persistent", "packed"])
def test_rows_on_a_channels_last_copy(tile, layout):
    # HeadConfig.x_cl: the rows GEMM reads a channels-last copy of the caller's NCDHW or strided
    # input; the output keeps the caller's layout.
    case = dataclasses.replace(PERSISTENT_ROWS["k-steps-n-tiles"], layout=layout)
    x, w, b = case.tensors()
    engine.clear_caches()
    y = run_head(case, x, w, b, kind="rows", BLOCK_M=16, BLOCK_N=64, num_stages=2, x_cl=True, **tile)
    check_against_reference(y, x, w, b, *case.args, context=f"rows on a channels-last copy, {layout}")
    rows = [s for s in engine._sites.values() if s.name == "head_rows_kernel"]
    assert [s.ints[-7] for s in rows] == [1], "the GEMM reads channels-last strides (stride_xc 1)"


@pytest.mark.parametrize("dtype,precision,layout_out", [
    (torch.bfloat16, "tf32", "ncdhw"), (torch.float32, "tf32", "ncdhw"), (torch.float32, "tf32", "cl")],
    ids=["bf16-ncdhw", "fp32-tf32-ncdhw", "fp32-tf32-cl"])
def test_channels_last_copies_are_offered_for_ncdhw_and_tf32_calls(dtype, precision, layout_out):
    # The copy tiles (HeadConfig.x_cl): for NCDHW calls (vector loads) and for fp32 calls at TF32
    # (the copy rounds the input); each is a persistent or packed rows tile of the plain list.
    params = ConvT3dParams(4, 240, 3, 1, (18, 66, 66), (4, 4, 4), (2, 2, 2), (3, 3, 3), (0, 0, 0), (1, 1, 1))
    configs = engine.candidate_configs(params, dtype, precision, channels_last_out=layout_out == "cl")
    copies = [c for c in configs if getattr(c, "x_cl", False)]
    assert copies and all(getattr(c, "head", "") == "rows" and (c.persist or c.w_packed) for c in copies)
    plain = [c for c in configs if getattr(c, "head", "") and not c.x_cl]
    assert all(dataclasses.replace(c, x_cl=False) in plain for c in copies)


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "tf32"), (torch.float32, "tf32x3"),
                                             (torch.float32, "ieee")], ids=["bf16", "fp32-tf32x3", "fp32-ieee"])
def test_channels_last_calls_get_no_copy_tiles_unless_rounded(dtype, precision):
    params = ConvT3dParams(4, 240, 3, 1, (18, 66, 66), (4, 4, 4), (2, 2, 2), (3, 3, 3), (0, 0, 0), (1, 1, 1))
    assert not any(getattr(c, "x_cl", False) for c in engine.candidate_configs(params, dtype, precision, channels_last_out=True))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("tile", [dict(persist=0), dict(persist=1), dict(persist=0, w_packed=True),
                                  dict(persist=1, x_cl=True), dict(persist=0, w_packed=True, x_cl=True),
                                  dict(persist=0, w_packed=True, n_joint=True),
                                  dict(persist=0, w_packed=True, n_joint=True, x_cl=True)],
                         ids=["gathered-w", "persistent", "packed", "persistent-copy", "packed-copy", "packed-joint",
                              "packed-joint-copy"])
def test_rows_tf32_rounds_each_operand_once(tile, layout):
    # At TF32 each operand is rounded to nearest exactly once, wherever it is rounded: the input
    # in registers or by the channels-last copy (x_cl), the weight in registers as it is
    # gathered or by head_rows_pack_kernel (w_packed). Against float64 of the rounded operands
    # the error is fp32 accumulation only (ieee tolerance); a missed rounding shows TF32's own
    # error, and a second rounding of a rounded value changes nothing (so this also holds).
    case = dataclasses.replace(PERSISTENT_ROWS["k-steps-n-tiles"], layout=layout)
    x, w, b = case.tensors()
    engine.clear_caches()
    y = run_head(case, x, w, b, "tf32", kind="rows", BLOCK_M=16, BLOCK_N=64, num_stages=2, **tile)

    def rnd(t):
        bits = t.contiguous().view(torch.int32)
        return ((bits + 0x1000) & -8192).view(torch.float32)

    check_against_reference(y, rnd(x), rnd(w), b, *case.args, precision="ieee",
                            context=f"rows {tile} {layout}, rounded operands")
    rows = [s for s in engine._sites.values() if s.name == "head_rows_kernel"]
    copied = bool(tile.get("x_cl"))
    assert [(s.consts["ROUND_X"], s.consts["ROUND_W"]) for s in rows] == [(not copied, True)]
    packs = [s for s in engine._sites.values() if s.name == "head_rows_pack_kernel"]
    assert [s.consts["ROUND_TF32"] for s in packs] == ([True] if tile.get("w_packed") else [])


@pytest.mark.parametrize("name", ["dilation2-op", "k-steps-n-tiles"])
def test_packed_weight_copy_holds_each_tap_once(name):
    # The packed copy against a host gather of the same tiles: every (shift, channel, column)
    # entry is the weight's tap tw = (rw + PW - delta * SW) / DW where that is a tap, else 0;
    # tiles of BLOCK_N x BLOCK_K (K fastest) in (shift, K step, N tile) order.
    case = PERSISTENT_ROWS[name]
    x, w, b = case.tensors()
    params, x5, configs = head_configs(case, x, w)
    cfg = dataclasses.replace(next(c for c in configs if getattr(c, "head", "") == "rows"), BLOCK_K=16, BLOCK_N=64, w_packed=True)
    steps = head_engine.HeadSteps(params, cfg, "ieee", True, engine._head_site)
    site, elements = steps._pack_site(w)
    packed = torch.full((elements,), float("nan"))
    site.launch(x.device, w, packed)
    shift0, nshift = head_engine.width_shifts(params)
    (kd, kh, kw), sw, pw, dw = params.kernel_size, params.stride[2], params.padding[2], params.dilation[2]
    ncol = params.out_channels_per_group * kd * kh * sw
    n_pad = -(-ncol // cfg.BLOCK_N) * cfg.BLOCK_N
    k_pad = -(-params.in_channels_per_group // cfg.BLOCK_K) * cfg.BLOCK_K
    want = torch.zeros(params.groups, nshift, k_pad, n_pad)
    wg = w.reshape(params.groups, params.in_channels_per_group, params.out_channels_per_group, kd, kh, kw)
    for j in range(nshift):
        for col in range(ncol):
            rw, (co, td, th) = col % sw, divmod(col // sw // kh, kd) + (col // sw % kh,)
            twn = rw + pw - (shift0 + j) * sw
            if twn >= 0 and twn % dw == 0 and twn // dw < kw:
                want[:, j, :params.in_channels_per_group, col] = wg[:, :, co, td, th, twn // dw]
    bk, bn = cfg.BLOCK_K, cfg.BLOCK_N
    tiles = want.reshape(params.groups, nshift, k_pad // bk, bk, n_pad // bn, bn).permute(0, 1, 2, 4, 5, 3)
    torch.testing.assert_close(packed.reshape(tiles.shape), tiles, rtol=0, atol=0)


def test_packed_tiles_where_no_weight_is_held_and_one_where_it_is():
    # The VQ-VAE decoder's bf16 240 -> 3 head (k4 s2, 3 width shifts: 196 KB of held weight)
    # and the fp32 128 -> 8 k3 head get the packed single-sweep tiles; the 3-D GAN head, whose
    # persistent tiles hold the weight, gets one (BLOCK_M 64) beside them.
    def packed(cin, cout, size, k, s, p, op, dtype):
        params = ConvT3dParams(4, cin, cout, 1, size, (k,) * 3, s, p, op, (1, 1, 1))
        tiles = head_engine.head_tiles(params, dtype, "tf32")
        assert all(not t.get("persist") for t in tiles if t.get("w_packed"))
        held = any(t.get("persist") and head_engine.head_smem(params, dtype, t)[1] for t in tiles)
        full_k = max(t["BLOCK_K"] for t in tiles if t["head"] == "rows")
        return held, [(t["BLOCK_M"], t["num_warps"], t["num_stages"]) for t in tiles
                      if t.get("w_packed") and t["BLOCK_K"] == full_k and not t.get("x_cl") and not t.get("n_joint")]

    assert packed(240, 3, (19, 67, 67), 4, (2, 2, 2), (3, 3, 3), (0, 0, 0), torch.bfloat16) == \
        (False, [(128, 8, 3), (64, 4, 3), (64, 4, 4), (256, 8, 3)])
    assert packed(128, 8, (16, 64, 64), 3, (1, 2, 2), (1, 1, 1), (0, 1, 1), torch.float32)[0] is False
    assert packed(64, 1, (32, 32, 32), 4, (2, 2, 2), (1, 1, 1), (0, 0, 0), torch.bfloat16) == (True, [(64, 4, 3)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cout, cin, kernel, stride",
                         [(1, 64, 4, 2), (3, 64, (1, 4, 4), (1, 2, 2)), (8, 128, 3, (1, 2, 2)), (15, 256, 3, 1)],
                         ids=["gan-head", "video-head", "128to8-k3", "256to15-k3s1"])
def test_head_tiles_fit_the_shared_memory(dtype, cout, cin, kernel, stride):
    # Every persistent rows tile offered fits one block's shared memory by head_smem's
    # estimate, and its programs per SM fit the SM together; the single-sweep tile comes first
    # (the untuned default).
    k3 = (kernel,) * 3 if isinstance(kernel, int) else kernel
    s3 = (stride,) * 3 if isinstance(stride, int) else stride
    params = ConvT3dParams(2, cin, cout, 1, (8, 16, 16), k3, s3, (1, 1, 1), (0, 0, 0), (1, 1, 1))
    tiles = [t for t in head_engine.head_tiles(params, dtype, "tf32") if t["head"] == "rows"]
    assert tiles
    assert not tiles[0].get("persist"), "the single-sweep tile stays the untuned default"
    for t in tiles:
        if t.get("persist"):
            smem, held = head_engine.head_smem(params, dtype, t)
            assert smem <= head_engine.MAX_BLOCK_SMEM, t
            assert t["persist"] * (smem + (9 << 10)) <= head_engine.SM_SHARED_BYTES, t


def _unseen_heads():
    # A fixed sweep of head geometries no suite row holds: 1-15 output channels, groups, odd
    # sizes, anisotropic kernels, strides and dilations, Cin from 8 to 320.
    import random

    rng = random.Random(20261203)
    out = []
    while len(out) < 48:
        groups = rng.choice([1, 1, 1, 2, 4])
        cout = groups * rng.randint(1, 15)
        cin = groups * rng.choice([8, 16, 24, 40, 64, 96, 128, 240, 320])
        k = tuple(rng.choice([1, 2, 3, 4, 5]) for _ in range(3))
        st = tuple(rng.choice([1, 2, 2, 3, 4]) for _ in range(3))
        dil = tuple(rng.choice([1, 1, 1, 2]) for _ in range(3))
        pad = tuple(rng.randint(0, (d * (kk - 1)) // 2) for kk, d in zip(k, dil))
        op = tuple(rng.randint(0, max(0, min(s_, d) - 1)) for s_, d in zip(st, dil))
        size = tuple(rng.randint(3, 40) for _ in range(3))
        out.append(ConvT3dParams(rng.choice([1, 2, 4]), cin, cout, groups, size, k, st, pad, op, dil))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("channels_last", [True, False], ids=["cl", "ncdhw"])
def test_rows_tile_offers_on_unseen_heads(dtype, channels_last):
    # The offer rules of the rows kind, on geometries the suites do not hold: joint N tiles
    # only on the packed weight at BLOCK_N 64 and only where the columns pass 128; the full
    # packed set where no persistent tile holds the weight, one packed tile where one does;
    # copy tiles only of persistent or packed rows tiles; every persistent tile within one
    # block's shared memory.
    seen_joint = seen_held = seen_unheld = 0
    for params in _unseen_heads():
        tiles = head_engine.head_tiles(params, dtype, "tf32", channels_last=channels_last)
        rows = [t for t in tiles if t["head"] == "rows"]
        if not rows:
            continue
        ncol = head_engine._rows_columns(params)
        full_k = max(t["BLOCK_K"] for t in rows)
        for t in rows:
            assert not t.get("n_joint") or (t.get("w_packed") and t["BLOCK_N"] == 64 and ncol > 128), (params, t)
            assert not t.get("w_packed") or not t.get("persist"), (params, t)
            assert not t.get("x_cl") or t.get("persist") or t.get("w_packed"), (params, t)
            if t.get("persist"):
                assert head_engine.head_smem(params, dtype, t)[0] <= head_engine.MAX_BLOCK_SMEM, (params, t)
        held = any(t.get("persist") and head_engine.head_smem(params, dtype, t)[1] for t in rows)
        packed = sorted((t["BLOCK_M"], t["num_warps"], t["num_stages"]) for t in rows
                        if t.get("w_packed") and not t.get("n_joint") and not t.get("x_cl") and t["BLOCK_K"] == full_k)
        assert packed == ([(64, 4, 3)] if held else [(64, 4, 3), (64, 4, 4), (128, 8, 3), (256, 8, 3)]), params
        joint = any(t.get("n_joint") for t in rows)
        fits = any(head_engine._joint_fits(params, dtype, bm, warps, 3, full_k) for bm, warps in ((64, 4), (128, 8)))
        assert joint == (not held and ncol > 128 and fits), params
        for t in rows:
            if t.get("n_joint"):
                assert head_engine._joint_fits(params, dtype, t["BLOCK_M"], t["num_warps"], t["num_stages"],
                                               t["BLOCK_K"]), (params, t)
        seen_joint += joint
        seen_held += held
        seen_unheld += not held
    assert seen_joint and seen_held and seen_unheld, "the sweep must reach every offer rule"


@pytest.mark.parametrize("name", ["overlap-per-dim-everything", "overlap-m-tiles", "overlap-dilation2-stride2-op"])
def test_gather_span_narrower_than_the_row(name):
    # Output rows of 6-20 columns split over tap-sum programs of 4 columns (tails included).
    case = REGIMES[name]
    x, w, b = case.tensors()
    check_against_reference(run_head(case, x, w, b, kind="rows", BLOCK_W=4), x, w, b, *case.args, context=name)


def test_empty_batch():
    case = dataclasses.replace(REGIMES["overlap-c1-k4s2p1"], batch=0)
    x, w, b = case.tensors()
    assert run_head(case, x, w, b).shape == (0, 1, 4, 6, 8)


def test_public_api_runs_a_seeded_head_config(monkeypatch):
    # The tuner's result (as prime_triton seeds a persisted one) is what backend="triton"
    # runs: seed a head config for the signature, then call the public function.
    case = REGIMES["overlap-groups2-c3"]
    x, w, b = case.tensors()
    params, x5, configs = head_configs(case, x, w)
    key = engine.plan(params, x5, w, "ieee").tune_key
    calls = []
    real_run = head_engine.HeadSteps.run
    monkeypatch.setattr(head_engine.HeadSteps, "run", lambda self, *a: calls.append(self.cfg) or real_run(self, *a))
    engine.clear_caches()
    try:
        engine.seed_tuning(key, configs[0])
        y = convt3d.conv_transpose3d(x, w, b, *case.args, backend="triton", precision="ieee")
    finally:
        engine.clear_caches()
    assert calls == [configs[0]]
    check_against_reference(y, x, w, b, *case.args, context="seeded")


# ---------------------------------------------------------------------------------------------
# Decision logic (no kernels): which layers get head candidates, of which kind
# ---------------------------------------------------------------------------------------------
def _params(cout, groups=1, cin=16, size=(4, 5, 6), kernel=(3, 3, 3), stride=(2, 2, 2), padding=(1, 1, 1),
            output_padding=(0, 0, 0), dilation=(1, 1, 1), batch=2):
    return ConvT3dParams.create(batch, cin, cout, groups, size, kernel, stride, padding, output_padding, dilation)


@pytest.mark.parametrize("cout_g, offered", [(1, True), (7, True), (8, True), (15, True), (16, False), (48, False)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("cin", [4, 16], ids=["fma-path-cin4", "tc-path-cin16"])
def test_head_candidates_for_at_most_15_channels(cin, cout_g, offered):
    p = _params(cout_g * 2, groups=2, cin=cin * 2)
    configs = engine.candidate_configs(p, torch.float32, "tf32")
    heads = [c for c in configs if getattr(c, "head", "")]
    assert bool(heads) == offered
    # The untuned default (CPU, graph capture, CONVT3D_AUTOTUNE=0) is a head tile where the phase
    # path has only FMA tiles (measured 5-55x slower on heads), the phase GEMM where it has
    # tensor-core tiles; the tuner times both kinds either way.
    assert bool(getattr(configs[0], "head", "")) == (offered and not engine.uses_tensor_cores(p))
    assert any(not getattr(c, "head", "") for c in configs)


@pytest.mark.parametrize("kernel, stride, dilation, free", [
    ((2, 2, 2), (2, 2, 2), (1, 1, 1), True),
    ((1, 2, 2), (1, 2, 2), (1, 1, 1), True),
    ((1, 1, 1), (1, 1, 1), (1, 1, 1), True),
    ((2, 3, 2), (3, 3, 3), (2, 1, 1), True),  # 2 * 1 < 3
    ((2, 2, 2), (2, 2, 2), (3, 1, 1), True),  # taps 3 apart: odd and even positions
    ((2, 2, 2), (2, 2, 2), (2, 1, 1), False),  # 2 * 1 = 2: taps of neighbours meet
    ((3, 2, 2), (2, 2, 2), (1, 1, 1), False),
    ((1, 1, 2), (1, 1, 1), (1, 1, 1), False),
], ids=["k2s2", "k122s122", "k1s1", "dil2-k2s3", "dil3-k2s2", "dil2-k2s2", "k3s2-depth", "k2s1-width"])
def test_collision_free_rule_picks_the_kind(kernel, stride, dilation, free):
    p = _params(3, kernel=kernel, stride=stride, dilation=dilation, padding=(0, 0, 0))
    assert head_engine.collision_free(p) == free
    kinds = {t["head"] for t in head_engine.head_tiles(p, torch.bfloat16, "tf32")}
    # (the shuffle kind: dilation 1, or kernels of 1, along every dimension)
    shuffle = all(d == 1 or k == 1 for k, d in zip(kernel, dilation))
    assert head_engine.shuffle_layer(p) == shuffle
    assert kinds == (set() if free else {"rows"}) | ({"shuffle"} if shuffle else set())


@pytest.mark.parametrize("stride, kinds", [(1, {"rows"}), (2, {"rows"}), (3, set()), (4, {"rows"})])
def test_rows_kind_needs_a_power_of_two_width_stride(stride, kinds):
    p = _params(2, kernel=(3, 3, 5), stride=(2, 2, stride), padding=(0, 0, 0))
    assert {t["head"] for t in head_engine.head_tiles(p, torch.float32, "tf32")} == kinds | {"shuffle"}


BF16_Z_CASES = ["overlap-c1-k4s2p1", "overlap-c3-k144-s122-cl", "overlap-groups2-c3", "overlap-c15-odd",
                "overlap-k-steps-n-tiles"]


@pytest.mark.parametrize("name", BF16_Z_CASES)
def test_bf16_z_rounds_each_partial_once(name):
    # Config.z_bf16 stores Z in bfloat16 (offered for bf16 calls; forced here on fp32 data,
    # since the interpreter mis-computes bf16 dots). Each partial is rounded once: to nearest on
    # a GPU (|error| <= 2^-8 of it, bf16 keeping 8 significant bits), towards zero in the
    # interpreter's numpy cast (2^-7). So |error| <= 2^-7 x sum of |partials| <=
    # 2^-7 x conv_transpose3d(|x|, |w|) per output. And the rounding must really happen: the
    # fp32 Z path is ~1e-6 off.
    case = REGIMES[name]
    x, w, b = case.tensors()
    y = run_head(case, x, w, b, "ieee", kind="rows", z_bf16=True)
    ref = torch.nn.functional.conv_transpose3d(x.double(), w.double(), b.double() if b is not None else None,
                                               *case.args)
    bound = torch.nn.functional.conv_transpose3d(x.double().abs(), w.double().abs(), None, *case.args)
    err = (y.double() - ref).abs()
    assert (err <= 2**-7 * bound + 1e-5).all(), (err - 2**-7 * bound).max()
    assert err.max() > 1e-4 * ref.abs().max(), "Z was not rounded to bfloat16"


def test_bf16_z_is_offered_for_bf16_calls_only():
    # bf16 calls: every rows tile keeps Z in bf16; fp16 and fp32 calls: none does.
    p = _params(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tiles = head_engine.head_tiles(p, dtype, "tf32")
        z_kinds = [t for t in tiles if t["head"] == "rows"]
        assert z_kinds and any(t["head"] == "shuffle" for t in tiles)
        assert all(t.get("z_bf16", False) == (dtype == torch.bfloat16) for t in z_kinds), dtype
        assert not any(t.get("z_bf16") for t in tiles if t["head"] != "rows")


def test_width_shifts_cover_every_tap():
    # Every (residue, tap) pair with a matching shift lies in the range, and the range ends are used.
    for k in range(1, 6):
        for s in (1, 2, 4):
            for pad in range(0, 4):
                for d in (1, 2, 3):
                    p = _params(1, kernel=(1, 1, k), stride=(1, 1, s), padding=(0, 0, pad), dilation=(1, 1, d),
                                size=(2, 2, 9))
                    first, count = head_engine.width_shifts(p)
                    used = {(rw + pad - tw * d) // s for rw in range(s) for tw in range(k)
                            if (rw + pad - tw * d) % s == 0}
                    assert min(used) == first and max(used) == first + count - 1


def test_brute_force_collision_rule():
    # collision_free agrees with enumerating every (input, tap) pair of small 1-D geometries.
    for k in range(1, 5):
        for s in range(1, 5):
            for d in range(1, 4):
                p = _params(1, kernel=(k, 1, 1), stride=(s, 1, 1), dilation=(d, 1, 1), padding=(0, 0, 0),
                            size=(6, 1, 1))
                hits = [i * s + t * d for i in range(6) for t in range(k)]
                assert head_engine.collision_free(p) == (len(hits) == len(set(hits))), (k, s, d)


# The shuffle kind (head_shuffle_kernel): regimes beyond the free ones above. Output padding
# past the last input block, padding that crops a box, boxes wider than the kernel (bias-only
# positions), a width stride of 3 (box width padded to 4), several W tiles, K steps of both
# tiles, groups.
SHUFFLE_REGIMES = {
    "k2s2-op-cl": Case(2, 8, 2, (2, 3, 5), (2, 2, 2), 2, 0, 1, layout="channels_last_3d"),
    "k122-s122-c3": Case(1, 16, 3, (2, 3, 17), (1, 2, 2), (1, 2, 2)),
    "k213-s423-p3-op": Case(1, 20, 5, (3, 2, 3), (2, 1, 3), (4, 2, 3), (3, 0, 1), (1, 1, 2)),
    "k2s2-groups2-ksteps": Case(1, 40, 4, (2, 2, 3), (2, 2, 2), 2, 1, 1, groups=2),
    "k2s2-w-tiles": Case(1, 4, 1, (1, 2, 37), (2, 2, 2), 2),
    "k2s2-row-tiles-op": Case(1, 4, 2, (1, 5, 6), (2, 2, 2), 2, 0, 1),
    # Kernels past the stride: shifts j < ceil(k / s) per dimension, taps j * s + r >= k
    # masked (k3 s2), padding above the stride, stride 1 (boxes of one position), k5 s3 with
    # groups and output padding, a width stride of 3 over 2 shifts, and output padding on a
    # width whose last block lies past the input in a W tile of its own (see the overrides).
    "k4s2p1-c1": Case(2, 4, 1, (2, 3, 4), (4, 4, 4), 2, 1),
    "k144-s122-c3-cl": Case(1, 6, 3, (2, 3, 5), (1, 4, 4), (1, 2, 2), (0, 1, 1), layout="channels_last_3d"),
    "k3-s122-op011-c8": Case(1, 8, 8, (2, 3, 4), (3, 3, 3), (1, 2, 2), 1, (0, 1, 1)),
    "k4s2p3-c5": Case(1, 4, 5, (3, 4, 4), (4, 4, 4), 2, 3, bias=False),
    "k3s1p1-c4-ksteps": Case(1, 40, 4, (2, 3, 3), (3, 3, 3), 1, 1),
    "k5s3-groups2-op": Case(1, 8, 6, (2, 3, 3), (5, 4, 5), 3, 1, 2, groups=2),
    "k2s2-op-w16-tail": Case(1, 4, 2, (1, 2, 16), (2, 2, 2), 2, 0, 1),
    # 21 width blocks x 19 height blocks: flat tiles offered (a box tile would pad 21 to 32)
    "k144-s122-flat-offered": Case(1, 4, 2, (1, 18, 20), (1, 4, 4), (1, 2, 2), (0, 1, 1)),
    # 14 width blocks x 10 height blocks at 256 columns (16 rows x 4 channels x 4): one flat
    # tile of 64 blocks
    "k5s3-groups2-flat-n256": Case(1, 8, 6, (2, 9, 13), (5, 5, 5), 3, 1, 2, groups=2),
    # Shifts in N (shifts_n): box tiles whose halo rows and columns cut the plane into tails
    # (37 width blocks in W tiles that write 15, 8 height blocks in boxes that write 3), with
    # output padding; and (overrides) flat tiles on a plane whose last width block is a real
    # input column (k4 s2 p3: 4 blocks over 4 columns), so that a width shift wraps into the
    # row above unless masked.
    "k4s2p1-op-shifts-n-box-tails": Case(1, 6, 2, (2, 7, 36), (4, 4, 4), 2, 1, 1),
    # shifts in N with groups, two channel blocks per group (40 per group in K blocks of 32)
    # and channels-last input
    "k4s2p1-groups2-ksteps-shifts-n-cl": Case(1, 80, 4, (2, 5, 6), (4, 4, 4), 2, 1, groups=2,
                                               layout="channels_last_3d"),
}
# Tiles forced instead of the offered ones: several W tiles (the last cut), programs of 4
# input rows over 6 height blocks (a tail, and the block output padding adds past the input),
# flat tiles (BOX_H 0) of 16 blocks over planes of 20 and 12 (tails that cross rows), and
# tiles with shifts in N (each replacing the offered tile of its shifts_n).
SHUFFLE_OVERRIDES = {"k2s2-w-tiles": dict(BLOCK_W=16, BLOCK_M=16, BOX_H=1),
                     "k4s2p3-c5": [dict(BLOCK_W=0, BLOCK_M=16, BOX_H=0, shifts_n=n) for n in (1, 2)],
                     "k4s2p1-op-shifts-n-box-tails": [dict(BLOCK_W=16, BLOCK_M=64, BOX_H=4, shifts_n=n)
                                                      for n in (1, 2)],
                     "k2s2-row-tiles-op": dict(BLOCK_W=8, BLOCK_M=32, BOX_H=4),
                     "k2s2-op-w16-tail": dict(BLOCK_W=16, BLOCK_M=16, BOX_H=1),
                     "k4s2p1-c1": dict(BLOCK_W=0, BLOCK_M=16, BOX_H=0),
                     "k5s3-groups2-op": dict(BLOCK_W=0, BLOCK_M=16, BOX_H=0)}


def test_flat_shift_wrap_reads_nothing():
    # head_shuffle_kernel's flat tiles with width shifts in N: block (bh, iw) adds the products
    # of row q - nw in row order, which for iw < nw is block blocks_w + iw - nw of the row
    # above. The kernel does not mask it: on every 1-D geometry here (dilation 1, k past the
    # stride) that block is past the input or every output of block iw that the shift's taps
    # reach is cropped.
    seen = 0
    for k in range(2, 8):
        for s in range(1, 5):
            shifts = -(-k // s)
            for p in range(k):
                for op in range(s):
                    for w in range(1, 9):
                        ow = (w - 1) * s - 2 * p + k + op
                        if shifts < 2 or ow <= 0:
                            continue
                        blocks = -(-(ow + p) // s)
                        for iw in range(min(blocks, shifts - 1)):
                            for nw in range(iw + 1, shifts):
                                seen += 1
                                src = blocks + iw - nw
                                reached = [r for r in range(s) if 0 <= iw * s - p + r < ow and nw * s + r < k]
                                assert src >= w or not reached, (k, s, p, op, w, iw, nw)
    assert seen > 1000


def test_joint_tiles_within_registers_and_shared_memory():
    # A 256 -> 7 k6 s2 head (the generated bench sweep's sweep09): 504 rows columns, 8 N tiles
    # of 64. Joint tiles of all 8 would hold 256 accumulator registers per thread and, in bf16
    # at 3 stages, 240 KB of shared memory (its compile failed on the H200): none is offered;
    # the 128 -> 8 k3 head's 3 tiles still are (in fp32, where no persistent tile holds its weight).
    wide = ConvT3dParams.create(4, 256, 7, 1, (28, 32, 37), (6, 6, 6), (2, 2, 2), (2, 2, 2), (0, 0, 0), (1, 1, 1))
    narrow = ConvT3dParams.create(4, 128, 8, 1, (16, 64, 64), (3, 3, 3), (1, 2, 2), (1, 1, 1), (0, 1, 1), (1, 1, 1))
    for dtype in (torch.bfloat16, torch.float32):
        assert not any(t.get("n_joint") for t in head_engine.head_tiles(wide, dtype, "tf32"))
    assert any(t.get("n_joint") for t in head_engine.head_tiles(narrow, torch.float32, "tf32"))


@pytest.mark.parametrize("use_dot", [True, False], ids=["mma", "fma"])
@pytest.mark.parametrize("name", list(SHUFFLE_REGIMES))
def test_shuffle_kind(name, use_dot):
    case = SHUFFLE_REGIMES[name]
    x, w, b = case.tensors()
    params, _, configs = head_configs(case, x, w)
    tiles = [c for c in configs if getattr(c, "head", "") == "shuffle" and c.use_dot == use_dot]
    shifted = math.prod(head_engine.shuffle_shifts(params)) > 1
    if not use_dot and shifted:
        # No FMA tile is offered with shifts (measured 4-19x behind the MMA tiles), so none runs.
        assert not tiles
        return
    assert tiles, "a shuffle tile of each path"
    if name == "k144-s122-flat-offered" and use_dot:
        assert all(c.BOX_H == 0 for c in tiles), "flat MMA tiles where the row of blocks pads"
    if name == "k5s3-groups2-flat-n256" and use_dot:
        assert [(c.BOX_H, c.BLOCK_M, c.BLOCK_N) for c in tiles] == [(0, 64, 256)]
    if name in ("k4s2p1-op-shifts-n-box-tails", "k4s2p1-groups2-ksteps-shifts-n-cl") and use_dot:
        assert {c.shifts_n for c in tiles} == {0, 1, 2}
    over = SHUFFLE_OVERRIDES.get(name, [])
    over = [o for o in (over if isinstance(over, list) else [over]) if use_dot or not o.get("shifts_n")]
    if over:  # (shifts in N are MMA columns: the FMA path keeps its tiles)
        tiles = [dataclasses.replace(next(c for c in tiles if c.shifts_n == o.get("shifts_n", 0)), **o)
                 for o in over]
    # Tiles that differ only in warps or stages launch the same program on the interpreter: one runs.
    launched = {}
    for c in tiles:
        launched.setdefault(dataclasses.replace(c, num_warps=4, num_stages=1), c)
    tiles = list(launched.values())
    if "ksteps" in name:
        # The K-step regimes prove the channel loop under every shift count: the tile of fewest programs
        # of each shifts_n runs (the box geometries are the tile regimes' and the overrides').
        tiles = [max((c for c in tiles if c.shifts_n == n), key=lambda c: c.BLOCK_M * c.BLOCK_N)
                 for n in dict.fromkeys(c.shifts_n for c in tiles)]
    # Every tile runs at ieee. TF32 rounds the operands in code that every tile of a path shares: the tile
    # of fewest programs checks it (the interpreter's time grows with the programs).
    rounded = max(tiles, key=lambda c: c.BLOCK_M * c.BLOCK_N)
    for cfg in tiles:
        for precision in ("ieee", "tf32") if cfg is rounded else ("ieee",):
            y = engine.forward(x, w, b, params, precision, config=cfg)
            check_against_reference(y, x, w, b, *case.args, precision=precision,
                                    context=f"{name} {cfg.short()} {precision}")


def test_shuffle_64_bit_output_offsets(monkeypatch):
    # Outputs whose batch element spans 2^31 elements take 64-bit offsets (Y64); forced here by
    # lowering the limit, on a channels-last and an NCDHW call.
    monkeypatch.setattr(head_engine, "OFFSET_LIMIT", 1)
    engine.clear_caches()
    try:
        for name in ("k2s2-op-cl", "k213-s423-p3-op"):
            case = SHUFFLE_REGIMES[name]
            x, w, b = case.tensors()
            y = run_head(case, x, w, b, kind="shuffle")
            check_against_reference(y, x, w, b, *case.args, context=f"{name} Y64")
        # and a tile with shifts in N, whose halo rows are not stored
        case = SHUFFLE_REGIMES["k4s2p1-op-shifts-n-box-tails"]
        x, w, b = case.tensors()
        params, _, configs = head_configs(case, x, w)
        cfg = next(c for c in configs if getattr(c, "head", "") == "shuffle" and c.shifts_n == 2)
        y = engine.forward(x, w, b, params, "ieee", config=cfg)
        check_against_reference(y, x, w, b, *case.args, context=f"shifts-n {cfg.short()} Y64")
    finally:
        engine.clear_caches()


def test_shuffle_tf32_rounds_operands_to_nearest():
    # Both shuffle paths at "tf32" are TF32 arithmetic on round-to-nearest operands, as cuDNN's:
    # against float64 of the rounded operands only fp32 accumulation error is left.
    case = SHUFFLE_REGIMES["k2s2-groups2-ksteps"]
    x, w, b = case.tensors()
    params, _, configs = head_configs(case, x, w)

    def rnd(t):
        bits = t.contiguous().view(torch.int32)
        return ((bits + 0x1000) & -8192).view(torch.float32)

    for cfg in (c for c in configs if getattr(c, "head", "") == "shuffle"):
        y = engine.forward(x, w, b, params, "tf32", config=cfg)
        check_against_reference(y, rnd(x), rnd(w), b, *case.args, precision="ieee", context=cfg.short())


def test_shuffle_offers_on_unseen_heads():
    # On the generated geometries: the kind exactly where every dimension is at dilation 1 or
    # has a kernel of 1 (and boxes of at most 16 rows and 16 columns), its MMA tile's N a
    # multiple of 16 up to 256, its FMA tile within 2048 accumulators; never a half-K copy.
    seen = 0
    for params in _unseen_heads():
        tiles = [t for t in head_engine.head_tiles(params, torch.float32, "tf32") if t["head"] == "shuffle"]
        fits = all(a.dilation == 1 or a.kernel == 1 for a in params.axes)
        small = params.stride[0] * params.stride[1] <= 16 and params.stride[2] <= 16
        # An MMA tile up to 256 columns; the FMA tile (2048 accumulators) without shifts only.
        shifted = any(a.kernel > a.stride for a in params.axes)
        mma_cols = math.prod(head_engine.shuffle_shape(params, True))
        fma_rows = math.prod(head_engine.shuffle_shape(params, False))
        assert bool(tiles) == (fits and small and params.out_channels_per_group <= 15
                               and params.in_channels * math.prod(params.in_size) < 2**31
                               and (mma_cols <= 256 or (not shifted and fma_rows <= 2048))), params
        assert all(t["use_dot"] for t in tiles) or not shifted, params
        for t in tiles:
            r_p, sw_p, bc = head_engine.shuffle_shape(params, t["use_dot"], t.get("shifts_n", 0))
            # Box tiles where the row of width blocks fills whole W tiles, else flat ones; with
            # shifts in N flat ones on planes of 128 blocks; every tile writes at least half of
            # the blocks it reads.
            _, blocks_h, blocks_w = head_engine.shuffle_blocks(params)
            sn = t.get("shifts_n", 0)
            njh, njw = head_engine.shuffle_n_shifts(params, sn)
            assert sn == 0 or (t["use_dot"] and njh * njw > 1), params
            hh, hw = head_engine.shuffle_halo(params, sn, t["BOX_H"], t["BLOCK_W"])
            if t["BOX_H"]:
                assert t["BLOCK_M"] == t["BOX_H"] * t["BLOCK_W"]
                assert not t["use_dot"] or blocks_w % t["BLOCK_W"] == 0 or blocks_w * t["BOX_H"] < 128
                assert not sn or blocks_h * blocks_w < 128
                assert 2 * (t["BOX_H"] - hh) * (t["BLOCK_W"] - hw) >= t["BLOCK_M"]
            else:
                assert t["use_dot"] and t["BLOCK_W"] == 0 and t["BLOCK_M"] in ((128, 256) if t["BLOCK_N"] <= 64 else (
                    128 * 128 // t["BLOCK_N"],))
                assert sn or blocks_w % min(128, pow2_at_least(max(16, blocks_w))) != 0
                assert t["BLOCK_M"] >= 2 * hw
            if t["use_dot"]:
                assert t["BLOCK_N"] == pow2_at_least(njh * njw) * r_p * bc * sw_p
                assert t["BLOCK_N"] % 16 == 0 and t["BLOCK_N"] <= 256
                assert (t["BLOCK_W"] >= 16 or not t["BOX_H"]) and t["BLOCK_M"] * t["BLOCK_N"] <= 128 * 128
            else:
                assert r_p * bc * sw_p * t["BLOCK_M"] <= 2048
        seen += bool(tiles)
    assert seen, "the sweep must hold layers of the shuffle kind"


def test_large_z_is_not_offered():
    # 8 x 3 x 3 rows columns of fp32 per input row position of a 2 x 64 x 160^3 input, over 319
    # output columns: 4.7 GB of Z.
    p = _params(8, cin=64, size=(160, 160, 160))
    assert head_engine.head_z_bytes(p) > head_engine.MAX_Z_BYTES
    # The shuffle kind remains (it needs no Z); at dilation 2 no head tile is left.
    assert {t["head"] for t in head_engine.head_tiles(p, torch.float32, "tf32")} == {"shuffle"}
    p = _params(8, cin=64, size=(160, 160, 160), dilation=(2, 2, 2))
    assert head_engine.head_tiles(p, torch.float32, "tf32") == []
    # A collision-free layer at dilation 1: the shuffle kind, whatever the size.
    p = _params(8, cin=64, size=(160, 160, 160), kernel=(2, 2, 2), padding=(0, 0, 0))
    assert {t["head"] for t in head_engine.head_tiles(p, torch.float32, "tf32")} == {"shuffle"}


def test_head_configs_survive_the_cache_round_trip():
    # cache.py persists a tuned Config as a dict and accepts it back only if it equals one of
    # the key's candidates field by field.
    p = _params(3)
    configs = engine.candidate_configs(p, torch.bfloat16, "tf32")
    for cfg in configs:
        assert cache.config_from_dict(cache.config_to_dict(cfg), configs) is cfg
    head = next(c for c in configs if getattr(c, "head", ""))
    assert head.head == "rows" and "head-rows" in head.short()
    # A head config is not confused with a phase config of the same tile.
    assert cache.config_from_dict(cache.config_to_dict(dataclasses.replace(head, head="")), configs) is None


@pytest.mark.parametrize("name", ["overlap-c1-k4s2p1", "free-c2-k2s2"])
def test_tuner_runs_phase_and_head_configs_on_one_call(name):
    # The tuner runs every candidate on one prepared call (Launch.run): a head config run after a
    # phase config must still read the weight as PyTorch stores it, not the phase packing.
    case = REGIMES[name]
    x, w, b = case.tensors()
    params, x5, _ = head_configs(case, x, w)
    launch = engine.prepare(x5, w, b, params, "ieee")
    phase = [c for c in launch.configs if not getattr(c, "head", "")]
    assert phase and any(getattr(c, "head", "") for c in launch.configs)
    # One head config of each kernel variant and operand preparation (the tile of fewest programs):
    # tiles of one variant read the weight and the input alike.
    variants = {}
    for c in (c for c in launch.configs if getattr(c, "head", "")):
        key = _variant(c)
        if key not in variants or c.BLOCK_M * c.BLOCK_N > variants[key].BLOCK_M * variants[key].BLOCK_N:
            variants[key] = c
    for cfg in (phase[0],) + tuple(variants.values()):
        launch.y.fill_(float("nan"))
        launch.run(cfg)
        check_against_reference(launch.y, x5, w, b, *case.args, context=cfg.short())


def test_views_reaching_beyond_2_pow_31_are_read_from_a_copy():
    # Strides of a view can reach further than its elements: the 32-bit in-element offsets of the
    # GEMM kernels must not see them (checked on the span helper; such tensors do not fit here).
    x = torch.empty(2, 3, 4, 5, 6)
    assert head_engine._batch_span(x) == 3 * 4 * 5 * 6
    wide = torch.empty(0, device="meta").as_strided((2, 3, 4, 5, 6), (0, 2**30, 1, 1, 1))
    assert head_engine._batch_span(wide) >= 2**31
    # ... and a layer whose batch element alone holds 2^31 input elements gets no head candidate.
    assert head_engine.head_tiles(_params(1, cin=2**11, size=(128, 128, 64)), torch.bfloat16, "tf32") == []
