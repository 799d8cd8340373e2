#!/usr/bin/env bash
# The issue-4 rows sessions 66-68 measured on H100s only, on an H200 (ask for kind nvidia-h200; if an H100 comes, the
# A/Bs still hold but the table's rows stay H100), ~7 min with the start:
# 1. mxfp4 and mxfp4-chains: the op (bf16 a), the W4A8 op and torch's bf16 GEMM -> NOTES' MXFP4 rows (session 68's
#    chains pair on: 32/64 x 4096x7168).
# 2. decode: the FP8 decode rows beside tilecraft-nodsmem (CLUSTER_SMEM_FOLD off; H100: 128x7168x16384 50.3 vs 52.7 us)
#    and tilecraft-no-pair-half (64x2112x7168's 4-split plan).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
# (mxfp4 also with tilecraft-chains-pair-all: the bf16 op's 16x4096x7168 gained 12.9 -> 12.3 us with it on an H100,
# one run; a second run decides a bf16-only rule)
for shape in mxfp4 mxfp4-chains; do
  extra=$([ $shape = mxfp4 ] && echo ",tilecraft-chains-pair-all")
  timeout 170 python3 -m bench.op gemm --shape $shape --out "$out" --graph --flush read --jobs 8 \
    --providers tilecraft,tilecraft-w4a8,torch$extra 2>&1 | grep -E "^mxfp4|wrote" | cut -c1-100
done
timeout 150 python3 -m bench.op gemm --shape decode --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-nodsmem,tilecraft-no-pair-half 2>&1 | grep -E "^dense|wrote" | cut -c1-110
# 3. PAIR_HALF_TILES (session 69, on; H100: 64x2112x7168 12.2 -> 10.4 us, 48 rows 11.7 -> 10.5, 17-32 a tie) on an H200
timeout 120 python3 -m bench.op gemm --shape pair-half --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-no-pair-half 2>&1 | grep -E "^dense|wrote" | cut -c1-100
