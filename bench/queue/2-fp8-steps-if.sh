#!/usr/bin/env bash
# Session 73: tile.steps_if in fp8_gemm_nt (CPU-checked, not yet run on a GPU). Where the split-K is even (per *
# splits == kb: every one-split plan, and 2 / 4 / 8 splits of 56 or 128 K blocks) the K-loop count is cast(row0 <
# limit) * per instead of if_then_else(...); the persistent tiles' count likewise. TileLang then proves the count a
# multiple of the burst and drops the dead tail bursts (192-wide 2189 -> 662 source lines, 7168x16384 1054 -> 307,
# 24576x1536 1338 -> 339); uneven splits (3 of 56) keep the old form, their sources byte-identical. The K loop's
# statements are the same up to index math the simplifier now proves int32 and `q & 1` -> `q` where q < 2.
# Written before the run: every fp8 GPU test passes (bitwise ones included), and the prefill, decode and grouped
# presets give the times of the tree before the change (patch reversed, run beside it on this card) within +-2%.
# ~6 min. If a test fails: revert the two call sites (2-fp8-steps-if.patch) before anything else.
# Session 73 ran part of it on an H100: the decode and prefill presets (same times: -5.3% to +2.6%, NOTES "Session
# 73") and ~180 of the GPU tests (one failure, the ready-fold test's reference plan, fixed since; it failed on the
# tree before too). Left: every fp8 GPU test (the ready-fold one included) and the grouped preset.
set -uo pipefail
cd "$(dirname "$0")/../.."
here=$PWD
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 400 python3 -m pytest -q -m gpu -n 8 -rf tests/test_gemm_fp8.py -k "not mxfp4" 2>&1 | tail -6 \
  | tee "$out/tests-fp8-steps-if.txt"
rm -rf /tmp/before5 && mkdir -p /tmp/before5 && cp -r codegen ops backends bench tilecraft runtime model /tmp/before5/ &&
  (cd /tmp/before5 && patch -s -R -p1 < "$here/bench/queue/2-fp8-steps-if.patch") || exit 1
for tree in /tmp/before5 "$here"; do
  name=$([ "$tree" = /tmp/before5 ] && echo before || echo after)
  (cd "$tree" && for shape in grouped; do
    PYTHONPATH=$tree:/tmp/site TILECRAFT_CACHE_DIR=/tmp/tc-cache5-$name timeout 100 python3 -m bench.op gemm \
      --shape $shape --out "$out/$name" --graph --flush read --jobs 8 --providers tilecraft 2>&1 \
      | grep -E "^(dense|contiguous|masked|sorted)|wrote" | sed "s/^/$name /" | cut -c1-110
  done)
done
