#!/usr/bin/env bash
# Session 58 (built after its GPU time, CPU-checked only): the MXFP4 warp kernel's trace (bench.trace_mxfp4_warps)
# at the plan's splits and at 16 / 4 warps a block, depth 1 / 2 / 4, then its GPU tests (the trace's among them)
# and the mxfp4 / mxfp4-warps presets on whichever card comes (the README row is H100-only so far).
# What to read: bench/NOTES.md "Session 58", "the warp kernel measured". ~6 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
for args in "" "--splits 16" "--splits 4" "--depth 1" "--depth 4"; do
  echo "== trace $args"; timeout 60 python3 -m bench.trace_mxfp4_warps $args --case 1x4096x7168 --case 1x7168x2048
done 2>&1 | tee "$out/trace-mxfp4-warps.txt"
TESTS="tests/test_gemm_fp8.py@3:warps" DEADLINE=300 TEST_BUDGET=150 bash bench/gpu_session.sh tests \
  "gemm mxfp4 tilecraft,tilecraft-swapped,tilecraft-warps-32,tilecraft-w4a8,torch --graph --flush read"
