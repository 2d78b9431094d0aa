"""Device ceilings measured on this GPU (copy bandwidth, matmul peaks per precision class) and the
flags a bench row runs under; the arithmetic is ``convt3d.core.roofline``."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

from ..core.roofline import COPY_BYTES, MATMUL_SIZE, Ceilings, floors, geomean, peak_class, roofline_percent, tflops
from ..dispatch.timing import gpu_ms


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
def measure_ceilings(device: torch.device | str = "cuda",
                     status: Callable[[str], None] = lambda _msg: None) -> Ceilings:
    """Copy bandwidth and matmul peaks of ``device``, on random data (a few seconds)."""
    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(1234)
    status("measuring device ceilings: 1 GiB device-to-device copy")
    src = torch.rand(COPY_BYTES // 4, generator=gen, device=device)
    dst = torch.empty_like(src)
    copy_bps = 2 * COPY_BYTES / (gpu_ms(lambda: dst.copy_(src), warmup=10, rep=60) * 1e-3)
    del src, dst
    n = MATMUL_SIZE
    peaks = {}
    for key, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                             ("fp32", torch.float32, False)):
        status(f"measuring device ceilings: {n}^3 matmul, {key}")
        a, b = (torch.randn((n, n), generator=gen, device=device).to(dtype) for _ in range(2))
        c = torch.empty((n, n), device=device, dtype=dtype)
        with _flag(torch.backends.cuda.matmul, "allow_tf32", tf32):
            # exact fp32, the slowest class, still gets several timed calls within ``rep``.
            peaks[key] = 2 * n ** 3 / (gpu_ms(lambda: torch.mm(a, b, out=c), warmup=25, rep=100) * 1e-3)
    torch.cuda.empty_cache()
    return Ceilings(copy_bps, peaks["bf16"], peaks["tf32"], peaks["fp32"], time.perf_counter() - t0)
