#!/usr/bin/env bash
# Session 67: READY_FOLD_ROWS = 16 (the FP8 v3 split plans of <= 16 rows fold in the tile's last block, fenceless).
# ~5 min with the start, any card:
# 1. the FP8 GPU tests of the dense paths (split-K, thin, the op): split plans of <= 16 rows now fold;
# 2. decode-few again, the op against tilecraft-nofold (READY_FOLD_ROWS 0): session 67's single run had 1x2112x7168
#    3% slower with the fold (9.9 -> 10.2 us) and the other <= 16-row rows 1-19% faster. If 1-row rows lose again in
#    this run, READY_FOLD_ROWS stays but the note records it.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 330 python3 -m pytest -v -m gpu -p no:cacheprovider -n 8 tests/test_gemm_fp8.py \
  -k "(split_k or ready_fold or dense or thin or cluster_room) and not mxfp4" \
  > "$out/tests-fp8.log" 2>&1
echo "tests: $(tail -1 "$out/tests-fp8.log")"; grep -h -E "^FAILED|^ERROR" "$out/tests-fp8.log" | cut -c1-200 | head
timeout 150 python3 -m bench.op gemm --shape decode-few --out "$out" --graph --flush read --jobs 8 \
  --providers tilecraft,tilecraft-nofold 2>&1 | grep -E "^dense|^gemm|wrote" | cut -c1-110
