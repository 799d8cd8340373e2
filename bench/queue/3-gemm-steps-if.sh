#!/usr/bin/env bash
# Session 72's tile.steps_if (CPU-checked, not yet run on a GPU): the grouped / masked MXFP4 and W4A8 kernels' K-loop
# trip count is cast(cond) * steps instead of if_then_else(cond, steps, 0). TileLang can then prove it a multiple of
# the burst, and the dead tail bursts go (grouped MXFP4 2709 -> 255 source lines, W4A8 masked 4529 -> 570); the K
# loop's source is the same. Written before the run: the same results (the GPU tests below, bitwise ones included) and
# the same times within noise (+-2%) against the tree before the change, run beside it on this card. ~5 min.
set -uo pipefail
cd "$(dirname "$0")/../.."
here=$PWD
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu -n 4 tests/test_gemm_w4a8.py tests/test_gemm_fp8.py -k "w4a8 or grouped or masked" \
  2>&1 | tail -4 | tee "$out/tests-steps-if.txt"
# the tree before the change: this one with the patch reversed
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r codegen ops backends bench tilecraft runtime model /tmp/before/ &&
  (cd /tmp/before && patch -s -R -p1 < "$here/bench/queue/3-steps-if.patch") || exit 1
for tree in /tmp/before "$here"; do
  name=$([ "$tree" = /tmp/before ] && echo before || echo after)
  (cd "$tree" && for shape in mxfp4-grouped mxfp4-moe-decode; do
    PYTHONPATH=$tree:/tmp/site TILECRAFT_CACHE_DIR=/tmp/tc-cache-$name timeout 150 python3 -m bench.op gemm --shape $shape \
      --out "$out/$name" --graph --flush read --jobs 8 --providers tilecraft,tilecraft-w4a8 2>&1 \
      | grep -E "^mxfp4|wrote" | sed "s/^/$name /" | cut -c1-110
  done)
done
