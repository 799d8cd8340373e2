#!/usr/bin/env bash
# Session 65, call 6: raw words a step ahead (SWAPPED_AHEAD) on the 64-row blocks. The traces (call 4) show the
# 64-row kernel bound by its one warpgroup's decode (400-560 cycles a step, data waits ~70), with four warps an SM
# to hide the raw words' shared-memory loads. Predicted: 50-100 cycles a step off, ~0.5 us at 64x7168x2048
# (11.7 -> ~11.1 us H200) and 32x7168x2048; the 128-row rows as in "MXFP4 v8" (no gain). Correctness: the ahead
# path's bits are tested by test_gpu_mxfp4_swapped_register_decode's knob loop (at the default's width).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m bench.op gemm --shape mxfp4-block-n --out "$out" --graph --flush read --rounds 2 --jobs 8 \
  --providers tilecraft,tilecraft-ahead,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-100
