"""``convt3d.conv_transpose3d``: a drop-in for ``torch.nn.functional.conv_transpose3d``."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from .dispatch import first_call, select as dispatch
from .core.call import Call, autocast_inputs, make_call, resolve_precision
from .core.epilogue import CHANNEL, TENSOR, Epilogue, apply_torch, as_epilogue
from .core.memo import memo
from .dispatch.registry import ENGINES
from .dispatch.timing import time_call
from .core.errors import BackendUnavailableError
from .engines.op import OP_NAME, conv_transpose3d_op
from .engines.triton import engine as triton_engine
from .core.flags import cudnn_conv_tf32
from .core.validate import check_call

__all__ = ["conv_transpose3d"]


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     backend=None, precision=None, epilogue=None):
    """3-D transposed convolution with the signature and semantics of ``torch.nn.functional.conv_transpose3d``.

    Args (beyond PyTorch's):
        backend: "auto" (default; ``$CONVT3D_BACKEND`` overrides the default), "triton" (our engine; on CPU tensors
            through Triton's interpreter), "torch" (PyTorch's own) or "conv3d" (a stride-1 call as PyTorch's conv3d of
            the flipped weight). A named backend that cannot run the call raises
            :class:`convt3d.BackendUnavailableError`; only "auto" falls back.
        precision: float32 only. None follows ``torch.backends.cudnn.allow_tf32`` as PyTorch's convolutions do (True:
            "tf32", False: exact grade); or "tf32", "tf32x3", "ieee". float16/bfloat16 multiply in their own type and
            accumulate in float32.
        epilogue: an elementwise program applied in float32 to the output before its one cast
            (``convt3d.core.epilogue``), as ``[("mul", 2.0), "relu", ("add", residual)]``. "auto" fuses it into the
            Triton GEMM's store where that is measured faster; "triton" fuses it or raises (also where autograd records
            the call: the fused path is forward-only); otherwise the convolution runs, then the program in PyTorch.
    """
    if epilogue is not None:
        return _with_epilogue(input, weight, bias, (stride, padding, output_padding, groups, dilation), backend,
                              precision, epilogue)
    if torch.compiler.is_compiling():
        input, weight, bias = autocast_inputs(input, weight, bias)
        return _traced(input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision)
    if torch.jit.is_tracing():
        return _pytorchs_op_only(_IN_JIT_TRACE, input, weight, bias, stride, padding, output_padding, groups,
                                 dilation, backend, precision)
    if has_torch_function((input, weight, bias)):
        # A tensor subclass with its own __torch_function__ (MONAI's MetaTensor) wraps our result.
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
    given = (input, weight, bias, (stride, padding, output_padding, groups, dilation), backend, precision)
    cast = autocast_inputs(input, weight, bias)
    # The caller's tensors, where autocast cast any: "auto" times its candidates from them, casts included.
    sources = None if all(c is t for c, t in zip(cast, (input, weight, bias))) else (input, weight, bias)
    input, weight, bias = cast
    call = make_call(input, weight, bias, stride, padding, output_padding, groups, dilation, precision,
                     autograd=True, sources=sources)
    with _device_current(input):
        decision = dispatch.select(call, backend)
        dispatch.remember(key, call, decision, given)
        return _run(ENGINES[decision.candidate], dispatch.decided_call(call, decision))


_NOTHING = contextlib.nullcontext()  # reusable: no device or flag to set


def _device_current(t: torch.Tensor):
    """The tensor's CUDA device made current for the block: Triton launches on the current device."""
    return torch.cuda.device(t.device) if t.is_cuda and t.device.index != torch.cuda.current_device() else _NOTHING


def _on_plain_tensors(input, weight, bias, stride, padding, output_padding, groups, dilation, *, backend=None,
                      precision=None):
    """``conv_transpose3d`` on plain views of tensor-subclass arguments (for their __torch_function__)."""
    return conv_transpose3d(_plain(input), _plain(weight), _plain(bias), stride, padding, output_padding, groups,
                            dilation, backend=backend, precision=precision)


