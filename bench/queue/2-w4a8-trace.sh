#!/usr/bin/env bash
# Before building stream-K for the 7168x2048 MXFP4 rows (bench/NOTES.md "Session 67", the next lever): where the
# W4A8 chains kernel's time goes at 1/8/16 tokens (its plan: 112 blocks of 64 weight rows, 16 steps). The design pays
# only if the loop (first data to the last step) is most of the span; if the span is mostly the prologue, the first
# data and the epilogue, stream-K's -15% of the loop is < 0.3 us and it is not built.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
timeout 200 python3 -m bench.trace_mxfp4 --w4a8 --case 1x7168x2048 8x7168x2048 16x7168x2048 1x4096x7168 \
  --flush read --blocks 2>&1 | tee "$out/trace-w4a8-chains-$(date -u +%Y%m%dT%H%MZ).txt" | tail -80
