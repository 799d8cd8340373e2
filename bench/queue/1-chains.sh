#!/usr/bin/env bash
# Session 65 (built after the rest; CPU-checked: no spills, no serialized WGMMA): SWAPPED_CHAINS, two MMA warpgroups
# on alternate K steps of 64-row blocks. Its GPU test first (exact against fp32, bitwise run to run, the default's
# bits where it does not apply), then the width A/B with it (2 rounds). Predicted from session 65's traces (a chain's
# step at the two-warpgroup cost, ~780 cycles at 32 tokens, ~1050 at 64): H200 64x7168x2048 11.8 -> ~10.9 us,
# 32x7168x2048 9.4 -> ~8.6, 32x7168x4096 15.5 -> ~14, 64x7168x4096 19.1 (128 rows) -> ~17; 4096x7168 unchanged.
# If it wins at 7168x2048 on both token counts: SWAPPED_CHAINS on. Any card (~4 min with the start).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider -n 5 tests/test_gemm_fp8.py -k "swapped_chains" \
  > "$out/tests-chains.log" 2>&1
echo "tests: $(tail -1 "$out/tests-chains.log")"; grep -h -E "^FAILED|^ERROR|^E " "$out/tests-chains.log" | cut -c1-200 | head
timeout 150 python3 -m bench.op gemm --shape mxfp4-block-n --out "$out" --graph --flush read --rounds 2 --jobs 8 \
  --providers tilecraft,tilecraft-chains,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
