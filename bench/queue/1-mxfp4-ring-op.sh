#!/usr/bin/env bash
# Session 62 left: the op with ACTS_RING on (the warp kernel's activations two steps ahead; its kernel 0.6-9.2%
# faster at 1-8 tokens on an H200 in the sweep). The mxfp4 and mxfp4-moe-decode presets against torch bf16, then the
# whole warp-kernel GPU test set. Predicted: 1x4096x7168 ~8.9 -> ~8.8 us, 8x4096x7168 ~10.1 -> ~9.8, 8x7168x2048
# ~7.7 -> ~7.0 (2.17 / 2.0 / 1.45x torch on an H200). ~8 min with the start.
# First (built at the end of session 62, CPU-checked only): the codes and scale words through a shared ring per warp
# by cp.async (smem=4 / 6: 3 / 5 steps in flight while a step decodes, against the register ring's 1; 72 registers
# against 96). The kernel sits ~2.5 us above its loads at 1x4096x7168 (8.39 against 5.92 without scale words): the
# decode (~2 ALU ops a code pair, ~1.8 us of issue an SMSP) is not overlapped with the stream. Predicted: if in-flight
# bytes are the limit, 1x4096x7168 8.4 -> ~6.5 us, 8x4096x7168 9.3 -> ~7.5 (H200); else +-3%. If so: SMEM on, its
# GPU tests (test_gpu_mxfp4_warps has smem 3 / 4 / 6 bitwise against the plan), the op presets with it.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 8x7168x2048 \
  --variant "" --variant smem=3 --variant smem=4 --variant smem=6 --variant loads=6 \
  2>&1 | tee "$out/sweep.txt"
timeout 120 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,torch --graph --flush read 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
timeout 90 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" --providers tilecraft,torch --graph \
  --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
t="tests/test_gemm_fp8.py"
run() { timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps and (1-7168 or 1-4096)" a & run "test_gpu_mxfp4_warps and (5-256 or 9-512)" b &
run "test_gpu_mxfp4_warps and (16-7168 or 16-4096)" c & run "test_gpu_mxfp4_warps_masked" d &
wait
for f in a b c d; do echo "== $f"; grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests-$f.log" | head -6; done
