#!/usr/bin/env bash
# Session 62: at 8 tokens the warp kernel's activations cost its loads ~2 us, and neither fewer A bytes a code byte
# (row_tiles=2) nor keeping A in L1 (stream) changed that (H100). They are asked for one step ahead (~1 us of a
# warp's ~7 steps at 1x4096x7168), the codes two: if their latency is what shows, acts_ring=1 (the activations in the
# codes' ring, depth steps ahead, the same registers at depth 2) takes 8x4096x7168's loads=6 ~8.7 -> ~7.5 and the
# kernel 10.5 -> ~9.5 (H100); at 1 token less. Then its bitwise GPU test. ~3.5 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
timeout 120 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 8x7168x2048 \
  --variant "" --variant acts_ring=1 --variant acts_ring=1,depth=3 --variant loads=6 \
  --variant acts_ring=1,loads=6 2>&1 | tee "$out/sweep.txt"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemm_fp8.py \
  -k "test_gpu_mxfp4_warps and 8-4096" > "$out/tests.log" 2>&1; echo "rc $?" >> "$out/tests.log"
grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests.log" | head -8
