"""Shared helpers of the convt3d test suite.

* The oracle is PyTorch itself in float64 on the CPU (``reference``).
* Errors are judged element by element against a bound derived from floating-point error
  analysis (``Tol``/``tolerance``/``assert_close_to_reference``), not one global allclose, so
  that a test can fail for a single wrong, unwritten or mis-rounded element anywhere -- bias-only
  and empty-phase positions included (their bound is essentially zero).
* ``gpu`` marks tests that need CUDA; they are skipped on CPU-only machines (CI).
* ``backend="triton"`` on CPU tensors needs Triton's interpreter, which Triton chooses when it is
  imported: this file turns it on (only when the variable is unset and there is no GPU) before
  any test module imports convt3d, so a bare ``pytest tests/`` behaves like CI.
"""
from __future__ import annotations

import dataclasses
import os
import math
import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _interpreter_without_dropped_overflow_checks():
    """Triton's interpreter computes an int32-overflow check beside every integer add, sub and mul,
    then drops it unless its debug option is on, which nothing here turns on; in index-heavy
    kernels that dropped work is a large share of the interpreted time. Skip computing it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    options = getattr(getattr(interpreter, "interpreter_builder", None), "options", None)
    if (dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow")
            and not getattr(options, "debug", True)):
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


_interpreter_without_dropped_overflow_checks()
# Tests check decisions as tuned: a first call waits for every candidate. The tests of the
# background mode (test_first_call.py, test_gpu_first_call.py) set it themselves.
os.environ.setdefault("CONVT3D_FIRST_CALL", "wait")

CL = torch.channels_last_3d
HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# pytest plumbing
# ---------------------------------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With $CONVT3D_TEST_LOG set, every failure is appended to that file
    as it happens, with its traceback, and every test over 10 s to ``<file>.slow``: a run cut
    by its time limit still names what failed and what was slow. Written by the controlling
    process only (under xdist the workers forward their reports to it)."""
    path = os.environ.get("CONVT3D_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
    if report.when == "call" and report.duration > 10:
        with open(path + ".slow", "a") as f:
            f.write(f"{report.duration:7.1f} s  {report.nodeid}\n")


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """convt3d's persistent cache (decisions, tiles, backward choices) goes to a directory of this
    test session, never to the user's ~/.cache/convt3d: a test must neither read what an earlier
    run measured nor leave its own measurements behind. Tests that need a fresh one per test use
    ``auto_state``."""
    from convt3d.dispatch import cache

    old = os.environ.get(cache.ENV_DIR)
    os.environ[cache.ENV_DIR] = str(tmp_path_factory.mktemp("convt3d-cache"))
    cache.reset()
    yield
    if old is None:
        os.environ.pop(cache.ENV_DIR, None)
    else:
        os.environ[cache.ENV_DIR] = old
    cache.reset()


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state, so a failure reproduces with the same data
    whatever the order or the xdist worker the test runs on. After a test its cached GPU memory
    goes back to the device: the xdist workers share one GPU."""
    torch.manual_seed(0)
    random.seed(0)
    yield
    if HAS_CUDA:
        torch.cuda.empty_cache()


@pytest.fixture
def large_gpu_memory(tmp_path_factory):
    """For tests that take much of the GPU's memory (KernelBench problems at full size, whole
    networks beside their float64 copies): one slot per 24 GiB of the device, each xdist worker
    bound to one slot by its index and holding it through the test, so that a run with many workers
    on one GPU does not fail them for memory the others hold. The test's memory goes back to the
    device before the slot is freed."""
    from filelock import FileLock  # a dependency of torch

    root = tmp_path_factory.getbasetemp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under xdist
    if worker:
        root = root.parent  # the run's directory, above each worker's own
    slots = max(1, torch.cuda.get_device_properties(0).total_memory // (24 << 30)) if HAS_CUDA else 1
    slot = int(worker.removeprefix("gw")) % slots if worker else 0
    with FileLock(str(root / f"large_gpu_memory.{slot}.lock")):
        yield
        if HAS_CUDA:
            torch.cuda.empty_cache()


@pytest.fixture
def auto_state(tmp_path, monkeypatch):
    """The auto backend's process state, isolated per test: fresh decisions, benchmark mode back
    to following cuDNN's flag, a private cache directory, no $CONVT3D_BACKEND."""
    from convt3d.dispatch import cache
    from convt3d.dispatch import select as dispatch

    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv("CONVT3D_BACKEND", raising=False)
    dispatch.clear_decisions()
    dispatch.set_benchmark(None)
    cache.reset()
    yield
    dispatch.set_benchmark(None)
    dispatch.clear_decisions()
    cache.reset()


