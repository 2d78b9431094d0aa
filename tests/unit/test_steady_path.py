"""The steady path: a call whose arguments were seen before skips validation and the dispatcher's
pass (``dispatch.steady_key``), and one whose decision is PyTorch goes straight to
``F.conv_transpose3d``. What it must never do: answer a call whose arguments, flags or
autocast state differ from the remembered ones, keep a guess or an error, or outlive a cleared
or overridden decision. CPU tests; counting the full passes through ``dispatch.select``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convt3d
from convt3d.dispatch.registry import ENGINES
from convt3d import functional
from convt3d.dispatch import select as dispatch
from convt3d.core.flags import cudnn_conv_allows_tf32, cudnn_conv_tf32
from conftest import requires_interpreter


@pytest.fixture(autouse=True)
def _fresh(auto_state):
    yield


@pytest.fixture
def passes(monkeypatch):
    """The number of full dispatcher passes so far (calls of dispatch.select from the API)."""
    count = [0]
    select = dispatch.select

    def counting(call, backend=None, **kw):
        count[0] += 1
        return select(call, backend, **kw)

    monkeypatch.setattr(functional.dispatch, "select", counting)
    return count


def _layer(batched=True, cl=False, cin=4, cout=3):
    x = torch.randn(*((2,) if batched else ()), cin, 3, 4, 5)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return x, torch.randn(cin, cout, 2, 3, 2), torch.randn(cout)


def test_a_repeated_call_takes_one_pass_and_matches_pytorch_bitwise(passes):
    x, w, b = _layer()
    ref = F.conv_transpose3d(x, w, b, 2, 1, 1)
    for _ in range(3):
        y = convt3d.conv_transpose3d(x, w, b, 2, 1, 1)
        assert torch.equal(y, ref) and y.stride() == ref.stride()
    assert passes[0] == 1
    # New tensors of the same signature: still no new pass.
    x2, w2, b2 = _layer()
    assert torch.equal(convt3d.conv_transpose3d(x2, w2, b2, 2, 1, 1), F.conv_transpose3d(x2, w2, b2, 2, 1, 1))
    assert passes[0] == 1


@pytest.mark.parametrize("change", [
    "input-shape", "layout", "dtype", "bias-none", "stride", "output_padding", "list-argument", "backend",
    "precision", "requires-grad", "grad-mode", "autocast", "tf32-flag", "env-backend"])
def test_every_argument_and_flag_is_part_of_the_signature(change, passes, monkeypatch):
    x, w, b = _layer()
    args = dict(stride=2, padding=1, output_padding=1)
    convt3d.conv_transpose3d(x, w, b, **args)
    assert passes[0] == 1
    kw, ctx = dict(args), torch.autocast("cpu", enabled=False)
    xx, ww, bb = x, w, b
    if change == "input-shape":
        xx = torch.randn(3, 4, 3, 4, 5)
    elif change == "layout":
        xx = x.contiguous(memory_format=torch.channels_last_3d)
    elif change == "dtype":
        xx, ww, bb = x.double(), w.double(), b.double()
    elif change == "bias-none":
        bb = None
    elif change == "stride":
        kw.update(stride=(2, 2, 3), output_padding=(1, 1, 0))
    elif change == "output_padding":
        kw.update(output_padding=0)
    elif change == "list-argument":
        kw.update(stride=[2, 2, 2])  # same geometry, but a list: its own key, the same answer
    elif change == "backend":
        kw.update(backend="torch")
    elif change == "precision":
        kw.update(precision="ieee")
    elif change == "requires-grad":
        ww = w.clone().requires_grad_()
    elif change == "grad-mode":
        ww = w.clone().requires_grad_()
        convt3d.conv_transpose3d(xx, ww, bb, **kw)
        passes[0] = 1
        ctx = torch.no_grad()
    elif change == "autocast":
        ctx = torch.autocast("cpu", torch.bfloat16)
    elif change == "tf32-flag":
        ctx = cudnn_conv_tf32(not cudnn_conv_allows_tf32())
    elif change == "env-backend":
        monkeypatch.setenv("CONVT3D_BACKEND", "torch")
    with ctx:
        y = convt3d.conv_transpose3d(xx, ww, bb, **kw)
        ref = F.conv_transpose3d(xx, ww, bb, kw["stride"], kw["padding"], kw["output_padding"])
    assert passes[0] == 2, f"{change}: a call with a different signature must take the full pass"
    assert y.dtype == ref.dtype and torch.equal(y, ref)


def test_errors_are_raised_every_time_and_never_remembered(passes):
    x, w, b = _layer()
    convt3d.conv_transpose3d(x, w, b, 2, 1, 1)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="output padding must be smaller than either stride or dilation"):
            convt3d.conv_transpose3d(x, w, b, 2, 1, 2)
        with pytest.raises(ValueError, match="unknown backend='fast'"):
            convt3d.conv_transpose3d(x, w, b, 2, 1, 1, backend="fast")
        with pytest.raises(convt3d.BackendUnavailableError):
            convt3d.conv_transpose3d(x, w, b, 2, 1, 1, backend="conv3d")


def test_unbatched_and_non_contiguous_inputs(passes):
    x, w, b = _layer(batched=False)
    xs = torch.randn(2, 8, 3, 4, 5)[:, ::2]  # every other channel
    for _ in range(2):
        assert torch.equal(convt3d.conv_transpose3d(x, w, b, 2), F.conv_transpose3d(x, w, b, 2))
        assert torch.equal(convt3d.conv_transpose3d(xs, w, b, 2), F.conv_transpose3d(xs, w, b, 2))
    assert passes[0] == 2


def test_autocast_casts_as_pytorch_on_the_steady_path(passes):
    x, w, b = _layer()
    w.requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        for _ in range(2):
            y = convt3d.conv_transpose3d(x, w, b, 2, 1, 1)
            ref = F.conv_transpose3d(x, w, b, 2, 1, 1)
            assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    assert passes[0] == 1
    (g,) = torch.autograd.grad(y.float().sum(), w)
    (g_ref,) = torch.autograd.grad(ref.float().sum(), w)
    assert g.dtype == torch.float32 and torch.equal(g, g_ref)


def test_cleared_and_overridden_decisions_take_a_new_pass(passes):
    x, w, b = _layer()
    convt3d.conv_transpose3d(x, w, b, 2)
    dispatch.clear_decisions()
    convt3d.conv_transpose3d(x, w, b, 2)
    assert passes[0] == 2
    dispatch.override("no such signature", "torch", "network check", torch.device("cpu"))
    convt3d.conv_transpose3d(x, w, b, 2)
    assert passes[0] == 3


def test_a_listener_sees_every_call(passes):
    x, w, b = _layer()
    seen = []
    with dispatch.listening(lambda event, info: seen.append(event)):
        for _ in range(3):
            convt3d.conv_transpose3d(x, w, b, 2)
    assert passes[0] == 3 and seen.count("decision") >= 1
    convt3d.conv_transpose3d(x, w, b, 2)
    convt3d.conv_transpose3d(x, w, b, 2)
    assert passes[0] == 4, "after the listener, the steady path again"


def test_heuristic_guesses_are_not_remembered(passes, monkeypatch):
    x, w, b = _layer()
    guess = dispatch.Decision("torch", "tf32", "auto (heuristic): a guess", source="heuristic")
    monkeypatch.setattr(functional.dispatch, "select", lambda call, backend=None, **kw: passes.__setitem__(
        0, passes[0] + 1) or guess)
    for _ in range(3):
        convt3d.conv_transpose3d(x, w, b, 2)
    assert passes[0] == 3


class _Tagged(torch.Tensor):
    """A subclass with its own __torch_function__ (as MONAI's MetaTensor has), counting calls."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class _Opaque(torch.Tensor):
    """A subclass without __torch_function__ dispatch (as wrapper subclasses declare)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def test_a_torch_function_subclass_is_handled_as_pytorch_handles_it(passes):
    """The subclass's handler runs the call once, on plain views: the steady path keys and memos
    them as plain tensors, and the result is wrapped as F.conv_transpose3d's is."""
    x, w, b = _layer()
    xt = x.as_subclass(_Tagged)
    ref = F.conv_transpose3d(xt, w, b, 2)
    for _ in range(3):
        _Tagged.calls = 0
        y = convt3d.conv_transpose3d(xt, w, b, 2)
        assert _Tagged.calls == 1 and type(y) is type(ref) is _Tagged
        assert torch.equal(y.as_subclass(torch.Tensor), ref.as_subclass(torch.Tensor))
    assert passes[0] == 1 and len(dispatch._direct) == 1


def test_an_opaque_subclass_gets_no_key_but_its_direct_memo(passes):
    """A subclass without __torch_function__ reaches the steady path as itself: no key (its
    validation and the pass run in full), but a call decided for PyTorch's op gets its direct
    memo."""
    x, w, b = _layer()
    xo = x.as_subclass(_Opaque)
    for _ in range(3):
        y = convt3d.conv_transpose3d(xo, w, b, 2)
        assert type(y) is type(F.conv_transpose3d(xo, w, b, 2))
        assert torch.equal(y.as_subclass(torch.Tensor), F.conv_transpose3d(x, w, b, 2))
    assert passes[0] == 1
    assert not dispatch._steady and len(dispatch._direct) == 1


@requires_interpreter
@pytest.mark.parametrize("kind", ["torch-function", "opaque"])
def test_a_tensor_subclass_runs_our_engine(kind, passes):
    x, w, b = _layer(cin=4, cout=2)
    xt = x.as_subclass(_Tagged if kind == "torch-function" else _Opaque)
    ref = F.conv_transpose3d(x.double(), w.double(), b.double(), 2)
    for _ in range(2):
        y = convt3d.conv_transpose3d(xt, w, b, 2, backend="triton", precision="ieee")
        torch.testing.assert_close(y.as_subclass(torch.Tensor).double(), ref, rtol=1e-4, atol=1e-4)
    if kind == "torch-function":
        assert type(y) is _Tagged and passes[0] == 1  # plain views: keyed, one pass
    else:
        assert passes[0] == 2  # no key: the full pass each call


def test_patched_module_in_training_and_eval(passes):
    torch.manual_seed(0)
    ref = torch.nn.ConvTranspose3d(4, 3, 3, stride=2, padding=1, output_padding=1)
    layer = convt3d.patch(torch.nn.Sequential(ref.__class__(4, 3, 3, stride=2, padding=1, output_padding=1)))[0]
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4, 3, 4, 5, requires_grad=True)
    for _ in range(2):
        y, y_ref = layer(x), ref(x)
        assert torch.equal(y, y_ref)
        gx, gw = torch.autograd.grad(y.square().sum(), (x, layer.weight))
        gx_ref, gw_ref = torch.autograd.grad(y_ref.square().sum(), (x, ref.weight))
        assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(layer(x), ref(x))
    assert passes[0] == 2  # one training signature, one inference signature


