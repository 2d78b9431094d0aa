#!/usr/bin/env bash
# Session 3, GPU call A: host-time profile of small layers; backward parts per layer (issue 5).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/smi.log 2>&1
timeout 150 python scripts/gpu_hostprof.py > $OUT/hostprof.log 2>&1
timeout 400 python scripts/gpu_training.py --json $OUT/gpu_training.json > $OUT/training.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -4 $f; done
