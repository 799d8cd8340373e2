#!/usr/bin/env bash
# Session 49's unmeasured contiguous W4A8 switches (bench/NOTES.md "Open GPU checks (end of session 49)" items 0-2):
# the contiguous GPU tests (the build without tail bursts, the split promotion, several n tiles a block), then the
# A/B of the switches against the default and torch, then the traces of both promotions. ~8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="tests/test_gemm_w4a8.py@3:contiguous" DEADLINE=560 TEST_BUDGET=300 bash bench/gpu_session.sh tests \
  "gemm mxfp4-prefill tilecraft-w4a8,tilecraft-w4a8-split,tilecraft-w4a8-ctiles,tilecraft-w4a8-tails,torch --graph --flush read"
for split in "" --split; do
  timeout 60 python3 -m bench.trace_mxfp4 --w4a8 --contiguous 4 $split --flush read --case 1024x4096x7168 \
    > "${OUT:-/tmp}/trace-contiguous${split:+-split}.log" 2>&1
  tail -30 "${OUT:-/tmp}/trace-contiguous${split:+-split}.log"
done
