"""box_gemm_kernel (kernels/gluon_gemm.py) without a GPU: it compiles for sm_90 on the Triton
installed here (CI's is newer than the GPU machine's 3.6) for every constexpr combination the
launcher can ask for, the candidate list offers it exactly where it can compute the call, and
its NCDHW epilogue buffer's layout gives every warp access 32 distinct banks.
Its numerics are GPU tests (tests/gpu/test_gpu.py, test_box_gemm_every_geometry): Triton's
interpreter does not run Gluon."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import triton

from convt3d.engines.triton import engine as E
from convt3d.core.validate import check_call
from clean_process import compile_in_clean_process

_GL = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# The Triton releases (major.minor) whose PTX for this compile holds PAIRS' 8-byte store. The
# store instruction is code generation, not behaviour: Triton 3.9 forms it from the kernel's
# alignment hints alone, while 3.6 and 3.8 form it only when the launch also specialises the output
# strides as multiples of 16 (this compile passes none) and otherwise store each value on its own,
# correctly. The wgmma and TMA assertions hold on every release.
PAIR_STORE_TRITON = ("3.9",)


def _compile(dtype: str, block_n: int, block_k: int, box: tuple, warps: int, **consts):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from convt3d.engines.triton.kernels import gluon_gemm as GK

    g = getattr(gl, _GL[dtype])
    a = gl.NVMMASharedLayout.get_default_for(list(box), g)
    b = gl.NVMMASharedLayout.get_default_for([block_n, block_k], g)
    sig = {"x_desc": f"tensordesc<{dtype}[{','.join(map(str, box))}],{a!r}>",
           "w_desc": f"tensordesc<{dtype}[{block_n},{block_k}],{b!r}>",
           "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "tab_ptr": "*i32"}
    consts = dict(consts, num_warps=warps)
    fn = GK.box_gemm_kernel
    signature = {a: sig.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    # The pointers 16-byte aligned, as the launch specialises a fresh allocation.
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("b_ptr", "y_ptr", "tab_ptr")}
    return triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


@pytest.mark.parametrize("dtype,block_n,block_k,box,warps,w_group,w_skip,cl_out,bias,off32,pairs", [
    ("fp32", 64, 32, (1, 1, 4, 32, 32), 4, 2, 0, False, False, True, True),    # KB 77: a W residue without taps
    ("fp32", 64, 32, (1, 1, 4, 32, 32), 4, 2, 1, False, True, True, False),    # the same, odd output width
    ("fp32", 64, 32, (1, 1, 8, 16, 32), 4, 1, -1, False, True, False, False),  # stride 1, 64-bit offsets
    ("bf16", 32, 64, (1, 1, 8, 16, 64), 4, 2, -1, False, True, True, True),    # both W residues with taps
    ("fp32", 32, 32, (1, 1, 8, 16, 32), 4, 2, -1, False, False, True, False),  # both, odd output width
    ("fp16", 128, 32, (1, 1, 8, 16, 32), 8, 1, -1, True, True, True, False),   # channels-last out, 2 warpgroups
    ("bf16", 16, 16, (1, 1, 4, 16, 16), 4, 1, -1, True, False, True, False),   # the smallest tiles
], ids=["kb77-wskip-pairs", "wskip-odd-width", "stride1-off64", "bf16-both-residues-pairs", "both-residues-odd-width",
        "fp16-cl-8warps", "bf16-smallest"])
def test_box_gemm_compiles_for_sm90(dtype, block_n, block_k, box, warps, w_group, w_skip, cl_out, bias, off32, pairs):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    # In a process of its own, without the interpreter (see clean_process.compile_in_clean_process).
    consts = dict(HAS_BIAS=bias, W_GROUP=w_group, W_SKIP=w_skip, OFF32=off32, CL_OUT=cl_out, PAIRS=pairs, STAGES=4)
    args = json.dumps([dtype, block_n, block_k, list(box), warps, consts])
    out = compile_in_clean_process([__file__, args])
    assert "wgmma.mma_async" in out
    assert "cp.async.bulk.tensor.5d" in out  # the 5-D input boxes
    if dtype == "fp32" and not cl_out and triton.__version__.startswith(tuple(v + "." for v in PAIR_STORE_TRITON)):
        # PAIRS: both W residues of a position leave as one 8-byte store, else one column per lane.
        assert ("st.global.v2.b32" in out) == pairs


def _params(cin, cout, size, k, s, p, op=0, g=1, d=1, dtype=torch.float32):
    x = torch.randn(2, cin, *size, dtype=dtype)
    w = torch.randn(cin, cout // g, *((k,) * 3 if isinstance(k, int) else k), dtype=dtype)
    return check_call(x, w, None, s, p, op, g, d)[0]


@pytest.mark.parametrize("dtype,precision,offered", [
    (torch.float32, "tf32", True), (torch.bfloat16, "tf32", True), (torch.float16, "tf32", True),
    (torch.float32, "tf32x3", False), (torch.float32, "ieee", False),
], ids=["fp32-tf32", "bf16", "fp16", "fp32-tf32x3", "fp32-ieee"])
def test_box_gemm_offered_where_wgmma_computes_the_precision(dtype, precision, offered):
    # wgmma multiplies fp32 as TF32: the split (tf32x3) and exact grades must not get it.
    params = _params(32, 48, (4, 9, 11), 3, 1, 1, dtype=dtype)
    configs = E.candidate_configs(params, dtype, precision, False, flat=True, gluon=True)
    assert any(c.gluon for c in configs) == offered
    assert not configs[0].gluon  # the untuned default (graph capture, no timing) stays portable


@pytest.mark.parametrize("case,offered", [
    (dict(cin=32, cout=48, size=(4, 9, 11), k=3, s=1, p=1), True),
    (dict(cin=32, cout=48, size=(4, 5, 6), k=3, s=1, p=1), False),   # compact plane of 30: below 64 wgmma rows
    (dict(cin=4, cout=48, size=(4, 9, 11), k=3, s=1, p=1), False),   # FMA path (< 8 channels per group)
    (dict(cin=36, cout=48, size=(4, 9, 11), k=3, s=1, p=1, g=2), False),  # 18 per group: rows not 16-byte aligned
], ids=["stride1", "small-plane", "fma-path", "unaligned-group-rows"])
def test_box_gemm_offered_only_where_it_applies(case, offered):
    params = _params(**case)
    configs = E.candidate_configs(params, torch.float32, "tf32", False, flat=True, gluon=True)
    assert any(c.gluon for c in configs) == offered
    # Never without the caller's say-so (no sm_90, or the interpreter).
    assert not any(c.gluon for c in E.candidate_configs(params, torch.float32, "tf32", False, flat=True))


def test_box_gemm_tile_is_a_box_of_the_compact_plane():
    # KB 77: the box is 4 compact rows of 32 (block_w), not the flat kernel's whole padded row.
    params = _params(32, 64, (16, 32, 32), 3, 2, 1, d=2)
    cfg = next(c for c in E.candidate_configs(params, torch.float32, "tf32", False, flat=True, gluon=True)
               if c.gluon)
    assert (cfg.BLOCK_M, cfg.BLOCK_W, cfg.W_GROUP) == (128, 32, 2)
    assert cfg.short().endswith("flat gluon") and "(4x32)" in cfg.short()


def _buffer_words(block_n: int, w_group: int, block_m: int) -> dict:
    """The word of every (channel, residue, position) in ``_epilogue_buffer``'s layout: offset
    bit b stands for the logical step ``offset_bases[b]``, XORed together."""
    pytest.importorskip("triton.experimental.gluon.language")
    from convt3d.engines.triton.kernels import gluon_gemm as GK

    bases = GK._epilogue_layout(block_n, w_group, block_m).offset_bases
    words = {}
    for off in range(block_n * w_group * block_m):
        n = j = m = 0
        for b, (dn, dj, dm) in enumerate(bases):
            if off >> b & 1:
                n, j, m = n ^ dn, j ^ dj, m ^ dm
        words[(n, j, m)] = off
    return words


@pytest.mark.parametrize("block_n,w_group,block_m,warps", [
    (64, 2, 128, 4), (64, 1, 128, 4), (128, 2, 128, 8), (16, 2, 64, 4), (32, 1, 64, 4),
], ids=["kb77", "stride1", "n128-8warps", "smallest-w-pairs", "stride1-m64"])
def test_epilogue_buffer_has_no_bank_conflicts(block_n, w_group, block_m, warps):
    # The buffer's layout is a permutation of its words, and each warp access the epilogue makes
    # touches 32 distinct banks (a word's bank: its offset mod 32):
    # - a store from wgmma's accumulator: lane l holds position 16 x warp + 8h + l // 4 and channel
    #   8i + 2(l % 4) + e of residue j, one register (h, i, e, j) per instruction;
    # - a read of one channel's output columns: lane l holds position m0 + l // 2, residue l % 2
    #   (W_GROUP=2), or position m0 + l (W_GROUP=1, and each residue of PAIRS).
    words = _buffer_words(block_n, w_group, block_m)
    assert sorted(words.values()) == list(range(block_n * w_group * block_m))
    lanes = range(32)
    for w in range(warps):
        for h in range(2):
            for i in range(block_n // 8):
                for e in range(2):
                    for j in range(w_group):
                        banks = {words[(8 * i + 2 * (l % 4) + e, j, 16 * w + 8 * h + l // 4)] % 32 for l in lanes}
                        assert len(banks) == 32, (w, h, i, e, j)
    for n in range(block_n):
        for m0 in range(0, block_m, 32):
            for j in range(w_group):
                assert len({words[(n, j, m0 + l)] % 32 for l in lanes}) == 32, (n, m0, j)
        if w_group == 2:
            for m0 in range(0, block_m, 16):
                assert len({words[(n, l % 2, m0 + l // 2)] % 32 for l in lanes}) == 32, (n, m0)


@pytest.mark.parametrize("case,layout,pairs", [
    (dict(k=4, s=2, p=1), "ncdhw", True),          # output width 2W: every pair starts on an even column
    (dict(k=3, s=2, p=1, d=2), "ncdhw", False),    # KB 77's geometry: width 2W + 1, odd rows start odd
    (dict(k=3, s=2, p=1, op=1), "ncdhw", True),
    (dict(k=4, s=2, p=1), "cl", False),            # channels-last: W_GROUP 1, no residues to pair
    (dict(k=3, s=1, p=1), "ncdhw", False),         # stride 1: one residue
    (dict(k=4, s=2, p=1), "offset", False),        # the address one element past an allocation
], ids=["k4s2-even-width", "kb77-odd-width", "op1-even-width", "channels-last", "stride1", "misaligned-address"])
def test_w_pairs_only_where_every_pair_is_aligned(case, layout, pairs):
    from convt3d.engines.triton.sites import w_pairs
    params = _params(16, 32, (3, 8, 10), **case)
    fmt = torch.channels_last_3d if layout == "cl" else torch.contiguous_format
    y = torch.empty(params.out_shape, memory_format=fmt)
    if layout == "offset":
        y = torch.empty(y.numel() + 1)[1:].view(params.out_shape)
    cfg = next(c for c in E.candidate_configs(params, torch.float32, "tf32", layout == "cl", flat=True, gluon=True)
               if c.gluon)
    assert w_pairs(cfg, params, y) == pairs


def test_no_gluon_candidate_off_sm90():
    assert not E.gluon_capable(torch.device("cpu"))
    x = torch.randn(1, 32, 4, 9, 11)
    w = torch.randn(32, 48, 3, 3, 3)
    params, _ = check_call(x, w, None, 1, 1, 0, 1, 1)
    assert not any(c.gluon for c in E.plan(params, x, w, "tf32").configs)


if __name__ == "__main__":  # the compile test's clean process: print the PTX of one configuration
    dtype_, bn_, bk_, box_, warps_, consts_ = json.loads(sys.argv[1])
    print(_compile(dtype_, bn_, bk_, tuple(box_), warps_, **consts_).asm["ptx"])
