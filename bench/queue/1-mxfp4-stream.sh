#!/usr/bin/env bash
# Session 62: at 8 tokens the warp kernel's activations cost its loads ~2 us (8x4096x7168 on an H100: without the
# scale words (loads=6) 9.68, without the activations (loads=7) 7.51). Every block (16 weight rows) reads all of A
# (114 KB at k = 7168), twice its codes' bytes. Two remedies, each and together:
#   stream=1: the codes loaded not allocated in L1, so that L1 keeps A between an SM's two blocks;
#   row_tiles=2: 32 rows a warp, each activation fragment feeding two tiles' MMAs (half the A bytes a code byte).
# Predicted (H100, 8x4096x7168): loads=6 9.68 -> ~8.5 with either, the kernel 10.7 -> ~9.5; at 1 token (4 lanes load
# activations) stream changes nothing, row_tiles=2 +-5% (twice the codes in flight a warp, half the warps).
# Then the bitwise GPU tests (row_tiles=2 and stream against the plan's kernel). ~4.5 min with the start (trimmed after two failed starts).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m bench.sweep_mxfp4_warps --csv "$out/sweep.csv" \
  --case 1x4096x7168 --case 8x4096x7168 --case 8x7168x2048 \
  --variant "" --variant stream=1 --variant row_tiles=2 --variant row_tiles=2,stream=1 \
  --variant loads=6 --variant stream=1,loads=6 --variant row_tiles=2,loads=6 2>&1 | tee "$out/sweep.txt"
t="tests/test_gemm_fp8.py"
run() { timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider "$t" -k "$1" > "$out/tests-$2.log" 2>&1;
        echo "rc $?" >> "$out/tests-$2.log"; }
run "test_gpu_mxfp4_warps and 8-4096" a & run "test_gpu_mxfp4_warps and 5-256" b &
run "test_gpu_mxfp4_warps and 1-7168" c &
wait
for f in a b c; do echo "== $f"; grep -E "passed|failed|^FAILED|^E  |^rc" "$out/tests-$f.log" | head -8; done
