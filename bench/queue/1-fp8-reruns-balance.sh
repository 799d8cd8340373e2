#!/usr/bin/env bash
# Session 75 (FlashMLA build prefix; ~6 min):
# 1. The three fp8 tests session 75 fixed (op_plan's `sms` argument is device_sms now; dense_overlap's forced plan
#    forces 4 stages) and did not get to rerun (its call 2 ran out of the 120 s it gave them). Expected: all pass.
# 2. The balance preset with FlashMLA in the same run: session 75 measured the least-cap deal against tilecraft-plain
#    only (b = 132: 295.2 us; FlashMLA 304.9 in an earlier call on another H100). Expected: b = 132 ~1.03x FlashMLA,
#    b = 66 ~1.03x, b = 128 ~0.96x, b = 64 ~0.94x (whole-unit deals; bench/NOTES.md "Session 75").
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu -n 8 -rf --tb=line -p no:cacheprovider tests/test_gemm_fp8.py \
  -k "dense_overlap or persistent_matches_one_tile or wide_tiles_match_128_wide" > "$out/tests-fp8.txt" 2>&1
grep -E "FAILED|passed|failed|^E " "$out/tests-fp8.txt" | cut -c1-300 | tail -6
[ -n "${WAIT_FOR_FILE:-}" ] && for _ in $(seq 200); do [ -e "$WAIT_FOR_FILE" ] && break; sleep 1; done
timeout 150 python3 -m bench.op mla --shape balance --out "$out" --graph --flush read --jobs 4 \
  --providers tilecraft,tilecraft-plain,flash_mla > "$out/balance.txt" 2>&1; tail -16 "$out/balance.txt" | cut -c1-120
