#!/usr/bin/env bash
# Session 66: ops.gemm_w4a8.W4A8_CHAINS (off): the bf16 kernel's two K chains on the W4A8 kernel (each warpgroup
# promotes its half of the accumulator). ~5 min with the start, any card:
# 1. Its GPU tests (exact against fp32, per-token and per-group scales, m tails, run-to-run bits); the default
#    sources are byte-identical to the ones before (the loop's promote changed only where chains > 1).
# 2. The A/B on mxfp4-chains (e4m3 activations): tilecraft-w4a8 against tilecraft-w4a8-chains and torch bf16.
#    Predicted from the bf16 kernel's session-66 A/B (H100): where the chains drop a split or a pair, 10-20%
#    (32/64 x 7168x2048, 32/64 x 4096x7168, 2048x7168, 24576x1536); 16 x 4096x7168 / 2048x7168 unchanged (no
#    chains there). If it wins by >= 5% where it applies and loses nowhere: W4A8_CHAINS = True.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider -n 7 tests/test_gemm_w4a8.py -k "chains" \
  > "$out/tests-w4a8-chains.log" 2>&1
echo "tests: $(tail -1 "$out/tests-w4a8-chains.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-w4a8-chains.log" | cut -c1-200 | head
timeout 150 python3 -m bench.op gemm --shape mxfp4-chains --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft-w4a8,tilecraft-w4a8-chains,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