def interpreter_active() -> bool:
    import triton
    return bool(triton.knobs.runtime.interpret)


# For tests that run backend="triton" on CPU tensors (on a GPU machine without the variable set,
# they are skipped; there the GPU tests cover the engine).
requires_interpreter = pytest.mark.skipif(
    not interpreter_active(),
    reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1 before triton is imported")


# ---------------------------------------------------------------------------------------------
# Reference and error bounds
# ---------------------------------------------------------------------------------------------
def _f64(t):
    return None if t is None else t.detach().to("cpu", torch.float64)


def reference(x, w, b=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1) -> torch.Tensor:
    """float64 PyTorch on the CPU of exactly the values given (16-bit inputs are upcast exactly)."""
    return F.conv_transpose3d(_f64(x), _f64(w), _f64(b), stride, padding, output_padding, groups, dilation)


def magnitude(x, w, b=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1) -> torch.Tensor:
    """Per output element, the sum of the absolute values of the terms that make it up,
    ``(|x| conv |w|) + |b|``: the natural scale of its rounding error (Higham's bound for a sum
    of products is proportional to it, whatever the summation order)."""
    return F.conv_transpose3d(_f64(x).abs(), _f64(w).abs(), None if b is None else _f64(b).abs(), stride, padding,
                              output_padding, groups, dilation)


@dataclass(frozen=True)
class Tol:
    """Allowed error of one output element: ``rel_mag * magnitude + rel_out * |ref| + abs``."""

    rel_mag: float  # accumulation and operand rounding, relative to sum |terms| (see magnitude)
    rel_out: float  # the final rounding to the output dtype, relative to the value itself
    abs: float  # the output dtype's subnormal spacing (absolute error floor)


# Why these numbers (u = unit roundoff):
# * float32 "ieee"/"tf32x3": a sum of K products in fp32 errs by at most ~K*u32*sum|terms| in the
#   worst case (u32 = 2^-24); K <= 1600 in every test here, so 1e-4 * magnitude is a bound, not a
#   hope, whatever order the kernel sums in. Real errors are ~1e-7 of magnitude. "tf32x3" splits
#   each operand into two TF32 halves; its products are good to ~2^-21, also far inside 1e-4.
#   A result computed in TF32 would err by ~1e-3 of magnitude and fail (test_checker_*).
# * float32 "tf32": each operand is rounded (or, on tensor cores, truncated) to 10 mantissa bits:
#   <= 2^-10 relative each, 2^-9 ~ 1.95e-3 per product, plus fp32 accumulation: 3e-3.
# * float16/bfloat16: operands are exact in fp32 and their products exact; accumulation is fp32
#   (as above, 1e-4), then one rounding to the output type: half an ulp, eps/2 relative, plus
#   the absolute spacing of its subnormals.
# * float64 (PyTorch itself, backend "torch"): 1e-12.
_TOLS = {
    (torch.float32, "ieee"): Tol(1e-4, 2.0 ** -24, 0.0),
    (torch.float32, "tf32x3"): Tol(1e-4, 2.0 ** -24, 0.0),
    (torch.float32, "tf32"): Tol(3e-3, 2.0 ** -24, 0.0),
    (torch.float16, None): Tol(1.1e-4, 2.0 ** -11, 2.0 ** -25),
    (torch.bfloat16, None): Tol(1.1e-4, 2.0 ** -8, 2.0 ** -134),
    (torch.float64, None): Tol(1e-12, 2.0 ** -53, 0.0),
}


def tolerance(dtype: torch.dtype, precision: str | None = "ieee") -> Tol:
    if dtype == torch.float32:
        return _TOLS[(dtype, precision or "ieee")]
    return _TOLS[(dtype, None)]


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, mag: torch.Tensor, tol: Tol,
                              context: str = "") -> None:
    """Element-wise check of ``actual`` against the float64 ``expected``.

    NaN must appear exactly where the reference has NaN and +-Inf exactly where it has the same
    infinity (PyTorch's propagation); every finite element must be within ``tol`` (class Tol).
    """
    assert tuple(actual.shape) == tuple(expected.shape), f"{context}: shape {tuple(actual.shape)} != " \
                                                         f"{tuple(expected.shape)}"
    a = actual.detach().to("cpu", torch.float64)
    nan_e, nan_a = torch.isnan(expected), torch.isnan(a)
    if not torch.equal(nan_a, nan_e):
        extra = (nan_a & ~nan_e).nonzero()[:5].tolist()
        missing = (nan_e & ~nan_a).nonzero()[:5].tolist()
        raise AssertionError(f"{context}: NaN pattern differs from PyTorch ({int((nan_a & ~nan_e).sum())} extra NaN, "
                             f"e.g. at {extra}; {int((nan_e & ~nan_a).sum())} missing, e.g. at {missing})")
    inf_e = torch.isinf(expected)
    if not torch.equal(torch.isinf(a), inf_e) or not torch.equal(a[inf_e], expected[inf_e]):
        raise AssertionError(f"{context}: Inf pattern differs from PyTorch")
    fin = ~(nan_e | inf_e)
    err = (a - expected).abs()
    bound = tol.rel_mag * mag + tol.rel_out * expected.abs() + tol.abs
    bad = fin & ~(err <= bound)
    if bad.any():
        ratio = torch.where(bad, err / bound.clamp_min(1e-300), torch.zeros_like(err))
        idx = tuple(int(i) for i in torch.nonzero(ratio == ratio.max())[0])
        raise AssertionError(
            f"{context}: {int(bad.sum())} of {bad.numel()} elements outside tolerance {tol}; worst at {list(idx)}: "
            f"got {a[idx].item()!r}, expected {expected[idx].item()!r} (magnitude {mag[idx].item():.3g}, "
            f"error {err[idx].item():.3g} = {ratio[idx].item():.3g} x bound)")


