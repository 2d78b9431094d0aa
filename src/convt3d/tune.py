"""``convt3d.tune(model, *example_inputs)``: fill the cache so that the first real step is already fast."""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .dispatch import cache, first_call, select as dispatch
from .core.flags import device_name
from .dispatch.network_check import check_network, layer_signature
from .engines.triton.persist import flush_triton
from .nn import ConvTranspose3d, _parametrized_convt

__all__ = ["tune", "TuneReport", "Progress"]


# ---- progress: rich on a terminal, else tqdm if installed, else plain lines ---------------------
class Progress:
    def __init__(self, total: int, title: str, kind: bool | str = True, stream=None):
        self.total, self.done, self.title = total, 0, title
        self.stream = stream if stream is not None else sys.stderr
        self.kind = self._pick(kind)
        if self.kind == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(file=self.stream), transient=True)
            self._task = self._bar.add_task(title, total=total)
            self._bar.start()
        elif self.kind == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=title, file=self.stream, leave=False)

    def _pick(self, kind: bool | str) -> str:
        if kind is False or kind == "off":
            return "off"
        if kind in ("rich", "tqdm", "plain"):
            return kind
        if kind is not True:
            raise ValueError(f"progress must be True, False, 'rich', 'tqdm', 'plain' or 'off', not {kind!r}")
        if getattr(self.stream, "isatty", lambda: False)() and find_spec("rich") is not None:
            return "rich"
        return "tqdm" if find_spec("tqdm") is not None else "plain"

    def status(self, msg: str, step: int = 0) -> None:
        if self.kind == "rich":
            self._bar.update(self._task, advance=step, description=msg)
        elif self.kind == "tqdm":
            self._bar.set_description_str(msg)
            if step:
                self._bar.update(step)
        elif self.kind == "plain":
            print(f"{self.title}: {f'[{self.done}/{self.total}] ' if step else ''}{msg}", file=self.stream, flush=True)

    def advance(self, msg: str) -> None:
        self.done += 1
        self.status(msg, 1)

    def close(self) -> None:
        if self.kind == "rich":
            self._bar.stop()
        elif self.kind == "tqdm":
            self._bar.close()


# ---- the report ---------------------------------------------------------------------------------
def _source(source: str) -> str:
    """How the report names a decision's ``source``."""
    return {"cache": "cached", "only": "only candidate", "requested": "named backend"}.get(source, source)


