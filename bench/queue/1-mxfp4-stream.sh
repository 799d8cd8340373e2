#!/usr/bin/env bash
# Session 62: at 8 tokens the warp kernel's activations cost its loads ~2 us (8x4096x7168 on an H100: loads=1 9.45,
# without the activations (loads=7) 7.51, without the scale words (loads=6) 9.68). Every block reads all of A
# (114 KB at k = 7168), twice the codes' bytes an SM, so what L1 keeps of it between the SM's blocks matters; the
# codes' __ldg stream (115 KB an SM) evicts it. stream=1 loads the codes not allocated in L1. Predicted: if L1
# reuse is the mechanism, 8x4096x7168 loads=1 9.45 -> ~8 and the kernel 10.7 -> ~9.3 (H100); at 1 token (4 lanes
# load activations) no change. Then its bitwise GPU tests. ~3 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 240 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 8x7168x2048 --case 16x4096x7168 \
  --variant "" --variant stream=1 --variant loads=1 --variant stream=1,loads=1 --variant loads=7 \
  --variant stream=1,loads=7 2>&1 | tee "$out/sweep.txt"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemm_fp8.py \
  -k "test_gpu_mxfp4_warps and (8-4096 or 5-256)" > "$out/tests.log" 2>&1; echo "rc $?" >> "$out/tests.log"
grep -E "passed|failed|^FAILED|^rc" "$out/tests.log"
