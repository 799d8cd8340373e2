#!/usr/bin/env bash
# The MXFP4 rows (sessions 66-68 measured them on H100s only), on an H200 if one comes (else the A/Bs still hold), ~6
# min with the start:
# 1. mxfp4 preset (1/8/16/64 tokens x 7168x2048, 4096x7168): the op (bf16 a), the W4A8 op and torch's bf16 GEMM ->
#    bench/NOTES.md's MXFP4 rows; beside them SWAPPED_CHAINS_PAIR "all" (the chains' cluster pair also at 1-16 tokens
#    x 4096x7168, where the 64-row plan pairs; session 68). Predicted for "all" (H100 terms): W4A8 16x4096x7168
#    10.9 -> ~10 us (two chains where one warpgroup, or a 4-split fold, ran); at 1/8 tokens +-0.5 us; bf16 16x4096x7168
#    13.1 -> ~12; the bf16 op's 1/8-token rows run the warp kernel (unchanged).
# 2. decode-few: the FP8 fold at <= 16 rows against tilecraft-nofold (H100: 0-11% faster).
# 3. the W4A8 chains' trace at 7168x2048 (before any stream-K: is the loop most of the span?).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 260 python3 -m bench.op gemm --shape mxfp4 --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-chains-pair-all,tilecraft-w4a8,tilecraft-w4a8-chains-pair-all,torch 2>&1 \
  | grep -E "^mxfp4|wrote" | cut -c1-120
timeout 120 python3 -m bench.op gemm --shape decode-few --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-nofold 2>&1 | grep -E "^dense|wrote" | cut -c1-110
timeout 150 python3 -m bench.trace_mxfp4 --w4a8 --case 1x7168x2048 8x7168x2048 16x7168x2048 \
  --flush read 2>&1 | tee "$out/trace-w4a8-chains-$(date -u +%Y%m%dT%H%MZ).txt" | grep -v "^    " | tail -30
