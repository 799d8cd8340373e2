#!/usr/bin/env bash
# Session 63: the shared ring (smem=3/4/6) ran 19-52% slower than the register ring on an H100 (sweep), bitwise
# right. Trace it beside the plan for where the time goes (expected: later first data and longer step waits, the
# cp.async path's loaded latency above LDG's), then the register ring one step deeper now that the activations ride
# in it: depth=3 (119 registers, still two 8-warp blocks an SM), depth=3/4 with the activations one step ahead
# (106/107 registers). Predicted from session 59's trace (depth 4: step waits 1317 -> 428 cycles, first data
# 3528 -> 5129, the same span): +-3%. ~5 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 1x7168x2048 --case 8x7168x2048 \
  --variant "" --variant depth=3 --variant "depth=3,acts_ring=0" --variant "depth=4,acts_ring=0" \
  2>&1 | tee "$out/sweep.txt"
for v in "" "--smem 3" "--depth 3"; do
  echo "== trace $v"
  timeout 100 python3 -m bench.trace_mxfp4_warps --case 1x4096x7168 --case 8x4096x7168 $v 2>&1 | tail -16
done | tee "$out/trace.txt"
