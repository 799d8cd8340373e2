#!/usr/bin/env bash
# Session 63: in the register-ring kernel's own layout the queue kernel was still 20-22% slower, so its mechanics, not
# its layout: a register-ring warp reads a row's 128-byte line as two halves one step apart, and the second half is
# then in L2; the queue's warps ask for both halves at once from different warps, and every step waits the whole
# DRAM latency (trace: 882 against 361 cycles a step). pairs=1: an item is two consecutive steps of one warp.
# Predicted, if that is it: the queue kernel at the register-ring kernel's time less part of its tail (1x4096x7168
# ~8.2-8.6 us against ~8.9); if not, +-3% against queue=1. Then its GPU tests. ~3 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 8x7168x2048 \
  --variant "" --variant queue=1 --variant "queue=1,pairs=1" --variant "queue=1,pairs=1,rotate=1,claim_ahead=1" \
  --variant "queue=1,pairs=1,blocks=256,warps=8" --variant "" 2>&1 | tee "$out/sweep.txt"
t="tests/test_gemm_fp8.py"
run() { timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps_queue and (1-7168 or 1-4096)" a & run "test_gpu_mxfp4_warps_queue and (5-256 or 9-512)" b &
run "test_gpu_mxfp4_warps_queue and (8-4096 or 16-4096)" c &
wait
for f in a b c; do echo "== $f"; grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests-$f.log" | head -8; done
