#!/usr/bin/env bash
# Session 60: the warp kernel's scale words four steps a load (ops.gemm_mxfp4_warps.QUADS, off until measured), the
# bulk feed and pair knob removed, the masked test's empty-group fix. Phase A: the warp kernel's GPU tests in four
# processes (correctness only; nothing timed runs beside them). Phase B: the sweep (plan / quads / loads alone with
# and without quads). Phase C: the op's mxfp4 and mxfp4-moe-decode presets with the quads and masked-warps providers.
# Prediction (bench/NOTES.md "Session 60"): if the scale words' line requests bound the loads, loads alone at
# 1x4096x7168 on an H200 6.3 -> ~4.5-5 us and the kernel 8.5 -> ~7.3; else +-2%. ~8 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
t="tests/test_gemm_fp8.py"
run() { timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps and (1-7168 or 1-4096 or 5-256)" a &
run "test_gpu_mxfp4_warps and (8-4096 or 9-512)" b &
run "test_gpu_mxfp4_warps and (16-7168 or 16-4096)" c &
run "test_gpu_mxfp4_warps_masked or test_gpu_mxfp4_warps_trace or test_gpu_mxfp4_warps_in_a_cuda_graph" d &
wait
for f in a b c d; do echo "== $f"; grep -E "passed|failed|^FAILED|^rc" "$out/tests-$f.log"; done
timeout 130 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 1x7168x2048 --case 8x4096x7168 --case 16x7168x2048 \
  --variant "" --variant quads=1 --variant loads=1 --variant quads=1,loads=1 --variant splits=16,quads=1 2>&1 \
  | tee "$out/sweep.txt"
timeout 130 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,tilecraft-quads,torch \
  --graph --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
timeout 90 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" \
  --providers tilecraft,tilecraft-masked-warps,tilecraft-masked-quads,torch --graph --flush read 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
