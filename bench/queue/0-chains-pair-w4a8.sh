#!/usr/bin/env bash
# The W4A8 chains-pair bit tests after the fix (__fadd_rn: call 1 found per-token-scale cases one FFMA off the reduce
# kernel's bits), then the H200-rows queue (bench/queue/1-h200-rows.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
timeout 150 python3 -m pytest -q -m gpu -n 8 tests/test_gemm_w4a8.py tests/test_gemm_fp8.py -k "chains_pair" 2>&1 \
  | tee "$out/tests-gpu-chains-pair-fadd-session68-$gpu-$(date -u +%Y%m%dT%H%MZ).txt" | tail -4
bash bench/queue/1-h200-rows.sh