@requires_interpreter
def test_a_named_engine_runs_again_on_the_steady_path(passes):
    x, w, b = _layer(cin=4, cout=2)
    first = convt3d.conv_transpose3d(x, w, b, 2, 1, 1, backend="triton", precision="ieee")
    again = convt3d.conv_transpose3d(x, w, b, 2, 1, 1, backend="triton", precision="ieee")
    assert passes[0] == 1 and torch.equal(first, again)
    ref = F.conv_transpose3d(x.double(), w.double(), b.double(), 2, 1, 1)
    torch.testing.assert_close(again.double(), ref, rtol=1e-4, atol=1e-4)


def test_timing_a_candidate_goes_through_the_steady_path(monkeypatch):
    """Engine.time of a forward builds a Call per timed call and runs it through ``run``, as a
    repeated call does, so the host cost of that path is in the measurement."""
    import triton.testing

    from convt3d.core.call import make_call
    from convt3d.dispatch.registry import ENGINES

    x, w, b = _layer()
    call = make_call(x, w, b, 2, 1, 1, 1, 1)
    seen = []
    engine = ENGINES["torch"]
    monkeypatch.setattr(engine, "run", lambda c: seen.append(c) or F.conv_transpose3d(c.x, c.weight, c.bias, 2, 1, 1))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: [fn() for _ in range(3)] and 0.5)
    from convt3d.dispatch.timing import HOST_CALLS

    t = engine.time(call)
    assert t.ms == 0.5 and t.host_ms > 0
    # The first call, three timed by do_bench and HOST_CALLS for the host time, each its own.
    n = 4 + HOST_CALLS
    assert len(seen) == n and len({id(c) for c in seen}) == n
    assert all(c.params is call.params and not c.training for c in seen)
    # The first is a first sight (the engine primes its caches, agrees across ranks), the timed
    # ones repeats, as the steady path's calls are.
    assert [c.repeat for c in seen] == [False] + [True] * (n - 1)


