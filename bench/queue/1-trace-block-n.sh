#!/usr/bin/env bash
# Session 65, call 4: why a 64-row swapped block's step costs 0.58 us at 32 tokens and 0.39 at 64 (H200, k 2048 ->
# 4096 differences, "Session 65"). Traces (read flush) of the 64-row kernel at 32x7168x2048, 32x7168x4096, 64x7168x4096
# and the 128-row one at 32x7168x4096. Expected if the decode binds both: the same work a step at 32 and 64 tokens,
# then the 32-token kernel waits for data (the feed); if the work a step differs, the MMA / decode side.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
{ timeout 200 python3 -m bench.trace_mxfp4 --flush read --block-n 64 --case 32x7168x2048 32x7168x4096 64x7168x4096
  timeout 100 python3 -m bench.trace_mxfp4 --flush read --case 32x7168x4096; } 2>&1 | tee "$out/trace-block-n.txt" \
  | grep -v "^ *decode:\|^ *launch:\|^ *retire:" | cut -c1-400
