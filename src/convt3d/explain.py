"""``convt3d.explain``: what convt3d would do with a call, and why, without running it; from a shell:
``convt3d explain --input 1,64,16,32,32 --weight 64,32,4,4,4 --stride 2 --padding 1``."""
from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

from .core.call import layout_name, make_call
from .core.errors import BackendUnavailableError
from .core.flags import cudnn_conv_allows_tf32
from .dispatch import cache, select as dispatch
from .dispatch.heuristic import floors, heuristic
from .engines.torch.calls import conv3d_padding
from .engines.triton import engine as triton_engine, predict
from .engines.triton.configs import device_name, tuning_log
from .engines.triton.head import HeadConfig
from .engines.triton.sites import interpreter_active
from .functional import epilogue_route, validated_epilogue

__all__ = ["explain", "Explanation"]

_MAX_PHASE_LINES = 27  # stride 3 in every dimension; larger strides are summarised


@dataclass
class Explanation:
    """The report of :func:`explain`; ``str()`` renders it. Fields are plain data for programs."""

    call: str
    device: str
    backend: str  # as asked (resolved name)
    engine: str | None  # None: the named backend cannot run the call
    precision: str
    reason: str
    benchmark: bool
    candidates: dict[str, str | None]  # engine -> None (can run) or why not
    heuristic: tuple[str, str] | None  # what the heuristic says on a CUDA device
    kernel: list[str]  # configuration lines of the chosen engine (and of Triton's plan)
    phases: list[str]
    num_phases: int
    empty_phases: int
    useful_macs: int
    dense_macs: int
    memory_floor_s: float | None
    compute_floor_s: float | None
    peak_class: str | None
    timings_ms: dict[str, float] | None = None  # measured per engine
    tuning_ms: dict[str, float] | None = None  # Triton tuning: per config
    notes: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)  # what a training step's backward would run
    epilogue: str | None = None  # where an epilogue= program runs, and why

    def __str__(self) -> str:
        out = [f"convt3d.explain: {self.call}", f"  device: {self.device}"]
        chosen = (f"{self.engine}, precision {self.precision}" if self.engine is not None
                  else "(none: the named backend cannot run this call)")
        out += [f"  backend: {self.backend} -> {chosen}", f"    why: {self.reason}"]
        if self.epilogue is not None:
            out.append(f"  epilogue: {self.epilogue}")
        mode = "on (the first call of a new signature times the candidates against PyTorch)" if self.benchmark \
            else "off (heuristic unless a measurement is cached)"
        out += [f"  measuring: {mode}", "  candidates:"]
        out += [f"    {name:<7} {'can run' if why is None else 'no: ' + why}" for name, why in self.candidates.items()]
        if self.heuristic is not None:
            out.append(f"  heuristic on a CUDA device: {self.heuristic[0]} -- {self.heuristic[1]}")
        out += ["  kernel configuration:"] + [f"    {line}" for line in self.kernel]
        out.append(f"  phases: {self.num_phases}, empty (bias/zero fill only): {self.empty_phases}")
        shown = self.phases[:_MAX_PHASE_LINES]
        out += [f"    {line}" for line in shown]
        if len(shown) < len(self.phases):
            out.append(f"    ... {len(self.phases) - len(shown)} more phases (Explanation.phases has all)")
        saved = 1 - self.useful_macs / self.dense_macs if self.dense_macs else 0.0
        out.append(f"  useful MACs: {self.useful_macs:,} ({self.useful_macs * 2 / 1e9:.3f} GFLOP); dense "
                   f"{self.dense_macs:,}: {100 * saved:.1f}% are structural zeros or fall outside the output")
        if self.memory_floor_s is not None:
            bound = "memory" if self.memory_floor_s >= self.compute_floor_s else "compute"
            out.append(f"  floors (nominal H200: 4.24 TB/s, {self.peak_class} peak): memory "
                       f"{_fmt_s(self.memory_floor_s)}, compute {_fmt_s(self.compute_floor_s)} -> {bound}-bound")
        timed = sorted(self.timings_ms.items(), key=lambda kv: kv[1]) if self.timings_ms else []
        out.append("  measured (ms, median): " + ", ".join(f"{k} {v:.4g}" for k, v in timed) if timed
                   else "  measured: nothing cached for this signature")
        if self.tuning_ms:
            out.append("  Triton tuning (ms per config): " + ", ".join(f"[{k}] {v:.4g}" for k, v in
                                                                       self.tuning_ms.items()))
        if self.backward:
            out.append("  backward (training steps on convt3d's engines, or torch+bwd):")
            out += [f"    {line}" for line in self.backward]
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)

    __repr__ = __str__


