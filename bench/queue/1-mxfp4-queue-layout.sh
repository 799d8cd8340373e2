#!/usr/bin/env bash
# Session 63: the queue kernel's steps waited 2.4x longer for their data than the register-ring kernel's (trace p50
# 882 against 361 cycles) while its warps' ends drew together; rotate, claim_ahead and no_sum took 0-4% each. Is it
# its layout (one 16-warp block an SM over two tiles) or its mechanics (claims, per-step partials)? The queue
# kernel in the register-ring kernel's layout (a block a tile, 8 warps, two blocks an SM) says: if it times as the
# plan, the layout; if as the queue kernel, the mechanics. ~3 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" --case 1x4096x7168 --case 8x4096x7168 \
  --variant "" --variant "queue=1,blocks=256,warps=8" --variant "queue=1,blocks=128,warps=16" \
  --variant "queue=1,blocks=256,warps=8,rotate=1" --variant "" 2>&1 | tee "$out/sweep.txt"
