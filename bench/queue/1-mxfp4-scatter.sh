#!/usr/bin/env bash
# Session 60 (built, its call refused for device time): the scatter probe: the warp kernel's codes alone in its own
# order (loads=2) against the same bytes read row by row in 512-byte pieces (loads=3) and piece by piece over the 16
# rows (loads=4, also at 2 warps a block: the order an 8-step chunked pipeline would read), beside the kernel and all
# its loads (loads=1). If 3 / 4 are much faster than 2, the rows' scatter is what holds the register feed at
# ~2.5 TB/s (bench/NOTES.md "Open GPU checks (end of session 60)"). Then the op's new masked route
# (expected_m <= 8 and k <= MASKED_WARPS_MAX_K = 2048 on the warp kernel) on the mxfp4-moe-decode preset
# (predicted: the down projection at the masked-warps provider's time, the up one unchanged). ~3 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 140 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 1x7168x2048 --case 8x4096x7168 \
  --variant "" --variant loads=1 --variant loads=2 --variant loads=3 --variant loads=4 \
  --variant splits=2,loads=2 --variant splits=2,loads=4 2>&1 | tee "$out/sweep.txt"
timeout 70 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" \
  --providers tilecraft,tilecraft-masked-warps,torch --graph --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
