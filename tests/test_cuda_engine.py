"""The CUDA engine on the CPU: what can be checked without a GPU.

* ``unsupported_reason``: CPU tensors, other dtypes, no compiler (monkeypatched) -- and it never
  builds; ``forward`` raises BackendUnavailableError for them, with the reason;
* a failed build raises BackendUnavailableError carrying the compiler's output tail;
* the geometry table against a brute-force enumeration of (output position, tap) pairs;
* an emulation of the kernel's index arithmetic (block -> tile, phase loop, window origin, tap
  offsets into the staged window, the fill of empty phases with its extra last index) in
  torch on the CPU: every output element is written exactly once and equals float64 PyTorch.
  The emulator reads only the table and meta, as the kernel does;
* the launcher's plan (``launch_plan``, a mirror of the .cu's arithmetic) for every geometry of
  the GPU tests (the 40-case sweep, KernelBench, the fixed cases) and a wider random sweep,
  every variant: within CUDA's launch limits (a grid of 0 blocks was sweep9's "invalid argument"
  on the H200), and its grid writes every output element exactly once (counted per dimension);
* the output memory format rule equals the Triton engine's;
* the TF32 mode: ``forward`` checks ``precision`` first and hands the module the TF32 switch
  (the compiled module recorded by a fake), and the Python declaration of ``convt3d_forward``
  equals the .cu's definition; gemm_kernel's tensor-core form (MMA_VARIANTS, TF32 only): its
  warp fragments, emulated lane by lane with the .cu's formulas and PTX's m16n8k8 layout, compute
  the block's product once per element, load and store without bank conflicts, and its block
  arithmetic is the plain tile's (the gemm emulation below runs it);
* gemm_kernel (the register-blocked path): an emulation of its index arithmetic (block decode,
  flattened position tile, tap table, loader masks and channel tail, padded weight rows, the
  thread -> register-tile map, the epilogue tile, the row writer's residue walk by carries, the
  bias runs) on small geometries: every output element written exactly once and equal to
  float64 PyTorch; the thread map covers the tile once and its epilogue stores are free of
  bank conflicts; fill_span's head/body/tail covers a run once; launch plans of every geometry
  above partition the output into the blocks' boxes; the default-variant rule.

GPU tests (correctness against float64, KernelBench, the Triton cross-check) are in
``tests/test_gpu_cuda.py``.
"""
from __future__ import annotations

import random
import re

import pytest
import torch
import torch.nn.functional as F

from convt3d.engines.cuda import gemm as E
from convt3d.core.errors import BackendUnavailableError
from convt3d.core.params import ConvT3dParams

from conftest import make_input, random_case


def _params(n, cin, cout, size, k, s=1, p=0, op=0, d=1, g=1) -> ConvT3dParams:
    t = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v,) * 3  # noqa: E731
    return ConvT3dParams.create(n, cin, cout, g, t(size), t(k), t(s), t(p), t(op), t(d))


# ---- unsupported_reason / errors ----------------------------------------------------------------
def test_cpu_tensor_is_unsupported_and_forward_raises():
    prm = _params(1, 2, 2, 3, 2)
    x, w = torch.randn(1, 2, 3, 3, 3), torch.randn(2, 2, 2, 2, 2)
    why = E.unsupported_reason(x, w, prm)
    assert why is not None and "CPU" in why
    with pytest.raises(BackendUnavailableError, match="CPU"):
        E.forward(x, w, None, prm)


