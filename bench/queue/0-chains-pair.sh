#!/usr/bin/env bash
# The chained 2-split plans' cluster-pair fold (ops.gemm_mxfp4.SWAPPED_CHAINS_PAIR, session 68), ~6 min:
# 1. its GPU tests (bits of the reduce path, bf16 and W4A8) and the chains' tests whose plans it changes;
# 2. the A/B on the mxfp4-chains preset: the op / W4A8 op against the same with the reduce kernel, torch beside.
#    Predicted (H100, written before the run): 32/64 x 4096x7168 (the only 2-split chained rows of the preset)
#    -0.8 to -2 us each (bf16 16.3 -> ~15, W4A8 14.1-14.4 -> ~13); every other row unchanged (+-0.2 us).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 260 python3 -m pytest -q -m gpu -n 8 tests/test_gemm_fp8.py tests/test_gemm_w4a8.py \
  -k "chains_pair or chains_wider or chains_match or test_gpu_mxfp4_swapped_chains" 2>&1 \
  | tee "$out/tests-gpu-chains-pair-session68-$gpu-$(date -u +%Y%m%dT%H%MZ).txt" | tail -8
timeout 280 python3 -m bench.op gemm --shape mxfp4-chains --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-chains-reduce,tilecraft-w4a8,tilecraft-w4a8-chains-reduce,torch 2>&1 \
  | grep -E "^mxfp4|wrote" | cut -c1-120
