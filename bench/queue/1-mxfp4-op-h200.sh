#!/usr/bin/env bash
# Left since session 63 (every call of sessions 63 and 64 ran on an H100): the op's MXFP4 rows with ACTS_RING on the
# issue's card, an H200, for bench/NOTES.md's top table (its H200 rows are session 62's, from before ACTS_RING). Run it
# when a call lands on an H200 (the reply's device); on an H100 it repeats session 63/64's numbers. Predicted from
# session 62's H200 sweep (the kernel 0.6-9% faster): 1x4096x7168 8.9 -> ~8.8 us, 8x4096x7168 10.1 -> ~9.8,
# 8x7168x2048 7.7 -> ~7.0, the rest within 3%. (WARP_TOKENS = 16 is settled: session 64 measured the warp kernel
# 8-19% slower than the swapped one at 16 tokens on an H100.) ~3 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,torch --graph \
  --flush read 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
timeout 90 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" --providers tilecraft,torch --graph \
  --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