class _FakeCuda:
    """A CPU tensor that claims to be on CUDA (enough for unsupported_reason's checks)."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.device = torch.device("cuda", 0)
        self.dtype = t.dtype

    def dim(self):
        return self._t.dim()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=["fp16", "bf16", "fp64"])
def test_non_fp32_is_unsupported(monkeypatch, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    prm = _params(1, 2, 2, 3, 2)
    why = E.unsupported_reason(_FakeCuda(torch.zeros(1, dtype=dtype)), _FakeCuda(torch.zeros(1, dtype=dtype)), prm)
    assert why == f"input dtype {dtype}: the cuda engine is fp32 only"


def test_old_gpu_is_unsupported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    prm = _params(1, 2, 2, 3, 2)
    why = E.unsupported_reason(_FakeCuda(torch.zeros(1)), _FakeCuda(torch.zeros(1)), prm)
    assert why is not None and "7.5" in why


def test_missing_nvcc_is_reported_without_building(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(E, "nvcc_path", lambda: None)
    monkeypatch.setitem(E._state, "module", None)

    def no_build(*a, **k):
        raise AssertionError("unsupported_reason must not build")

    monkeypatch.setattr(E, "load_module", no_build)
    prm = _params(1, 2, 2, 3, 2)
    why = E.unsupported_reason(_FakeCuda(torch.zeros(1)), _FakeCuda(torch.zeros(1)), prm)
    assert why is not None and why.startswith("no CUDA compiler (nvcc) found")


def test_missing_nvcc_raises_on_build(monkeypatch):
    monkeypatch.setattr(E, "nvcc_path", lambda: None)
    monkeypatch.setitem(E._state, "module", None)
    with pytest.raises(BackendUnavailableError, match="nvcc"):
        E.load_module(torch.device("cuda", 0))


def test_build_failure_carries_compiler_output(monkeypatch):
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(E, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setitem(E._state, "module", None)
    monkeypatch.setattr(E, "_arch_flags", lambda device: (["-gencode=arch=compute_90,code=sm_90"], "sm90"))

    def failing_build(**kwargs):
        raise RuntimeError("Error building extension 'x': convt3d.cu(12): error: identifier \"oops\" is undefined")

    monkeypatch.setattr(ext, "load_inline", failing_build)
    with pytest.raises(BackendUnavailableError, match="identifier \"oops\" is undefined") as info:
        E.load_module(torch.device("cuda", 0))
    assert "building the CUDA engine failed" in str(info.value)
    assert E.build_seconds() is None or E._state["module"] is None


def test_source_is_packaged_and_the_build_name_follows_it():
    src = E.cuda_source()
    assert "__global__" in src and "phase_kernel" in src and "convt3d_forward" in src
    # each variant the Python side names exists in the .cu's table and switch
    for name, (idx, p, c, wp, wc) in E.VARIANTS.items():
        if idx >= 0:
            assert re.search(rf"\{{{p}, {c}, {wp}, {wc}\}},\s+// {idx}:", src), name
            assert f"case {idx}: launch_phase<{p}, {c}, {wp}, {wc}>" in src, name
    for name, (idx, bn, bm, bk, stages) in E._GEMM_ALL.items():
        halo, mma = name in E.HALO_VARIANTS, name in E.MMA_VARIANTS
        assert re.search(rf"\{{{bn}, {bk}, {stages}, {int(halo)}, {int(mma)}\}},\s+// {idx}: {bn} channels x {bm} "
                         rf"positions, {bk} input", src), name
        tail = ", true>" if halo else (", false, true>" if mma else ">")
        assert f"case {idx}: launch_gemm<{bn}, {bk}, {stages}{tail}" in src, name
        assert f"gemm_kernel<{bn}, {bk}, {stages}, 2{tail}" in src, name  # the standalone compile instantiates it
    for name, plain in E.HALO_VARIANTS.items():
        # the fallback takes the same padded weight packing: same BN, BK (and STAGES)
        assert E.GEMM_VARIANTS[name][1:] == E.GEMM_VARIANTS[plain][1:] and plain not in E.HALO_VARIANTS
    assert f"HALO_MAX_SHIFT = {E.HALO_MAX_SHIFT};" in src
    assert f"HALO_SMEM_MAX = {E.HALO_SMEM_MAX // 1024} * 1024;" in src
    assert f"GEMM_THREADS = {E.GEMM_THREADS};" in src
    assert f"GEMM_MAX_TAPS = {E.GEMM_MAX_TAPS};" in src
    assert f"NUM_VARIANTS = {sum(1 for v in E.VARIANTS.values() if v[0] >= 0)};" in src
    assert f"NUM_GEMM = {len(E.GEMM_VARIANTS) + len(E.MMA_VARIANTS)};" in src
    assert f"MMA_PAD = {E.MMA_PAD};" in src


# ---- precision ------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["tf32x3", "TF32", None, "fp32"], ids=["tf32x3", "upper", "none", "fp32"])
def test_precision_is_checked_before_anything_else(precision):
    prm = _params(1, 2, 2, 3, 2)
    with pytest.raises(ValueError, match=r"precision=.*expected one of \('ieee', 'tf32'\)"):
        E.forward(torch.randn(1, 2, 3, 3, 3), torch.randn(2, 2, 2, 2, 2), None, prm, precision)


class _RecordingModule:
    """Stands in for the compiled module: records the arguments of convt3d_forward."""

    def __init__(self, params):
        self.calls, self.params = [], params

    def convt3d_forward(self, x, wpk, bias, has_bias, tab, meta, variant, hreuse, tf32):
        self.calls.append({"variant": variant, "hreuse": hreuse, "tf32": tf32, "meta": meta})
        return torch.zeros(self.params.out_shape)


@pytest.mark.parametrize("precision,tf32", [("ieee", False), ("tf32", True)])
@pytest.mark.parametrize("variant", [None, "g64", "p8c8", "direct"], ids=lambda v: v or "default")
def test_forward_hands_the_tf32_switch_to_the_module(monkeypatch, precision, tf32, variant):
    monkeypatch.delenv("CONVT3D_CUDA_VARIANT", raising=False)
    prm = _params(2, 8, 40, (3, 4, 5), 3, s=2, p=1)
    module = _RecordingModule(prm)
    monkeypatch.setattr(E, "unsupported_reason", lambda x, w, p: None)
    monkeypatch.setattr(E, "load_module", lambda device=None: module)
    x, w = torch.randn(2, 8, 3, 4, 5), torch.randn(8, 40, 3, 3, 3)
    x0, w0 = x.clone(), w.clone()
    y = E.forward(x, w, None, prm, precision, variant=variant)
    assert y.shape == prm.out_shape
    (call,) = module.calls
    assert call["tf32"] is tf32 and call["meta"] == E.kernel_meta(prm)
    assert torch.equal(x, x0) and torch.equal(w, w0)  # the caller's tensors are left alone
    if variant is None:  # 8 input channels per group: too few for the tensor-core tiles, both modes
        assert call["variant"] == E.GEMM_VARIANTS["g64k8"][0]
    # the default precision keeps the engine's exact grade
    module.calls.clear()
    E.forward(x, w, None, prm, variant=variant)
    assert module.calls[0]["tf32"] is False


def _signature(text: str) -> list[str]:
    return [" ".join(a.split()) for a in text.split(",")]


def test_python_declaration_matches_the_cu_definition():
    """load_inline binds _CPP_DECL: it must declare the very function the .cu defines (a tf32
    switch declared but not defined would fail only at the GPU link)."""
    src = E.cuda_source()
    m = re.search(r"^torch::Tensor convt3d_forward\(([^)]*)\)\s*\{", src, re.M)
    assert m, "convt3d_forward definition not found"
    decl = re.fullmatch(r"torch::Tensor convt3d_forward\(([^)]*)\);", E._CPP_DECL)
    assert decl and _signature(decl.group(1)) == _signature(m.group(1))
    assert _signature(m.group(1))[-1] == "bool tf32"
    # TF32 mode rounds with cvt.rna (nearest, ties away), the rounding of the Triton engine's bit trick
    assert "cvt.rna.tf32.f32" in src and "x = rounded_tf32(x, stream);" in src and \
        "wpk = rounded_tf32(wpk, stream);" in src


# ---- geometry table against brute force ---------------------------------------------------------
GEOMETRIES = {
    "kb77-k3s2p1d2": dict(size=(4, 5, 6), k=3, s=2, p=1, d=2),
    "k4s2p1": dict(size=(3, 4, 5), k=4, s=2, p=1),
    "k3s2p1op1": dict(size=(3, 3, 4), k=3, s=2, p=1, op=1),
    "s3d2-aniso": dict(size=(2, 3, 4), k=(2, 3, 4), s=(3, 1, 2), p=(0, 1, 2), d=(2, 1, 3), op=(1, 0, 1)),
    "s1-k5-p2": dict(size=(3, 4, 5), k=(1, 5, 3), s=1, p=(0, 2, 1)),
    "k1s4": dict(size=(2, 2, 3), k=1, s=4, op=(0, 3, 2)),
    "d3s2k3": dict(size=(3, 4, 5), k=3, s=2, d=3, p=2),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_geometry_table_matches_brute_force(name):
    prm = _params(1, 1, 1, **GEOMETRIES[name])
    tab = E.geometry_table(prm)
    assert tab[15] == sum(prm.stride) and len(tab) == E.HEADER + 4 * tab[15]
    for a, axis in enumerate(prm.axes):
        s, first = tab[a], tab[12 + a]
        tstep, ostep = tab[6 + a], tab[9 + a]
        assert s == axis.stride
        sizes_with_taps = []
        for r in range(s):
            T, t0, off0, Q = tab[E.HEADER + 4 * (first + r): E.HEADER + 4 * (first + r) + 4]
            outs = [o for o in range(axis.out_size) if o % s == r]
            assert Q == len(outs)
            # brute force: the (input, tap) pairs landing on o = q*s + r, with i possibly outside
            for q, o in enumerate(outs):
                want = sorted((t, (o + axis.padding - t * axis.dilation) // s) for t in range(axis.kernel)
                              if (o + axis.padding - t * axis.dilation) % s == 0)
                got = sorted((t0 + j * tstep, q + off0 - j * ostep) for j in range(T))
                assert got == want, (name, a, r, q)
            if T:
                sizes_with_taps.append(Q)
        assert tab[3 + a] == max(sizes_with_taps)
        # empty residues hold at most one compact index more than the non-empty ones
        assert max(tab[E.HEADER + 4 * (first + r) + 3] for r in range(s)) <= tab[3 + a] + 1


# ---- emulation of the kernel's index arithmetic ---------------------------------------------------
def emulate(x: torch.Tensor, weight: torch.Tensor, bias, prm: ConvT3dParams, variant: str, hreuse: bool):
    """What phase_kernel computes, block by block, with the .cu's index formulas (float64).
    Returns (output, number of writes per element)."""
    idx, P, C, WP, WC = E.VARIANTS[variant]
    tab, meta = E.geometry_table(prm), E.kernel_meta(prm)
    N, G, cin_g, cout_g, D, H, W, OD, OH, OW, KD, KH, KW, qcd, qch, qcw, halo_h, halo_w, thw = meta[:19]
    TQH, CO_T = WP * P, WC * C
    xh_alloc = (TQH + max(halo_h, 2 if hreuse else 0)) | 1
    wpk = E.pack_weight(weight.double(), prm)
    xd = x.double()
    y = torch.full((N, G * cout_g, OD, OH, OW), float("nan"), dtype=torch.float64)
    writes = torch.zeros(y.shape, dtype=torch.int64)

    def row(axis, r):
        at = E.HEADER + 4 * (tab[12 + axis] + r)
        return tab[at: at + 4]  # T, t0, off0, Q

    sd, sh, sw = tab[0:3]
    tsd, tsh, tsw = tab[6:9]
    osd, osh, osw = tab[9:12]
    tiles = (-(-cout_g // CO_T), -(-qcw // 32), -(-qch // TQH))
    lane = torch.arange(32)
    rows_t = torch.arange(TQH)  # all rows of the tile: warp wp holds rows wp*P .. wp*P+P-1
    for g in range(G):
        for n in range(N):
            for qd in range(qcd):
                for thi in range(tiles[2]):
                    for twi in range(tiles[1]):
                        for cot in range(tiles[0]):
                            qh0, qw0 = thi * TQH, twi * 32
                            co = cot * CO_T + torch.arange(CO_T)
                            co_ok = co < cout_g
                            fill = torch.zeros(CO_T, dtype=torch.float64)
                            if bias is not None:
                                fill[co_ok] = bias.double()[g * cout_g + co[co_ok]]
                            qh = qh0 + rows_t[:, None].expand(TQH, 32)
                            qw = qw0 + lane[None, :].expand(TQH, 32)
                            for rd in range(sd):
                                Td, t0d, offd, Qd = row(0, rd)
                                if Td == 0 or qd >= Qd:
                                    continue
                                base = qd + offd
                                jd_hi = min(Td - 1, base // osd)
                                jd_lo = max(0, (base - D) // osd + 1)
                                for rh in range(sh):
                                    Th, t0h, offh, Qh = row(1, rh)
                                    if Th == 0 or qh0 >= Qh:
                                        continue
                                    for rw in range(sw):
                                        Tw, t0w, offw, Qw = row(2, rw)
                                        if Tw == 0 or qw0 >= Qw:
                                            continue
                                        XH, XW = TQH + (Th - 1) * osh, 32 + (Tw - 1) * osw
                                        assert XH <= xh_alloc and XW <= 32 + halo_w and Th * Tw <= thw
                                        ih_lo = qh0 + offh - (Th - 1) * osh
                                        iw_lo = qw0 + offw - (Tw - 1) * osw
                                        acc = torch.zeros(TQH, 32, CO_T, dtype=torch.float64)
                                        for jd in range(jd_lo, jd_hi + 1):
                                            idd = base - jd * osd
                                            assert 0 <= idd < D
                                            kd = t0d + jd * tsd
                                            # the staged window: column-major [XW][xh_alloc], zero outside the input
                                            win = torch.zeros(cin_g, XW, xh_alloc, dtype=torch.float64)
                                            for xr in range(XH):
                                                ih = ih_lo + xr
                                                for xc in range(XW):
                                                    iw = iw_lo + xc
                                                    if 0 <= ih < H and 0 <= iw < W:
                                                        win[:, xc, xr] = xd[n, g * cin_g:(g + 1) * cin_g, idd, ih, iw]
                                            for th in range(Th):
                                                for tw in range(Tw):
                                                    kh, kw = t0h + th * tsh, t0w + tw * tsw
                                                    # thread (row p, lane) reads column lane + (Tw-1-tw)*osw,
                                                    # row p + (Th-1-th)*osh (the HREUSE path reads the same cells)
                                                    col = lane + (Tw - 1 - tw) * osw
                                                    rr = rows_t + (Th - 1 - th) * osh
                                                    vals = win[:, col][:, :, rr].permute(2, 1, 0)  # [TQH, 32, cin]
                                                    wblk = torch.zeros(cin_g, CO_T, dtype=torch.float64)
                                                    wblk[:, co_ok] = wpk[g, kd, kh, kw][:, co[co_ok]]
                                                    acc += vals @ wblk
                                        ok = (qh < Qh) & (qw < Qw) & (qh < qch)
                                        od = qd * sd + rd
                                        for hh, ww in ok.nonzero().tolist():
                                            oh, ow = int(qh[hh, ww]) * sh + rh, int(qw[hh, ww]) * sw + rw
                                            chans = (g * cout_g + co[co_ok]).tolist()
                                            y[n, chans, od, oh, ow] = acc[hh, ww, co_ok] + fill[co_ok]
                                            writes[n, chans, od, oh, ow] += 1
                            # empty phases, with the extra last index
                            for rd in range(sd):
                                Td, _, _, Qd = row(0, rd)
                                for e in range(2 if qd == qcd - 1 else 1):
                                    qdd = qd + e
                                    if qdd >= Qd:
                                        continue
                                    for rh in range(sh):
                                        Th, _, _, Qh = row(1, rh)
                                        for rw in range(sw):
                                            Tw, _, _, Qw = row(2, rw)
                                            if Td and Th and Tw:
                                                continue
                                            for hh in range(TQH):
                                                q_h = qh0 + hh
                                                if q_h >= qch:
                                                    break
                                                for eh in range(2 if q_h == qch - 1 else 1):
                                                    for ln in range(32):
                                                        q_w = qw0 + ln
                                                        if q_w >= qcw:
                                                            continue
                                                        for ew in range(2 if q_w == qcw - 1 else 1):
                                                            if q_h + eh >= Qh or q_w + ew >= Qw:
                                                                continue
                                                            od = qdd * sd + rd
                                                            oh, ow = (q_h + eh) * sh + rh, (q_w + ew) * sw + rw
                                                            chans = (g * cout_g + co[co_ok]).tolist()
                                                            y[n, chans, od, oh, ow] = fill[co_ok]
                                                            writes[n, chans, od, oh, ow] += 1
    return y, writes


EMULATED = {
    # name: (batch, cin, cout, groups, geometry, variant, hreuse)
    "kb77-geometry-p8c16-hreuse": (1, 3, 5, 1, dict(size=(3, 4, 5), k=3, s=2, p=1, d=2), "p8c16", True),
    "k4s2p1-p8c4": (1, 2, 3, 1, dict(size=(2, 3, 4), k=4, s=2, p=1), "p8c4", False),
    "k3s2p1op1-grouped-p8c8w": (2, 4, 6, 2, dict(size=(2, 3, 3), k=3, s=2, p=1, op=1), "p8c8w", True),
    "aniso-s3d2-p4c16": (1, 2, 2, 1, GEOMETRIES["s3d2-aniso"], "p4c16", False),
    "s1-k5-wide-p16c8": (1, 2, 3, 1, dict(size=(2, 3, 40), k=(2, 5, 3), s=1, p=(0, 2, 1)), "p16c8", True),
    "k1s4-depthwise-p8c8": (1, 2, 2, 2, GEOMETRIES["k1s4"], "p8c8", False),
    # GPU sweep9: the depth residue with the tap has no outputs, the one output is an empty residue
    "sweep9-no-live-output-p8c8w": (1, 2, 6, 1, dict(size=(2, 5, 2), k=(1, 2, 2), s=(2, 1, 3), p=(1, 0, 1),
                                                       d=(1, 2, 1)), "p8c8w", False),
}


@pytest.mark.parametrize("name", list(EMULATED))
def test_kernel_index_arithmetic_emulated(name):
    batch, cin, cout, groups, geo, variant, hreuse = EMULATED[name]
    prm = _params(batch, cin, cout, g=groups, **geo)
    x = torch.randn(prm.in_shape, dtype=torch.float64)
    w = torch.randn(cin, cout // groups, *prm.kernel_size, dtype=torch.float64)
    b = torch.randn(cout, dtype=torch.float64)
    y, writes = emulate(x, w, b, prm, variant, hreuse)
    assert int(writes.min()) == 1 and int(writes.max()) == 1, "every output element written exactly once"
    ref = F.conv_transpose3d(x, w, b, prm.stride, prm.padding, prm.output_padding, groups, prm.dilation)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


# ---- variant choice, meta, memory format ----------------------------------------------------------
@pytest.mark.parametrize("cout_g,expected", [(1, "p8c4"), (4, "p8c4"), (8, "p8c8w"), (16, "p8c8w"), (32, "p8c8"),
                                             (33, "p8c16"), (64, "p8c16")],
                         ids=lambda v: str(v))
def test_choose_variant_by_output_channels(monkeypatch, cout_g, expected):
    monkeypatch.delenv("CONVT3D_CUDA_VARIANT", raising=False)
    assert E.choose_variant(_params(1, 2, cout_g, 3, 3)) == expected


def test_variant_override_is_checked(monkeypatch):
    monkeypatch.setenv("CONVT3D_CUDA_VARIANT", "nope")
    with pytest.raises(ValueError, match="CONVT3D_CUDA_VARIANT='nope'"):
        E.choose_variant(_params(1, 2, 2, 3, 3))


def test_kernel_meta_for_kernelbench_77():
    prm = _params(16, 32, 64, (16, 32, 32), 3, s=2, p=1, d=2)
    meta = E.kernel_meta(prm)
    assert len(meta) == 28
    assert meta[7:10] == [33, 65, 65]          # output size
    assert meta[13:16] == [16, 32, 32]         # compact grid of the one non-empty phase
    assert meta[16:19] == [2, 2, 9]            # halos (2 taps x offset step 1) and 3 x 3 (h, w) taps
    assert E.hreuse_applies(prm)
    assert sum(not p.empty for p in prm.phases) == 1


@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d", "slice_w", "permuted_view", "transpose_dh"])
def test_output_memory_format_equals_triton_rule(layout):
    from convt3d.engines.triton import engine as triton_engine

    x = make_input(2, 3, (3, 4, 5), layout)
    for w in (torch.randn(3, 2, 2, 2, 2), torch.randn(3, 2, 2, 2, 2).contiguous(memory_format=torch.channels_last_3d)):
        assert E.output_memory_format(x, w) == triton_engine.output_memory_format(x, w)


# ---- launch plans against CUDA's launch limits ---------------------------------------------------
def _case_params(case) -> ConvT3dParams:
    from convt3d.core.validate import check_call

    x, w, b = case.tensors()
    return check_call(x, w, b, *case.args)[0]


def _gpu_sweep_params(seed: int) -> ConvT3dParams:
    """The geometry of tests/test_gpu_cuda.py::test_random_sweep[sweep<seed>] (same rng)."""
    return _case_params(random_case(random.Random(1000 + seed), max_channels=12, max_in=7, max_kernel=5))


def _write_counts(prm: ConvT3dParams, plan: dict) -> torch.Tensor:
    """How many times phase_kernel's grid writes each output position (channels aside: every
    channel tile covers its channels once). Per dimension and residue: the compact indices
    written by the compute path (launched index q < Q) and by the empty-residue path (launched
    q < Qc, plus q + 1 for the last one); a phase (rd, rh, rw) takes the outer product of the
    compute counts when it has taps along all three dimensions, else of the empty ones."""
    _, P, C, WP, WC = E.VARIANTS[plan["variant"]]
    meta = E.kernel_meta(prm)
    qc = meta[13:16]
    launched = [qc[0], -(-qc[1] // (WP * P)) * WP * P, -(-qc[2] // 32) * 32]
    assert plan["grid"][0] == (-(-prm.out_channels_per_group // (WC * C)) * (launched[1] // (WP * P)) *
                               (launched[2] // 32) * qc[0] * prm.batch * prm.groups)
    per_dim = []
    for a, axis in enumerate(prm.axes):
        rows = []
        for ph in axis.phases:
            q = torch.arange(ph.size)
            compute = (q < launched[a]).long()
            lo = torch.arange(min(launched[a], qc[a]))
            empty = torch.bincount(torch.cat([lo, lo[-1:] + 1]), minlength=ph.size + 2)[:ph.size]
            rows.append((ph.num_taps > 0, compute, empty))
        per_dim.append(rows)
    counts = torch.zeros(prm.out_size, dtype=torch.long)
    sd, sh, sw = prm.stride
    for rd, (ld, cd, ed) in enumerate(per_dim[0]):
        for rh, (lh, ch, eh) in enumerate(per_dim[1]):
            for rw, (lw, cw, ew) in enumerate(per_dim[2]):
                vd, vh, vw = (cd, ch, cw) if (ld and lh and lw) else (ed, eh, ew)
                counts[rd::sd, rh::sh, rw::sw] = vd[:, None, None] * vh[None, :, None] * vw[None, None, :]
    return counts


def _check_plans(prm: ConvT3dParams, context: str):
    for variant in E.variant_names("tf32"):
        for hreuse in (False, True):
            plan = E.launch_plan(prm, variant, hreuse)
            bad = E.launch_limit_violations(plan)
            assert not bad, f"{context} {variant} hreuse={hreuse}: {plan} breaks {bad}"
            if plan["kernel"] in ("phase", "gemm"):
                counts = (_write_counts if plan["kernel"] == "phase" else _gemm_write_counts)(prm, plan)
                assert int(counts.min()) == 1 and int(counts.max()) == 1, f"{context} {variant}: {counts.unique()}"
            elif variant != "direct":
                # the launcher falls back only for windows over the opt-in shared memory or > 2^31 blocks
                assert plan["grid"][0] >= 1


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"gpu-sweep{s}")
def test_launch_plans_of_gpu_sweep_within_cuda_limits(seed):
    _check_plans(_gpu_sweep_params(seed), f"sweep{seed}")


def test_launch_plans_of_wider_random_sweep():
    rng = random.Random(7)
    for i in range(150):
        case = random_case(rng, max_channels=12, max_in=7, max_kernel=5, max_stride=4, max_dilation=3)
        _check_plans(_case_params(case), f"random{i} {case.id()}")


def _kernelbench_params():
    from convt3d.kernelbench.problems import PROBLEMS

    out = {}
    for pr in PROBLEMS:
        la = pr.layer_args()
        t = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v,) * 3  # noqa: E731
        n, cin, *size = pr.input_shape
        out[f"kb{pr.id}"] = ConvT3dParams.create(
            n, cin, la["out_channels"], la.get("groups", 1), tuple(size), t(la["kernel_size"]),
            t(la.get("stride", 1)), t(la.get("padding", 0)), t(la.get("output_padding", 0)), t(la.get("dilation", 1)))
    return out


GPU_FIXED = {
    # the fixed geometries of tests/test_gpu_cuda.py
    "kb77-tails": _params(2, 7, 13, (5, 9, 37), 3, s=2, p=1, d=2),
    "nan-inf": _params(1, 8, 4, (4, 5, 6), 3, s=2, p=1, d=2),
    "channels-last": _params(2, 6, 5, (4, 5, 12), (2, 3, 3), s=2, p=1, op=1),
    "depthwise": _params(2, 8, 8, (5, 6, 7), 3, s=2, p=1, op=1, g=8),
    "grouped-70": _params(2, 6, 70, (5, 6, 7), 3, s=2, p=1, op=1, g=2),
    "deterministic": _params(2, 16, 24, (6, 10, 10), 3, s=2, p=1, d=2),
    "above-2^31": _params(1, 1, 256, (130, 130, 65), 3, s=2),
    "build": _params(1, 2, 2, 3, 3),
}


@pytest.mark.parametrize("name", ["kb58", "kb61", "kb68", "kb70", "kb72", "kb73", "kb77"] + list(GPU_FIXED))
def test_launch_plans_of_fixed_gpu_geometries(name):
    prm = GPU_FIXED[name] if name in GPU_FIXED else _kernelbench_params()[name]
    for variant in E.variant_names():
        for hreuse in (False, True):
            plan = E.launch_plan(prm, variant, hreuse)
            assert not E.launch_limit_violations(plan), (name, variant, plan)
    if prm.batch * prm.out_channels * prm.out_size[2] < 4096:  # write counts on the small ones only
        _check_plans(prm, name)


def test_sweep9_launches_one_depth_index():
    """Regression (H200, issue 6): OD = 1 from stride 2, padding 1; the depth residue with the
    tap has 0 outputs, so the compact depth grid was 0 and the launch had 0 blocks."""
    prm = _gpu_sweep_params(9)
    assert prm.out_size[0] == 1 and [p.size for p in prm.axes[0].phases if p.num_taps > 0] == [0]
    assert E.kernel_meta(prm)[13] == 1
    plan = E.launch_plan(prm, "p8c8w", False)
    assert plan["kernel"] == "phase" and plan["grid"][0] >= 1


@pytest.mark.parametrize("plan,problem", [
    ({"grid": (0, 1, 1), "block": (128, 1, 1), "smem": 0}, "empty grid"),
    ({"grid": (2**31, 1, 1), "block": (128, 1, 1), "smem": 0}, "over"),
    ({"grid": (1, 65536, 1), "block": (128, 1, 1), "smem": 0}, "over"),
    ({"grid": (1, 1, 1), "block": (2048, 1, 1), "smem": 0}, "block"),
    ({"grid": (1, 1, 1), "block": (128, 1, 1), "smem": 240000}, "shared memory"),
], ids=["zero-grid", "grid-x", "grid-y", "threads", "smem"])
def test_launch_limit_violations_names_the_limit(plan, problem):
    bad = E.launch_limit_violations(plan)
    assert len(bad) == 1 and problem in bad[0]


# ---- gemm_kernel: emulation of its index arithmetic -----------------------------------------------
def _fill_span_indices(addr_floats: int, length: int) -> list[int]:
    """The indices fill_span writes (lanes and iterations flattened), for a run starting at float
    address ``addr_floats`` (only its alignment mod 4 matters)."""
    head = min((4 - (addr_floats & 3)) & 3, length)
    out = list(range(head))
    n4 = (length - head) >> 2
    for i in range(n4):
        assert (addr_floats + head + 4 * i) % 4 == 0, "float4 body must be 16-byte aligned"
        out += [head + 4 * i + c for c in range(4)]
    tail = (length - head) & 3
    assert tail < 32 and head < 32
    out += [head + 4 * n4 + lane for lane in range(tail)]
    return out


@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 5, 7, 31, 64, 65, 130, 1040])
def test_fill_span_covers_a_run_once(length):
    for align in range(4):
        got = _fill_span_indices(1000 + align, length)
        assert sorted(got) == list(range(length)) and len(got) == length, (align, length)


def _gemm_thread_map(bn: int):
    """gemm_kernel's (tid -> tm, tn) map and the (m, n) of each accumulator acc[i][j]."""
    nt, tn_count = E.GEMM_THREADS, bn // 8
    tm_count, lm = nt // tn_count, 32 // tn_count
    bm = 8 * tm_count
    cells = {}
    for tid in range(nt):
        lane, warp = tid % 32, tid // 32
        tn, tm = lane // lm, warp * lm + lane % lm
        for i in range(8):
            m = 4 * tm + i if i < 4 else bm // 2 + 4 * tm + i - 4
            for j in range(8):
                n = 4 * tn + j if j < 4 else bn // 2 + 4 * tn + j - 4
                cells[(tid, i, j)] = (m, n)
    return cells, bm


