#!/usr/bin/env bash
# Session 79, call 3 (FlashMLA build prefix; ~5 min): stage_out is pick_tiling's since this call's commit (the bf16
# cache in the default operand order on sm_90a: the persistent seesaw at 128+ rows, the plain schedule at 33-127).
# The op's GPU tests through its own path at 64 / 128 rows, then the op (tilecraft) against the direct stores
# (tilecraft-direct) and FlashMLA. Expected: tilecraft = call 2's tilecraft-stageout (278.7 / 522.6 / 272.6 us on an
# H100), tilecraft-direct = call 2's tilecraft (286.6 / 537.1 / 279.7); h_q 64: ~-1.3%.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; log=/tmp/q; mkdir -p "$out" $log
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader
timeout 170 python3 -m pytest -q -m gpu -n 8 -rf --tb=short -p no:cacheprovider -W ignore tests/test_mla_decode.py \
  -k "test_gpu_matches_reference or page_sizes or batch_invariant_mode_at_128 or fp16_and_non_causal or off_alignment" \
  > "$out/tests.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests.txt" | cut -c1-200 | tail -12
pkill -f pytest; sleep 1
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
for shape in h128 decode; do
  timeout 120 python3 -m bench.op mla --shape $shape --out "$out" --graph --flush read --jobs 4 \
    --providers tilecraft,tilecraft-direct,flash_mla > $log/$shape.txt 2>&1
  grep -E "^b=" $log/$shape.txt | cut -c1-150
done
