#!/usr/bin/env bash
# Session 65 turned SWAPPED_CHAINS on after one H100 run (12-28% faster on the four shapes it applies to; its 5 GPU
# tests passed) and built SWAPPED_CHAINS_SPLIT (the chains where 64-row blocks still split K; CPU-checked, never run).
# First call, any card, ~8 min with the start (2-chains-rows.sh follows):
# 1. The MXFP4 GPU tests of test_gemm_fp8.py with the chains on (the 64-row and register-decode tests changed with
#    them; test_gpu_mxfp4_swapped_chains_split is new).
# 2. The A/B: the op (chains) against them off and against the split chains. Predicted: H200 64x7168x2048 11.8 ->
#    ~8.5 us with the chains (1.3x torch), 32x7168x2048 9.4 -> ~8.2, 32x7168x4096 15.5 -> ~12.5, 64x7168x4096 ~19 ->
#    ~14. The split chains at 32 / 64 x 4096 x 7168 (4 splits of 128 rows -> 2 of 64 rows in two chains; half the
#    partials, the chains' ~18% a step measured at 64x7168x4096): ~-15%, 17.2 -> ~14.5 us at 64 tokens. If it wins by
#    >= 5% on both rows: SWAPPED_CHAINS_SPLIT on.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 300 python3 -m pytest -v -m gpu -p no:cacheprovider -n 6 tests/test_gemm_fp8.py -k "mxfp4 and not w4a8" \
  > "$out/tests-mxfp4.log" 2>&1
echo "tests: $(tail -1 "$out/tests-mxfp4.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-mxfp4.log" | cut -c1-200 | head
timeout 150 python3 -m bench.op gemm --shape mxfp4-block-n --out "$out" --graph --flush read --rounds 2 --jobs 8 \
  --providers tilecraft,tilecraft-nochains,tilecraft-chains-split,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
