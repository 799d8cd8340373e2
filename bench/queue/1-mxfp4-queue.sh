#!/usr/bin/env bash
# Session 63: the queue kernel (QUEUE: a block an SM, its 16 warps taking (tile, step) items from a shared counter,
# per-item partials summed in step order), built after the trace showed the register-ring kernel's last ~1.3 us is an
# SM's second block starting late and finishing alone. Predicted (H100, from the trace: median warp end 6.9 us, last
# 8.3): 1x4096x7168 9.0 -> ~8.0 us, 8x4096x7168 9.9 -> ~9.0; 7168x2048 (3.4 tiles an SM either way) +-5%; a miss
# would be the items' partial stores and the 56-step sums (~0.3 us), or the claims' latency before each load.
# Then its GPU tests (bitwise run to run and across block counts and depths) and the op preset beside it. ~6 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 1x7168x2048 --case 8x7168x2048 \
  --variant "" --variant queue=1 --variant "queue=1,depth=3" --variant "" --variant queue=1 2>&1 | tee "$out/sweep.txt"
t="tests/test_gemm_fp8.py"
run() { timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps_queue and (1-7168 or 1-4096)" a & run "test_gpu_mxfp4_warps_queue and (5-256 or 9-512)" b &
run "test_gpu_mxfp4_warps_queue and (8-4096 or 16-4096)" c &
wait
for f in a b c; do echo "== $f"; grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests-$f.log" | head -8; done
timeout 100 python3 -m bench.op gemm --shape mxfp4 --out "$out" --providers tilecraft,tilecraft-queue,torch --graph \
  --flush read 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
