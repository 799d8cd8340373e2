#!/usr/bin/env bash
# The MXFP4 rows of bench/NOTES.md's top table on an H200 (session 66 measured the chains on H100s only). ~4 min with
# the start; ask for an H200 (kind nvidia-h200):
# the op (bf16 activations; SWAPPED_CHAINS_WHERE "any") and the W4A8 op (chains) against torch's bf16 GEMM, the
# mxfp4 and mxfp4-chains presets. Expected from the H100 ratios: 16-64 tokens 1.5-1.9x (bf16 a), 1.8-1.9x (W4A8) at
# 7168x2048; the H200's faster memory helps torch more than us (our rows are decode-bound), so ~0.1-0.2x lower.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
# session 67's fix of the fold test (the bf16 op's 128-row plans pinned: SWAPPED_FOLD off let its chains take them)
timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider -n 4 tests/test_gemm_w4a8.py -k fenceless > "$out/tests-fold.log" 2>&1
echo "fold test: $(tail -1 "$out/tests-fold.log")"
for shape in mxfp4 mxfp4-chains; do
  timeout 150 python3 -m bench.op gemm --shape $shape --out "$out" --graph --flush read --jobs 8 \
    --providers tilecraft,tilecraft-w4a8,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
done
