#!/usr/bin/env bash
# Session 4, GPU call D2: issue 7's table -- auto against each backend on both suites, benchmark
# on and off (scripts/gpu_auto.py, JSON per row); --mode full with benchmark on; the cuda engine's
# bench rows.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
# gemm_kernel geometries first; KB 58 and 72 (phase_kernel fallback, a session-3 run stalled > 6 min on
# KB 58) separately, one timed call each, under their own limit.
timeout 70 python -m convt3d bench --case kb61,kb68,kb70,kb73,kb77 --precision exact --backend cuda \
  --json $OUT/bench_cuda.json > $OUT/bench_cuda.log 2>&1; stamp bench_cuda
timeout 45 python -m convt3d bench --case kb72,kb58 --precision exact --backend cuda --min-reps 1 --rep-ms 1 \
  --warmup-ms 1 --json $OUT/bench_cuda_fallback.json > $OUT/bench_cuda_fallback.log 2>&1; stamp bench_cuda_fallback
timeout 300 python scripts/gpu_auto.py $OUT/auto.json > $OUT/auto.log 2>&1; stamp auto
L=$(( 585 - ($(date +%s) - T0) )); [ $L -gt 20 ] && timeout $(( L / 2 )) python -m convt3d bench --suite layers --mode full \
  --dtype bf16 --layout cl --cudnn-benchmark --json $OUT/full_bf16_cl_bm.json > $OUT/full_bf16_cl_bm.log 2>&1; stamp full_bf16_bm
L=$(( 585 - ($(date +%s) - T0) )); [ $L -gt 20 ] && timeout $L python -m convt3d bench --suite layers --mode full \
  --dtype fp32 --layout ncdhw --cudnn-benchmark --json $OUT/full_fp32_bm.json > $OUT/full_fp32_bm.log 2>&1; stamp full_fp32_bm
for f in $OUT/*.log; do echo "== $f"; tail -4 $f; done
tail -30 $OUT/auto.log
