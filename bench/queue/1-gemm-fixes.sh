#!/usr/bin/env bash
# Session 74: what the fp8 / MXFP4 steps_if checks left (bench/NOTES.md "Session 74"), ~4 min on any Hopper card:
# 1. The grouped preset: the masked 128 x 256 tile is back on the if_then_else count (steps_if made nvcc spill 19/38
#    words a thread there: 51.8 -> 67.8 us at 1x1024x4096x7168 on an H100; its source is now byte-identical to the
#    51.8 us build). Written before the run: masked ~52 us (1160 TFLOP/s on an H100), contiguous ~1.65 ms as before.
# 2. The fixed tests: test_gpu_dense_overlap (one forced split plan for v2 and v3), the cluster-fold tests (_launch
#    drops the plan's pair exchange when a caller's cluster / splits leave no 2-split cluster). Expected: all pass.
# 3. The 15 of session 72's 83 MXFP4 / W4A8 count tests that session 74's 240 s did not reach (68 passed).
# 4. topk_select's v2 program with k read from Out's shape (one build for every k; CPU-tested): its CUDA variant
#    (kernel="v2") in the topk GPU tests. Expected: all pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 60 python3 -m bench.op gemm --shape grouped --out "$out" --graph --flush read --jobs 8 --providers tilecraft \
  2>&1 | grep -E "^(contiguous|masked)|wrote" | cut -c1-110
timeout 100 python3 -m pytest -q -m gpu -n 8 -rf --tb=line -p no:cacheprovider tests/test_gemm_fp8.py \
  -k "dense_overlap or cluster_fold" > "$out/tests-fp8-fixed.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests-fp8-fixed.txt" | cut -c1-300 | tail -8
timeout 330 python3 -m pytest -q -m gpu -n 8 -rf --tb=line -p no:cacheprovider tests/test_gemm_w4a8.py \
  tests/test_gemm_fp8.py -k "w4a8 or grouped or masked" > "$out/tests-steps-if.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests-steps-if.txt" | cut -c1-300 | tail -8
timeout 150 python3 -m pytest -q -m gpu -n 4 -rf --tb=line -p no:cacheprovider tests/test_topk_select.py \
  > "$out/tests-topk.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests-topk.txt" | cut -c1-300 | tail -8