def check_against_reference(y, x, w, b, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                            precision="ieee", context=""):
    """Compare one convt3d output with float64 PyTorch: dtype, shape, then every element."""
    assert y.dtype == x.dtype, f"{context}: output dtype {y.dtype} != input dtype {x.dtype}"
    args = (stride, padding, output_padding, groups, dilation)
    assert_close_to_reference(y, reference(x, w, b, *args), magnitude(x, w, b, *args), tolerance(x.dtype, precision),
                              context)


def check_epilogue(y, x, w, b, args: tuple, epi, *, precision="ieee", context=""):
    """Compare a convt3d output with an epilogue program ``epi`` (a validated ``Epilogue``) against the
    float64 reference followed by the program (``apply_torch``): the convolution's bound (Tol) is carried
    through the program by evaluating it at the reference plus and minus that bound, plus the float32
    rounding of each step (operands are taken below 4 in magnitude)."""
    from convt3d.core.epilogue import Epilogue, apply_torch

    assert y.dtype == x.dtype, f"{context}: output dtype {y.dtype} != input dtype {x.dtype}"
    epi = Epilogue(tuple(dataclasses.replace(s, operand=s.operand.cpu()) if isinstance(s.operand, torch.Tensor)
                         else s for s in epi.steps))  # the reference is computed on the CPU
    ref, tol = reference(x, w, b, *args), tolerance(x.dtype, precision)
    err = tol.rel_mag * magnitude(x, w, b, *args) + tol.rel_out * ref.abs() + tol.abs
    cd = ref.dim() - 4  # the channel dimension (unbatched outputs have none before it)
    want = apply_torch(ref, epi, cd)
    moved = (apply_torch(ref + err, epi, cd) - want).abs() + (apply_torch(ref - err, epi, cd) - want).abs()
    bound = moved + 2.0 ** -18 * len(epi.steps) * (4 * ref.abs() + want.abs() + 1)
    assert_close_to_reference(y, want, bound, Tol(1.0, tol.rel_out, tol.abs), context)


def round_tf32_reference(t: torch.Tensor) -> torch.Tensor:
    """The kernels' TF32 rounding, as cuDNN rounds its operands (nearest, ties away from zero;
    inf and NaN kept), in PyTorch, of ``t`` as fp32."""
    t = t.float().contiguous()
    rounded = ((t.view(torch.int32) + 0x1000) & -8192).view(torch.float32)
    return torch.where(t.abs() < float("inf"), rounded, t)


