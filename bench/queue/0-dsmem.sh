#!/usr/bin/env bash
# FP8 2-split plans folding through distributed shared memory (ops.gemm_fp8.CLUSTER_SMEM_FOLD, session 68), ~4 min:
# the op-level bit test, the kernel's bit tests, then the decode preset with and without it (only 128x7168x16384 is a
# 2-split plan). Predicted: 128x7168x16384 -1 to -3 us (the reduce kernel and its gap, less a 5th stage: 4 remain).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu -n 8 tests/test_gemm_fp8.py -k "dsmem_plan or smem_fold_matches" 2>&1 \
  | tee "$out/tests-gpu-dsmem-session68-$gpu-$(date -u +%Y%m%dT%H%MZ).txt" | tail -4
timeout 200 python3 -m bench.op gemm --shape decode --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-dsmem 2>&1 | grep -E "^dense|wrote" | cut -c1-110
