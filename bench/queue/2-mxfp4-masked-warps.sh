#!/usr/bin/env bash
# Session 59 (CPU-checked only): the warp kernel's masked form for MoE decode (ops.gemm_mxfp4_warps
# mxfp4_gemm_nt_warps_masked; ops.gemm_mxfp4.MASKED_WARPS, off until measured). Its GPU tests (groups of 0 / 3 /
# max_m rows, three token tiles, NaN past masked_m, register and bulk feeds bitwise the same), then the new preset
# mxfp4-moe-decode (8 experts x 4 tokens, up 4096x7168 and down 7168x2048) against the swapped masked kernel (the
# op today), W4A8 and torch. Turn MASKED_WARPS on (and FEED, if call 1 said bulk) only where it wins. ~5 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemm_fp8.py -k "test_gpu_mxfp4_warps_masked" \
  > "$out/tests-masked.log" 2>&1; tail -6 "$out/tests-masked.log"
timeout 200 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" \
  --providers tilecraft,tilecraft-masked-warps,tilecraft-masked-bulk,tilecraft-w4a8,torch --graph --flush read 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