def packed_weight_reference(w: torch.Tensor, params, fold: int = 1) -> torch.Tensor:
    """The packed weight p[g, tap, co, ci] of the kernels' ``params`` (merged groups when
    ``fold`` > 1: block-diagonal over the ``fold`` original groups, zero between them)."""
    g, cin_g, cout_g = params.groups, params.in_channels_per_group, params.out_channels_per_group
    kvol = math.prod(params.kernel_size)
    sub_ci, sub_co = cin_g // fold, cout_g // fold
    wf = w.reshape(w.shape[0], w.shape[1], kvol)
    p = torch.zeros(g, kvol, cout_g, cin_g, dtype=w.dtype, device=w.device)
    for gi in range(g):
        for f in range(fold):
            rows = wf[gi * cin_g + f * sub_ci: gi * cin_g + (f + 1) * sub_ci]  # [sub_ci, sub_co, kvol]
            p[gi, :, f * sub_co:(f + 1) * sub_co, f * sub_ci:(f + 1) * sub_ci] = rows.permute(2, 1, 0)
    return p


def padded_input_reference(x: torch.Tensor, geo) -> torch.Tensor:
    """The flat path's zero-haloed NDHWC copy of x: ``geo`` = ((PD, PH, PW), (DP, HP, WP)), x at
    offset (PD, PH, PW) of a [N, DP, HP, WP, C] grid that may also cut x off."""
    (pd, ph, pw), (dp, hp, wp) = geo
    n, c, d, h, w = x.shape
    y = torch.zeros(n, dp, hp, wp, c, dtype=x.dtype, device=x.device)
    y[:, pd:pd + d, ph:ph + h, pw:pw + w] = x.permute(0, 2, 3, 4, 1)[:, :dp - pd, :hp - ph, :wp - pw]
    return y


def memory_format_of(t: torch.Tensor) -> str:
    """'contiguous', 'channels_last_3d' or 'strided' (ambiguous tensors count as contiguous)."""
    if t.is_contiguous():
        return "contiguous"
    if t.dim() == 5 and t.is_contiguous(memory_format=CL):
        return "channels_last_3d"
    return "strided"


# ---------------------------------------------------------------------------------------------
# Test cases: a problem description and tensors for it
# ---------------------------------------------------------------------------------------------
LAYOUTS = ("contiguous", "channels_last_3d", "slice_w", "slice_c", "transpose_dh", "permuted_view")