# torch.func's transforms wrap tensors that have no storage of their own: only PyTorch's op has their rules.
_is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_IN_TRANSFORM = (": its tensors are inside a torch.func transform (vmap, grad, jacrev, ...), whose batching and "
                 "gradient rules only PyTorch's own op has; use backend='auto' or 'torch' there")
_IN_JIT_TRACE = (" under torch.jit.trace, which records ATen operations only: convt3d runs PyTorch's own op there "
                 "(backend='auto' or 'torch'); torch.compile and torch.export record convt3d's custom op instead")


def _transformed(input, weight, bias) -> bool:
    # Written out rather than any() over a generator, which costs more on every repeated call.
    tensor = torch.Tensor
    return _is_wrapped is not None and ((isinstance(input, tensor) and _is_wrapped(input))
                                        or (isinstance(weight, tensor) and _is_wrapped(weight))
                                        or (isinstance(bias, tensor) and _is_wrapped(bias)))


def _pytorchs_op_only(why, input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision):
    """A call only PyTorch's own op can run: that op under "auto" or "torch" (an explicit precision
    sets cuDNN's TF32 flag for the call), else BackendUnavailableError ending in ``why``."""
    name = dispatch.resolve_backend_name(backend)
    if name not in ("auto", "torch"):
        raise BackendUnavailableError(f"backend={name!r} cannot run this call{why}")
    with _NOTHING if precision is None else cudnn_conv_tf32(resolve_precision(precision) == "tf32"):
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
    """``fn(*args)``, under a profiler recorded as one op named as torch.compile's custom op."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(OP_NAME):
            return fn(*args)
    return fn(*args)


@torch.compiler.assume_constant_result
def _decide_for_trace(input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision):
    """Validation and dispatch as plain values, run eagerly once at trace time on the example tensors
    (so "auto" decides as an eager first call does); the result is a graph constant, so changing
    $CONVT3D_BACKEND or the TF32 flag after compiling does not recompile."""
    params, unbatched = check_call(input, weight, bias, stride, padding, output_padding, groups, dilation)
    # The measurement times on the current device, and waits for every candidate: the graph keeps its result.
    with _device_current(input), first_call.waiting():
        d = dispatch.decide(input, backend, precision, params, weight=weight, bias=bias)
    return (d.engine, d.precision, list(params.stride), list(params.padding), list(params.output_padding),
            params.groups, list(params.dilation), unbatched)


def _traced(input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision):
    engine, prec, stride, padding, output_padding, groups, dilation, unbatched = _decide_for_trace(
        input, weight, bias, stride, padding, output_padding, groups, dilation, backend, precision)
    if engine == "torch":
        # PyTorch's own op traces natively (inside a graph the TF32 flag at run time applies).
        return F.conv_transpose3d(input, weight, bias, stride, padding, output_padding, groups, dilation)
    x = input.unsqueeze(0) if unbatched else input
    y = conv_transpose3d_op(x, weight, bias, stride, padding, output_padding, groups, dilation, prec, engine)
    return y.squeeze(0) if unbatched else y


# ---- the fused epilogue ---------------------------------------------------------------------------
# (call key, program signature) -> (fused path no slower, its ms, the composite's ms): auto's timing.
_fused: dict[tuple, tuple[bool, float, float]] = memo("functional.fused_epilogue")


def _with_epilogue(input, weight, bias, args: tuple, backend, precision, program):
    """``conv_transpose3d`` followed by ``program``: fused into the Triton GEMM's store where
    ``epilogue_route`` says so, else the composite (the convolution, then ``apply_torch``)."""
    name = dispatch.resolve_backend_name(backend)

    def composite(epi: Epilogue | None = None):
        y = conv_transpose3d(input, weight, bias, *args, backend=backend, precision=precision)
        epi = epi if epi is not None else as_epilogue(program, y.shape[-4], tuple(y.shape))
        return apply_torch(y, epi, y.dim() - 4)  # the channel dimension of a batched or unbatched output

    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or has_torch_function((input, weight, bias))
            or _transformed(input, weight, bias)):
        return composite()  # traced, subclassed or transformed tensors: PyTorch's ops carry the program
    input, weight, bias = autocast_inputs(input, weight, bias)
    call = make_call(input, weight, bias, *args, precision, autograd=True)
    epi = validated_epilogue(program, call)
    # The program of the call's 5-D form: an unbatched call's residual gains the batch dimension.
    epi5 = Epilogue(tuple(dataclasses.replace(s, operand=s.operand.unsqueeze(0)) if s.form == TENSOR
                          and call.unbatched else s for s in epi.steps))
    with _device_current(input):  # auto's measurement and Triton's launches run on the current device
        fused, _ = epilogue_route(call, epi5, name, composite=lambda: composite(epi))
        if fused is None:
            return composite(epi)
        y = _recorded(_run_fused, fused, epi5)
    return y.squeeze(0) if call.unbatched else y


def validated_epilogue(program, call: Call) -> Epilogue:
    """``program`` validated for the call's output, its tensors on the output's device as PyTorch requires."""
    p = call.params
    epi = as_epilogue(program, p.out_channels, p.out_shape[1:] if call.unbatched else p.out_shape)
    for s in epi.steps:
        if s.form in (CHANNEL, TENSOR) and s.operand.device != call.device:
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                               f"{call.device} and {s.operand.device}!")
    return epi


def _run_fused(call: Call, epi: Epilogue) -> torch.Tensor:
    return triton_engine.forward(call.x, call.weight, call.bias, call.params, call.precision, epilogue=epi)


def epilogue_route(call: Call, epi: Epilogue, name: str, *, composite=None, decision=None) -> tuple[Call | None, str]:
    """(the call the fused Triton path runs, or None for the composite; why) for the program ``epi``.
    Auto times the fused path against ``composite`` on a signature's first CUDA call; without it (explain)
    nothing is timed, and ``decision`` is auto's for the plain call where known."""
    if not epi:
        return None, "an empty program: the convolution alone"
    if call.training or (torch.is_grad_enabled() and any(
            s.form in (CHANNEL, TENSOR) and s.operand.requires_grad for s in epi.steps)):
        why = "autograd records this call and the fused path is forward-only"
        if name == "triton":
            raise BackendUnavailableError(f"backend='triton' cannot fuse this epilogue: {why}; backend='auto' runs "
                                          "the convolution, then the program in PyTorch")
        return None, f"{why}: the convolution, then the program in PyTorch"
    if name not in ("auto", "triton"):
        return None, f"backend={name!r}: its convolution, then the program in PyTorch"
    why = ENGINES["triton"].epilogue_reasons(call, epi)
    if name == "triton":
        if why:
            raise BackendUnavailableError("backend='triton' cannot fuse this epilogue: " + "; ".join(why))
        return call, "backend='triton': fused into the GEMM before its store"
    if why or call.device.type != "cuda":
        return None, ("auto: the dispatched convolution, then the program in PyTorch ("
                      + ("; ".join(why) or "CPU tensors use PyTorch") + ")")
    d = decision if decision is not None else dispatch.select(call, "auto", measure=composite is not None)
    fused = dispatch.decided_call(call, d)
    key = (fused.key, epi.signature)
    if key not in _fused and composite is not None and dispatch.benchmark_enabled() \
            and not torch.cuda.is_current_stream_capturing():
        with torch.no_grad():
            f = time_call(lambda: _run_fused(fused, epi))
            c = time_call(composite)
        # Charged the host time it costs beyond the composite's, as auto charges its candidates.
        _fused[key] = (f.ms + max(0.0, f.host_ms - c.host_ms) <= c.ms, f.ms, c.ms)
    composite_text = f"{d.engine}'s convolution, then the program in PyTorch"
    if key in _fused:
        won, f_ms, c_ms = _fused[key]
        return (fused if won else None), (f"auto (measured): fused {f_ms:.4g} ms, composite ({composite_text}) "
                                          f"{c_ms:.4g} ms -> {'fused' if won else 'composite'}")
    if composite is None and dispatch.benchmark_enabled():
        return None, f"auto: the first call times the fused path against the composite ({composite_text})"
    # Nothing timed (measuring off, graph capture): fused where the convolution alone runs on Triton.
    won = d.engine == "triton"
    return (fused if won else None), f"auto (not measured): {'fused' if won else composite_text}"
