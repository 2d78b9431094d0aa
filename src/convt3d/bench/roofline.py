"""Device ceilings measured on this GPU (copy bandwidth, matmul peaks per precision class) and the
flags a bench row runs under; the arithmetic is ``convt3d.core.roofline``."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

from ..core.roofline import COPY_BYTES, MATMUL_SIZE, Ceilings, floors, geomean, peak_class, roofline_percent, tflops
from ..dispatch.timing import gpu_ms

__all__ = ["Ceilings", "peak_class", "floors", "roofline_percent", "tflops", "geomean", "measure_ceilings",
           "cudnn_tf32"]


# ---- flags ----------------------------------------------------------------------------------------
# Plain attribute assignment rather than torch.backends.cudnn.flags(), which resets every flag it is
# not given; only the legacy allow_tf32 switches, since mixing them with fp32_precision makes PyTorch raise.
@contextlib.contextmanager
def _flag(obj, attr: str, value: bool) -> Iterator[None]:
    saved = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, saved)


def cudnn_tf32(allow: bool):
    """``torch.backends.cudnn.allow_tf32 = allow`` for a block, restored after."""
    return _flag(torch.backends.cudnn, "allow_tf32", allow)


# ---- measuring (CUDA only) ------------------------------------------------------------------------
def _copy_bytes_per_s(device, gen: torch.Generator) -> float:
    src = torch.rand(COPY_BYTES // 4, generator=gen, device=device)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / (gpu_ms(lambda: dst.copy_(src), warmup=10, rep=60) * 1e-3)


def _matmul_flops_per_s(device, gen: torch.Generator, dtype: torch.dtype, tf32: bool) -> float:
    n = MATMUL_SIZE
    a = torch.randn((n, n), generator=gen, device=device).to(dtype)
    b = torch.randn((n, n), generator=gen, device=device).to(dtype)
    c = torch.empty((n, n), device=device, dtype=dtype)
    with _flag(torch.backends.cuda.matmul, "allow_tf32", tf32):
        # exact fp32, the slowest class, still gets several timed calls within ``rep``.
        ms = gpu_ms(lambda: torch.mm(a, b, out=c), warmup=25, rep=100)
    return 2 * n ** 3 / (ms * 1e-3)


def measure_ceilings(device: torch.device | str = "cuda", status: Callable[[str], None] | None = None) -> Ceilings:
    """Copy bandwidth and matmul peaks of ``device``, on random data (a few seconds)."""
    say = status or (lambda _msg: None)
    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(1234)
    say("measuring device ceilings: 1 GiB device-to-device copy")
    copy_bps = _copy_bytes_per_s(device, gen)
    peaks = {}
    for key, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                             ("fp32", torch.float32, False)):
        say(f"measuring device ceilings: {MATMUL_SIZE}^3 matmul, {key}")
        peaks[key] = _matmul_flops_per_s(device, gen, dtype, tf32)
    torch.cuda.empty_cache()
    return Ceilings(copy_bps, peaks["bf16"], peaks["tf32"], peaks["fp32"], time.perf_counter() - t0)