def test_a_direct_call_is_answered_by_its_weights_memo_without_the_key(passes, monkeypatch):
    """A call decided for PyTorch's op at the flags as they are: the next call with the same weight
    object and signature is answered by that weight's memo (steady.Direct), never by the key."""
    x, w, b = _layer()
    convt3d.conv_transpose3d(x, w, b, 2, 1, 1)
    keys = [0]
    key = dispatch.steady_key
    monkeypatch.setattr(dispatch, "steady_key", lambda *a: keys.__setitem__(0, keys[0] + 1) or key(*a))
    for _ in range(3):
        assert torch.equal(convt3d.conv_transpose3d(x, w, b, 2, 1, 1), F.conv_transpose3d(x, w, b, 2, 1, 1))
    assert passes[0] == 1 and keys[0] == 0
    # Another weight object of the same signature: the key answers once, then its own memo.
    w2 = w.clone()
    for _ in range(3):
        assert torch.equal(convt3d.conv_transpose3d(x, w2, b, 2, 1, 1), F.conv_transpose3d(x, w2, b, 2, 1, 1))
    assert passes[0] == 1 and keys[0] == 1


@pytest.mark.parametrize("change", ["other-weight", "other-bias", "no-bias", "tensor-stride", "list-stride",
                                    "non-tensor-input"])
