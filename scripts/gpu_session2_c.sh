#!/usr/bin/env bash
# Session 2, GPU call C: host/device split of small layers, the re-fixed GPU tests, layers bench.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 60 python scripts/gpu_host.py > $OUT/host.log 2>&1
CONVT3D_AUTOTUNE=0 timeout 90 python -m pytest -q -n 4 -p no:cacheprovider -p no:benchmark \
  tests/test_gpu.py::test_tuning_picks_a_candidate tests/test_gpu_auto.py > $OUT/gpu_tests2.log 2>&1
timeout 120 python -m convt3d bench --suite layers --json $OUT/bench_layers.json > $OUT/bench_layers.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -3 $f; done
cat $OUT/host.log
