#!/usr/bin/env bash
# Session 66 turned W4A8_CHAINS on (64-row blocks in two K chains where the 128-row plan splits K, token tiles of 16+)
# after its 7 chains GPU tests and one A/B at 16-64 tokens (H100: 4-26% faster where it applies); two device calls
# were refused before the rest ran. ~7 min with the start, any card:
# 1. Every W4A8 GPU test with the default on (the dense default-path tests now run the chains at 16-64 tokens; the
#    knob tests pin W4A8_CHAINS = False), and the chains tests' new 8-token cases (W4A8_CHAINS_TOKENS = 8).
# 2. The mxfp4 preset (1-64 tokens): the op (chains) against tilecraft-w4a8-nochains and tilecraft-w4a8-chains8
#    (the chains on 8-token tiles: at 1 and 8 x 7168x2048 in place of a 2-split pair). Predicted for chains8 from the
#    16-token row (-18%): ~-15% at 1 / 8 x 7168x2048; 4096x7168 unchanged (its 64-row plan folds at 8 tokens).
#    If chains8 wins by >= 5% there and its tests pass: W4A8_CHAINS_TOKENS = 8.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 300 python3 -m pytest -v -m gpu -p no:cacheprovider -n 7 tests/test_gemm_w4a8.py > "$out/tests-w4a8.log" 2>&1
echo "tests: $(tail -1 "$out/tests-w4a8.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-w4a8.log" | cut -c1-200 | head
timeout 120 python3 -m bench.op gemm --shape mxfp4 --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft-w4a8,tilecraft-w4a8-nochains,tilecraft-w4a8-chains8,torch 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
