#!/usr/bin/env bash
# ops.gemm_fp8.PAIR_HALF_TILES (session 69, on): 17-64 x 2112 x 7168 as 66 pairs of 64 x 32 tiles folding through
# distributed shared memory instead of 33 tiles x 4 splits + the reduce kernel. Its GPU tests (the op's plan is the
# reduce kernel's bits for the same tiles; the plan rules), then the A/B. Predicted from session 69's pair32 run
# (H100: 64x2112x7168 11.5 -> 10.4 us): -0.5 to -1.5 us at every row (fewer rows: A smaller, the same B stream).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu -n 3 tests/test_gemm_fp8.py -k "pair_half or dsmem_plan_is" 2>&1 | tail -3 \
  | tee "$out/tests-pair-half.txt"
timeout 150 python3 -m bench.op gemm --shape pair-half --out "$out" --graph --flush read --jobs 8 --rounds 2 \
  --providers tilecraft,tilecraft-no-pair-half 2>&1 | grep -E "^dense|wrote" | cut -c1-100
