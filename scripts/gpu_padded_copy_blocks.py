"""The zero-haloed NDHWC copy of x (``to_padded_kernel``) alone, over its block shapes, on the
GPU: do_bench medians, one JSON line per (geometry, BLOCK_C, BLOCK_W).

For each geometry it times the block that ``triton_sites._padded_blocks`` picks and the
power-of-two blocks of 512-4096 elements that mask fewer lanes (masked lanes issue the same
instructions as live ones, and ncu read the copy as issue-bound on KB 61). NOTES.md, section 12,
"The padded copy's blocks", holds the run of 2026-12-05.

    PYTHONPATH=src python scripts/gpu_padded_copy_blocks.py > blocks.jsonl
"""
import json

import torch
from triton.testing import do_bench

from convt3d import triton_sites
from convt3d.kernels import phase_gemm as K
from convt3d.triton_configs import _cdiv

# name, batch, channels, (D, H, W), halo per side, dtype, channels-last source
GEOMETRIES = [
    ("kb61", 8, 48, (64, 64, 64), (2, 2, 2), torch.float32, False),
    ("kb68", 16, 32, (64, 64, 64), (2, 4, 4), torch.float32, False),
    ("kb73", 4, 32, (32, 64, 128), (1, 1, 1), torch.float32, False),
    ("kb77", 16, 32, (16, 32, 32), (2, 2, 2), torch.float32, False),
    ("kb70", 8, 48, (96, 96, 96), (2, 2, 2), torch.float32, False),
    ("kb58", 16, 32, (16, 32, 64), (2, 4, 6), torch.float32, False),
    ("monai", 4, 64, (32, 32, 32), (1, 1, 1), torch.float32, False),
    ("monai_bf16", 4, 64, (32, 32, 32), (1, 1, 1), torch.bfloat16, False),
    ("monai_cl", 4, 64, (32, 32, 32), (1, 1, 1), torch.float32, True),
    ("gan", 8, 256, (16, 16, 16), (1, 1, 1), torch.float32, False),
    ("odd24", 2, 24, (20, 45, 45), (1, 1, 1), torch.float32, False),
    ("c3", 1, 3, (33, 70, 70), (1, 1, 1), torch.float32, False),
    ("video", 4, 240, (10, 34, 34), (2, 2, 2), torch.bfloat16, False),
]


def _lanes(c: int, wp: int, bc: int, bw: int) -> int:
    return _cdiv(c, bc) * bc * _cdiv(wp, bw) * bw


def main() -> None:
    for name, n, c, (d, h, w), (pd, ph, pw), dtype, cl in GEOMETRIES:
        x = torch.randn(n, c, d, h, w, device="cuda", dtype=dtype)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        dp, hp, wp = d + 2 * pd, h + 2 * ph, w + 2 * pw
        y = torch.empty(n, dp, hp, wp, c, device="cuda", dtype=dtype)
        chosen = triton_sites._padded_blocks(x, ((pd, ph, pw), (dp, hp, wp)))[:2]
        blocks = {chosen} | {(bc, bw) for bc in (4, 8, 16, 32, 64) for bw in (8, 16, 32, 64, 128)
                             if 512 <= bc * bw <= 4096 and _lanes(c, wp, bc, bw) < _lanes(c, wp, *chosen)}
        for bc, bw in sorted(blocks):
            r_blocks, c_blocks = dp * hp * _cdiv(wp, bw), _cdiv(c, bc)
            args = (x, y, c, d, h, w, dp, hp, wp, pd, ph, pw, *x.stride(), r_blocks, c_blocks)
            meta = dict(ROUND_TF32=dtype == torch.float32, SRC_CL=cl, BLOCK_C=bc, BLOCK_W=bw, num_warps=4)

            def copy():
                K.to_padded_kernel[(r_blocks * c_blocks * n,)](*args, **meta)

            us = do_bench(copy, warmup=10, rep=40) * 1e3
            gb = (x.numel() + y.numel()) * x.element_size() / 1e9
            print(json.dumps(dict(geo=name, C=c, WP=wp, bc=bc, bw=bw, util=round(c * wp / _lanes(c, wp, bc, bw), 3),
                                  us=round(us, 2), tbs=round(gb / us * 1e3, 2), chosen=(bc, bw) == chosen)),
                  flush=True)


if __name__ == "__main__":
    main()
