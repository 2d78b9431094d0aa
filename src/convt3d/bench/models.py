"""The networks the networks suite writes from their published layouts (no code taken from their projects): the 3D-GAN
generator (Wu et al. 2016) and a VQ-VAE video decoder laid out as VideoGPT's (Yan et al. 2021)."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class GAN3DGenerator(nn.Module):
    """3D-GAN generator: a latent vector to a voxel grid, ConvTranspose3d k4 s2 p1 (the first k4 s1
    p0 from 1^3) each followed by BatchNorm3d + ReLU, a sigmoid head; no bias (BatchNorm follows
    every hidden layer). The grid side is 4 * 2^len(widths)."""

    def __init__(self, z_dim: int = 200, widths: Sequence[int] = (512, 256, 128, 64), out_channels: int = 1):
        super().__init__()
        if not widths:
            raise ValueError("GAN3DGenerator needs at least one hidden width")
        layers: list[nn.Module] = [nn.ConvTranspose3d(z_dim, widths[0], 4, 1, 0, bias=False),
                                   nn.BatchNorm3d(widths[0]), nn.ReLU(inplace=True)]
        for cin, cout in zip(widths, widths[1:]):
            layers += [nn.ConvTranspose3d(cin, cout, 4, 2, 1, bias=False), nn.BatchNorm3d(cout), nn.ReLU(inplace=True)]
        layers += [nn.ConvTranspose3d(widths[-1], out_channels, 4, 2, 1, bias=False), nn.Sigmoid()]
        self.net = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() == 2:  # (N, z_dim) -> (N, z_dim, 1, 1, 1)
            z = z[:, :, None, None, None]
        return self.net(z)


class AxialAttention3d(nn.Module):
    """Multi-head self-attention along each of the T, H and W axes of (N, C, T, H, W), summed
    (VideoGPT's axial block): a sequence is one line of voxels along the axis."""

    def __init__(self, channels: int, heads: int):
        super().__init__()
        if channels % heads:
            raise ValueError(f"channels ({channels}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(channels, 3 * channels, bias=False) for _ in range(3))
        self.proj = nn.ModuleList(nn.Linear(channels, channels) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        xl = x.movedim(1, -1)  # (N, T, H, W, C)
        out = None
        for axis in range(3):
            xa = xl.movedim(axis + 1, -2)  # the attended axis next to the channels
            lead, length = xa.shape[:-2], xa.shape[-2]
            seq = xa.reshape(-1, length, c)
            qkv = self.qkv[axis](seq).view(seq.shape[0], length, 3, self.heads, c // self.heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(seq.shape[0], length, c)
            o = self.proj[axis](o).view(*lead, length, c).movedim(-2, axis + 1)
            out = o if out is None else out + o
        return out.movedim(-1, 1)


class _VideoResidualBlock(nn.Module):
    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.block = nn.Sequential(
            nn.BatchNorm3d(channels), nn.ReLU(), nn.Conv3d(channels, channels // 2, 3, padding=1, bias=False),
            nn.BatchNorm3d(channels // 2), nn.ReLU(), nn.Conv3d(channels // 2, channels, 1, bias=False),
            nn.BatchNorm3d(channels), nn.ReLU(), AxialAttention3d(channels, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class _SamePadConvTranspose3d(nn.Module):
    """Pre-pad by kernel - stride (the larger half first), then ConvTranspose3d with padding
    kernel - 1: the output is exactly stride x the input, for any kernel and stride."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: Sequence[int]):
        super().__init__()
        # F.pad takes the last dimension first: (W_lo, W_hi, H_lo, H_hi, D_lo, D_hi).
        self.pad = tuple(p for s in reversed(stride) for p in ((kernel - s + 1) // 2, (kernel - s) // 2))
        self.conv = nn.ConvTranspose3d(cin, cout, kernel, tuple(stride), padding=kernel - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.pad))


class VideoDecoder(nn.Module):
    """VQ-VAE video decoder in VideoGPT's layout: residual blocks (BN-ReLU-Conv3d k3 to half the
    channels, BN-ReLU-Conv3d k1 back, BN-ReLU, axial attention), then one k4 up-convolution per
    factor of 2 of ``upsample`` (stride 1 along axes already at their factor), ReLU between them."""

    def __init__(self, channels: int = 240, res_blocks: int = 4, heads: int = 2,
                 upsample: Sequence[int] = (4, 4, 4), out_channels: int = 3):
        super().__init__()
        steps = [int(math.log2(u)) for u in upsample]
        if len(steps) != 3 or any(u < 1 or 2 ** s != u for u, s in zip(upsample, steps)) or max(steps) < 1:
            raise ValueError(f"upsample must be three powers of 2, one of them >= 2; got {tuple(upsample)}")
        self.res = nn.Sequential(*[_VideoResidualBlock(channels, heads) for _ in range(res_blocks)],
                                 nn.BatchNorm3d(channels), nn.ReLU())
        n = max(steps)
        self.up = nn.ModuleList(
            _SamePadConvTranspose3d(channels, out_channels if i == n - 1 else channels, 4,
                                    tuple(2 if s > i else 1 for s in steps)) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.res(x)
        for up in self.up[:-1]:
            h = F.relu(up(h))
        return self.up[-1](h)
