#!/usr/bin/env bash
# Session 4, GPU call D2 (warm after D1): the KernelBench evaluator again (D1's files exceeded the
# per-call file count), the cuda engine's bench rows, --mode full with benchmark on, and issue 7's
# table (scripts/gpu_auto.py). At most 8 files under $OUT.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
[ -d /tmp/tex ] || { tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +; }
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
timeout 150 python -m convt3d kernelbench --json $OUT/kb_eval.json > $OUT/kb_eval.log 2>&1; stamp kb_eval
timeout 70 python -m convt3d bench --case kb61,kb68,kb70,kb73,kb77 --precision exact --backend cuda \
  --json $OUT/bench_cuda.json > /tmp/bench_cuda.log 2>&1; stamp bench_cuda
timeout 40 python -m convt3d bench --suite layers --mode full --dtype bf16 --layout cl --cudnn-benchmark \
  --json $OUT/full_bf16_cl_bm.json > /tmp/full_bf16_bm.log 2>&1; stamp full_bf16_bm
timeout 40 python -m convt3d bench --suite layers --mode full --dtype fp32 --layout ncdhw --cudnn-benchmark \
  --json $OUT/full_fp32_bm.json > /tmp/full_fp32_bm.log 2>&1; stamp full_fp32_bm
L=$(left); timeout $L python scripts/gpu_auto.py $OUT/auto.json > $OUT/auto.log 2>&1; stamp auto
tail -25 $OUT/auto.log; cat $OUT/times.log
