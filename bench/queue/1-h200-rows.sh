#!/usr/bin/env bash
# The rows sessions 66-67 measured on H100s only, on an H200 (ask for kind nvidia-h200; if an H100 comes, the A/Bs
# still hold but the table's rows stay H100). ~5 min with the start:
# 1. mxfp4 and mxfp4-chains presets: the op (bf16 a: SWAPPED_CHAINS_WHERE "any"), the W4A8 op (chains from 8-token
#    tiles) and torch's bf16 GEMM -> bench/NOTES.md's MXFP4 rows. Expected from the H100 ratios (bf16 1.53-2.70x,
#    W4A8 1.88-2.61x): ~0.1-0.3x lower, the H200's faster memory helping torch's GEMM more than our decode-bound rows.
# 2. decode-few: the FP8 fold at <= 16 rows against tilecraft-nofold (H100: 0-11% faster).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
for shape in mxfp4 mxfp4-chains; do
  timeout 150 python3 -m bench.op gemm --shape $shape --out "$out" --graph --flush read --jobs 8 \
    --providers tilecraft,tilecraft-w4a8,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
done
timeout 120 python3 -m bench.op gemm --shape decode-few --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-nofold 2>&1 | grep -E "^dense|^gemm|wrote" | cut -c1-110
