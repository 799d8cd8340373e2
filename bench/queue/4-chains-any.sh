#!/usr/bin/env bash
# Session 66: SWAPPED_CHAINS_WHERE = "any" (the chains wherever the 64-row plan takes them). ~7 min with the start,
# an H200 for the top table:
# 1. Every MXFP4 GPU test of test_gemm_fp8.py but W4A8 (the knob loop now compares the chains' bits only where the
#    knobs keep the chains).
# 2. The op's rows: mxfp4 and mxfp4-chains against "unsplit" (the op before) and torch. Expected as call 3 on the
#    H100: 16x7168x2048 -13%, 32-64 x 4096x7168 -9/-10%, 2048x7168 -12/-14%, 24576x1536 -5..-13%, elsewhere equal.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 330 python3 -m pytest -v -m gpu -p no:cacheprovider -n 6 tests/test_gemm_fp8.py -k "mxfp4 and not w4a8" \
  > "$out/tests-mxfp4.log" 2>&1
echo "tests: $(tail -1 "$out/tests-mxfp4.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-mxfp4.log" | cut -c1-200 | head
for shape in mxfp4 mxfp4-chains; do
  timeout 150 python3 -m bench.op gemm --shape $shape --out "$out" --graph --flush read --jobs 8 \
    --providers tilecraft,tilecraft-chains-unsplit,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
done
