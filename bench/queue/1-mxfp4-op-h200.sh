#!/usr/bin/env bash
# Session 63: the op's MXFP4 rows on an H200 (the issue's card) with ACTS_RING on, which the top table of
# bench/NOTES.md lacks (last: session 62's run before it), and depth 3 against 2 on the H200 (on an H100: -5% / +5% /
# -2% / -5%). Predicted, from the H100's 1-14% and session 62's H200 sweep (kernel 0.6-9% faster): 1x4096x7168
# 8.9 -> ~8.8 us, 8x4096x7168 10.1 -> ~9.8, 8x7168x2048 7.7 -> ~7.0, the rest within 3%. ~4 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,torch --graph --flush read 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
timeout 90 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" --providers tilecraft,torch --graph \
  --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
timeout 120 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 1x7168x2048 --case 8x7168x2048 \
  --variant "" --variant depth=3 --variant "" --variant depth=3 2>&1 | tee "$out/sweep.txt"
