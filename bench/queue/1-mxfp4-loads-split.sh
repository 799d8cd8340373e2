#!/usr/bin/env bash
# Session 62: where the warp kernel's loads alone (loads=1) spend their time beyond the codes alone (loads=2): at
# 1x4096x7168 on an H200, 6.85 against 5.29 us. loads=6 drops the scale words (16 rows' 4-byte words a step: 16 line
# requests for 64 bytes), loads=7 the activations (L1-resident). Predicted: if the scale words' requests are the cost,
# loads=6 ~5.3-5.6 and loads=7 ~6.8 -> a scale layout read as whole lines (a pre-tiled scale array) is next; if the
# activations are, the reverse (token rows through shared memory once a block). quads=1 (a quarter of the scale
# requests) beside them on the kernel and on its loads. ~2.5 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 240 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 1x7168x2048 --case 8x4096x7168 \
  --variant "" --variant loads=1 --variant loads=2 --variant loads=6 --variant loads=7 \
  --variant quads=1 --variant quads=1,loads=1 --variant quads=1,loads=7 2>&1 | tee "$out/sweep.txt"
