#!/usr/bin/env bash
# Session 65: SWAPPED_BLOCK_N's rule (None: 64-row blocks only where they take the reduce kernel away) and what session
# 65's first call left. ~9 min with the start; any card.
# 1. tests/test_runtime.py's last three GPU tests (the first three passed; the 330 s deadline cut the fourth), beside
#    the MXFP4 GPU tests of test_gemm_fp8.py with the rule on (the 64-row test now also checks the rule's bits).
# 2. The width A/B at 32 and 64 tokens (preset mxfp4-block-n): the rule (tilecraft) against both widths forced.
#    Predicted (H100): 64x7168x2048 13.4 -> ~12.1 us as measured with n64 forced; 64x7168x4096 and 32-token rows
#    where the rule picks 64: 0.5-1.5 us faster (the reduce kernel and the partials' round trip, ~1-3 us, gone; the
#    block's steps doubled but cheaper); 4096x7168 rows: tilecraft = n128 within noise.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 400 python3 -m pytest -v -m gpu -p no:cacheprovider -n 3 tests/test_runtime.py \
  -k "not kernels_match_the_cpu and not fp8_gemm_kernels_match_dequantized and not cuda_graph_decode" \
  > "$out/tests-runtime.log" 2>&1 &
timeout 400 python3 -m pytest -v -m gpu -p no:cacheprovider -n 6 tests/test_gemm_fp8.py -k "mxfp4 and not w4a8" \
  > "$out/tests-mxfp4.log" 2>&1 &
wait
for f in "$out"/tests-*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
grep -h -E "(FAILED|ERROR)" "$out"/tests-*.log | cut -c1-200 | head -20
timeout 170 python3 -m bench.op gemm --shape mxfp4-block-n --out "$out" --graph --flush read \
  --providers tilecraft,tilecraft-swapped-n64,tilecraft-swapped-n128,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-120
