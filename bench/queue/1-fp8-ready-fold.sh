#!/usr/bin/env bash
# Session 67: the FP8 v3 loop's split plans fold in the tile's last block without fences (READY_FOLD_ROWS, 0) instead
# of the reduce kernel. ~6 min with the start, any card:
# 1. the new GPU tests (bits of the reduce kernel, NaN rows, partials emptied, CUDA graph) and the other split-K tests;
# 2. the decode preset: the op against tilecraft-readyfold (its two split rows: 64x2112x7168 4 splits, 128x7168x16384
#    2 splits; the other eight rows have one split and must time the same). Predicted: -2 us at 64x2112x7168 (reduce
#    kernel ~1.5 us + its graph gap, less ~1 us of counter round trip and one L2 read of the partials), -1.5 to -2 us
#    at 128x7168x16384. If it wins on both: READY_FOLD = True;
# 3. the bf16 MXFP4 op at <= 8 tokens on the swapped kernel's 64-row chains (tilecraft-swapped: WARP_TOKENS 0) against
#    the warp kernel (the op), the mxfp4 preset. Predicted from W4A8's chains at 8 tokens (7.4 -> 6.4 us): 8x7168x2048
#    7.3 -> ~6.6 us; 4096x7168 (the 64-row plan folds there) no gain.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider -n 6 tests/test_gemm_fp8.py -k "ready_fold or split_k" \
  > "$out/tests-ready-fold.log" 2>&1
echo "tests: $(tail -1 "$out/tests-ready-fold.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-ready-fold.log" | cut -c1-200 | head
timeout 120 python3 -m bench.op gemm --shape decode --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-readyfold,torch 2>&1 | grep -E "^decode|^dense|^gemm|wrote" | cut -c1-110
timeout 100 python3 -m bench.op gemm --shape mxfp4 --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-swapped,torch 2>&1 | grep -E "^mxfp4|^gemm|wrote" | cut -c1-110