@dataclass
class TuneReport:
    """What :func:`tune` saw: one entry per call signature, and what its network check reverted."""

    entries: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    backward: bool = False
    cache_file: str | None = None
    notes: list[str] = field(default_factory=list)
    network: dict | None = None

    def __str__(self) -> str:
        lines = [f"convt3d.tune: {len(self.entries)} call signature(s), forward"
                 + (" + backward" if self.backward else "") + f", {self.seconds:.1f} s"]
        for e in self.entries:
            t = e.get("timings_ms") or {}
            times = ", ".join(f"{k} {v:.4g} ms" for k, v in sorted(t.items(), key=lambda kv: kv[1]))
            lines.append(f"  {e['engine']:<6} ({e['source']}) {e['signature']}" + (f"  [{times}]" if times else ""))
        if self.network:
            n = self.network
            lines.append(f"  network check: {n['convt3d_ms']:.4g} ms with convt3d's choices, {n['torch_ms']:.4g} ms "
                         f"with PyTorch for every layer, {n['final_ms']:.4g} ms kept; "
                         + (f"reverted to PyTorch: {len(n['reverted'])} signature(s)" if n["reverted"]
                            else "nothing reverted"))
            lines += [f"    reverted: {sig}" for sig in n["reverted"]]
        if self.cache_file:
            lines.append(f"  cache: {self.cache_file}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(v)


def tune(model, *example_inputs, backward: bool | None = None, progress: bool | str = True,
         check: bool = True) -> TuneReport:
    """Run ``model(*example_inputs)`` once with measuring on to fill convt3d's caches, then restore gradients
    (``.grad`` of parameters and inputs) and buffers.

    Args:
        model: an ``nn.Module`` (or any callable) whose transposed convolutions are convt3d's
            (``convt3d.ConvTranspose3d``, ``convt3d.patch(model)``, or ``convt3d.conv_transpose3d``).
        example_inputs: inputs of the real shapes, dtypes, layouts and devices.
        backward: also run a backward pass (of the sum of the outputs). Default: when the model has a parameter that
            requires grad and grad mode is on.
        progress: True (rich on a terminal, else tqdm if installed, else plain lines on stderr), False, or one of
            "rich", "tqdm", "plain".
        check: the network check (CUDA, an ``nn.Module`` with convt3d layers on "auto"): the whole model is timed with
            the per-layer decisions against PyTorch for every layer, and the signatures that make it slower are reverted
            to PyTorch, here and in the cache file.
    """
    if not callable(model):
        raise TypeError(f"tune(): argument 'model' must be an nn.Module or callable, not {type(model).__name__}")

    is_module = isinstance(model, nn.Module)
    params = list(model.parameters()) if is_module else []
    if backward is None:
        backward = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    named = [(n or type(model).__name__, m) for n, m in model.named_modules()] if is_module else []
    layers = [(n, m) for n, m in named if isinstance(m, ConvTranspose3d)]
    report = TuneReport(backward=bool(backward))
    plain = [n for n, m in named if type(m) is nn.ConvTranspose3d or _parametrized_convt(m)]
    if plain:
        msg = (f"{len(plain)} torch.nn.ConvTranspose3d layer(s) ({', '.join(plain[:5])}"
               f"{', ...' if len(plain) > 5 else ''}) are not convt3d layers and are not tuned; "
               "call convt3d.patch(model) first")
        warnings.warn(msg, UserWarning, stacklevel=2)
        report.notes.append(msg)

    # What the run changes and must be put back.
    grad_owners = params + [t for t in _tensors(example_inputs) if t.requires_grad]
    saved_grads = [(t, None if t.grad is None else t.grad.detach().clone()) for t in grad_owners]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()] if is_module else []

    bar = Progress(max(1, len(layers)) + (1 if backward else 0), "convt3d tune", progress)
    seen: dict[str, dict] = {}
    unseen = {m: n for n, m in layers}  # the layers whose first forward is still to come

    def on_event(event: str, info: dict) -> None:
        if event == "measure":
            bar.status(f"timing {info['engine']}: {info['signature']}")
        elif event == "decision" and info["signature"] not in seen:
            d = info["decision"]
            seen[info["signature"]] = {"signature": info["signature"], "engine": d.candidate, "precision": d.precision,
                                       "source": _source(d.source), "reason": d.reason,
                                       "timings_ms": dict(info["timings"]) if info.get("timings") else None}

    def layer_done(module, inputs, output):
        if module in unseen:
            bar.advance(f"forward: {unseen.pop(module)}")

    layers_by_sig: dict[str, list[nn.Module]] = {}

    def record_signature(module, args):
        if module.backend is None:  # "auto" layers only: a named backend is the user's choice
            sig = layer_signature(module, args)
            if sig is not None and module not in layers_by_sig.setdefault(sig, []):
                layers_by_sig[sig].append(module)

    hooks = [m.register_forward_hook(layer_done) for _, m in layers]
    hooks += [m.register_forward_pre_hook(record_signature) for _, m in layers]

    def run_once(after_forward: Callable[[], object] = lambda: None) -> bool:
        """One forward, then with ``backward`` the backward of the outputs (True if one ran)."""
        with torch.enable_grad() if backward else torch.no_grad():
            out = model(*example_inputs)
        after_forward()
        outs = [t for t in _tensors(out) if t.requires_grad] if backward else []
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        return bool(outs)

    devices = {t.device for t in _tensors(example_inputs)} | {p.device for p in params}
    cuda = [d for d in devices if d.type == "cuda"]
    t0 = time.perf_counter()
    try:
        with dispatch.benchmark(True), dispatch.listening(on_event), first_call.waiting():
            ran = run_once(lambda: None if layers else bar.advance("forward"))
            if backward:
                if not ran:
                    report.notes.append("backward skipped: no output requires grad")
                bar.advance("backward")
        flush_triton()
        for h in hooks[len(layers):]:
            h.remove()
        report.entries = list(seen.values())
        if check and is_module and cuda:
            check_network(report, layers_by_sig, run_once, cuda[0], bar)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for t, g in saved_grads:
                t.grad = g
            for b, v in saved_buffers:
                b.copy_(v)
        bar.close()
    report.seconds = time.perf_counter() - t0
    if cuda:
        report.cache_file = str(cache.file_for(cache.cache_dir(), device_name(cuda[0])))
    else:
        report.notes.append("no CUDA tensors: 'auto' runs PyTorch on the CPU, nothing was measured")
    return report
