"""The roofline arithmetic of a call: its memory and compute floors against device ceilings."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

PEAK_CLASSES = ("bf16", "tf32", "exact")

COPY_BYTES = 1 << 30  # each way: far beyond L2, so the copy runs at HBM speed
MATMUL_SIZE = 8192  # the size shared/CONTEXT.md's peaks were measured at


@dataclass(frozen=True)
class Ceilings:
    """Measured device ceilings (bytes/s and FLOP/s)."""

    copy_bytes_per_s: float  # device-to-device copy, read + write bytes counted
    bf16_flops_per_s: float
    tf32_flops_per_s: float
    fp32_flops_per_s: float  # exact fp32 (TF32 off)
    seconds: float = 0.0  # how long measuring took

    @property
    def exact_grade_flops_per_s(self) -> float:
        return max(self.fp32_flops_per_s, self.tf32_flops_per_s / 3)

    def peak(self, peak_class: str) -> float:
        peaks = {"bf16": self.bf16_flops_per_s, "tf32": self.tf32_flops_per_s, "exact": self.exact_grade_flops_per_s}
        if peak_class not in peaks:
            raise ValueError(f"unknown peak class {peak_class!r}; expected one of {PEAK_CLASSES}")
        return peaks[peak_class]

    def as_dict(self) -> dict:
        return dict(asdict(self), exact_grade_flops_per_s=self.exact_grade_flops_per_s, copy_bytes=COPY_BYTES,
                    matmul_size=MATMUL_SIZE)


def peak_class(dtype: str, precision: str) -> str:
    """The matmul peak that bounds a row: 16-bit rows "bf16"; fp32 rows "tf32" or "exact"."""
    if dtype in ("bf16", "fp16"):
        return "bf16"
    if dtype != "fp32":
        raise ValueError(f"no tensor-core peak for dtype {dtype!r}")
    return "exact" if precision == "exact" else "tf32"


def floors(flop: float, nbytes: float, ceilings: Ceilings, peak: str) -> tuple[float, float]:
    """(memory floor, compute floor) in seconds."""
    return nbytes / ceilings.copy_bytes_per_s, flop / ceilings.peak(peak)


def roofline_percent(time_s: float, mem_floor_s: float, compute_floor_s: float) -> float:
    """100 * (the larger floor) / time: how close a measured time is to the roofline."""
    if not time_s > 0:
        raise ValueError(f"time must be positive, got {time_s}")
    return 100.0 * max(mem_floor_s, compute_floor_s) / time_s


def tflops(flop: float, time_s: float) -> float:
    return flop / time_s / 1e12


def geomean(values: Iterable[float]) -> float:
    vals = [float(v) for v in values]
    if not vals:
        return math.nan
    if any(not v > 0 for v in vals):
        raise ValueError(f"geometric mean needs positive values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))
