#!/usr/bin/env bash
# Session 65, third call: the width rule with its step limit (64-row blocks only where they take the reduce kernel away
# and a block runs <= 16 steps), after the second call's H200 A/B (64 rows lost at 32x7168x4096, 15.4 -> 18.6 us).
# 1. The tests the rule touches: register_decode (its knob loop now at the default's width: the second call's failure at
#    1x7168x2048 with fold and pair forced off, where the rule had taken the split away), the 64-row and pair tests.
# 2. The width A/B again (2 rounds) and the op's MXFP4 rows on this card (bench/NOTES.md's top table when an H200).
#    Predicted: tilecraft = n64 at 7168x2048 (H200 11.7 / 9.2 us at 64 / 32 tokens), = n128 elsewhere.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider -n 6 tests/test_gemm_fp8.py \
  -k "register_decode or 64_row or pair_fold" > "$out/tests-mxfp4.log" 2>&1
echo "tests: $(tail -1 "$out/tests-mxfp4.log")"; grep -h -E "^FAILED|^ERROR" "$out"/tests-*.log | cut -c1-200 | head
timeout 200 python3 -m bench.op gemm --shape mxfp4-block-n --out "$out" --graph --flush read --rounds 2 \
  --providers tilecraft,tilecraft-swapped-n64,tilecraft-swapped-n128,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-120
timeout 150 python3 -m bench.op gemm --shape mxfp4 --out "$out" --graph --flush read --providers tilecraft,torch 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-120