def test_a_weights_memo_fits_only_its_own_call(change):
    from convt3d.dispatch.steady import Direct

    x, w, b = _layer()
    args = (2, 1, 1, 1, 1)
    memo = Direct(x, w, b, args, None, None)
    assert memo.fits(x, w, b, args, None, None)
    xx, ww, bb, aa = x, w, b, args
    if change == "other-weight":
        ww = w.clone()
    elif change == "other-bias":
        bb = b.clone()
    elif change == "no-bias":
        bb = None
    elif change == "tensor-stride":
        aa = (torch.tensor([2, 2, 2]),) + args[1:]  # compares as a tensor: no fit, and no error
    elif change == "list-stride":
        aa = ([2, 2, 2],) + args[1:]
    elif change == "non-tensor-input":
        xx = x.tolist()
    assert not memo.fits(xx, ww, bb, aa, None, None)


def test_timing_a_candidate_pays_its_steady_check(monkeypatch):
    """Engine.time runs the host work of the steady path with each timed call: the weight's memo
    check for PyTorch's op at the flags as they are and for an inference call on our engines
    (steady.Direct, steady.Repeat), the key for a training call on ours."""
    import triton.testing

    from convt3d.engines import base as engines
    from convt3d.dispatch import timing
    from convt3d.dispatch import steady
    from convt3d.core.call import make_call

    x, w, b = _layer()
    call = make_call(x, w, b, 2, 1, 1, 1, 1)
    keys, fits = [0], [0]
    key, fit = steady.steady_key, steady.Direct.fits
    monkeypatch.setattr(engines, "steady_key", lambda *a: keys.__setitem__(0, keys[0] + 1) or key(*a))
    monkeypatch.setattr(steady.Direct, "fits", lambda self, *a: fits.__setitem__(0, fits[0] + 1) or fit(self, *a))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: [fn() for _ in range(3)] and 0.5)
    ENGINES["torch"].time(call)
    n = 4 + timing.HOST_CALLS  # the first call, three by do_bench, HOST_CALLS for the host time
    assert fits[0] == n and keys[0] == 0
    triton = ENGINES["triton"]
    monkeypatch.setattr(triton, "run", lambda c: F.conv_transpose3d(c.x, c.weight, c.bias, 2, 1, 1))
    triton.time(call)
    assert keys[0] == 0 and fits[0] == 2 * n
    w.requires_grad_()
    triton.time(make_call(x, w, b, 2, 1, 1, 1, 1, autograd=True))
    assert keys[0] == n and fits[0] == 2 * n


