#!/usr/bin/env bash
# Session 62 left: the op with ACTS_RING on (the warp kernel's activations two steps ahead; its kernel 0.6-9.2%
# faster at 1-8 tokens on an H200 in the sweep). The mxfp4 and mxfp4-moe-decode presets against torch bf16, with
# the ring off beside it (tilecraft-acts-ring is the default now: the row to compare is the plan's), then the whole
# warp-kernel GPU test set. Predicted: 1x4096x7168 ~8.9 -> ~8.8 us, 8x4096x7168 ~10.1 -> ~9.8, 8x7168x2048
# ~7.7 -> ~7.0 (2.17 / 2.0 / 1.45x torch on an H200). ~5 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,torch --graph --flush read 2>&1 \
  | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
timeout 90 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" --providers tilecraft,torch --graph \
  --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
t="tests/test_gemm_fp8.py"
run() { timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps and (1-7168 or 1-4096)" a & run "test_gpu_mxfp4_warps and (5-256 or 9-512)" b &
run "test_gpu_mxfp4_warps and (16-7168 or 16-4096)" c & run "test_gpu_mxfp4_warps_masked" d &
wait
for f in a b c d; do echo "== $f"; grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests-$f.log" | head -6; done
