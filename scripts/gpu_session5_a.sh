#!/usr/bin/env bash
# Session 5, GPU call A: the precision probe (tf32 / tf32x3 / bf16x3 on the seven KernelBench
# problems, plus the FMA path on KB 72).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 420 python scripts/gpu_precision_probe.py > $OUT/probe.jsonl 2> $OUT/probe.err
echo rc=$? >> $OUT/probe.err
tail -5 $OUT/probe.err
cat $OUT/probe.jsonl