@pytest.mark.parametrize("name", list(E.GEMM_VARIANTS))
def test_gemm_thread_map_covers_the_tile_once_and_stores_without_bank_conflicts(name):
    _, bn, bm, bk, stages = E.GEMM_VARIANTS[name]
    cells, bm2 = _gemm_thread_map(bn)
    assert bm2 == bm
    assert sorted(cells.values()) == [(m, n) for m in range(bm) for n in range(bn)]
    # the epilogue tile [BN/2][BM + 4]: per half h and j, a thread stores two float4 at
    # (4tn + j) * CPITCH + 4tm (+ BM/2); a quarter warp (8 lanes) must hit 8 distinct 16-byte groups
    cpitch = bm + 4
    lm = 32 // (bn // 8)
    for warp in range(E.GEMM_THREADS // 32):
        for q in range(4):
            for j in range(4):
                for half in (0, bm // 2):
                    groups = set()
                    for lane in range(8 * q, 8 * q + 8):
                        tn, tm = lane // lm, warp * lm + lane % lm
                        groups.add((((4 * tn + j) * cpitch + 4 * tm + half) // 4) % 8)
                    assert len(groups) == 8, (name, warp, q, j)
    # B: whole float4 rows per sweep of the 256 threads
    assert E.GEMM_THREADS % (bn // 4) == 0 and stages >= 2


def emulate_gemm(x: torch.Tensor, weight: torch.Tensor, bias, prm: ConvT3dParams, name: str):
    """What gemm_kernel computes, block by block, with the .cu's index formulas (float64).
    Returns (output, number of writes per element)."""
    plan = E.launch_plan(prm, name, False)
    assert plan["kernel"] == "gemm"
    name = plan["variant"]  # a HALO variant outside halo_layout's limits runs its plain tile
    halo = E.halo_layout(prm, name) if name in E.HALO_VARIANTS else None
    assert bool(plan.get("halo")) == (halo is not None)
    _, BN, BM, BK, STAGES = E._GEMM_ALL[name]
    NT = E.GEMM_THREADS
    HBN = BN // 2
    tab, meta = E.geometry_table(prm), E.kernel_meta(prm)
    N, G, cin_g, cout_g, D, H, W, OD, OH, OW, KD, KH, KW, qcd, qch, qcw = meta[:16]
    tiles_hw, tiles_co = -(-(qch * qcw) // BM), -(-cout_g // BN)
    assert plan["grid"][0] == tiles_co * tiles_hw * qcd * N * G
    nchunks = -(-cin_g // BK)
    cout_pad = tiles_co * BN
    wtap = nchunks * BK * cout_pad
    wflat = E.pack_weight_padded(weight.double(), prm, BN, BK).reshape(-1)
    assert wflat.numel() == G * KD * KH * KW * wtap
    xflat = x.double().contiguous().reshape(-1)
    cstride = D * H * W
    plane, vol = OH * OW, OH * OW * OD
    y = torch.full((N * G * cout_g * vol,), float("nan"), dtype=torch.float64)
    writes = torch.zeros(y.shape, dtype=torch.int64)
    bias_d = None if bias is None else bias.double()

    def row(axis, r):
        at = E.HEADER + 4 * (tab[12 + axis] + r)
        return tab[at: at + 4]  # T, t0, off0, Q

    def fv(g, co):
        return 0.0 if bias_d is None else float(bias_d[g * cout_g + co])

    def write(offset, value):
        y[offset] = value
        writes[offset] += 1

    sd, sh, sw = tab[0:3]
    tsd, tsh, tsw = tab[6:9]
    osd, osh, osw = tab[9:12]
    for blk in range(plan["grid"][0]):
        b = blk
        cot = b % tiles_co; b //= tiles_co
        thw = b % tiles_hw; b //= tiles_hw
        qd = b % qcd; b //= qcd
        n = b % N; b //= N
        g = b
        p0 = thw * BM
        p1 = min(p0 + BM, qch * qcw)
        qh_a, qh_b = p0 // qcw, (p1 - 1) // qcw
        co_base = cot * BN
        chan0 = (n * G + g) * cout_g

        # ---- bias runs: rows whose depth or height residue has no taps ----
        od_lo = qd * sd
        od_hi = OD if qd == qcd - 1 else min(OD, od_lo + sd)
        runs, run0, runlen = [], 0, 0
        for od in range(od_lo, od_hi):
            rd = od - od_lo
            live_d = rd < sd and row(0, rd)[0] != 0
            for qh in range(qh_a, qh_b + 1):
                qw_a = p0 - qh * qcw if qh == qh_a else 0
                qw_b = p1 - qh * qcw if qh == qh_b else qcw
                ow_a = qw_a * sw
                ow_b = OW if qw_b == qcw else min(OW, qw_b * sw)
                oh_lo = qh * sh
                oh_hi = OH if qh == qch - 1 else min(OH, oh_lo + sh)
                for oh in range(oh_lo, oh_hi):
                    rh = oh - oh_lo
                    live_h = rh < sh and row(1, rh)[0] != 0
                    if live_d and live_h:
                        continue
                    start = od * plane + oh * OW + ow_a
                    if runlen > 0 and run0 + runlen == start:
                        runlen += ow_b - ow_a
                    else:
                        if runlen:
                            runs.append((run0, runlen))
                        run0, runlen = start, ow_b - ow_a
        if runlen:
            runs.append((run0, runlen))
        for run0, runlen in runs:
            for co in range(co_base, min(co_base + BN, cout_g)):
                base = (chan0 + co) * vol + run0
                for k in _fill_span_indices(base, runlen):
                    write(base + k, fv(g, co))

        # ---- non-empty phases ----
        m = torch.arange(BM)
        p = p0 + m
        pin = p < p1
        pqh = torch.where(pin, p // qcw, 0)
        pqw = torch.where(pin, p - pqh * qcw, 0)
        xg = (n * G + g) * cin_g * cstride
        for rd in range(sd):
            Td, t0d, offd, Qd = row(0, rd)
            if Td == 0 or qd >= Qd:
                continue
            dbase = qd + offd
            jd_hi = min(Td - 1, dbase // osd)
            jd_lo = max(0, (dbase - D) // osd + 1)
            njd = max(0, jd_hi - jd_lo + 1)
            for rh in range(sh):
                Th, t0h, offh, Qh = row(1, rh)
                if Th == 0 or qh_a >= Qh:
                    continue
                for rw in range(sw):
                    Tw, t0w, offw, _ = row(2, rw)
                    if Tw == 0:
                        continue
                    ntaps = njd * Th * Tw
                    taps = []
                    for t in range(ntaps):
                        jw, jh, jd = t % Tw, (t // Tw) % Th, jd_lo + t // (Tw * Th)
                        idd = dbase - jd * osd
                        assert 0 <= idd < D
                        dh, dw = offh - jh * osh, offw - jw * osw
                        kd, kh, kw = t0d + jd * tsd, t0h + jh * tsh, t0w + jw * tsw
                        taps.append((dh, dw, (idd * H + dh) * W + dw, ((g * KD + kd) * KH + kh) * KW + kw))
                    acc = torch.zeros(BM, BN, dtype=torch.float64)
                    if halo is not None:
                        acc = _emulate_halo_steps(xflat, wflat, taps, halo, dict(
                            BN=BN, BM=BM, BK=BK, p0=p0, p1=p1, qh_a=qh_a, qh_b=qh_b, qcw=qcw, cin_g=cin_g, H=H, W=W,
                            cstride=cstride, xg=xg, njd=njd, nchunks=nchunks, dbase=dbase, jd_lo=jd_lo, osd=osd,
                            osh=osh, osw=osw, Th=Th, Tw=Tw, offh=offh, offw=offw, wtap=wtap, cout_pad=cout_pad,
                            co_base=co_base))
                    l_chunk = l_tap = 0
                    for _ in range(0 if halo is not None else ntaps * nchunks):
                        dh, dw, xoff, wt = taps[l_tap]
                        ih, iw = pqh + dh, pqw + dw
                        aok = pin & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                        asrc = xg + torch.where(aok, pqh * W + pqw + xoff, 0)
                        ci0 = l_chunk * BK
                        ci = ci0 + torch.arange(BK)
                        ok = aok[None, :] & (ci < cin_g)[:, None]
                        idx = asrc[None, :] + ci[:, None] * cstride
                        A = torch.where(ok, xflat[torch.where(ok, idx, 0)], 0.0)  # [BK][BM]
                        rows_b = wt * wtap + (ci0 + torch.arange(BK)) * cout_pad + co_base  # B: no masks
                        Bt = wflat[rows_b[:, None] + torch.arange(BN)[None, :]]  # [BK][BN]
                        acc += A.T @ Bt
                        l_chunk += 1
                        if l_chunk == nchunks:
                            l_chunk, l_tap = 0, l_tap + 1
                    # epilogue: the tile through shared memory, half of the channels at a time
                    od_off = (qd * sd + rd) * plane
                    first = all(row(2, r)[0] == 0 for r in range(rw))
                    owed = {r for r in range(sw) if row(2, r)[0] == 0} if first else set()
                    nrows = min(qh_b, Qh - 1) - qh_a + 1
                    assert nrows >= 1
                    for h in range(2):
                        cs = acc[:, h * HBN:(h + 1) * HBN].T  # Cs[cl][m]
                        for t in range(nrows * HBN):
                            r, cl = t // HBN, t % HBN
                            co = co_base + h * HBN + cl
                            if co >= cout_g:
                                continue
                            qh = qh_a + r
                            qw_a = p0 - qh * qcw if qh == qh_a else 0
                            qw_b = p1 - qh * qcw if qh == qh_b else qcw
                            ow_a = qw_a * sw
                            length = (OW if qw_b == qcw else min(OW, qw_b * sw)) - ow_a
                            yr = (chan0 + co) * vol + od_off + (qh * sh + rh) * OW + ow_a
                            cr = qh * qcw + qw_a - p0
                            sr, sq = 32 % sw, 32 // sw
                            for lane in range(32):
                                rr, jq = lane % sw, lane // sw
                                for j in range(lane, length, 32):
                                    assert (rr, jq) == (j % sw, j // sw)
                                    if rr == rw:
                                        assert 0 <= cr + jq < p1 - p0
                                        write(yr + j, float(cs[cl, cr + jq]) + fv(g, co))
                                    elif rr in owed:
                                        write(yr + j, fv(g, co))
                                    rr, jq = rr + sr, jq + sq
                                    if rr >= sw:
                                        rr, jq = rr - sw, jq + 1
    shape = (N, G * cout_g, OD, OH, OW)
    return y.reshape(shape), writes.reshape(shape)


def _emulate_halo_steps(xflat, wflat, taps, lay: dict, v: dict) -> torch.Tensor:
    """gemm_kernel's HALO K loop with the .cu's index formulas: per (depth tap, chunk) step the
    window [BK][nr][pitch] (unloaded window floats are NaN, so reading one poisons the result),
    the weights [Th*Tw][BK][BN], and per (h, w) tap the A operand read at each thread group's
    window offset plus the tap's row and column shift. Returns the [BM][BN] accumulator."""
    BN, BM, BK, Th, Tw, qcw = v["BN"], v["BM"], v["BK"], v["Th"], v["Tw"], v["qcw"]
    hp, hch = lay["pitch"], lay["ch"]
    nr = (v["qh_b"] - v["qh_a"] + 1) + (Th - 1) * v["osh"]
    assert nr * hp <= hch and BK * hch == lay["a"] and BK * hch + Th * Tw * BK * BN <= lay["stage"]
    assert lay["region"] >= 3 * lay["stage"] or lay["region"] >= BN // 2 * (BM + 4)
    # float4 window reads, 16-byte stage bases, the int4 tap table after the region
    assert (Tw - 1) * v["osw"] <= E.HALO_MAX_SHIFT and hp % 4 == 0 and hch % 4 == 0 and lay["a"] % 4 == 0
    assert lay["stage"] % 4 == 0 and lay["region"] % 4 == 0
    ih_lo = v["qh_a"] + v["offh"] - (Th - 1) * v["osh"]
    iw_lo = v["offw"] - (Tw - 1) * v["osw"]
    # window offset of each position's group of 4 (gb in the .cu): m = 4*tm + i and BM/2 + 4*tm + i
    m = torch.arange(BM)
    p4 = v["p0"] + m - m % 4
    qh = p4 // qcw
    gb = torch.where(p4 < v["p1"], (qh - v["qh_a"]) * hp + (p4 - qh * qcw), 0)
    assert bool((gb % 4 == 0).all()), "each group starts a float4"
    inside = (v["p0"] + m) < v["p1"]
    assert bool((inside == (p4 < v["p1"])).all()), "a group of 4 is wholly inside or outside the tile"
    acc = torch.zeros(BM, BN, dtype=torch.float64)
    k = torch.arange(BK)
    r = torch.arange(nr)
    c = torch.arange(hp)
    for s in range(v["njd"] * v["nchunks"]):
        jdi, ci0 = s // v["nchunks"], (s % v["nchunks"]) * BK
        idd = v["dbase"] - (v["jd_lo"] + jdi) * v["osd"]
        ih, iw = ih_lo + r, iw_lo + c
        ok = ((ci0 + k < v["cin_g"])[:, None, None] & ((ih >= 0) & (ih < v["H"]))[None, :, None]
              & ((iw >= 0) & (iw < v["W"]))[None, None, :])
        idx = (v["xg"] + (ci0 + k)[:, None, None] * v["cstride"] + idd * v["H"] * v["W"]
               + ih[None, :, None] * v["W"] + iw[None, None, :])
        win = torch.where(ok, xflat[torch.where(ok, idx, 0)], 0.0)
        hs = torch.full((BK * hch,), float("nan"), dtype=torch.float64)
        hs.view(BK, hch)[:, :nr * hp] = win.reshape(BK, nr * hp)
        for jh in range(Th):
            for jw in range(Tw):
                wt = taps[jdi * Th * Tw + jh * Tw + jw][3]
                col = (Tw - 1 - jw) * v["osw"] + m % 4  # within the group's two float4
                assert int(col.max()) < 8
                addr = gb + (Th - 1 - jh) * v["osh"] * hp + col
                A = hs.view(BK, hch)[:, addr]  # [BK][BM]
                assert not bool(A[:, inside].isnan().any()), "a position read an unloaded window float"
                A = torch.where(inside[None, :], A, 0.0)  # the epilogue never reads outside positions
                rows_b = wt * v["wtap"] + (ci0 + k) * v["cout_pad"] + v["co_base"]
                Bt = wflat[rows_b[:, None] + torch.arange(BN)[None, :]]
                acc += A.T @ Bt
    return acc


EMULATED_GEMM = {
    # name: (batch, cin, cout, groups, geometry, variant)
    "kb77-geometry-g64": (1, 3, 5, 1, dict(size=(3, 4, 5), k=3, s=2, p=1, d=2), "g64"),
    "kb77-rows-over-tile-g64": (1, 2, 3, 1, dict(size=(2, 12, 30), k=3, s=2, p=1, d=2), "g64"),
    "k4s2p1-two-live-w-g32": (1, 2, 3, 1, dict(size=(2, 3, 4), k=4, s=2, p=1), "g32"),
    "k3s2p1op1-grouped-g64": (2, 4, 6, 2, dict(size=(2, 3, 3), k=3, s=2, p=1, op=1), "g64"),
    "aniso-s3d2-g64": (1, 2, 2, 1, GEOMETRIES["s3d2-aniso"], "g64"),
    "s1-k5-wide-g32": (1, 2, 3, 1, dict(size=(2, 3, 40), k=(2, 5, 3), s=1, p=(0, 2, 1)), "g32"),
    "k1s4-g64": (1, 2, 2, 2, GEOMETRIES["k1s4"], "g64"),
    "cin-tail-cout-tiles-g64": (1, 19, 70, 1, dict(size=(2, 2, 3), k=2, s=2, p=0), "g64"),
    "cin-tail-g64k8": (1, 19, 40, 1, dict(size=(2, 3, 3), k=3, s=2, p=1, d=2), "g64k8"),
    "cin-tail-two-stages-g64k32": (1, 40, 33, 1, dict(size=(2, 3, 5), k=3, s=2, p=1, d=2), "g64k32"),
    "one-chunk-two-stages-g64k32": (2, 32, 64, 1, dict(size=(2, 2, 3), k=(1, 2, 3), s=(1, 2, 2), p=0), "g64k32"),
    "sweep9-no-live-output-g64": (1, 2, 6, 1, dict(size=(2, 5, 2), k=(1, 2, 2), s=(2, 1, 3), p=(1, 0, 1),
                                                      d=(1, 2, 1)), "g64"),
    "stride-34-along-w-g64": (1, 1, 2, 1, dict(size=(1, 2, 2), k=(1, 2, 1), s=(1, 1, 34), op=(0, 0, 5)), "g64"),
    # HALO (g64r): the window path, and the plain-tile fallback where halo_layout refuses
    "kb77-geometry-g64r": (1, 3, 5, 1, dict(size=(3, 4, 8), k=3, s=2, p=1, d=2), "g64r"),
    "kb77-rows-over-tile-g64r": (1, 2, 3, 1, dict(size=(2, 30, 12), k=3, s=2, p=1, d=2), "g64r"),
    "cin-tail-cout-tiles-g64r": (1, 19, 70, 1, dict(size=(2, 3, 8), k=3, s=2, p=1, d=2), "g64r"),
    "osw2-shift4-g64r": (1, 3, 4, 1, dict(size=(2, 5, 14), k=3, s=2, p=2, d=4), "g64r"),
    "osw3-aniso-g64r": (1, 2, 2, 1, dict(size=(2, 3, 5), k=(2, 3, 4), s=(3, 1, 2), p=(0, 1, 2), d=(2, 1, 3),
                                         op=(1, 0, 1)), "g64r"),
    "s1-k5-w-g64r": (1, 2, 3, 1, dict(size=(2, 3, 4), k=(2, 2, 5), s=1, p=(0, 1, 0)), "g64r"),
    "grouped-op1-g64r": (2, 8, 12, 2, dict(size=(2, 3, 4), k=3, s=2, p=1, op=1), "g64r"),
    "fallback-qcw14-g64r": (1, 3, 4, 1, dict(size=(2, 5, 12), k=3, s=2, p=2, d=4), "g64r"),
    # the tensor-core form: the plain tile's block arithmetic (its warp fragments: test_mma_*)
    "kb77-geometry-g64t": (1, 3, 5, 1, dict(size=(3, 4, 5), k=3, s=2, p=1, d=2), "g64t"),
    "cin-tail-cout-tiles-g64t": (1, 40, 70, 1, dict(size=(2, 3, 5), k=3, s=2, p=1, d=2), "g64t"),
    "grouped-op1-g64t16": (2, 8, 12, 2, dict(size=(2, 3, 4), k=3, s=2, p=1, op=1), "g64t16"),
    "s1-k5-wide-g64t16": (1, 17, 3, 1, dict(size=(2, 3, 40), k=(2, 5, 3), s=1, p=(0, 2, 1)), "g64t16"),
}


@pytest.mark.parametrize("name", list(EMULATED_GEMM))
def test_gemm_kernel_index_arithmetic_emulated(name):
    batch, cin, cout, groups, geo, variant = EMULATED_GEMM[name]
    prm = _params(batch, cin, cout, g=groups, **geo)
    x = torch.randn(prm.in_shape, dtype=torch.float64)
    w = torch.randn(cin, cout // groups, *prm.kernel_size, dtype=torch.float64)
    b = torch.randn(cout, dtype=torch.float64)
    y, writes = emulate_gemm(x, w, b, prm, variant)
    assert int(writes.min()) == 1 and int(writes.max()) == 1, "every output element written exactly once"
    ref = F.conv_transpose3d(x, w, b, prm.stride, prm.padding, prm.output_padding, groups, prm.dilation)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [9, 30, 28, 8, 22])
def test_gemm_kernel_emulated_on_gpu_sweep_geometries(seed):
    """A few geometries of the GPU sweep, both gemm tiles, no bias."""
    prm = _gpu_sweep_params(seed)
    g = prm.groups
    x = torch.randn(prm.in_shape, dtype=torch.float64)
    w = torch.randn(prm.in_channels, prm.out_channels // g, *prm.kernel_size, dtype=torch.float64)
    for variant in E.GEMM_VARIANTS:
        y, writes = emulate_gemm(x, w, None, prm, variant)
        assert int(writes.min()) == 1 and int(writes.max()) == 1, (seed, variant)
        ref = F.conv_transpose3d(x, w, None, prm.stride, prm.padding, prm.output_padding, g, prm.dilation)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", [n for n in EMULATED_GEMM if n.endswith("g64r")])
def test_halo_cases_take_the_intended_path(name):
    """The g64r cases above run the window path, except the fallback case (compact width 14)."""
    batch, cin, cout, groups, geo, variant = EMULATED_GEMM[name]
    prm = _params(batch, cin, cout, g=groups, **geo)
    plan = E.launch_plan(prm, variant, False)
    if name.startswith("fallback"):
        assert E.halo_layout(prm, variant) is None and plan["variant"] == E.HALO_VARIANTS[variant]
        assert "halo" not in plan
    else:
        assert plan["variant"] == variant and plan["halo"] and plan["smem"] == E.halo_layout(prm, variant)["smem"]


def test_halo_layout_gating_on_kernelbench():
    kb = _kernelbench_params()
    lay = E.halo_layout(kb["kb77"], "g64r")
    # 8 compact rows of 32 per tile + 2 halo rows, pitch 32 + 4; 3 stages of 8 channels x 360 window
    # floats + 9 taps x 8 x 64 weights; the 27-entry tap table
    assert lay == {"rows": 8, "pitch": 36, "ch": 360, "a": 2880, "stage": 2880 + 4608, "region": 3 * 7488,
                   "smem": 4 * 3 * 7488 + 16 * 27}
    plan = E.launch_plan(kb["kb77"], "g64r", False)
    assert plan["grid"] == E.launch_plan(kb["kb77"], "g64k8", False)["grid"] and plan["smem"] == 90288
    # two blocks of 256 threads per SM fit (228 KB per SM, 1 KB reserved per block)
    assert 2 * (plan["smem"] + 1024) <= 228 * 1024
    # KB 68 (5 x 5 (h, w) taps): 3 stages of 25 x 8 x 64 weights are over HALO_SMEM_MAX; KB 61: compact
    # width 66 is not a multiple of 4. Both run the plain g64k8 tile.
    for name in ("kb68", "kb61"):
        assert E.halo_layout(kb[name], "g64r") is None
        assert E.launch_plan(kb[name], "g64r", False)["variant"] == "g64k8"
    # a width shift over HALO_MAX_SHIFT ((Tw-1)*osw = 2*3): the plain tile
    wide = _params(1, 8, 64, (2, 3, 8), 3, s=1, d=(1, 1, 3))
    assert E.kernel_meta(wide)[17] == 6 and E.halo_layout(wide, "g64r") is None
    # outside gemm_kernel's limits: the direct kernel, as for the plain tiles
    big = _params(1, 8, 64, 20, 17)
    assert E.halo_layout(big, "g64r") is None and E.launch_plan(big, "g64r", False)["kernel"] == "direct"


def test_default_variant_does_not_pick_halo(monkeypatch):
    monkeypatch.delenv("CONVT3D_CUDA_VARIANT", raising=False)
    for prm in _kernelbench_params().values():
        assert E.choose_variant(prm) not in E.HALO_VARIANTS


def test_pack_weight_padded_zero_pads_channels():
    prm = _params(1, 6, 10, 3, 3, g=2)
    w = torch.randn(6, 5, 3, 3, 3)
    p = E.pack_weight_padded(w, prm, 8, 16)
    assert p.shape == (2, 3, 3, 3, 16, 8)
    torch.testing.assert_close(p[..., :3, :5], E.pack_weight(w, prm))
    assert not p[..., 3:, :].any() and not p[..., :, 5:].any()
    prm2 = _params(1, 32, 64, 3, 3)
    w2 = torch.randn(32, 64, 3, 3, 3)
    assert E.pack_weight_padded(w2, prm2, 64, 16).data_ptr() != w2.data_ptr()
    assert torch.equal(E.pack_weight_padded(w2, prm2, 64, 16), E.pack_weight(w2, prm2))


def test_default_variant_is_gemm_where_it_applies(monkeypatch):
    monkeypatch.delenv("CONVT3D_CUDA_VARIANT", raising=False)
    kb = _kernelbench_params()
    # Cin/g a multiple of 32: the 32-channel K step (KB 77: 32 -> 64); otherwise g64
    assert E.choose_variant(kb["kb77"]) == "g64k32"
    for name in ("kb61", "kb68"):
        want = "g64k32" if kb[name].in_channels_per_group % 32 == 0 else "g64"
        assert E.choose_variant(kb[name]) == want
    assert E.choose_variant(kb["kb70"]) == "g32" and E.choose_variant(kb["kb73"]) == "g32"
    assert E.choose_variant(kb["kb58"]) == "p8c8w"  # 16 output channels: phase_kernel
    assert E.choose_variant(kb["kb72"]) == "p8c8w"  # groups 4: 8 output channels per group
    # fewer than 8 input channels per group: phase_kernel; 8-15: the 8-channel K step
    assert E.choose_variant(_params(1, 4, 64, 5, 3)) == "p8c16"
    assert E.choose_variant(_params(1, 12, 64, 5, 3)) == "g64k8"
    # outside gemm_kernel's limits (a tap table over GEMM_MAX_TAPS): phase_kernel
    big = _params(1, 8, 64, 20, 17)
    assert not E.gemm_applies(big) and E.choose_variant(big) == "p8c16"
    assert E.launch_plan(big, "g64", False)["kernel"] == "direct"
    monkeypatch.setenv("CONVT3D_CUDA_VARIANT", "g32")
    assert E.choose_variant(kb["kb77"]) == "g32"


def test_tf32_default_is_the_tensor_core_tile_where_it_applies(monkeypatch):
    """TF32 mode: the 64-channel tiles with 16+ input channels per group move to the tensor cores
    (g64t where Cin/g fills its 32-channel K step, else g64t16); everything else keeps its FFMA
    choice. The exact grade never picks a tensor-core tile."""
    monkeypatch.delenv("CONVT3D_CUDA_VARIANT", raising=False)
    kb = _kernelbench_params()
    assert E.choose_variant(kb["kb77"], "tf32") == "g64t"
    assert E.choose_variant(kb["kb61"], "tf32") == "g64t16"  # 48 input channels
    assert E.choose_variant(kb["kb68"], "tf32") == "g64t"
    for name in ("kb58", "kb70", "kb72", "kb73"):  # 8-32 output channels per group
        assert E.choose_variant(kb[name], "tf32") == E.choose_variant(kb[name])
    assert E.choose_variant(_params(1, 12, 64, 5, 3), "tf32") == "g64k8"  # 12 input channels
    for prm in kb.values():
        assert E.choose_variant(prm) not in E.MMA_VARIANTS
    assert set(E.variant_names("tf32")) - set(E.variant_names()) == set(E.MMA_VARIANTS)
    monkeypatch.setenv("CONVT3D_CUDA_VARIANT", "g64t")
    with pytest.raises(ValueError, match="CONVT3D_CUDA_VARIANT='g64t'"):
        E.choose_variant(kb["kb77"])
    assert E.choose_variant(kb["kb77"], "tf32") == "g64t"


def test_tensor_core_variants_refuse_the_exact_grade(monkeypatch):
    prm = _params(2, 8, 40, (3, 4, 5), 3, s=2, p=1)
    monkeypatch.setattr(E, "unsupported_reason", lambda x, w, p: None)

    def no_build(device=None):
        raise AssertionError("a refused variant must not build the engine")

    monkeypatch.setattr(E, "load_module", no_build)
    for name in E.MMA_VARIANTS:
        with pytest.raises(ValueError, match=rf"variant='{name}' at precision='ieee'"):
            E.forward(torch.randn(2, 8, 3, 4, 5), torch.randn(8, 40, 3, 3, 3), None, prm, variant=name)


def test_kb77_tensor_core_plan():
    prm = _kernelbench_params()["kb77"]
    # the stage rows of A (256) and B (64) padded by 8 floats each
    assert E.launch_plan(prm, "g64t", False)["smem"] == 4 * 2 * 32 * (256 + 64 + 16) + 16 * 27
    assert E.launch_plan(prm, "g64t16", False)["smem"] == 4 * 3 * 16 * (256 + 64 + 16) + 16 * 27
    for name in E.MMA_VARIANTS:  # two blocks per SM (228 KB, 1 KB reserved per block)
        assert 2 * (E.launch_plan(prm, name, False)["smem"] + 1024) <= 228 * 1024


def _mma_fragments(lane: int):
    """PTX's m16n8k8 TF32 fragment coordinates for one lane: A (row m, col k) of a0..a3, B (k, n)
    of b0..b1, D (m, n) of d0..d3."""
    g, t = lane // 4, lane % 4
    a = [(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)]
    b = [(t, g), (t + 4, g)]
    d = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
    return a, b, d


@pytest.mark.parametrize("name", list(E.MMA_VARIANTS))
def test_mma_warp_fragments_compute_the_block_product(name):
    """gemm_kernel's MMA form, lane by lane with the .cu's address formulas: each warp (wm, wn)
    loads its A fragments at As[(k0 + t) * AP + wm*64 + 16i + g] (+8 rows, +4 channels) and B at
    Bs[(k0 + t) * BP + wn*32 + 8j + g] (+4 channels), multiplies per PTX's layout, and the
    epilogue stores D at Cs[(8j + 2t + r%2) * CPITCH + wm*64 + 16i + g + 8*(r//2)] for its
    channel half. The result equals A^T B; every accumulator cell is stored once; the padded
    pitches make each fragment load and each epilogue store hit 32 distinct banks."""
    _, bn, bm, bk, _ = E.MMA_VARIANTS[name]
    pad = E.MMA_PAD
    ap, bp, cpitch, hbn = bm + pad, bn + pad, bm + 4, bn // 2
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(bk, bm, dtype=torch.float64, generator=gen)  # the stage's A tile [k][m]
    B = torch.randn(bk, bn, dtype=torch.float64, generator=gen)
    As = torch.full((bk * ap,), float("nan"), dtype=torch.float64)
    Bs = torch.full((bk * bp,), float("nan"), dtype=torch.float64)
    As.view(bk, ap)[:, :bm] = A  # the loader's destinations: k * AP + m, row * BP + 4cb
    Bs.view(bk, bp)[:, :bn] = B
    Asl, Bsl = As.tolist(), Bs.tolist()
    acc = {}  # (warp, lane, i, j, r) -> value
    for warp in range(E.GEMM_THREADS // 32):
        wm, wn = warp & 3, warp >> 2
        for k0 in range(0, bk, 8):
            loads_a = [[None] * 32 for _ in range(16)]
            loads_b = [[None] * 32 for _ in range(8)]
            frag_a, frag_b = {}, {}
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i in range(4):
                    base = t * ap + wm * 64 + g + k0 * ap + 16 * i
                    for r, off in enumerate((0, 8, 4 * ap, 4 * ap + 8)):
                        frag_a[(lane, i, r)] = Asl[base + off]
                        loads_a[4 * i + r][lane] = base + off
                for j in range(4):
                    base = t * bp + wn * 32 + g + k0 * bp + 8 * j
                    for r, off in enumerate((0, 4 * bp)):
                        frag_b[(lane, j, r)] = Bsl[base + off]
                        loads_b[2 * j + r][lane] = base + off
            for addrs in loads_a + loads_b:  # one shared-memory load instruction of the warp
                assert len({a % 32 for a in addrs}) == 32, (name, warp, "fragment load bank conflict")
            # the warp's mma per PTX's layout: gather the lanes' fragments into 16x8 and 8x8 operands
            for i in range(4):
                Am = torch.full((16, 8), float("nan"), dtype=torch.float64)
                for lane in range(32):
                    for r, (mm, kk) in enumerate(_mma_fragments(lane)[0]):
                        Am[mm, kk] = frag_a[(lane, i, r)]
                for j in range(4):
                    Bm = torch.full((8, 8), float("nan"), dtype=torch.float64)
                    for lane in range(32):
                        for r, (kk, nn) in enumerate(_mma_fragments(lane)[1]):
                            Bm[kk, nn] = frag_b[(lane, j, r)]
                    assert not Am.isnan().any() and not Bm.isnan().any()
                    Dm = (Am @ Bm).tolist()
                    for lane in range(32):
                        for r, (mm, nn) in enumerate(_mma_fragments(lane)[2]):
                            key = (warp, lane, i, j, r)
                            acc[key] = acc.get(key, 0.0) + Dm[mm][nn]
    want = A.T @ B  # [m][n]
    for h in range(2):
        Cs = torch.full((hbn * cpitch,), float("nan"), dtype=torch.float64)
        written = torch.zeros(hbn * cpitch, dtype=torch.long)
        for warp in range(E.GEMM_THREADS // 32):
            wm, wn = warp & 3, warp >> 2
            if wn != h:
                continue
            for i in range(4):
                for j in range(4):
                    for r in range(4):
                        addrs = []
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            at = (8 * j + 2 * t + (r & 1)) * cpitch + wm * 64 + 16 * i + g + 8 * (r >> 1)
                            Cs[at] = acc[(warp, lane, i, j, r)]
                            written[at] += 1
                            addrs.append(at)
                        assert len({a % 32 for a in addrs}) == 32, (name, "epilogue store bank conflict")
        tile = Cs.view(hbn, cpitch)[:, :bm]  # what the row writer reads: Cs[cl][m]
        assert int(written.view(hbn, cpitch)[:, :bm].min()) == 1 and int(written.max()) == 1
        torch.testing.assert_close(tile, want[:, h * hbn:(h + 1) * hbn].T, rtol=1e-12, atol=1e-12)


def test_kb77_gemm_plan():
    prm = _kernelbench_params()["kb77"]
    plan = E.launch_plan(prm, "g64", False)
    # 16 x 16 depth slices, 32 x 32 compact plane in tiles of 256, one channel tile of 64
    assert plan == {"kernel": "gemm", "variant": "g64", "grid": (16 * 16 * 4, 1, 1), "block": (256, 1, 1),
                    "smem": 4 * 3 * 16 * (256 + 64) + 16 * 27, "ci_chunk": 16}
    # BK = 8: the epilogue tile (32 x 260) is larger than the three stages (3 x 8 x 320)
    assert E.launch_plan(prm, "g64k8", False)["smem"] == 4 * 32 * 260 + 16 * 27
    assert E.launch_plan(prm, "g64k32", False)["smem"] == 4 * 2 * 32 * 320 + 16 * 27


def _gemm_write_counts(prm: ConvT3dParams, plan: dict) -> torch.Tensor:
    """How many times gemm_kernel's grid writes each output position (channels aside): each block
    owns I(qd) x (per compact row qh of its flattened tile: I(qh) x its W run), with I(q) =
    [q*s, (q+1)*s), the last compact index up to the end of the dimension."""
    _, bn, bm, _, _ = E._GEMM_ALL[plan["variant"]]
    qcd, qch, qcw = E.kernel_meta(prm)[13:16]
    tiles_hw = -(-(qch * qcw) // bm)
    assert plan["grid"][0] == -(-prm.out_channels_per_group // bn) * tiles_hw * qcd * prm.batch * prm.groups
    (od_, oh_, ow_), (sd, sh, sw) = prm.out_size, prm.stride

    def interval(q, qc, s, o):
        return q * s, (o if q == qc - 1 else min(o, (q + 1) * s))

    counts = torch.zeros(prm.out_size, dtype=torch.long)
    for qd in range(qcd):
        d0, d1 = interval(qd, qcd, sd, od_)
        for t in range(tiles_hw):
            p0, p1 = t * bm, min((t + 1) * bm, qch * qcw)
            for qh in range(p0 // qcw, (p1 - 1) // qcw + 1):
                qw_a = max(p0, qh * qcw) - qh * qcw
                qw_b = min(p1, (qh + 1) * qcw) - qh * qcw
                h0, h1 = interval(qh, qch, sh, oh_)
                w0, w1 = qw_a * sw, (ow_ if qw_b == qcw else min(ow_, qw_b * sw))
                counts[d0:d1, h0:h1, w0:w1] += 1
    return counts


def test_pack_weight_padded_is_16_byte_aligned_for_offset_views():
    prm = _params(1, 4, 4, 3, 1)  # 1x1x1 kernel: the packing permute is a no-op view
    base = torch.randn(1 + 4 * 4)
    w = base[1:].view(4, 4, 1, 1, 1)
    assert w.data_ptr() % 16 != 0 and E.pack_weight(w, prm).data_ptr() == w.data_ptr()
    p = E.pack_weight_padded(w, prm, 4, 4)
    assert p.data_ptr() % 16 == 0 and torch.equal(p, E.pack_weight(w, prm))
