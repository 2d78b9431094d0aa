"""Geometry of a 3-D transposed convolution, worked out once per call signature (pure Python). Along one
dimension input ``i`` and tap ``t`` reach output ``o = i*s - p + t*d``; the outputs of one residue ``r = o mod s``
form a **phase**, whose **taps** are ``t = t0 + j*s/gcd(s,d)``, tap ``j`` reading input ``q + off0 - j*d/gcd(s,d)``
for the **compact** index ``q`` of output ``q*s + r``. A phase without taps along some dimension is **empty** (bias
or zero); every other one is an implicit GEMM per group: M = N x compact positions, N = Cout/g, K = Cin/g x taps."""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceil division on the host: triton.cdiv is a slow ConstexprFunction when called from Python."""
    return -(-a // b)


def pow2_at_least(v: int) -> int:
    """The least power of two at least ``v`` (1 for ``v`` <= 1)."""
    return 1 << max(0, (int(v) - 1).bit_length())


@dataclass(frozen=True)
class AxisPhase:
    """The taps of one residue along one dimension."""

    residue: int
    num_taps: int  # T
    first_tap: int  # t0 (meaningless when num_taps == 0)
    first_offset: int  # off0: input index = q + off0 - j*ostep
    size: int  # Q: compact positions of this residue


@dataclass(frozen=True)
class Axis:
    """One spatial dimension: sizes, arguments and its per-residue taps."""

    in_size: int
    kernel: int
    stride: int
    padding: int
    dilation: int
    output_padding: int

    @property
    def out_size(self) -> int:
        return (self.in_size - 1) * self.stride - 2 * self.padding + self.dilation * (self.kernel - 1) \
            + self.output_padding + 1

    @property
    def tap_step(self) -> int:
        return self.stride // math.gcd(self.stride, self.dilation)

    @property
    def offset_step(self) -> int:
        return self.dilation // math.gcd(self.stride, self.dilation)

    @functools.cached_property
    def phases(self) -> tuple[AxisPhase, ...]:
        s, p, d, out = self.stride, self.padding, self.dilation, self.out_size
        result = []
        for r in range(s):
            taps = [t for t in range(self.kernel) if (r + p - t * d) % s == 0]
            t0 = taps[0] if taps else 0
            size = max(0, cdiv(out - r, s))
            result.append(AxisPhase(r, len(taps), t0, (r + p - t0 * d) // s if taps else 0, size))
        return tuple(result)

    def useful_taps(self) -> int:
        """Sum over input positions of the taps that land inside the output (for MAC counts)."""
        count = 0
        for t in range(self.kernel):
            lo = max(0, -(-(self.padding - t * self.dilation) // self.stride))
            hi = min(self.in_size - 1, (self.out_size - 1 + self.padding - t * self.dilation) // self.stride)
            count += max(0, hi - lo + 1)
        return count


@dataclass(frozen=True)
class Phase:
    """A 3-D phase: one residue per dimension."""

    index: int  # linear index, residue of width fastest
    axes: tuple[AxisPhase, AxisPhase, AxisPhase]

    @property
    def residue(self) -> tuple[int, int, int]:
        return tuple(a.residue for a in self.axes)

    @property
    def num_taps(self) -> int:
        return self.axes[0].num_taps * self.axes[1].num_taps * self.axes[2].num_taps

    @property
    def positions(self) -> int:
        return self.axes[0].size * self.axes[1].size * self.axes[2].size

    @property
    def empty(self) -> bool:
        """No multiply-add lands here: the output of this phase is bias or zero."""
        return self.num_taps == 0


@dataclass(frozen=True)
class ConvT3dParams:
    """Every argument, normalised, plus derived geometry: :meth:`create` (cached) builds it from validated
    integers; unbatched input has ``batch`` 1."""

    batch: int
    in_channels: int
    out_channels: int
    groups: int
    in_size: tuple[int, int, int]
    kernel_size: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]
    output_padding: tuple[int, int, int]
    dilation: tuple[int, int, int]

    def __hash__(self) -> int:
        # Cached: instances key several per-signature dicts on every call.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.batch, self.in_channels, self.out_channels, self.groups, self.in_size, self.kernel_size,
                      self.stride, self.padding, self.output_padding, self.dilation))
            object.__setattr__(self, "_hash", h)
        return h

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def create(batch: int, in_channels: int, out_channels: int, groups: int, in_size: tuple[int, int, int],
               kernel_size: tuple[int, int, int], stride: tuple[int, int, int], padding: tuple[int, int, int],
               output_padding: tuple[int, int, int], dilation: tuple[int, int, int]) -> "ConvT3dParams":
        return ConvT3dParams(batch, in_channels, out_channels, groups, tuple(in_size), tuple(kernel_size),
                             tuple(stride), tuple(padding), tuple(output_padding), tuple(dilation))

    @functools.cached_property
    def axes(self) -> tuple[Axis, Axis, Axis]:
        return tuple(Axis(self.in_size[i], self.kernel_size[i], self.stride[i], self.padding[i],
                          self.dilation[i], self.output_padding[i]) for i in range(3))

    @functools.cached_property
    def out_size(self) -> tuple[int, int, int]:
        return tuple(a.out_size for a in self.axes)

    @property
    def out_shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.out_channels) + self.out_size

    @property
    def in_shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.in_channels) + self.in_size

    @property
    def in_channels_per_group(self) -> int:
        return self.in_channels // self.groups

    @property
    def out_channels_per_group(self) -> int:
        return self.out_channels // self.groups

    def fold_groups(self, fold: int) -> "ConvT3dParams":
        """Every ``fold`` neighbouring groups merged (block-diagonal weight): same output, fold x the MACs."""
        if fold < 1 or self.groups % fold:
            raise ValueError(f"fold must divide groups={self.groups}, but got fold={fold}")
        return ConvT3dParams.create(self.batch, self.in_channels, self.out_channels, self.groups // fold, self.in_size,
                                    self.kernel_size, self.stride, self.padding, self.output_padding, self.dilation)

    @functools.cached_property
    def phases(self) -> tuple[Phase, ...]:
        """All ``sd*sh*sw`` phases, residue of width varying fastest."""
        combos = itertools.product(*(a.phases for a in self.axes))
        return tuple(Phase(i, axes) for i, axes in enumerate(combos))

    @property
    def num_phases(self) -> int:
        return self.stride[0] * self.stride[1] * self.stride[2]

    @functools.cached_property
    def compact_size(self) -> tuple[int, int, int]:
        """The largest compact grid over phases (residue 0 along each dimension)."""
        return tuple(a.phases[0].size for a in self.axes)

    def gemm_shape(self, phase: Phase) -> tuple[int, int, int]:
        """(M, N, K) of one group's implicit GEMM for ``phase``."""
        return (self.batch * phase.positions, self.out_channels_per_group, self.in_channels_per_group * phase.num_taps)

    @functools.cached_property
    def useful_macs(self) -> int:
        """Multiply-adds whose product lands inside the output (structural zeros excluded)."""
        taps = math.prod(a.useful_taps() for a in self.axes)
        return self.batch * self.in_channels_per_group * self.out_channels * taps

    @property
    def useful_flops(self) -> int:
        return 2 * self.useful_macs

    def min_bytes(self, element_size: int, has_bias: bool = False) -> int:
        """Bytes that must move through device memory: every operand read once, the output written once."""
        n_in = self.batch * self.in_channels * math.prod(self.in_size)
        n_w = self.in_channels * self.out_channels_per_group * math.prod(self.kernel_size)
        n_out = self.batch * self.out_channels * math.prod(self.out_size)
        return element_size * (n_in + n_w + n_out + (self.out_channels if has_bias else 0))

    def describe(self) -> str:
        """One line per phase: residue, taps, compact grid, GEMM shape (for explain and the bench)."""
        lines = []
        for ph in self.phases:
            m, n, k = self.gemm_shape(ph)
            tag = "empty (bias/zero fill)" if ph.empty else f"GEMM M={m} N={n} K={k} x{self.groups} groups"
            lines.append(f"phase {ph.residue}: taps {tuple(a.num_taps for a in ph.axes)}, "
                         f"grid {tuple(a.size for a in ph.axes)}: {tag}")
        return "\n".join(lines)
