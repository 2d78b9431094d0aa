"""Probe: flat_gemm_kernel (2-D TMA boxes over a haloed input) against the older paths."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu_variants as GV  # noqa: E402
from gpu_probe import KB, LAYERS  # noqa: E402
from gpu_tma import breakdown  # noqa: E402

V = [{}, {"num_stages": 4}, {"BLOCK_M": 256, "num_warps": 8}, {"BLOCK_M": 64, "num_warps": 4, "num_stages": 4},
     {"flat": False, "tma": True, "BLOCK_M": 128}, {"flat": False, "tma": True, "BLOCK_M": 64, "num_warps": 4, "num_stages": 4}]

if __name__ == "__main__":
    GV.sweep("kb77", KB["kb77"], torch.float32, False, "tf32", V)
    GV.sweep("kb77", KB["kb77"], torch.float32, False, "tf32x3", V)
    breakdown("kb77", KB["kb77"], torch.float32, False, "tf32")
    for nm in ("kb73", "kb58", "kb61", "kb72"):
        GV.sweep(nm, KB[nm], torch.float32, False, "tf32", V[:4] + V[4:5])
    for nm in ("gan_k4s2p1", "refine_k3s1", "nnunet_64_32", "aniso_122", "monai_unet_k3"):
        GV.sweep(nm, LAYERS[nm], torch.bfloat16, True, "tf32", V[:4] + V[4:5], bias=True)
    GV.sweep("gan_k4s2p1", LAYERS["gan_k4s2p1"], torch.float32, False, "tf32", V[:4] + V[4:5], bias=True)
    with open(os.path.join(GV.OUT, "flat.json"), "w") as f:
        json.dump(GV.rows, f, indent=1)
