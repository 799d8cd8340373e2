#!/usr/bin/env bash
# Session 65 turned SWAPPED_CHAINS on after one H100 run (12-28% faster on the four shapes it applies to, its 5 GPU
# tests passed). On the issue's card, an H200: the MXFP4 GPU tests of test_gemm_fp8.py with it on (the 64-row and
# register-decode tests changed with it), then the width A/B against it off and the op's MXFP4 rows for
# bench/NOTES.md's top table. Predicted (H200): 64x7168x2048 11.8 -> ~8.5 us (1.3x torch), 32x7168x2048 9.4 -> ~8.2,
# 32x7168x4096 15.5 -> ~12.5, 64x7168x4096 ~19 -> ~14; the rest unchanged. ~8 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 300 python3 -m pytest -v -m gpu -p no:cacheprovider -n 6 tests/test_gemm_fp8.py -k "mxfp4 and not w4a8" \
  > "$out/tests-mxfp4.log" 2>&1
echo "tests: $(tail -1 "$out/tests-mxfp4.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-mxfp4.log" | cut -c1-200 | head
timeout 150 python3 -m bench.op gemm --shape mxfp4-block-n --out "$out" --graph --flush read --rounds 2 --jobs 8 \
  --providers tilecraft,tilecraft-nochains,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
timeout 120 python3 -m bench.op gemm --shape mxfp4 --out "$out" --graph --flush read --jobs 8 --providers tilecraft,torch \
  2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