@dataclass(frozen=True)
class Case:
    """One transposed convolution. Spatial arguments are kept in the form they are passed in
    (int, 1-tuple, 3-tuple or list), so the sweeps exercise every rank of argument."""

    batch: int | None  # None: unbatched 4-D input
    cin: int
    cout: int
    in_size: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: object = 1
    padding: object = 0
    output_padding: object = 0
    dilation: object = 1
    groups: int = 1
    bias: bool = True
    layout: str = "contiguous"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def args(self) -> tuple:
        """Positional arguments after (input, weight, bias), as F.conv_transpose3d takes them."""
        return (self.stride, self.padding, self.output_padding, self.groups, self.dilation)

    def id(self) -> str:
        def f(v):
            if isinstance(v, (tuple, list)):
                s = "x".join(map(str, v))
                return f"[{s}]" if isinstance(v, list) else f"({s})"
            return str(v)
        b = "unb" if self.batch is None else f"n{self.batch}"
        return (f"{b}-c{self.cin}to{self.cout}-g{self.groups}-i{'x'.join(map(str, self.in_size))}"
                f"-k{'x'.join(map(str, self.kernel))}-s{f(self.stride)}-p{f(self.padding)}"
                f"-op{f(self.output_padding)}-d{f(self.dilation)}-{'bias' if self.bias else 'nobias'}-{self.layout}")

    def tensors(self, dtype=torch.float32, device="cpu", scale=1.0):
        """(input, weight, bias) with this case's layout; values ~N(0, scale^2), rounded to dtype."""
        x = make_input(self.batch, self.cin, self.in_size, self.layout, dtype, device, scale)
        w = (torch.randn(self.cin, self.cout // self.groups, *self.kernel, dtype=torch.float64) * scale).to(dtype)
        b = (torch.randn(self.cout, dtype=torch.float64) * scale).to(dtype) if self.bias else None
        return x, w.to(device), None if b is None else b.to(device)


def make_input(batch, cin, in_size, layout, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    """An input of logical shape (batch, cin, *in_size) (or (cin, *in_size) when batch is None)
    with the given memory layout:
    contiguous | channels_last_3d | slice_w (every other W element of a wider tensor) |
    slice_c (every other channel) | transpose_dh (D and H swapped in memory) |
    permuted_view (an NDHWC tensor permuted to NCDHW: channels-last strides that
    ``is_contiguous(channels_last_3d)`` may or may not recognise)."""
    n = 1 if batch is None else batch
    d, h, w = in_size

    def rnd(*shape):
        return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)

    if layout == "contiguous":
        x = rnd(n, cin, d, h, w)
    elif layout == "channels_last_3d":
        x = rnd(n, cin, d, h, w).contiguous(memory_format=CL)
    elif layout == "slice_w":
        x = rnd(n, cin, d, h, 2 * w)[..., ::2]
    elif layout == "slice_c":
        x = rnd(n, 2 * cin, d, h, w)[:, ::2]
    elif layout == "transpose_dh":
        x = rnd(n, cin, h, d, w).transpose(2, 3)
    elif layout == "permuted_view":
        x = rnd(n, d, h, w, cin).permute(0, 4, 1, 2, 3)
    else:
        raise ValueError(layout)
    x = x.to(device)
    return x[0] if batch is None else x


def out_len(i, k, s, p, op, d) -> int:
    return (i - 1) * s - 2 * p + d * (k - 1) + op + 1


def random_case(rng: random.Random, *, max_channels=8, max_in=5, max_kernel=4, max_stride=3, max_dilation=3,
                layouts=LAYOUTS, allow_unbatched=True, max_batch=2) -> Case:
    """A random valid problem (positive output size, output_padding < max(stride, dilation))."""
    while True:
        dims = []
        for _ in range(3):
            i = rng.randint(1, max_in)
            k = rng.randint(1, max_kernel)
            s = rng.randint(1, max_stride)
            d = rng.randint(1, max_dilation)
            p = rng.randint(0, max(0, (d * (k - 1)) // 2 + 1))
            op = rng.randint(0, max(s, d) - 1)
            if out_len(i, k, s, p, op, d) >= 1:
                dims.append((i, k, s, p, op, d))
        if len(dims) == 3:
            break
    groups = rng.choice([1, 1, 2, 3])
    cin = groups * rng.randint(1, max(1, max_channels // groups))
    cout = groups * rng.randint(1, max(1, max_channels // groups))
    i, k, s, p, op, d = zip(*dims)

    def form(v, default):
        # Every rank the API accepts: int (when the three agree), 1-tuple, 3-tuple, list.
        kind = rng.choice(["int", "one", "tuple", "list"])
        if len(set(v)) == 1 and kind in ("int", "one"):
            return v[0] if kind == "int" else (v[0],)
        return list(v) if kind == "list" else tuple(v)

    batch = None if allow_unbatched and rng.random() < 0.15 else rng.randint(1, max_batch)
    layout = rng.choice(layouts)
    return Case(batch, cin, cout, tuple(i), tuple(k), form(s, 1), form(p, 0), form(op, 0), form(d, 1), groups,
                bias=rng.random() < 0.6, layout=layout)


class PoisonedTorch:
    """The ``torch`` module as the launcher sees it, except that uninitialised allocations
    (``empty``, ``empty_like``, ``empty_strided``) come back full of NaN: any output element
    (or packed-operand element) the kernels fail to write then shows up as NaN."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name in ("empty", "empty_like", "empty_strided"):
            def poisoned(*args, **kwargs):
                t = attr(*args, **kwargs)
                if t.is_floating_point():
                    t.fill_(float("nan"))
                return t
            return poisoned
        return attr


def poisoned_call(module, fn, context: str = ""):
    """``fn()`` with ``module``'s ``torch`` a :class:`PoisonedTorch` (only for that call: the
    test's own patches stay); asserts that the output it returns holds no NaN, i.e. that the
    kernels wrote every element, and returns it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "torch", PoisonedTorch(torch))
        y = fn()
    assert not torch.isnan(y).any(), \
        f"{context}: {int(torch.isnan(y).sum())} of {y.numel()} output elements never written"
    return y


def assert_compiled_matches_eager(m, x) -> None:
    """``torch.compile(m, fullgraph=True)`` with the aot_eager backend (Dynamo's full capture and
    AOTAutograd's joint graph with our fake kernels, without Inductor's C++ build on the CPU):
    one frame, the eager output bitwise with its strides, and the gradients of a squared-sum
    loss within 1e-6. ``x`` requires grad."""
    from torch._dynamo import testing as dynamo_testing

    torch._dynamo.reset()
    y0 = m(x)
    y0.square().sum().backward()
    eager = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    y1 = torch.compile(m, fullgraph=True, backend=counter)(x)
    y1.square().sum().backward()
    assert counter.frame_count == 1
    assert y1.stride() == y0.stride()
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    for a, c in zip([p.grad for p in m.parameters()] + [x.grad], eager):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
