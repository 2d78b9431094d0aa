"""``convt3d.conv_transpose3d``: a drop-in for ``torch.nn.functional.conv_transpose3d``."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from .dispatch import select as dispatch
from .core.call import Call, autocast_inputs, make_call, resolve_precision
from .dispatch.registry import ENGINES
from .core.errors import BackendUnavailableError
from .engines.op import OP_NAME, conv_transpose3d_op
from .core.flags import cudnn_conv_tf32
from .core.validate import check_call

__all__ = ["conv_transpose3d"]


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     backend=None, precision=None):
    """3-D transposed convolution with the signature and semantics of
    ``torch.nn.functional.conv_transpose3d``.

    Args (beyond PyTorch's):
        backend: "auto" (default; ``$CONVT3D_BACKEND`` overrides the default), "triton" (our
            engine; on CPU tensors it runs through Triton's interpreter), "torch" (PyTorch's
            own implementation), "cuda" (the CUDA head kernel, for output heads) or "conv3d" (a
            stride-1 call as PyTorch's conv3d of the flipped weight). A named backend
            that cannot run the call raises :class:`convt3d.BackendUnavailableError`; only
            "auto" falls back.
        precision: float32 only. None follows ``torch.backends.cudnn.allow_tf32`` as PyTorch's
            convolutions do (True: "tf32", False: exact grade); or "tf32", "tf32x3", "ieee".
            float16/bfloat16 multiply in their own type and accumulate in float32.
    """
    if torch.compiler.is_compiling():
        input, weight, bias = autocast_inputs(input, weight, bias)
        return _traced(input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision)
    if torch.jit.is_tracing():
        return _pytorchs_op_only(_IN_JIT_TRACE, input, weight, bias, stride, padding, output_padding, groups,
                                 dilation, backend, precision)
    if has_torch_function((input, weight, bias)):
        # A tensor subclass with its own __torch_function__ (MONAI's MetaTensor): its handler runs
        # the call on plain views and wraps the result, as it wraps F.conv_transpose3d's.
        return handle_torch_function(_on_plain_tensors, (input, weight, bias), input, weight, bias, stride, padding,
                                     output_padding, groups, dilation, backend=backend, precision=precision)
    # A call whose arguments were seen before skips validation and the pass (dispatch.steady).
    key, hit = dispatch.steady(input, weight, bias, stride, padding, output_padding, groups, dilation, backend,
                               precision)
    if hit is not None and hit.direct:
        return _recorded(ENGINES["torch"].run_arguments, input, weight, bias, stride, padding, output_padding, groups,
                         dilation)
    if _transformed(input, weight, bias):
        return _pytorchs_op_only(_IN_TRANSFORM, input, weight, bias, stride, padding, output_padding, groups,
                                 dilation, backend, precision)
    if hit is not None:
        if hit.run is not None:  # an inference call settled on one of our engines (steady.Repeat)
            return _recorded(hit.run, input, weight, bias)
        input, weight, bias = autocast_inputs(input, weight, bias)
        call = Call(input.unsqueeze(0) if hit.unbatched else input, weight, bias, hit.params, hit.precision,
                    precision, hit.training, hit.unbatched, repeat=True)
        with _device_current(input):
            return _run(ENGINES[hit.decision.candidate], call)
    # One validation, one dispatcher pass, one engine run.
    given = (input, weight, bias, (stride, padding, output_padding, groups, dilation), backend, precision)
    cast = autocast_inputs(input, weight, bias)
    # The caller's tensors, where autocast cast any: "auto" times its candidates from them, with
    # the casts every later call makes (ours each call, PyTorch's own op with autocast's cache).
    sources = None if all(c is t for c, t in zip(cast, (input, weight, bias))) else (input, weight, bias)
    input, weight, bias = cast
    call = make_call(input, weight, bias, stride, padding, output_padding, groups, dilation, precision,
                     autograd=True, sources=sources)
    with _device_current(input):
        decision = dispatch.select(call, backend)
        call = dispatch.decided_call(call, decision)
        dispatch.remember(key, call, decision, given)
        return _run(ENGINES[decision.candidate], call)


_SAME_DEVICE = contextlib.nullcontext()  # reusable: no device or flag to set


def _device_current(t: torch.Tensor):
    """The tensor's CUDA device made current for the block, where another one is: Triton launches
    and the measurement times on the current device, whatever the tensors' device."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _SAME_DEVICE


def _on_plain_tensors(input, weight, bias, stride, padding, output_padding, groups, dilation, *, backend=None,
                      precision=None):
    """``conv_transpose3d`` on plain views of tensor-subclass arguments (``as_subclass``: the same
    storage, still attached to autograd), for the subclass's __torch_function__ to call."""
    return conv_transpose3d(_plain(input), _plain(weight), _plain(bias), stride, padding, output_padding, groups,
                            dilation, backend=backend, precision=precision)


# torch.func's transforms (vmap, grad, jacrev, ...) wrap tensors that have no storage of their
# own; only PyTorch's op has their batching and gradient rules. Asked only off the direct path.
_is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_IN_TRANSFORM = (": its tensors are inside a torch.func transform (vmap, grad, jacrev, ...), whose batching and "
                 "gradient rules only PyTorch's own op has; use backend='auto' or 'torch' there")
# torch.jit.trace records ATen operations only: our engines' launches would be missing from its graph.
_IN_JIT_TRACE = (" under torch.jit.trace, which records ATen operations only: convt3d runs PyTorch's own op there "
                 "(backend='auto' or 'torch'); torch.compile and torch.export record convt3d's custom op instead")


def _transformed(input, weight, bias) -> bool:
    # Written out rather than any() over a generator, which costs more on every repeated call.
    tensor = torch.Tensor
    return _is_wrapped is not None and ((isinstance(input, tensor) and _is_wrapped(input))
                                        or (isinstance(weight, tensor) and _is_wrapped(weight))
                                        or (isinstance(bias, tensor) and _is_wrapped(bias)))


def _pytorchs_op_only(why, input, weight, bias, stride, padding, output_padding, groups, dilation, backend,
                      precision):
    """A call only PyTorch's own op can run: that op under "auto" or "torch" (an explicit precision
    sets cuDNN's TF32 flag for the call), else BackendUnavailableError ending in ``why``."""
    name = dispatch.resolve_backend_name(backend)
    if name not in ("auto", "torch"):
        raise BackendUnavailableError(f"backend={name!r} cannot run this call{why}")
    flag = _SAME_DEVICE if precision is None else cudnn_conv_tf32(resolve_precision(precision) == "tf32")
    with flag:
        return _recorded(ENGINES["torch"].run_arguments, input, weight, bias, stride, padding, output_padding,
                         groups, dilation)


def _plain(t):
    if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter):
        return t.as_subclass(torch.Tensor)
    return t


def _run(engine, call):
    y = _recorded(engine.run, call)
    return y.squeeze(0) if call.unbatched else y


def _recorded(fn, *args):
    """``fn(*args)``; under a profiler recorded as one op named as torch.compile's custom op, so
    every kernel it launches is attributed to it (outside a profiler, one flag test)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(OP_NAME):
            return fn(*args)
    return fn(*args)


@torch.compiler.assume_constant_result
def _decide_for_trace(input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision):
    """Validation and dispatch as plain values, run eagerly once at trace time on the example
    tensors (which hold real values, so "auto" decides as an eager first call does); the result
    is a graph constant under Dynamo's guards on the tensors. Changing $CONVT3D_BACKEND or the
    TF32 flag after compiling does not recompile."""
    params, unbatched = check_call(input, weight, bias, stride, padding, output_padding, groups, dilation)
    with _device_current(input):  # the measurement times on the current device
        d = dispatch.decide(input, backend, precision, params, weight=weight, bias=bias)
    return (d.engine, d.precision, list(params.stride), list(params.padding), list(params.output_padding),
            params.groups, list(params.dilation), unbatched)


def _traced(input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision):
    engine, prec, stride, padding, output_padding, groups, dilation, unbatched = _decide_for_trace(
        input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision)
    if engine == "torch":
        # PyTorch's own op traces natively (an explicit precision cannot set cuDNN's global flag
        # inside a graph: the flag at run time applies).
        return F.conv_transpose3d(input, weight, bias, stride, padding, output_padding, groups, dilation)
    x = input.unsqueeze(0) if unbatched else input
    y = conv_transpose3d_op(x, weight, bias, stride, padding, output_padding, groups, dilation, prec, engine)
    return y.squeeze(0) if unbatched else y


