#!/usr/bin/env bash
# Session 60, call 4: the op's new masked route (expected_m <= 8 and k <= MASKED_WARPS_MAX_K = 2048 on the warp
# kernel) under the masked GPU tests and the mxfp4-moe-decode preset (predicted: the down projection at the
# masked-warps provider's time, the up one unchanged); then the scatter probe: the warp kernel's codes alone in its
# own order (loads=2) against the same bytes read row by row in 512-byte pieces (loads=3). If 3 is much faster than
# 2, the rows' scatter is what holds the register feed at ~2.5 TB/s. ~5 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
t="tests/test_gemm_fp8.py"
(timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "test_gpu_mxfp4_warps_masked" > "$out/tests-a.log" 2>&1; echo "rc $?" >> "$out/tests-a.log") &
(timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "mxfp4 and masked and not warps_masked" > "$out/tests-b.log" 2>&1; echo "rc $?" >> "$out/tests-b.log") &
wait
for f in a b; do echo "== $f"; grep -E "passed|failed|^FAILED|^rc" "$out/tests-$f.log"; done
timeout 130 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 1x7168x2048 --case 8x4096x7168 \
  --variant "" --variant loads=1 --variant loads=2 --variant loads=3 --variant loads=2,depth=4 --variant loads=3,depth=4 \
  2>&1 | tee "$out/sweep.txt"
timeout 80 python3 -m bench.op gemm --shape mxfp4-moe-decode --out "$out" \
  --providers tilecraft,tilecraft-masked-warps,torch --graph --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
