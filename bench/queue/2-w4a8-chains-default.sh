#!/usr/bin/env bash
# Session 66: W4A8_CHAINS = True (chains where the 128-row plan splits). Any card, ~3.5 min:
# 1. The default-path W4A8 GPU tests that now take the chains (the knob tests pin W4A8_CHAINS = False: unchanged).
# 2. The mxfp4 preset (1-64 tokens) against the kernel without the chains: 1 and 8 tokens at 7168x2048 take the
#    chains too (8-token tiles, a pair before), never measured.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 100 python3 -m pytest -v -m gpu -p no:cacheprovider -n 7 tests/test_gemm_w4a8.py \
  -k "matches_the_fp32_product and not grouped or per_group_activation and not masked or nan_rows" \
  > "$out/tests-w4a8-default.log" 2>&1
echo "tests: $(tail -1 "$out/tests-w4a8-default.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-w4a8-default.log" | cut -c1-200 | head
timeout 90 python3 -m bench.op gemm --shape mxfp4 --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft-w4a8,tilecraft-w4a8-nochains,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
