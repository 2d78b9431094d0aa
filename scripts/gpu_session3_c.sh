#!/usr/bin/env bash
# Session 3, GPU call C: training-step profile, launch-site replay check, host time, both bench suites.
export PYTHONPATH=src PYTHONUNBUFFERED=1 CONVT3D_BWD_INPUT=cudnn
timeout 100 python scripts/gpu_stepprof.py nnunet_128_64,monai_unet_k3 > $OUT/stepprof.log 2>&1
timeout 90 python -m pytest -q -p no:cacheprovider -p no:benchmark tests/test_gpu.py -k "replay" > $OUT/replay.log 2>&1
timeout 60 python scripts/gpu_hostprof.py > $OUT/hostprof.log 2>&1
timeout 150 python -m convt3d bench --suite layers --json $OUT/bench_layers.json > $OUT/bench_layers.log 2>&1
timeout 120 python -m convt3d bench --suite kernelbench --json $OUT/bench_kb.json > $OUT/bench_kb.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -3 $f; done
grep -E "us/call|launch" $OUT/hostprof.log
