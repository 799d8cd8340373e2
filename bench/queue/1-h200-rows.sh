#!/usr/bin/env bash
# The issue-4 rows sessions 66-68 measured on H100s only, on an H200 (ask for kind nvidia-h200; if an H100 comes, the
# A/Bs still hold but the table's rows stay H100), ~7 min with the start:
# 1. mxfp4 and mxfp4-chains: the op (bf16 a), the W4A8 op and torch's bf16 GEMM -> NOTES' MXFP4 rows (session 68's
#    chains pair on: 32/64 x 4096x7168).
# 2. decode: the FP8 decode rows beside tilecraft-nodsmem (CLUSTER_SMEM_FOLD off; H100: 128x7168x16384 50.3 vs 52.7 us).
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
  --providers tilecraft,tilecraft-nodsmem 2>&1 | grep -E "^dense|wrote" | cut -c1-110
# 3. FP8 decode rows as 2-split pairs of 64-row one-warpgroup tiles folding through distributed shared memory
#    (providers tilecraft-pair32/64/128, session 68, CPU-checked only), their kernel bit tests first. Predicted:
#    64x2112x7168 (pair32: 66 pairs, 28 K blocks a block instead of 14, no reduce kernel) 10.4 -> ~8.5-9.5 us;
#    128x2112x7168 (pair64: 132 blocks; A read 230 KB a block instead of 459) 10.6 -> ~9-10; 128x4096x7168 (pair128:
#    128 blocks, 25% fewer L2 -> SM bytes than the thin 64 x 64 tiles) 14.7 -> ~13-15. Rows whose pairs make two
#    waves: slower.
timeout 150 python3 -m pytest -q -m gpu -n 4 tests/test_gemm_fp8.py -k "smem_fold_matches and True-128" 2>&1 | tail -3
timeout 170 python3 -m bench.op gemm --shape decode --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-pair32,tilecraft-pair64,tilecraft-pair128 2>&1 | grep -E "^dense|wrote" | cut -c1-110
