#!/usr/bin/env bash
# Session 63: the queue kernel ran 17-36% slower than the register-ring kernel (H100; 1x4096x7168 8.7 -> 11.6 us),
# predicted -10%. Which of three causes: (a) every block walks K from step 0 in lockstep, so the whole GPU asks for
# the same few activation lines and the same K window of every row at once (rotate: block b starts at b * kb //
# blocks; if this, rotate recovers most of it); (b) the claim's atomic and shuffle sit between a step's MMAs and the
# next loads (claim_ahead; if this, ~-1 us); (c) the 56-step sums at the end (no_sum, wrong results; ~0.3-0.6 us).
# The traces say which: first data, step waits and work, items a warp. ~5 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 8x7168x2048 \
  --variant "" --variant queue=1 --variant "queue=1,rotate=1" --variant "queue=1,claim_ahead=1" \
  --variant "queue=1,rotate=1,claim_ahead=1" --variant "queue=1,no_sum=1" --variant "" 2>&1 | tee "$out/sweep.txt"
for v in "" "--queue" "--queue --rotate" "--queue --rotate --claim-ahead"; do
  echo "== trace $v"
  timeout 60 python3 -m bench.trace_mxfp4_warps --case 1x4096x7168 $v 2>&1 | tail -9
done | tee "$out/trace.txt"
t="tests/test_gemm_fp8.py"
run() { timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps_queue and (1-7168 or 1-4096)" a & run "test_gpu_mxfp4_warps_queue and (5-256 or 9-512)" b &
run "test_gpu_mxfp4_warps_queue and (8-4096 or 16-4096)" c &
wait
for f in a b c; do echo "== $f"; grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests-$f.log" | head -8; done