@pytest.mark.parametrize("setting", ["as-is", "legacy-flag-off", "per-op-ieee", "per-op-tf32"])
def test_the_steady_paths_flag_reader_agrees_with_torch_engines(setting, monkeypatch):
    from convt3d.dispatch import steady

    conv = getattr(torch.backends.cudnn, "conv", None)
    if setting.startswith("per-op") and not hasattr(conv, "fp32_precision"):
        pytest.skip("this torch has no per-operator fp32_precision")
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=setting != "legacy-flag-off"):
        if setting.startswith("per-op"):
            old = conv.fp32_precision
            conv.fp32_precision = "ieee" if setting == "per-op-ieee" else "tf32"
        try:
            assert steady._tf32() is cudnn_conv_allows_tf32()
        finally:
            if setting.startswith("per-op"):
                conv.fp32_precision = old


def test_a_steady_repeat_skips_the_triton_engines_priming(monkeypatch):
    """The Triton engine seeds a signature's tile from the disk cache at its first sight; a call of
    the steady path (``Call.repeat``) only checks for tuning results to persist."""
    from types import SimpleNamespace

    from convt3d.engines.triton import engine as triton_engine
    from convt3d.engines.triton import peer as triton_peer

    engine = ENGINES["triton"]
    primed, flushed = [], []
    monkeypatch.setattr(triton_peer, "prime_triton", lambda *a: primed.append(a))
    monkeypatch.setattr(triton_peer, "has_pending", lambda: True)
    monkeypatch.setattr(triton_peer, "flush_triton", lambda: flushed.append(1))
    monkeypatch.setattr(triton_engine, "plan", lambda *a: SimpleNamespace(tune_key="tk", configs=[]))
    monkeypatch.setattr(triton_peer, "device_name", lambda device: "gpu")
    monkeypatch.setattr(triton_peer, "tuned_config", lambda key: "seeded from the cache file")  # nothing to tune

    def call(repeat):
        return SimpleNamespace(device=torch.device("cuda"), key=("signature",), bias=None, repeat=repeat, params=None,
                               x=None, weight=None, precision="tf32")

    engine.forget()
    try:
        engine._prime(call(repeat=True))
        assert primed == [] and len(flushed) == 1
        engine._prime(call(repeat=False))
        engine._prime(call(repeat=False))
        assert len(primed) == 1 and len(flushed) == 2
    finally:
        engine.forget()


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_calls_inside_a_torch_func_transform_take_pytorchs_op(transform):
    """vmap and grad wrap tensors that have no storage of their own: "auto" runs PyTorch's op,
    which has their rules, and matches it exactly."""
    x, w, b = _layer()
    ours = lambda t: convt3d.conv_transpose3d(t, w, b, 2, 1, 1)  # noqa: E731
    theirs = lambda t: F.conv_transpose3d(t, w, b, 2, 1, 1)  # noqa: E731
    convt3d.conv_transpose3d(x, w, b, 2, 1, 1)  # a steady entry for the plain signature first
    if transform == "vmap":
        xs = torch.stack([x, 2 * x])
        assert torch.equal(torch.vmap(ours)(xs), torch.vmap(theirs)(xs))
    else:
        g = torch.func.grad(lambda t: ours(t).square().sum())(x)
        assert torch.equal(g, torch.func.grad(lambda t: theirs(t).square().sum())(x))


@requires_interpreter
def test_a_named_engine_inside_a_transform_raises():
    x, w, b = _layer()
    convt3d.conv_transpose3d(x, w, b, 2, backend="triton", precision="ieee")  # its steady entry exists
    with pytest.raises(convt3d.BackendUnavailableError, match="backend='triton' cannot run this call: .*torch.func"):
        torch.vmap(lambda t: convt3d.conv_transpose3d(t, w, b, 2, backend="triton"))(torch.stack([x, x]))


