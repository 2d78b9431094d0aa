#!/usr/bin/env bash
# Session 4, GPU call D1 (final code): GPU tests of the engines, the bench tables of both suites,
# the KernelBench evaluator, and the --mode full tables (benchmark off). The CUDA build of call C
# is carried in as build/tex.tgz.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
timeout 200 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu_cuda.py tests/test_gpu.py \
  > $OUT/gpu_tests_a.log 2>&1; stamp tests_a
timeout 100 python -m convt3d bench --suite kernelbench --json $OUT/bench_kb.json > $OUT/bench_kb.log 2>&1; stamp bench_kb
timeout 110 python -m convt3d bench --suite layers --json $OUT/bench_layers.json > $OUT/bench_layers.log 2>&1; stamp bench_layers
timeout 130 python -m convt3d kernelbench --json $OUT/kb_eval.json > $OUT/kb_eval.log 2>&1; stamp kb_eval
L=$(( 585 - ($(date +%s) - T0) )); [ $L -gt 20 ] && timeout $(( L / 2 )) python -m convt3d bench --suite layers --mode full \
  --dtype bf16 --layout cl --json $OUT/full_bf16_cl.json > $OUT/full_bf16_cl.log 2>&1; stamp full_bf16
L=$(( 585 - ($(date +%s) - T0) )); [ $L -gt 20 ] && timeout $L python -m convt3d bench --suite layers --mode full \
  --dtype fp32 --layout ncdhw --json $OUT/full_fp32.json > $OUT/full_fp32.log 2>&1; stamp full_fp32
for f in $OUT/*.log; do echo "== $f"; tail -4 $f; done
