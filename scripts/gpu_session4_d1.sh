#!/usr/bin/env bash
# Session 4, GPU call D1 (final code): GPU tests of the CUDA engine (its .cu changed after call A),
# the bench tables of both suites, the KernelBench evaluator (its CUDA entry builds once, ~70 s),
# then the --mode full tables (benchmark off) with whatever time is left. The CUDA build of call C
# is carried in as build/tex.tgz.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
timeout 150 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu_cuda.py \
  > $OUT/gpu_tests_cuda.log 2>&1; stamp tests_cuda
timeout 100 python -m convt3d bench --suite kernelbench --json $OUT/bench_kb.json > $OUT/bench_kb.log 2>&1; stamp bench_kb
timeout 200 python -m convt3d kernelbench --json $OUT/kb_eval.json > $OUT/kb_eval.log 2>&1; stamp kb_eval
(cd /tmp && tar czf $OUT/tex.tgz tex 2>/dev/null)
L=$(left); [ $L -gt 30 ] && timeout $L python -m convt3d bench --suite layers --json $OUT/bench_layers.json \
  > $OUT/bench_layers.log 2>&1; stamp bench_layers
L=$(left); [ $L -gt 30 ] && timeout $(( L / 2 )) python -m convt3d bench --suite layers --mode full \
  --dtype bf16 --layout cl --json $OUT/full_bf16_cl.json > $OUT/full_bf16_cl.log 2>&1; stamp full_bf16
L=$(left); [ $L -gt 30 ] && timeout $L python -m convt3d bench --suite layers --mode full \
  --dtype fp32 --layout ncdhw --json $OUT/full_fp32.json > $OUT/full_fp32.log 2>&1; stamp full_fp32
for f in $OUT/*.log; do echo "== $f"; tail -3 $f; done