@pytest.mark.parametrize("precision", [None, "ieee", "tf32"])
def test_inside_a_transform_auto_runs_pytorchs_op_at_the_precision_asked(precision):
    x, w, b = _layer()
    xs = torch.stack([x, -x])
    assert not functional._transformed(xs, w, b)
    assert torch.vmap(lambda t: torch.tensor(functional._transformed(t, w, b)))(xs).all()
    ran = torch.vmap(lambda t: functional._pytorchs_op_only(functional._IN_TRANSFORM, t, w, b, 2, 1, 1, 1, 1, None, precision))(xs)
    assert torch.equal(ran, torch.vmap(lambda t: F.conv_transpose3d(t, w, b, 2, 1, 1))(xs))


def _autocast_call(batched=True, requires_grad=False):
    """(call, (x, w, b)): a call made as conv_transpose3d makes it under CPU bf16 autocast from
    fp32 tensors -- the cast tensors in the Call, the caller's as its sources."""
    from convt3d.core.call import autocast_inputs, make_call

    x, w, b = _layer(batched=batched)
    w.requires_grad_(requires_grad)
    b.requires_grad_(requires_grad)
    with torch.autocast("cpu", torch.bfloat16):
        cx, cw, cb = autocast_inputs(x, w, b)
        call = make_call(cx, cw, cb, 2, 1, 1, 1, 1, autograd=True, sources=(x, w, b))
    return call, (x, w, b)


def test_conv_transpose3d_gives_the_call_its_sources_only_where_autocast_cast(monkeypatch):
    seen = []
    select = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda call, backend=None, **kw: seen.append(call) or select(call, backend))
    x, w, b = _layer()
    convt3d.conv_transpose3d(x, w, b, 2, 1, 1)
    with torch.autocast("cpu", torch.bfloat16):
        y = convt3d.conv_transpose3d(x, w, b, 2, 1, 1)  # autocast is part of the signature: a new pass
    assert seen[0].sources is None
    assert seen[1].sources[0] is x and seen[1].sources[1] is w and seen[1].sources[2] is b
    assert seen[1].x.dtype == seen[1].weight.dtype == torch.bfloat16 and y.dtype == torch.bfloat16


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_timing_under_autocast_starts_from_the_callers_tensors(batched, monkeypatch):
    """Under autocast, each timed call of our engines casts the caller's tensors again (as every
    call of the layer does), and PyTorch's op at the flags as they are gets the caller's fp32
    tensors, which it casts itself (with autocast's weight cache)."""
    import triton.testing

    from convt3d.engines import base as engines
    from convt3d.dispatch import timing
    from convt3d.dispatch.registry import ENGINES

    call, (x, w, b) = _autocast_call(batched)
    casts, got = [0], []
    cast = engines.autocast_inputs
    monkeypatch.setattr(engines, "autocast_inputs", lambda *a: casts.__setitem__(0, casts[0] + 1) or cast(*a))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: [fn() for _ in range(3)] and 0.5)
    torch_engine = ENGINES["torch"]
    run_arguments = torch_engine.run_arguments

    def record(*args):
        got.append(args[:3])
        return run_arguments(*args)

    monkeypatch.setattr(torch_engine, "run_arguments", record)
    with torch.autocast("cpu", torch.bfloat16):
        torch_engine.time(call)
        assert got and all(a[0] is x and a[1] is w and a[2] is b for a in got) and casts[0] == 0
        seen = []
        triton = ENGINES["triton"]
        monkeypatch.setattr(triton, "run", lambda c: seen.append(c) or F.conv_transpose3d(
            c.x, c.weight, c.bias, 2, 1, 1))
        triton.time(call)
    n = 4 + timing.HOST_CALLS
    assert casts[0] == n and len(seen) == n
    assert all(c.x.dtype == c.weight.dtype == c.bias.dtype == torch.bfloat16 and c.x.dim() == 5 for c in seen)
    assert all(c.x is not call.x for c in seen)  # cast again for every timed call


def test_a_timed_training_step_under_autocast_differentiates_through_the_casts(monkeypatch):
    """The step auto times under autocast: the caller's fp32 leaves, cast in the step, so the
    weight gradient comes back in fp32 through the cast's backward, as in the caller's model."""
    from convt3d.dispatch.registry import ENGINES

    call, (x, w, b) = _autocast_call(requires_grad=True)
    assert call.training
    with torch.autocast("cpu", torch.bfloat16):
        for name in ("torch", "triton"):
            engine = ENGINES[name]
            if name == "triton":
                monkeypatch.setattr(engine, "run", lambda c: F.conv_transpose3d(c.x, c.weight, c.bias, 2, 1, 1))
            grads = engine._step(call, lambda: None)()
            assert [g.dtype for g in grads] == [torch.float32, torch.float32]  # dW, db of the fp32 leaves
            assert grads[0].shape == w.shape and grads[1].shape == b.shape