def _fmt_s(seconds: float) -> str:
    scale, unit = (1e3, "ms") if seconds >= 1e-3 else (1e6, "us") if seconds >= 1e-6 else (1e9, "ns")
    return f"{seconds * scale:.3g} {unit}"


def _triton_lines(x5, weight, params, prec, chosen: bool) -> tuple[list[str], dict | None]:
    plan = triton_engine.plan(params, x5, weight, prec)
    head = "Triton engine" + ("" if chosen else " (if backend='triton')")
    lines = [f"{head}: phase GEMM {'on tensor cores' if triton_engine.uses_tensor_cores(params) else 'on the FMA path'}"
             f" (Cin/g={params.in_channels_per_group}, Cout/g={params.out_channels_per_group}), "
             f"dot precision {plan.dot_precision}, output "
             f"{'channels_last_3d' if plan.out_format == torch.channels_last_3d else 'contiguous'}, "
             f"input {'copied to NDHWC' if plan.copy_input else 'read in place'}"
             f"{', TF32-rounded' if plan.round_tf32 else ''}"]
    heads = [c for c in plan.configs if isinstance(c, HeadConfig)]
    if heads:
        (kd, kh, _), stride, cout_g = params.kernel_size, params.stride, params.out_channels_per_group
        shifts = math.prod(-(-k // s) for k, s in zip(params.kernel_size, stride))
        about = {"rows": f"rows: a GEMM with M = input rows x output columns / W stride, K = Cin/g per width "
                         f"shift, N = Cout/g x depth and height taps x W residues = {cout_g * kd * kh * stride[2]}, "
                         "into output rows whose depth and height taps are then summed",
                 "shuffle": f"shuffle: one sweep over blocks of stride-sized outputs, K = Cin/g x {shifts} shift(s), "
                            f"N = Cout/g x stride volume = {cout_g * math.prod(stride)}, no buffer"}
        lines.append("output-head tiles (" + "; ".join(about[k] for k in dict.fromkeys(c.head for c in heads))
                     + "); the tuner times them against the phase GEMM"
                     + (" and runs one by default" if isinstance(plan.configs[0], HeadConfig) else ""))
    tuning = None
    log = tuning_log().get(plan.tune_key)
    if log is not None:
        src = "tuned in this process" if log.seconds > 0 else "seeded (cache file or untimed)"
        if log.seconds > 0 and len(log.timings_ms) + len(log.failed) < len(plan.configs):
            src += (f", {len(log.timings_ms) + len(log.failed)} of {len(plan.configs)} candidates timed: the"
                    f" shortlist the tuning table predicts ({predict.ENV_MODE}=predicted)")
        lines.append(f"config: {log.config.short()} ({src}{f', {log.seconds:.2f} s' if log.seconds > 0 else ''})")
        lines += [f"left out of the tuning, it failed on this GPU: [{cfg}] {why}" for cfg, why in log.failed.items()]
        tuning = dict(log.timings_ms) or None
    else:
        entry = (cache.store_for(device_name(x5.device)).get("triton_configs", cache.tune_key_text(plan.tune_key))
                 if x5.device.type == "cuda" else None)
        cfg = cache.config_from_dict(entry.get("config"), plan.configs) if entry else None
        if cfg is not None:
            lines.append(f"config: {cfg.short()} (from the cache file; the first call skips tuning)")
            tuning = entry.get("timings_ms") or None
        elif x5.device.type == "cuda" and len(plan.configs) > 1:
            short = predict.shortlist(plan.configs, params, x5.dtype, plan.tune_key[2], plan.tune_key[3], x5.device)
            lines.append(f"config: not tuned yet; the first call times {len(short)} of {len(plan.configs)} "
                         "candidates: " + "; ".join(c.short() for c in short))
        else:
            lines.append(f"config: {plan.configs[0].short()} (untuned default"
                         f"{': CPU runs the interpreter' if x5.device.type != 'cuda' else ''})")
    return lines, tuning


def _backward_lines(x5, weight, params, prec) -> list[str]:
    """Per gradient: the implementations the backward's timed choice would compare, and what it
    chose for this signature in this process (any dY layout), if it has."""
    from .engines.triton import backward as B

    bprec = prec if x5.dtype == torch.float32 else "tf32"
    lines, made = [], B.recorded_choices(x5, weight, params, bprec)
    rows = (("dX", B.dgrad_choice_candidates(params, weight.dtype, x5.device, bprec), None),
            ("dW", B.wgrad_choice_candidates(params, x5.dtype, x5.device), B.wgrad_unavailable(params)))
    for what, cands, unavailable in rows:
        kinds = Counter("head" if c.short().startswith("head") else "general" for c in cands)
        offer = ", ".join(f"{n} Triton {k} tile{'s' if n > 1 else ''}" for k, n in kinds.items()) or "no Triton tile"
        lines.append(f"{what}: cuDNN against {offer}"
                     + (" (timed on the first backward of a signature on CUDA)" if cands else ""))
        if unavailable is not None:
            lines.append(f"  forced: {unavailable}")
        lines += [f"  chosen: {rec.impl}{'' if rec.config is None else ' ' + rec.config.short()} -- {rec.reason}"
                  for grad, rec in made if grad == what]
    return lines


def _epilogue_text(call, program, name: str, decision) -> str:
    """Where ``program`` runs (fused into the Triton GEMM or after the convolution) and why, nothing timed."""
    try:
        fused, why = epilogue_route(call, validated_epilogue(program, call), name, decision=decision)
    except BackendUnavailableError as exc:
        return f"cannot run: {exc}"
    return ("fused into the Triton GEMM's store" if fused is not None else "after the convolution") + f" -- {why}"


def explain(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
            backend=None, precision=None, epilogue=None) -> Explanation:
    """Explain what ``convt3d.conv_transpose3d`` would do with these arguments (same signature;
    invalid arguments raise the same errors): the dispatcher's pass (``dispatch.explain_pass``)
    with nothing run or timed, the chosen engine's plan, and where an ``epilogue`` program runs."""
    # A call autograd records is a training step, decided as one.
    call = make_call(input, weight, bias, stride, padding, output_padding, groups, dilation, precision, autograd=True)
    name = dispatch.resolve_backend_name(backend)
    p, prec, x5, cuda = call.params, call.precision, call.x, input.device.type == "cuda"
    record = dispatch.explain_pass(call, name)
    d = record.decision
    engine, eprec = (None, prec) if d is None else (d.engine, d.precision)
    reason = record.error if d is None else d.reason + (f" [{d.source}]" if d.source else "")
    candidates: dict[str, str | None] = {}
    for cand, why in record.reasons.items():
        if cand == "triton" and not why and not cuda and not interpreter_active():
            why = ["CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)"]
        candidates[cand] = "; ".join(why) if why else (
            "not timed by auto: " + record.skipped[cand] if cand in record.skipped else None)

    kernel, tuning, notes = [], None, []
    if engine == "torch":
        flags = f"cudnn.benchmark={torch.backends.cudnn.benchmark}"
        if input.dtype == torch.float32:
            tf32 = (precision == "tf32") if precision is not None else cudnn_conv_allows_tf32()
            flags += f", TF32 {'on' if tf32 else 'off'}"
        kernel.append(f"PyTorch conv_transpose3d ({'cuDNN' if cuda else 'CPU'}; {flags})")
    elif engine == "conv3d":
        pad, trim = conv3d_padding(p)
        kernel.append(f"PyTorch conv3d of the flipped weight, padding {pad}" + (f", x trimmed by {trim} on each side"
                      if any(trim) else "") + f" ({'cuDNN forward kernels' if cuda else 'CPU'})")
    if candidates.get("triton") is None or engine == "triton":
        lines, tuning = _triton_lines(x5, weight, p, eprec if engine == "triton" else prec, engine == "triton")
        kernel += lines

    klass = dispatch.precision_class_of(call)
    if klass == "fp32":
        notes.append("PyTorch's own call computes this TF32-allowed call in full fp32 (measured): convt3d runs it "
                     "at exact grade")
    elif klass == "tf32":
        notes.append("PyTorch's own call computes this call with TF32 operands (measured): convt3d does too")
    elif input.dtype == torch.float32 and prec == "tf32" and precision is None and cuda:
        notes.append("auto's first call measures whether PyTorch's own call computes in full fp32 although TF32 "
                     "is allowed; where it does, convt3d runs at exact grade")
    if not cuda:
        notes.append("CPU tensors: 'auto' runs PyTorch; floors and the heuristic describe a CUDA device")

    heur = mem = comp = peak = None
    backward_lines = []
    if input.dtype in triton_engine.SUPPORTED_DTYPES:
        cands = tuple(c for c in ("triton", "torch") if candidates.get(c) is None or not cuda)
        heur = heuristic(p, input.dtype, prec, bias is not None, cands)
        mem, comp, peak = floors(p, input.dtype, prec if input.dtype == torch.float32 else "tf32", bias is not None)
        backward_lines = _backward_lines(x5, weight, p, eprec if engine is not None else prec)
    return Explanation(
        call=f"input {tuple(input.shape)} {str(input.dtype).replace('torch.', '')} ({layout_name(input)}), weight "
             f"{tuple(weight.shape)}, bias {'yes' if bias is not None else 'no'}, stride {p.stride}, padding "
             f"{p.padding}, output_padding {p.output_padding}, groups {p.groups}, dilation {p.dilation} -> output "
             f"{p.out_shape}",
        device=f"{input.device} ({device_name(input.device)})" if cuda else str(input.device),
        backend=name, engine=engine, precision=eprec, reason=reason, benchmark=dispatch.benchmark_enabled(),
        candidates=candidates, heuristic=heur, kernel=kernel, phases=p.describe().splitlines(),
        num_phases=len(p.phases), empty_phases=sum(ph.empty for ph in p.phases), useful_macs=p.useful_macs,
        dense_macs=p.batch * p.in_channels * p.out_channels_per_group * math.prod(p.in_size) * math.prod(p.kernel_size),
        memory_floor_s=mem, compute_floor_s=comp, peak_class=peak, timings_ms=dispatch.cached_timings(call),
        tuning_ms=tuning, notes=notes, backward=backward_lines,
        epilogue=None if epilogue is None else _epilogue_text(call, epilogue, name, record.decision))


_CLI_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _size(text: str) -> int | tuple[int, ...]:
    sizes = _sizes(text)
    return sizes[0] if len(sizes) == 1 else sizes


def main(argv: list[str] | None = None) -> int:
    """``convt3d explain``: :func:`explain` of a call given by its shapes, on empty tensors of the
    CUDA device (else the CPU); arguments the call rejects exit with status 2 and its error."""
    parser = argparse.ArgumentParser(prog="convt3d explain", description="What convt3d would do with a "
                                     "conv_transpose3d call, and why, without running it. Sizes are comma-separated "
                                     "(--stride 2 or --stride 1,2,2).")
    parser.add_argument("--input", type=_sizes, required=True, help="input shape N,C,D,H,W (or C,D,H,W)")
    parser.add_argument("--weight", type=_sizes, required=True, help="weight shape Cin,Cout/groups,kD,kH,kW")
    parser.add_argument("--bias", action="store_true", help="the call has a bias")
    for name, default in (("stride", 1), ("padding", 0), ("output-padding", 0), ("dilation", 1)):
        parser.add_argument(f"--{name}", type=_size, default=default)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--dtype", choices=tuple(_CLI_DTYPES), default="fp32")
    parser.add_argument("--channels-last", action="store_true", help="the input is channels_last_3d")
    parser.add_argument("--backend", help=f"one of {dispatch.BACKENDS} (default: $CONVT3D_BACKEND, else auto)")
    parser.add_argument("--precision", help="float32 precision: tf32, tf32x3 or ieee (default: cuDNN's TF32 flag)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    like = {"dtype": _CLI_DTYPES[args.dtype], "device": device}
    try:
        x = torch.empty(args.input, **like)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        w = torch.empty(args.weight, **like)
        b = torch.empty(w.shape[1] * args.groups if w.dim() > 1 else 1, **like) if args.bias else None
        report = explain(x, w, b, args.stride, args.padding, args.output_padding, args.groups, args.dilation,
                         backend=args.backend, precision=args.precision)
    except (RuntimeError, ValueError, TypeError) as exc:
        print(f"convt3d explain: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        print("no CUDA device here: explained for CPU tensors, which 'auto' runs with PyTorch's call")
    print(report)
    return 0
