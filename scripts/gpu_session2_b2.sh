#!/usr/bin/env bash
# Session 2, GPU call B2: layers suite (forward), KernelBench evaluator, training-step bench.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
timeout 200 python -m convt3d bench --suite layers --json $OUT/bench_layers.json > $OUT/bench_layers.log 2>&1
timeout 200 python -m convt3d kernelbench --json $OUT/kb_eval.json > $OUT/kb_eval.log 2>&1
timeout 100 python -m convt3d bench --suite layers --mode full --dtype bf16 --layout cl --json $OUT/full_bf16.json > $OUT/full_bf16.log 2>&1
timeout 100 python -m convt3d bench --suite layers --mode full --dtype fp32 --layout ncdhw --json $OUT/full_fp32.json > $OUT/full_fp32.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -4 $f; done