@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "training-step"])
def test_timed_calls_after_the_first_are_steady_path_repeats(requires_grad, monkeypatch):
    # Engine.time's first call is a first sight (the engine primes its caches); every timed call
    # after it is a repeat, as the steady path makes it -- for a training step as for a forward.
    from convt3d.engines import base as engines
    from convt3d.dispatch import timing
    from convt3d.dispatch.registry import ENGINES

    call, _ = _autocast_call(requires_grad=requires_grad)
    assert call.training is requires_grad
    engine = ENGINES["triton"]
    seen = []

    def run(c):
        seen.append(c.repeat)
        return F.conv_transpose3d(c.x, c.weight, c.bias, 2, 1, 1)

    def bench(fn, first=None):
        (first or fn)()
        fn(), fn()
        return timing.Timing(1.0, 0.1)

    monkeypatch.setattr(engine, "run", run)
    monkeypatch.setattr(engines, "time_call", bench)
    with torch.autocast("cpu", torch.bfloat16):
        engine.time(call)
    assert seen == [False, True, True]


# ---- steady.Repeat: inference calls decided for our engine ----------------------------------------
def _ours(x, w, b, **kw):
    return convt3d.conv_transpose3d(x, w, b, 2, 1, 1, backend="triton", precision="ieee", **kw)


def _f64_ref(x, w, b):
    return F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), 2, 1, 1)


@pytest.fixture
def keys(monkeypatch):
    """The number of steady keys built so far (a call its weight's memo answers builds none)."""
    count = [0]
    key = dispatch.steady_key
    monkeypatch.setattr(dispatch, "steady_key", lambda *a: count.__setitem__(0, count[0] + 1) or key(*a))
    return count


@requires_interpreter
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("cout", [2, 9], ids=["head-path", "phase-path"])
def test_an_inference_call_on_our_engine_is_answered_by_its_weights_memo(batched, cout, passes, keys):
    """First call: the pass; second: the key, which gives the weight its steady.Repeat memo; then
    the memo alone answers, with the engine's own launches (bitwise its first output), and the
    weight's current values (an in-place update is seen, nothing of the old values is kept)."""
    x, w, b = _layer(batched=batched, cin=4, cout=cout)
    with torch.no_grad():
        first = _ours(x, w, b)
        for _ in range(3):
            assert torch.equal(_ours(x, w, b), first)
        assert passes[0] == 1 and keys[0] == 2  # the first call's key, and the one that made the memo
        assert type(dispatch._direct[id(w)]).__name__ == "Repeat"
        w.mul_(-0.5)
        y = _ours(x, w, b)
    assert keys[0] == 2 and y.shape == first.shape
    torch.testing.assert_close(y.double(), _f64_ref(x, w, b), rtol=1e-4, atol=1e-4)


@requires_interpreter
@pytest.mark.parametrize("change", ["weight-data-layout", "weight-data-dtype", "bias-data-layout", "input-layout",
                                    "grad-mode", "autocast", "cleared-tuning", "seeded-tile", "other-weight"])
