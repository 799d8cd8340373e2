#!/usr/bin/env bash
# Session 64's GPU regression left two things (bench/NOTES.md "Session 64"): the switch-on FP8 hypothesis test after its
# fix (its reference's cache now follows the op's tiling: 256 rows run the bf16-converting kernel, not the rows64 one,
# and the forced exact cache had failed there on lse by K's bf16 rounding), and tests/test_runtime.py's GPU tests (the
# model), which the regression's deadline cut off. Expected: all pass. Any card; ~6 min with the start.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 420 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_mla_decode_fp8_rows64.py -k switch_on \
  > "$out/tests-switch-on.log" 2>&1 &
timeout 420 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_runtime.py > "$out/tests-runtime.log" 2>&1 &
wait
for f in "$out"/tests-*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
grep -h -E "^(FAILED|ERROR)" "$out"/tests-*.log | cut -c1-200
