#!/usr/bin/env bash
# Session 59 (built after its GPU time was lost to failed starts, CPU-checked only): the MXFP4 warp kernel's codes by
# bulk copies into shared memory (ops.gemm_mxfp4_warps feed="bulk"). Its GPU tests (bitwise the register feed's at
# the same splits, phases 1-3, odd warp counts; the traced bulk kernel), the sweep (bulk at phases 1/2/4, phase-major, and 4/8/16
# warps a block beside the plan and the loads alone), the bulk trace, then the op against tilecraft-bulk(-32) and
# torch on the mxfp4 preset. What to read first: bench/NOTES.md "Session 59", the plan's expectation
# (1x4096x7168 ~6-6.5 us on an H100 from 9.1; 1x7168x2048 ~4.5 from 7.4). ~6 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
(timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemm_fp8.py -k "test_gpu_mxfp4_warps and not masked" \
   > "$out/tests.log" 2>&1; echo "tests rc $?" >> "$out/tests.log") &
timeout 190 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 1x7168x2048 --case 8x4096x7168 --case 8x7168x2048 \
  --variant "" --variant feed=bulk --variant feed=bulk,phase=1 --variant feed=bulk,phase=4 \
  --variant feed=bulk,phase_major=1 --variant feed=bulk,splits=16 --variant feed=bulk,splits=4 --variant loads=1 \
  2>&1 | tee "$out/sweep.txt"
wait; tail -6 "$out/tests.log"
timeout 60 python3 -m bench.trace_mxfp4_warps --feed bulk --case 1x4096x7168 --case 1x7168x2048 2>&1 \
  | tee "$out/trace-bulk.txt"
timeout 170 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,tilecraft-bulk,tilecraft-bulk-32,torch \
  --graph --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