def test_a_repeat_memo_answers_only_its_own_call(change, keys, request):
    """Whatever a Repeat memo does not pin sends the call back to the key and, where the
    signature is new, to the pass: the result is the reference's each time."""
    from convt3d.engines.triton import engine as triton_engine

    x, w, b = _layer(cin=4, cout=2)
    w = torch.nn.Parameter(w)
    with torch.no_grad():
        for _ in range(3):
            _ours(x, w, b)
    built = keys[0]
    kw = {}
    if change == "weight-data-layout":
        w.data = w.data.permute(0, 1, 4, 3, 2).contiguous().permute(0, 1, 4, 3, 2)  # same shape, other strides
    elif change == "weight-data-dtype":
        w.data = w.data.half()
        x, b = x.half(), b.half()
    elif change == "bias-data-layout":
        b = torch.stack([b, b], 1)[:, 0]  # a strided bias of the same values
    elif change == "input-layout":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    elif change == "cleared-tuning":
        triton_engine.clear_caches()
    elif change == "seeded-tile":
        from convt3d.core.validate import check_call

        params, _ = check_call(x, w, b, 2, 1, 1, 1, 1)
        plan = triton_engine.plan(params, x, w.detach(), "ieee")
        # The seeded tile is this test's alone: later tests of the signature start untuned.
        request.addfinalizer(triton_engine.clear_caches)
        triton_engine.seed_tuning(plan.tune_key, plan.configs[-1], replace=True)
    elif change == "other-weight":
        w = torch.nn.Parameter(w.detach().clone())
    if change == "grad-mode":
        y = _ours(x, w, b)  # records autograd: the weight requires grad
        assert y.requires_grad
    elif change == "autocast":
        # float16: Triton's interpreter mis-computes bfloat16.
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            y = _ours(x, w, b)
        assert y.dtype == torch.float16
    else:
        with torch.no_grad():
            y = _ours(x, w, b)
    assert keys[0] == built + 1
    half = y.dtype == torch.float16
    if half:  # the reference of the operands as the call rounded them
        x, w, b = x.half(), w.detach().half(), b.half()
    torch.testing.assert_close(y.detach().double(), _f64_ref(x, w.detach(), b), rtol=2e-3 if half else 1e-4,
                               atol=2e-3 if half else 1e-4)


@requires_interpreter
def test_a_repeat_memo_never_answers_inside_a_torch_func_transform():
    """Under vmap the per-example input has the memo's very shape; the transform still gets
    PyTorch's op (its batching rule), not the engine's launches on a tensor without storage."""
    x, w, b = _layer(cin=4, cout=2)
    with torch.no_grad():
        for _ in range(3):
            convt3d.conv_transpose3d(x, w, b, 2, 1, 1)  # auto on CPU tensors: PyTorch's op
            _ours(x, w, b)
    xs = torch.stack([x, 2 * x])
    ys = torch.func.vmap(lambda t: convt3d.conv_transpose3d(t, w, b, 2, 1, 1))(xs)
    torch.testing.assert_close(ys, torch.stack([F.conv_transpose3d(t, w, b, 2, 1, 1) for t in xs]))
    with pytest.raises(convt3d.BackendUnavailableError):
        torch.func.vmap(lambda t: _ours(t, w, b))(xs)


@requires_interpreter
def test_timing_an_inference_call_on_our_engine_times_the_launcher_a_repeat_runs(monkeypatch):
    """Engine.time of a Triton inference call: the first call settles the signature through
    ``run``; the timed repeats go through the weight's memo check and the steady launcher, as a
    repeated call of the steady path does (steady.Repeat), not through the key and ``run``."""
    from convt3d.engines import base as engines
    from convt3d.dispatch import timing
    from convt3d.core.call import make_call
    from convt3d.dispatch.registry import ENGINES

    x, w, b = _layer(cin=4, cout=2)
    call = make_call(x, w, b, 2, 1, 1, 1, 1, precision="ieee")
    engine = ENGINES["triton"]
    runs, launched, outs = [], [], []
    run, launcher = engine.run, engine.steady_launcher
    monkeypatch.setattr(engine, "run", lambda c: runs.append(c.repeat) or run(c))

    def counting_launcher(*a):
        got = launcher(*a)
        return None if got is None else (lambda *t: launched.append(1) or got[0](*t), got[1])

    monkeypatch.setattr(engine, "steady_launcher", counting_launcher)
    monkeypatch.setattr(dispatch, "steady_key", lambda *a: pytest.fail("a timed repeat built a steady key"))

    def bench(fn, first=None):
        outs.append((first or fn)())
        outs.extend((fn(), fn()))
        return timing.Timing(1.0, 0.1)

    monkeypatch.setattr(engines, "time_call", bench)
    with torch.no_grad():
        engine.time(call)
    assert runs == [False] and len(launched) == 2
    assert all(torch.equal(o, outs[0]) for o in outs)
    torch.testing.assert_close(outs[0].double(), _f64_ref(x, w, b), rtol=1e-4, atol=1e-4)
