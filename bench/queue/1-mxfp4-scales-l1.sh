#!/usr/bin/env bash
# Session 63's open question: the queue kernel's steps waited ~2.4x longer for their data than the register-ring
# kernel's, for the same bytes. One difference the session did not test: a register-ring warp reads its rows' scale
# words for seven consecutive steps from one 32-byte sector, so six of seven come from L1, while the queue kernel's
# warps took steps eight apart and missed L1 on every scale word: twice the L1 misses a step (16 code lines + 16
# scale lines against ~16 + 2). If the SM's outstanding misses bound the feed, the register-ring kernel with its
# scale words not allocated in L1 (scales_no_l1, the same bits) slows by ~20-30% toward the queue kernel (H100:
# 1x4096x7168 ~8.9 -> ~11 us); else +-3%, and misses are not the bound (session 60's quads only ever cut L1 hits).
# loads=7 (the kernel's loads without the activations, 50-80 registers) with and without: the feed alone. Any card.
# ~5 min with the start (with the probe's bitwise GPU test). If it holds: fewer line misses a step (a row's
# 128-byte line as one request, the scale words of several steps a load) is what the feed wants, not depth.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 1x7168x2048 --case 8x7168x2048 \
  --variant "" --variant scales_no_l1=1 --variant "" --variant scales_no_l1=1 \
  --variant loads=7 --variant "loads=7,scales_no_l1=1" 2>&1 | tee "$out/sweep.txt"
# the probe's bitwise check against the plan (test_gpu_mxfp4_warps has scales_no_l1 among its same-bits variants)
t="tests/test_gemm_fp8.py"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "test_gpu_mxfp4_warps and (1-4096 or 8-4096)" \
  > "$out/tests.log" 2>&1; echo "rc $?" >> "$out/tests.log"
grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests.log" | head -8
