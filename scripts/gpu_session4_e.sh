#!/usr/bin/env bash
# Session 4, GPU call E (the steady host path): Triton engine GPU tests, host time per call
# (scripts/gpu_autodiag.py), the layers bench, KB 77.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
timeout 70 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu.py > $OUT/gpu_tests.log 2>&1; stamp tests
timeout 40 python scripts/gpu_autodiag.py > $OUT/autodiag.log 2>&1; stamp autodiag
timeout 70 python -m convt3d bench --suite layers --json $OUT/bench_layers.json > $OUT/bench_layers.log 2>&1; stamp layers
timeout 15 python -m convt3d bench --case kb77 --precision default --json $OUT/bench_kb77.json > /dev/null 2>&1; stamp kb77
tail -3 $OUT/gpu_tests.log; grep -E "host|==" $OUT/autodiag.log | cut -c1-160; tail -8 $OUT/bench_layers.log; cat $OUT/times.log
